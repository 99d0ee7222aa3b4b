"""The capture path: asynchronous step buffers equal plain blocking copies."""

from __future__ import annotations

import pytest
import torch

from eagle_extract.files.fp8 import to_fp8

from .common import capture_vs_synchronous


def test_step_capture_equals_blocking_copies():
    """The capture path (on a GPU: side stream into pinned memory) against plain `.cpu()` copies,
    with layers that overwrite their inputs in place as vLLM's fused add+norm does.
    tests/gpu/test_copies.py runs the same check on CUDA."""
    rows, equal = capture_vs_synchronous("cpu")
    assert rows == 12 and equal == rows


def test_a_budget_smaller_than_one_step_slows_the_capture_but_never_stops_it():
    """Requests split over steps are joined while earlier rows are still held: with a budget of one byte
    every step waits for room, and the assembly thread must never wait on rows it holds itself."""
    import threading

    from eagle_extract.worker.hostmem import ByteBudget

    budget, result = ByteBudget(1), []
    run = threading.Thread(target=lambda: result.append(capture_vs_synchronous("cpu", budget=budget)), daemon=True)
    run.start()
    run.join(120)
    assert not run.is_alive(), f"capture stuck: {budget.used} bytes held, {budget.rows} rows, {budget.steps} steps"
    assert result == [(12, 12)] and budget.waits > 0 and budget.used == 0


def test_fp8_quantised_on_the_models_device_equals_the_hosts():
    """With --storage-dtype fp8 the capture quantises each step on the model's device (here the CPU;
    tests/gpu/test_copies.py runs it on CUDA) and rows are slices of it: values and scales must be the
    bytes the host writer makes from the same states, for rows within one step and rows over several."""
    rows, equal = capture_vs_synchronous("cpu", fp8=True)
    assert rows == 12 and equal == rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_layout_is_speculators(dtype):
    """value = fp8 * scale with one float32 scale per token, scale = amax / 448 (an all-zero token keeps
    a tiny positive scale), the values the float32 quotient cast to FP8, for a strided view too (a slot is
    one); dequantised within half an fp8 step of the input."""
    torch.manual_seed(0)
    x = torch.randn(7, 32, 4, dtype=torch.float32).transpose(1, 2) * torch.logspace(-3, 3, 7).view(7, 1, 1)
    x = x.to(dtype)
    x[3] = 0
    q, scale = to_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (7, 1, 1)
    amax = x.float().abs().flatten(1).max(1).values.view(7, 1, 1)
    assert torch.equal(scale, (amax / 448).clamp(min=1e-12))
    assert torch.equal(q.view(torch.uint8), (x.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    back = q.float() * scale
    assert torch.all((back - x.float()).abs() <= amax * 2**-4 + 1e-30)
    assert torch.equal(q.float().abs().flatten(1).max(1).values[[0, 1, 2, 4, 5, 6]], torch.full((6,), 448.0))


def test_rows_the_engine_ran_without_a_match_and_steps_without_token_ids_are_counted():
    """Once the engine has run a batch (settle), its rows still waiting are unmatched and no longer waited
    for; a step whose token-id hook never fired is a dropped step, its tokens counted."""
    from eagle_extract.worker.capture import StepCapture
    from eagle_extract.worker.hostmem import ByteBudget
    from eagle_extract.worker.model_nav import DecoderStack

    from .common import _ToyLayer

    torch.manual_seed(0)
    embed, blocks = torch.nn.Embedding(100, 16), torch.nn.ModuleList(_ToyLayer(16) for _ in range(3))
    written = []
    capture = StepCapture(
        DecoderStack("toy", blocks, blocks, 0, 3, embed),
        [0, 1],
        lambda i, rows, ids: written.append(i),
        ByteBudget(2**30),
    )
    capture.install()

    def step(ids, hooked=True):
        h = embed(torch.tensor(ids)) if hooked else embed.weight[ids].clone()  # the second skips the embedding's hook
        p, r = torch.arange(len(ids)), None
        for block in blocks:
            h, r = block(p, h, r)

    capture.expect([(0, [1, 2, 3]), (1, [4, 5, 6]), (2, [7, 8])])
    with torch.no_grad():
        step([1, 2, 3])  # row 0
        step([9, 9, 9])  # row 1's prompt ran as other tokens
        step([7, 8], hooked=False)  # row 2's token ids never arrived
    assert capture.counts()["settled_rows"] == 0  # nothing is settled before the engine says it ran them
    capture.settle()
    report = capture.drain()
    capture.remove()
    stats = report["stats"]
    assert written == [0] and report["pending"] == [] and not report["errors"]
    assert (stats["settled_rows"], stats["unmatched_rows"], stats["first_unmatched_row"]) == (3, 2, 1)
    assert (stats["unmatched_tokens"], stats["dropped_steps"], stats["dropped_tokens"]) == (3, 1, 2)


def test_a_look_between_steps_never_waits_for_the_assembler_and_its_rows_still_match():
    """The server's look between two steps (rows retired, counts, rows to run again, the distrust flag, new rows
    announced, a settle) must not wait while the assembler matches a step, which holds capture.lock; the rows
    announced meanwhile are registered before the step that runs them, and an announcement the matcher
    refuses is reported, not a hung assembler."""
    import threading

    from eagle_extract.worker.capture import StepCapture
    from eagle_extract.worker.hostmem import ByteBudget
    from eagle_extract.worker.model_nav import DecoderStack

    from .common import _ToyLayer

    embed = torch.nn.Embedding(100, 16)
    blocks = torch.nn.ModuleList(_ToyLayer(16) for _ in range(2))
    got = []
    capture = StepCapture(DecoderStack("toy", blocks, blocks, 0, 2, embed), [0], lambda i, rows, ids: got.append(i),
                          ByteBudget(2**30))  # fmt: skip
    capture.install()
    ids = [5, 6, 7, 8]
    capture.lock.acquire()  # the assembler in the middle of a step's matching
    looked = threading.Event()

    def look():
        capture.retire([99])
        capture.counts(), capture.take_unwritten(), capture.untrusted
        capture.expect([(0, ids)])
        looked.set()

    threading.Thread(target=look, daemon=True).start()
    try:
        assert looked.wait(10), "the look waited for the matcher's lock"
    finally:
        capture.lock.release()
    with torch.no_grad():
        h, r, p = embed(torch.tensor(ids)), None, torch.arange(len(ids))
        for block in blocks:
            h, r = block(p, h, r)
    capture.settle()
    report = capture.drain()
    assert got == [0] and not report["errors"] and report["stats"]["unmatched_rows"] == 0, report
    capture.expect([(1, [-1]), (2, ids[:2])])  # no token id: the matcher refuses it in the assembler's thread
    reported = []
    drain = threading.Thread(target=lambda: reported.append(capture.drain()), daemon=True)
    drain.start()
    drain.join(30)
    assert reported, "the drain hung: the assembler stopped at the refused row"
    assert reported[0]["errors"][0].startswith("capture: row 1: "), reported
    assert reported[0]["pending"] == [2], reported  # row 2 registered all the same: it waits for its tokens
    capture.remove()
