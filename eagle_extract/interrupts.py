"""A scheduler's SIGTERM stops a job the way Ctrl-C does, leaving it resumable."""

from __future__ import annotations

import signal


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
