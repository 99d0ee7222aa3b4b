"""Kimi-K2.5 on dummy weights: its text model at the published widths with TP=2, and the checkpoint as
released (the multimodal wrapper, INT4 routed experts) cut to --kimi-layers layers on one GPU, through the
CLI as users run it; the *_bench tests record benchmarks/throughput.py's figures against plain prefill
(figures for the report only: no timing is asserted)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from ..common import copy_tokenizer, load_row
from .runs import (
    REPO,
    TWO_GPUS,
    bench_detail,
    bench_figures,
    engine_log_lines,
    extracted,
    kimi_release,
    manifest,
    verified,
)

pytestmark = pytest.mark.gpu

TEXT_LAYERS, TEXT_AUX = 6, "1,2,4"
DUMMY = ("--engine-arg", "load_format=dummy")
KIMI_ENGINE = (*DUMMY, "--engine-arg", "language_model_only=true")
# Plain prefill, then bf16 and FP8 rows timed until they are on the disk, on the wrapper's language model.
SYNCED = ("--prompts", "64", "--storage-dtypes", "model,fp8", "--sync", "--engine-arg", "language_model_only=true")


@pytest.fixture(scope="module")
def text_model(work, smollm2) -> Path:
    """Kimi-K2.5's text model (benchmarks/configs/kimi-k2.5-text: DeepSeek-V3 architecture, MLA, 384 experts
    top-8 + 1 shared) with 6 of its 61 layers."""
    config = json.loads((REPO / "benchmarks/configs/kimi-k2.5-text/config.json").read_text())
    model = work / f"kimi-k2.5-text-{TEXT_LAYERS}l"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": TEXT_LAYERS}))
    copy_tokenizer(smollm2, model)  # ids < 163,840; the weights are random anyway
    return model


@TWO_GPUS
def test_text_widths_tp2_cli(text_model, mixed_conversations, work, record):
    """The CLI at TP=2 on hidden size 7,168 writes [T, 4, 7168] rows of the layers asked for plus the last,
    and `verify` passes."""
    t0 = time.perf_counter()
    out = extracted(text_model, mixed_conversations, work / "kimi-tp2", "--tp", "2", "--layers", TEXT_AUX,
                    "--dtype", "bfloat16", *DUMMY, gpus="0,1")  # fmt: skip
    record("seconds_end_to_end", round(time.perf_counter() - t0))
    row = load_row(out, 0)["hidden_states"]
    passed, said = verified(out)
    slots = manifest(out)["slot_layer_ids"]
    record("row_0", [list(row.shape), str(row.dtype)])
    record("slots", slots)
    record("verify", said)
    assert passed, f"verify: {said}"
    assert tuple(row.shape[1:]) == (4, 7168) and slots == [1, 2, 4, TEXT_LAYERS], (list(row.shape), slots)


@TWO_GPUS
def test_text_widths_tp2_bench(text_model, work, record):
    """Extraction against plain prefill at TP=2 (figures only)."""
    figures, table = bench_figures(text_model, work, TEXT_AUX, "kimi-bench", "--tp", "2", "--prompts", "32",
                                   gpus="0,1")  # fmt: skip
    record("throughput", figures)
    record("table", table)


@pytest.fixture(scope="module")
def int4_model(work, smollm2, kimi_layers) -> Path:
    return kimi_release(work, smollm2, kimi_layers)


def int4_aux(layers: int) -> str:
    return f"2,{layers // 2},{layers - 3}"


def test_int4_release_cli(int4_model, kimi_layers, kimi_engine_args, mixed_conversations, work, record):
    """Kimi-K2.5 as released runs through the CLI on one GPU: the wrapper's language model is found, its
    INT4 experts load, and the rows have the layout `verify` and a draft expect (layout, not values: the
    weights are dummy), finite and non-zero in every slot."""
    layers = kimi_layers
    t0 = time.perf_counter()
    info = {"VLLM_LOGGING_LEVEL": "INFO"}  # the run's log then names the MoE kernel and the KV cache
    out = extracted(int4_model, mixed_conversations, work / "kimi-int4", "--layers", int4_aux(layers),
                    "--dtype", "bfloat16", *KIMI_ENGINE, *kimi_engine_args, env=info)  # fmt: skip
    record("seconds_end_to_end", round(time.perf_counter() - t0))
    written = manifest(out)
    capture = written["capture"]
    row = load_row(out, 0)["hidden_states"].float()
    passed, said = verified(out)
    record("rows", written["num_samples"])
    record("row_0", list(row.shape))
    record("slots", written["slot_layer_ids"])
    record("model", f"{capture['model_class']} via {capture['decoder_path']}")
    record("writing_ranks", len(capture["stages"]))
    record("max_abs_per_slot", [float(row[:, k].abs().max()) for k in range(row.shape[1])])
    record("verify", said)
    record("vllm", engine_log_lines((out / "eagle_extract.log").read_text()))
    assert passed, f"verify: {said}"
    assert tuple(row.shape[1:]) == (4, 7168), list(row.shape)
    assert written["slot_layer_ids"] == [2, layers // 2, layers - 3, layers], written["slot_layer_ids"]
    assert capture["model_class"] == "KimiK25ForConditionalGeneration", capture["model_class"]
    assert capture["decoder_path"] == "language_model.model", capture["decoder_path"]
    assert len(capture["stages"]) == 1, capture["stages"]
    assert bool(torch.isfinite(row).all())
    assert all(row[:, k].abs().max() > 0 for k in range(row.shape[1]))


def test_int4_release_bench(int4_model, kimi_layers, work, record):
    """Extraction (bf16 and FP8 storage) against plain prefill on one GPU, fsynced (figures only)."""
    figures, table = bench_figures(int4_model, work, int4_aux(kimi_layers), f"kimi-int4-{kimi_layers}l", *SYNCED)
    record("throughput", figures)
    record("summary", bench_detail(figures))
    record("table", table)


@pytest.mark.parametrize("int4", [True, False], ids=["int4", "bf16"])
def test_int4_vs_bf16_experts_bench(int4, smollm2, work, record):
    """The INT4 kernels' own speed: the same 4 layers with INT4 and with bf16 routed experts (figures only)."""
    model = kimi_release(work, smollm2, 4, int4=int4)
    figures, table = bench_figures(model, work, "1,2,3", f"bench-{model.name}", *SYNCED)
    record("throughput", figures)
    record("summary", bench_detail(figures))
    record("table", table)
