"""SmolLM2-135M-Instruct (real weights) extracted on GPU 0, against transformers float32 on the same GPU
(TF32 off) and against itself."""

from __future__ import annotations

import pytest
import torch

from ..common import compare_with_reference, load_row, rel_err
from ..conftest import BUDGET
from .runs import extract, extracted, manifest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "backend", [(), ("--engine-arg", "attention_backend=FLEX_ATTENTION")], ids=["default", "flex_attention"]
)
def test_fp32_vs_transformers(backend, smollm2, mixed_conversations, work, reference, record):
    """float32 rows within 1e-4 of transformers' float32 hidden states, per sample and slot, whatever the
    attention backend (prompts split over engine steps by the 128-token budget)."""
    tag = "fp32" if not backend else "fp32-flex"
    out = extracted(smollm2, mixed_conversations, work / tag, *BUDGET, "--dtype", "float32",
                    "--layers", "0,2,15,27,29", *backend)  # fmt: skip
    worst, overall = compare_with_reference(out, reference(smollm2))
    record("worst_sample", worst)
    record("all_tokens", overall)
    assert max(worst.values()) < 1e-4, f"worst sample per slot {worst}"


@pytest.fixture(scope="module")
def bf16(smollm2, mixed_conversations, work):
    return extracted(smollm2, mixed_conversations, work / "bf16-1", *BUDGET, "--dtype", "bfloat16")


@pytest.fixture(scope="module")
def bf16_single(smollm2, mixed_conversations, work):
    """Three bf16 runs, one request per generate call: vLLM's engine core may start stepping before a
    call's requests have all arrived, so only one request per call fixes the batches (and bf16 rounding)."""
    return [
        extracted(
            smollm2, mixed_conversations, work / f"bf16-single-{k}", *BUDGET, "--dtype", "bfloat16", "--batch-size", "1"
        )
        for k in (1, 2, 3)
    ]


def test_bf16_vs_transformers(bf16, smollm2, reference, record):
    """bfloat16 rows within 2e-2 of transformers float32 over all tokens (bf16 rounding, not a bug)."""
    worst, overall = compare_with_reference(bf16, reference(smollm2))
    record("worst_sample", worst)
    record("all_tokens", overall)
    assert max(overall.values()) < 2e-2, f"all tokens per slot {overall}"


def test_bf16_repeats_are_bitwise_equal(bf16_single, record):
    """With the batches fixed, any difference between runs would be a capture race."""
    first, *others = bf16_single
    n = manifest(first)["num_samples"]
    same = [all(torch.equal(load_row(first, i)["hidden_states"], load_row(other, i)["hidden_states"])
                for i in range(n)) for other in others]  # fmt: skip
    record("runs_2_3_equal_run_1", same)
    assert all(same), f"one request per call: runs 2 and 3 bitwise equal to run 1: {same}"


def test_bf16_batched_vs_one_request_per_call(bf16, bf16_single, record):
    """Batching changes bf16 rounding only: every row within 2e-2 of the same row run alone."""
    n = manifest(bf16)["num_samples"]
    worst = max(rel_err(load_row(bf16, i)["hidden_states"], load_row(bf16_single[0], i)["hidden_states"])
                for i in range(n))  # fmt: skip
    record("worst_sample", worst)
    assert worst < 2e-2, f"batched vs one-per-call bf16 worst sample rel err {worst:.1e}"


def test_engine_without_enforce_eager_is_refused(smollm2, mixed_conversations, work, record):
    """CUDA graphs would replay the forward without the capture's hooks: such an engine must be refused
    before it starts, in the run's last line."""
    rc, log = extract(smollm2, mixed_conversations, work / "noeager", "--engine-arg", "enforce_eager=false")
    last = log.strip().splitlines()[-1] if log.strip() else ""
    record("last_line", last)
    assert rc != 0 and "enforce_eager" in last, f"exit {rc}; last line: {last}"
