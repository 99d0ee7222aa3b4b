"""Flat-batch bookkeeping: segments by position runs, requests matched by tokens in any order."""

from __future__ import annotations

import torch

from eagle_extract.hooks import RequestMatcher, segments

from .common import capture_vs_synchronous


def test_segments_split_on_position_restarts_and_jumps():
    pos = torch.tensor([0, 1, 2, 0, 1, 7, 8, 0])
    assert segments(pos) == [(0, 3, 0), (3, 2, 0), (5, 2, 7), (7, 1, 0)]
    mrope = torch.stack([pos, pos, pos])
    assert segments(mrope) == segments(pos)


def test_matcher_any_order_split_and_duplicates():
    m = RequestMatcher()
    a, b, c = [5, 6, 7], [5, 6, 7, 8, 9, 10], [1, 2]
    for i, ids in enumerate([a, b, c, a]):
        m.expect(i, ids)
    # step 1: c whole, b's first chunk (which equals request a's full prompt), a whole
    assert m.match(c, 0).index == 2
    first = m.match([5, 6, 7], 0)
    second = m.match([5, 6, 7], 0)
    assert {first.index, second.index} == {0, 3}  # identical prompts: either copy is right
    # the remaining prompt starting with 5, 6, 7 is b, matched by its first chunk
    chunk = m.match([5, 6, 7], 0)
    assert chunk.index == 1 and m.split_requests == 1
    chunk.filled = 3
    assert m.match([8, 9, 10], 3).index == 1
    assert m.match([8, 9, 10], 4) is None  # wrong position: not a continuation
    assert m.match([0, 0], 0) is None  # padding or foreign tokens


def test_pending_lists_unfinished_rows():
    m = RequestMatcher()
    m.expect(0, [1, 2, 3])
    m.expect(1, [4])
    req = m.match([1, 2], 0)
    req.filled = 2
    assert m.pending == [0, 1]
    m.finished(req)
    assert m.pending == [1]


def test_step_capture_equals_blocking_copies():
    """The capture path (on a GPU: side stream into pinned memory) against plain `.cpu()` copies,
    with layers that overwrite their inputs in place as vLLM's fused add+norm does.
    scripts/gpu_checks.py runs the same check on CUDA."""
    rows, equal = capture_vs_synchronous("cpu")
    assert rows == 12 and equal == rows
