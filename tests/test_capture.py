"""The capture path: asynchronous step buffers equal plain blocking copies."""

from __future__ import annotations

from .common import capture_vs_synchronous


def test_step_capture_equals_blocking_copies():
    """The capture path (on a GPU: side stream into pinned memory) against plain `.cpu()` copies,
    with layers that overwrite their inputs in place as vLLM's fused add+norm does.
    scripts/gpu_checks.py runs the same check on CUDA."""
    rows, equal = capture_vs_synchronous("cpu")
    assert rows == 12 and equal == rows
