"""The one exception type eagle-extract raises for what a user can fix, and engine failures turned into it."""

from __future__ import annotations

from contextlib import contextmanager


class ExtractError(Exception):
    """A failure the user can act on; the message is one line and names the fix."""


@contextmanager
def engine_errors():
    """Inside, anything but an ExtractError is the engine's failure, said in one line."""
    try:
        yield
    except ExtractError:
        raise
    except Exception as exc:
        raise engine_failed(exc) from None


def engine_failed(exc: Exception) -> ExtractError:
    """The engine or a worker died: one line, and every completed row is kept.  A multi-line message
    (a pydantic ValidationError of vLLM's config names the field on its second line) is joined."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = " ".join(line for line in lines if not line.startswith("For further information")) or "no message"
    return ExtractError(
        f"the vLLM engine failed ({type(exc).__name__}: {said[:400]}); "
        "every completed row is kept: fix the cause and rerun the same command to resume"
    )
