"""The one exception type eagle-extract raises for what a user can fix, and engine failures turned into it."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path

from .interrupts import interrupted
from .runlog import NOTE, START


class ExtractError(Exception):
    """A failure the user can act on; the message is one line and names the fix."""


class RequestError(Exception):
    """One server request's failure, not the server's: answered with HTTP `status` (400 unless said) and
    OpenAI's error body, naming the request's `param` where one is at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


ROWS_KEPT = "every completed row is kept: fix the cause and rerun the same command to resume"
RESUMES = "every completed row is kept, and rerunning the same command resumes"


@contextmanager
def engine_errors(log_path=None, advice: str = ROWS_KEPT, after_bug: str = RESUMES):
    """Inside, anything but an ExtractError is the engine's failure, or (raised in eagle-extract's own
    code) eagle-extract's bug, said in one line; the traceback stays chained for the run's log, whose
    path lets the line name what an engine process died of.  `advice` and `after_bug` end the line: what to do
    next (a server keeps no rows; it is started again)."""
    try:
        yield
    except ExtractError:
        raise
    except Exception as exc:
        if interrupted():  # the engine died of the user's Ctrl-C (or a SIGTERM): say that, not its failure
            raise KeyboardInterrupt from exc
        if _raised_in_eagle_extract(exc):
            said = " ".join(str(exc).split())[:400] or "no message"
            raise ExtractError(
                f"eagle-extract failed ({type(exc).__name__}: {said}): a bug, please report it with the traceback "
                f"in the run's log; {after_bug}"
            ) from exc
        raise engine_failed(exc, log_path, advice) from exc


def _raised_in_eagle_extract(exc: Exception) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(__file__).parent in Path(tb.tb_frame.f_code.co_filename).parents


def engine_failed(exc: Exception, log_path=None, advice: str = ROWS_KEPT) -> ExtractError:
    """The engine or a worker died: one line, and every completed row is kept.  A multi-line message
    (a pydantic ValidationError of vLLM's config names the field on its second line) is joined; where
    vLLM only points at "the root cause above", that cause is read from the run's log."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = " ".join(line for line in lines if not line.startswith("For further information")) or "no message"
    what, fix = f"{type(exc).__name__}: {said}", ""
    if _POINTER.search(said):
        what, fix = _engine_process_error(log_path) or (what, "")
    return ExtractError(f"the vLLM engine failed ({what[:400]}){fix}; {advice}")


# vLLM's messages that name no cause but point at one logged before ("See root cause above", "See stack
# trace (above) for the root cause", "please check the stack trace above for the root cause").
_POINTER = re.compile(r"root cause|stack trace", re.IGNORECASE)
# An exception as an engine process logs it: "(EngineCore_DP0 pid=7) ValueError: ...", or with vLLM's
# "ERROR 12-03 08:34:02 [core.py:1231] " between; workers' lines start "(Worker_TP1 pid=...)", Ray's
# "(RayWorkerProc pid=...)"; a bare "AssertionError", and Ray's "RayTaskError(ValueError): ..." too.
_LOGGED_ERROR = re.compile(
    r"^\((?:\w*EngineCore|\w*Worker)\w*[^)]*\)\s+(?:(?:ERROR|CRITICAL) [^\]]*\]\s+)?"
    r"([\w.]*(?:Error|Exception)(?:\([\w.]+\))?(?::\s.*)?)$"
)
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its workers' prefixes


# vLLM 0.32 and later convert INT4 MoE experts to the Humming kernel's format on Hopper by default, unpacking
# each layer's 4-bit codes to one int32 each while loading: 42 GiB for one Kimi-K2.5 layer at TP=1, on top of
# every weight (docs/models.md, measured on an H100).  Marlin runs on the packed weights.
_HUMMING_OOM = (
    ", while vLLM unpacked a layer's INT4 experts into its Humming kernel's format: pass "
    "--engine-arg moe_backend=marlin, which keeps them packed (slower prefill), or more GPUs with --tp"
)


def _engine_process_error(log_path) -> tuple[str, str] | None:
    """The last exception an engine process wrote to the run's log (its last 256 KiB) since this run
    started there (a resumed run appends to the log of the runs before it), if any, and the fix for a
    failure whose cause the log shows."""
    if log_path is None:
        return None
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 2**18))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    tail = tail.rsplit(f" {NOTE}{START}", 1)[-1]
    lines = [_COLOUR.sub("", line).strip() for line in tail.splitlines()]
    logged = [(i, m.group(1)) for i, line in enumerate(lines) if (m := _LOGGED_ERROR.match(line))]
    logged = [(i, e) for i, e in logged if not _POINTER.search(e)]
    if not logged:
        return None
    at, error = logged[-1]
    start = next((i for i in range(at, -1, -1) if "Traceback (most recent call last)" in lines[i]), at)
    if "OutOfMemoryError" in error and any("convert_to_humming_moe_kernel_format" in x for x in lines[start:at]):
        return error.split(" Including non-PyTorch")[0], _HUMMING_OOM  # not torch's allocator advice
    return error, ""
