"""The run's log file, and progress that a batch scheduler's log can hold.

While a run holds its output, file descriptors 1 and 2 point at `OUT/eagle_extract.log`: the
engine's processes inherit them and vLLM's log handlers write to them, so the engine's warnings
and tracebacks land there, not on the terminal.  eagle-extract's own lines and progress go to the
terminal explicitly (and to the log, timestamped), so the last line a user sees is ours.  A
failure's whole traceback goes to the log.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import traceback

NOTE = "eagle-extract: "  # after the stamp, on each line of ours in the log
START = "start: "  # after NOTE, each run's first line in the log: where its part of the log begins
PROGRESS_FILE = "EAGLE_EXTRACT_PROGRESS_FILE"  # a --dp replica's: where it tells its parent its rows on disk


def share_progress(rows: int) -> None:
    """A --dp replica's rows on disk, for its parent's display: one small file each, read once a second, so
    the parent's cost does not grow with the rows (listing the row files did: 0.62 s at 200k files)."""
    path = os.environ.get(PROGRESS_FILE)
    if path:
        try:
            with open(f"{path}.tmp", "w") as f:
                f.write(str(rows))
            os.replace(f"{path}.tmp", path)
        except OSError:  # the display only: the run goes on
            pass


def shared_progress(paths: list) -> int:
    """The rows on disk the replicas' progress files give together."""
    total = 0
    for path in paths:
        try:
            with open(path) as f:
                total += int(f.read() or 0)
        except (OSError, ValueError):
            pass
    return total
_terminal = None  # the terminal's stderr while a RunLog holds fds 1 and 2, for progress()


def terminal():
    """The user's stderr, also while a RunLog sends fds 1 and 2 to the log."""
    return _terminal or sys.stderr


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


class RunLog:
    """`with RunLog(path, log) as run_log:` sends the engine's output into `path` for the block;
    `run_log.say` is `log` on the terminal plus the log file, `run_log.note` the log file alone."""

    def __init__(self, path, log) -> None:
        self.path, self._log = path, log
        self._file = None
        self._saved: list[tuple[int, int]] = []
        self._terminal: list = []

    def say(self, message: str) -> None:
        with self._on_terminal():
            self._log(message)
        self.note(message)

    def note(self, message: str) -> None:
        self._write(f"{_stamp()} {NOTE}{message}\n")

    def _write(self, text: str) -> None:
        try:
            self._file.write(text)
        except OSError:  # a full disk stops the run through its rows, never through its log
            pass

    @contextlib.contextmanager
    def _on_terminal(self):
        """Python's own streams on the terminal for a moment, where they are fds 1 and 2."""
        streams = sys.stdout, sys.stderr
        if _fileno(sys.stdout) == 1:
            sys.stdout = self._terminal[0]
        if _fileno(sys.stderr) == 2:
            sys.stderr = self._terminal[1]
        try:
            yield
        finally:
            sys.stdout, sys.stderr = streams

    def __enter__(self) -> RunLog:
        global _terminal
        self._file = open(self.path, "a", buffering=1)
        self.note(f"{START}{' '.join(sys.argv)} (pid {os.getpid()})")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._saved = [(fd, os.dup(fd)) for fd in (1, 2)]
        self._terminal = [os.fdopen(os.dup(saved), "w", buffering=1) for _, saved in self._saved]
        for fd, _ in self._saved:
            os.dup2(self._file.fileno(), fd)
        _terminal = self._terminal[1]
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _terminal
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            self.note(f"failed: {exc}")
            self._write("".join(traceback.format_exception(exc)))
        while exc is not None:  # frames in the traceback still hold the engine: free it, so it stops into the log
            traceback.clear_frames(exc.__traceback__)
            exc = exc.__cause__ or exc.__context__
        gc.collect()
        self.note("end")
        for stream in (sys.stdout, sys.stderr, *self._terminal):
            stream.flush()
        for fd, saved in self._saved:
            os.dup2(saved, fd)
            os.close(saved)
        for stream in self._terminal:
            stream.close()
        _terminal = None
        with contextlib.suppress(OSError):
            self._file.close()


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


class _Lines:
    """tqdm's bar on a terminal; elsewhere (a scheduler's log) a plain line every `every` seconds and at the end."""

    def __init__(self, total: int | None, initial: int, desc: str, unit: str, every: float, file) -> None:
        self.total, self.n, self.desc, self.unit, self.every, self.file = total, initial, desc, unit, every, file
        self._postfix, self._last = "", time.monotonic()

    def update(self, n: int) -> None:
        self.n += n
        if time.monotonic() - self._last >= self.every:
            self._print()

    def set_postfix(self, **values) -> None:
        self._postfix = ", " + ", ".join(f"{k} {v}" for k, v in values.items()) if values else ""

    def _print(self) -> None:
        self._last = time.monotonic()
        total = f"/{self.total:,}" if self.total is not None else ""
        print(f"{_stamp()} {self.desc}: {self.n:,}{total} {self.unit}s{self._postfix}", file=self.file)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._print()


def counting(total: int, desc: str, unit: str, show: bool = True):
    """range(total), its progress shown as progress() shows it (not at all unless `show`)."""
    if not show:
        yield from range(total)
        return
    with progress(total, desc, unit) as bar:
        for i in range(total):
            yield i
            bar.update(1)


def progress(total: int | None, desc: str, unit: str, initial: int = 0, every: float = 30.0):
    """A progress display for `total` units (None: not known) on the terminal: tqdm's bar, or plain periodic lines where
    stderr is not a terminal (a batch scheduler's log)."""
    file = terminal()
    if file.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=file)
    return _Lines(total, initial, desc, unit, every, file)
