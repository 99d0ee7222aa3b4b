"""A Qwen3-MoE checkpoint at Qwen3-30B-A3B's widths (4 layers, random weights saved to disk so every run
loads the same tensors), float32 (IEEE, not TF32): the fused MoE kernels against transformers, and TP=2
against TP=1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ..common import compare_with_reference, copy_tokenizer
from ..conftest import BUDGET
from .runs import TWO_GPUS, extracted, manifest, rows_compared

pytestmark = pytest.mark.gpu

QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    vocab_size=151936,
)


@pytest.fixture(scope="module")
def model(work, smollm2) -> Path:
    """Built once per --gpu-work folder: a rerun loads the very same weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = work / "qwen3-moe-4l"
    if (path / "config.json").exists():
        return path
    cfg = Qwen3MoeConfig(**QWEN3_30B_A3B, num_hidden_layers=4, norm_topk_prob=True, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16")  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        built = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    built.save_pretrained(path)
    del built
    torch.cuda.empty_cache()  # the engines started next need this GPU's memory
    copy_tokenizer(smollm2, path)
    return path


def run(model: Path, data: Path, work: Path, tp: int) -> Path:
    gpus = "0,1" if tp == 2 else "0"
    return extracted(model, data, work / f"moe-tp{tp}", "--tp", str(tp), "--dtype", "float32", *BUDGET, gpus=gpus)


@pytest.fixture(scope="module")
def tp1(model, mixed_conversations, work) -> Path:
    return run(model, mixed_conversations, work, 1)


def test_tp1_vs_transformers(tp1, model, reference, record):
    """float32 TP=1 rows within 1e-4 of transformers float32 per sample and slot."""
    record("timing", manifest(tp1)["timing"])
    worst, overall = compare_with_reference(tp1, reference(model))
    record("worst_sample", worst)
    record("all_tokens", overall)
    assert max(worst.values()) < 1e-4, f"worst sample per slot {worst}"


@TWO_GPUS
def test_tp2_vs_tp1(tp1, model, mixed_conversations, work, record):
    """TP=2 (experts and heads split over two GPUs) within 1e-4 of TP=1, on the same token ids."""
    tp2 = run(model, mixed_conversations, work, 2)
    record("timing", manifest(tp2)["timing"])
    worst, _, same_ids, _ = rows_compared(tp2, tp1)
    record("worst_sample", worst)
    record("token_files_equal", same_ids)
    assert worst < 1e-4 and same_ids, f"worst sample rel err {worst:.1e}; token files equal {same_ids}"
