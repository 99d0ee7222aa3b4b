"""--pp 2 (each stage hooks its own layers, the driver joins the stages' part files) against --pp 1 and
against transformers, float32: SmolLM2 (tied embeddings: the last stage holds an embedding it never calls),
the tiny Qwen3-MoE and the Aria wrapper (text-only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..common import compare_with_reference
from ..conftest import BUDGET
from .runs import TWO_GPUS, extracted, manifest, rows_compared

pytestmark = [pytest.mark.gpu, TWO_GPUS]

SMALL = ("--dtype", "float32", "--engine-arg", "gpu_memory_utilization=0.3", *BUDGET)
KINDS = ("smollm2", "qwen3_moe", "aria")


@pytest.fixture(scope="module", params=KINDS, ids=[kind.replace("_", "-") for kind in KINDS])
def case(request, work, smollm2) -> tuple[str, Path, Path, tuple[str, ...]]:
    """(kind, checkpoint, transformers' reference checkpoint, extra CLI arguments)."""
    from ..tiny_models import build, build_aria

    kind = request.param
    if kind == "smollm2":
        return kind, smollm2, smollm2, ()
    if kind == "aria":
        aria = build_aria(work / "aria-pp", smollm2, std=0.02)
        return kind, aria, aria / "reference", ("--engine-arg", "language_model_only=true")
    model = build("qwen3_moe", work / "qwen3_moe-pp", smollm2, std=0.02)
    return kind, model, model, ()


def run(case, data: Path, work: Path, pp: int) -> Path:
    kind, model, _, extra = case
    return extracted(model, data, work / f"{kind}-pp{pp}", "--pp", str(pp), *SMALL, *extra,
                     gpus="0,1" if pp == 2 else "0")  # fmt: skip


@pytest.fixture(scope="module")
def pp2(case, mixed_conversations, work) -> Path:
    return run(case, mixed_conversations, work, 2)


def test_pp2_vs_pp1(case, pp2, mixed_conversations, work, record):
    """Two stages write what one does (within 1e-4, same token ids), no part file is left behind, and the
    manifest names both stages."""
    worst, same, ids, n = rows_compared(pp2, run(case, mixed_conversations, work, 1))
    left = list((pp2 / ".pp_parts").glob("**/*.safetensors"))
    stages = manifest(pp2)["capture"]["stages"]
    record("worst_sample", worst)
    record("bitwise_equal", f"{same}/{n}")
    record("token_files_equal", ids)
    record("stages", stages)
    assert worst < 1e-4 and ids, f"worst rel err {worst:.1e}; {same}/{n} rows bitwise equal; token files equal {ids}"
    assert not left, f"part files left: {left[:3]}"
    assert len(stages) == 2, f"stages {stages}"


def test_pp2_vs_transformers(case, pp2, reference, record):
    """float32 --pp 2 rows within 1e-4 of transformers float32 per sample and slot."""
    worst, overall = compare_with_reference(pp2, reference(case[2]))
    record("worst_sample", worst)
    record("all_tokens", overall)
    assert max(worst.values()) < 1e-4, f"worst sample per slot {worst}"
