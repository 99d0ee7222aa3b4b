"""A scheduler's SIGTERM stops a job the way Ctrl-C does, leaving it resumable; and whether either came.

The engine's processes get the terminal's Ctrl-C too and die of it, so what the driver sees next is often
the engine's failure ("cancelled", a dead engine): once an interrupt has come, that is the interrupt."""

from __future__ import annotations

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


def handles_signals() -> bool:
    """Whether this process stops on signals as `stop_on_signals` set it up (the CLI), not as a caller of ours."""
    return signal.getsignal(signal.SIGTERM) is _interrupt
