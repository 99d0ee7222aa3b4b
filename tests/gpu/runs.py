"""Helpers of the GPU tests: eagle-extract and benchmarks/throughput.py in child processes on chosen GPUs
(as users run them), and comparisons of two outputs of the same rows.

GPU numbers here are relative to CUDA_VISIBLE_DEVICES, so two sessions can share a host.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..common import load_row, rel_err

REPO = Path(__file__).resolve().parents[2]

# Marked, not checked inside the test, so that a one-GPU host starts none of the test's runs.
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def visible(gpus: str) -> str:
    """GPU numbers as CUDA_VISIBLE_DEVICES for a child: relative to the GPUs this process was given."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    return ",".join(given.split(",")[int(g)] for g in gpus.split(",")) if given else gpus


def child_env(gpus: str) -> dict:
    path = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"
    return {**os.environ, "CUDA_VISIBLE_DEVICES": visible(gpus), "PYTHONPATH": path}


def extract(
    model: Path, data: Path, out: Path, *args: str, gpus: str = "0", env: dict | None = None, overwrite: bool = True
) -> tuple[int, str]:
    """The CLI on `gpus`: its exit status and the tail of what it printed."""
    env = {**child_env(gpus), **(env or {})}
    cmd = [sys.executable, "-m", "eagle_extract", "--model", str(model), "--data", str(data), "--output", str(out),
           *(["--overwrite"] if overwrite else []), *args]  # fmt: skip
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


def manifest(out: Path) -> dict:
    return json.loads((Path(out) / "eagle_extract.json").read_text())


def verified(out: Path) -> tuple[bool, str]:
    """`eagle-extract verify OUT`: whether it passed, and its last line."""
    proc = subprocess.run([sys.executable, "-m", "eagle_extract", "verify", str(out)], capture_output=True, text=True,
                          cwd=REPO)  # fmt: skip
    text = proc.stdout.strip()
    return proc.returncode == 0, text.splitlines()[-1] if text else proc.stderr[-300:]


def rows_compared(a: Path, b: Path) -> tuple[float, int, bool, int]:
    """Two outputs of the same rows: (worst relative error of a row, rows bitwise equal, token files equal, rows)."""
    n = manifest(b)["num_samples"]
    pairs = [(load_row(a, i), load_row(b, i)) for i in range(n)]
    worst = max(rel_err(x["hidden_states"], y["hidden_states"]) for x, y in pairs)
    same = sum(torch.equal(x["hidden_states"], y["hidden_states"]) for x, y in pairs)
    return worst, same, all(torch.equal(x["token_ids"], y["token_ids"]) for x, y in pairs), n


def kimi_release(work: Path, tokenizer: Path, layers: int, int4: bool = True) -> Path:
    """Kimi-K2.5 as released (benchmarks/configs/kimi-k2.5), cut to its first `layers` decoder layers, for
    dummy weights; int4=False drops the quantization config, so the routed experts are bf16."""
    from ..common import copy_tokenizer
    from ..tiny_models import KIMI_MEDIA

    config = json.loads((REPO / "benchmarks/configs/kimi-k2.5/config.json").read_text())
    text = {**config["text_config"], "num_hidden_layers": layers}
    if not int4:
        del text["quantization_config"]
    model = work / f"kimi-k2.5-{'int4' if int4 else 'bf16'}-{layers}l"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({**config, "text_config": text}, indent=1))
    (model / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": KIMI_MEDIA}))
    copy_tokenizer(tokenizer, model)  # Kimi's own tokenizer is remote code; SmolLM2's ids are < 163,840
    return model


def engine_log_lines(log: str) -> str:
    """What vLLM said about the weights, the MoE kernel and the KV cache, from a run's log."""
    wanted = ("Model loading took", "Available KV cache memory", "GPU KV cache size", "MoEMethod", "MoE backend")
    lines = [line.split("] ", 1)[-1].strip() for line in log.splitlines() if any(w in line for w in wanted)]
    return "; ".join(dict.fromkeys(lines))


def bench_figures(model: Path, work: Path, aux: str, tag: str, *args: str, gpus: str = "0") -> tuple[dict, str]:
    """benchmarks/throughput.py on dummy weights, 2,048-token prompts, 3 repetitions, plus `args`:
    its figures and the tail of the tables it printed."""
    figures = work / f"{tag}.json"
    cmd = [sys.executable, "benchmarks/throughput.py", "--model", str(model), "--dummy", "--layers", aux,
           "--prompt-len", "2048", "--reps", "3", "--out", str(work / tag), "--json", str(figures), *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(gpus), cwd=REPO)
    print(proc.stdout[-3000:], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(root_cause(proc.stdout + proc.stderr))
    return json.loads(figures.read_text()), proc.stdout[-3000:]


def bench_detail(f: dict) -> str:
    """throughput.py's figures (a --sync run's) in one line."""
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
