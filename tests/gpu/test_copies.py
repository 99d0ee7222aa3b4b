"""The capture path on CUDA (side stream into pinned memory, background assembly) against blocking copies
taken by separate hooks in the same forward passes, bitwise (tests/test_capture.py runs it on the CPU)."""

from __future__ import annotations

import pytest

from ..common import capture_vs_synchronous

pytestmark = pytest.mark.gpu

STEPS = dict(hidden=4096, layers=8, steps=8, step_tokens=8192)  # 8 steps of 8,192 tokens


def test_capture_equals_blocking_copies(record):
    """A copy race (a step buffer read after vLLM overwrote it) shows as a row that differs."""
    rows, equal = capture_vs_synchronous("cuda", **STEPS)
    record("rows", rows)
    record("bitwise_equal", equal)
    assert rows == equal, f"{equal} of {rows} requests bitwise equal to blocking copies"


def test_fp8_on_the_gpu_equals_the_hosts(record):
    """FP8 quantised on the GPU in the capture must be the bytes (values and scales) the host makes from
    blocking copies of the same states."""
    rows, equal = capture_vs_synchronous("cuda", **STEPS, fp8=True)
    record("rows", rows)
    record("bitwise_equal", equal)
    assert rows == equal, f"{equal} of {rows} requests: values and scales bitwise equal to the host's quantisation"
