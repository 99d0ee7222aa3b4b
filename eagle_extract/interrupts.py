"""A scheduler's SIGTERM stops a job the way Ctrl-C does, leaving it resumable; and whether either came.

The engine's processes get the terminal's Ctrl-C too and die of it, so what the driver sees next is often
the engine's failure ("cancelled", a dead engine): once an interrupt has come, that is the interrupt."""

from __future__ import annotations

import contextlib
import signal
import threading

_received = threading.Event()


def note_interrupt() -> None:
    _received.set()


def _interrupt(signum, frame):
    note_interrupt()
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


def interrupted() -> bool:
    return _received.is_set()


@contextlib.contextmanager
def engine_starting():
    """While vLLM starts its engine, Ctrl-C or SIGTERM stops the engine's processes instead of raising.

    vLLM's start-up wait takes the KeyboardInterrupt `_interrupt` raises for a socket's and goes on waiting (up
    to 10 minutes, for an engine whose handshake it cut short); an engine whose processes are gone ends that
    wait at once, with the failure `errors.engine_errors` reports as the interrupt.  Only where this process
    stops on signals (`stop_on_signals`); processes that ran before the start (a tokenizer's, the guard) stay."""
    if signal.getsignal(signal.SIGTERM) is not _interrupt or threading.current_thread() is not threading.main_thread():
        yield
        return
    import psutil

    this = psutil.Process()
    before = {p.pid for p in this.children(recursive=True)}

    def stop_engine(signum, frame):
        note_interrupt()
        for proc in this.children(recursive=True):
            if proc.pid not in before:
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_engine)
    try:
        yield
    finally:
        stop_on_signals()
    if interrupted():  # the signal came as the engine became ready: stop now, as it would have later
        raise KeyboardInterrupt
