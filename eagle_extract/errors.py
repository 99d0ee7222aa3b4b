"""The one exception type eagle-extract raises for what a user can fix, and engine failures turned into it."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


class ExtractError(Exception):
    """A failure the user can act on; the message is one line and names the fix."""


@contextmanager
def engine_errors():
    """Inside, anything but an ExtractError is the engine's failure, or (raised in eagle-extract's own
    code) eagle-extract's bug, said in one line; the traceback stays chained for the run's log."""
    try:
        yield
    except ExtractError:
        raise
    except Exception as exc:
        if _raised_in_eagle_extract(exc):
            said = " ".join(str(exc).split())[:400] or "no message"
            raise ExtractError(
                f"eagle-extract failed ({type(exc).__name__}: {said}): a bug, please report it with the traceback "
                "in the run's log; every completed row is kept, and rerunning the same command resumes"
            ) from exc
        raise engine_failed(exc) from exc


def _raised_in_eagle_extract(exc: Exception) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).parent == Path(__file__).parent


def engine_failed(exc: Exception) -> ExtractError:
    """The engine or a worker died: one line, and every completed row is kept.  A multi-line message
    (a pydantic ValidationError of vLLM's config names the field on its second line) is joined."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = " ".join(line for line in lines if not line.startswith("For further information")) or "no message"
    return ExtractError(
        f"the vLLM engine failed ({type(exc).__name__}: {said[:400]}); "
        "every completed row is kept: fix the cause and rerun the same command to resume"
    )
