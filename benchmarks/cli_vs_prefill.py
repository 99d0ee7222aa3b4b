"""The CLI end to end against plain vLLM prefill of exactly the same token ids, side by side.

    python benchmarks/cli_vs_prefill.py [--model smollm2] [--data FILE] [--reps 3] [--out DIR]
        [--dtype bfloat16] [--batch-size N] [--engine-arg KEY=VALUE ...] [--cli-arg ARG ...]

Each repetition runs (a) `eagle-extract` on the data file into a fresh OUT (its own process: the user's
command), then (b) a fresh process that starts vLLM exactly as eagle-extract does (`job/engine.start_engine`:
eager, no prefix caching, the worker extension loaded but no hooks installed, the same engine arguments
and model length) and prefills the token ids the CLI wrote (OUT's `input_ids`), `max_tokens=1`, in
generate calls of --batch-size rows in dataset order, as the CLI makes them.

a's clock is the manifest's `extract_s`: from the engine being ready to the last row file written and
fsynced, so it holds tokenizing (which overlaps the engine) and the captures, but not completion (the
dataset files and the manifest, written after it), which favours a slightly. b's clock is its generate
calls. `--cli-arg` goes to a alone: pass nothing there that changes the engine (`--tp`, `--seq-length`,
`--max-num-batched-tokens`), or the two no longer run alike. Neither holds the engine's start, which the table gives
apart, with each process's whole wall time. The ratio a/b is the median of per-repetition ratios.
The disk is in a's clock (pass `--out` on tmpfs to take it out); the files are fsynced, so the page
cache does not hide it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = "prefill: "
sys.path.insert(0, str(REPO))


def extract(args, out: Path) -> dict:
    """(a) The CLI, as a user runs it; its manifest's timing and the process's wall time."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "eagle_extract", "--model", args.model, "--output", str(out), "--dtype", args.dtype,
           "--batch-size", str(args.batch_size), *(["--data", args.data] if args.data else []),
           *[x for kv in args.engine_arg for x in ("--engine-arg", kv)], *args.cli_arg]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, cwd=REPO)  # its progress lines go on to stderr as they come
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"eagle-extract failed (exit {proc.returncode}): its last lines are above")
    manifest = json.loads((out / "eagle_extract.json").read_text())
    timing = manifest["timing"]
    return {"tokens": manifest["num_tokens"], "start_s": timing["engine_start_s"], "work_s": timing["extract_s"],
            "wall_s": wall}  # fmt: skip


def prefill(args, out: Path) -> dict:
    """(b) In a fresh process: plain prefill of OUT's token ids (this script with --prefill OUT)."""
    engine = [x for kv in args.engine_arg for x in ("--engine-arg", kv)]
    cmd = [sys.executable, __file__, "--prefill", str(out), "--model", args.model, "--dtype", args.dtype,
           "--batch-size", str(args.batch_size), *engine]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)  # its stderr (progress) as it comes
    wall = time.perf_counter() - t
    if proc.returncode:
        tail = proc.stdout.strip()[-2000:]  # vLLM's own log lines go to stdout
        raise SystemExit(f"plain prefill failed (exit {proc.returncode}); its stderr is above, its stdout ends: {tail}")
    said = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]  # vLLM prints to stdout too
    if not said:
        raise SystemExit(f"plain prefill printed no figures: {proc.stdout.strip()[-2000:]}")
    return {**json.loads(said[-1][len(RESULT) :]), "wall_s": wall}


def prefill_here(args) -> None:
    """The body of (b): one engine as eagle-extract starts it, the same rows, no capture."""
    from datasets import load_from_disk
    from transformers import AutoConfig
    from vllm import SamplingParams, TokensPrompt

    from eagle_extract.config import ExtractConfig
    from eagle_extract.faces.cli import parse_engine_args
    from eagle_extract.job.engine import start_engine

    cfg = ExtractConfig(model=args.model, dtype=args.dtype, batch_size=args.batch_size,
                        engine_args=parse_engine_args(tuple(args.engine_arg))).resolved()  # fmt: skip
    rows = [r.tolist() for r in load_from_disk(str(args.prefill)).with_format("numpy")["input_ids"]]
    context = getattr(AutoConfig.from_pretrained(cfg.model).get_text_config(), "max_position_embeddings", None)
    t = time.perf_counter()
    llm = start_engine(cfg, min(cfg.seq_length + 1, context or cfg.seq_length + 1))
    start = time.perf_counter() - t
    print(f"prefill: engine ready in {start:.0f} s; {len(rows):,} rows", file=sys.stderr, flush=True)
    params = SamplingParams(max_tokens=1, detokenize=False)
    t = time.perf_counter()
    for i in range(0, len(rows), cfg.batch_size):
        llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows[i : i + cfg.batch_size]], params, use_tqdm=False)
        print(f"prefill: {min(i + cfg.batch_size, len(rows)):,}/{len(rows):,} rows", file=sys.stderr, flush=True)
    work = time.perf_counter() - t
    print(RESULT + json.dumps({"tokens": sum(map(len, rows)), "start_s": start, "work_s": work}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", default=None, help="the data file (default: the CLI's bundled sample)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--cli-arg", action="append", default=[], help="one more argument for (a) only, repeatable")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/cli-vs-prefill"))
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--prefill", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prefill:
        return prefill_here(args)
    runs = []
    for rep in range(args.reps):
        a = extract(args, args.out)
        b = prefill(args, args.out)
        assert a["tokens"] == b["tokens"], (a, b)
        runs.append({"a": a, "b": b, "ratio": (a["tokens"] / a["work_s"]) / (b["tokens"] / b["work_s"])})
        print(f"rep {rep + 1}: {json.dumps(runs[-1])}", flush=True)
    shutil.rmtree(args.out, ignore_errors=True)

    def col(side: str, key: str) -> str:
        values = [r[side][key] for r in runs]
        return f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"

    def rate(side: str) -> str:
        values = [r[side]["tokens"] / r[side]["work_s"] for r in runs]
        return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"

    tokens = runs[0]["a"]["tokens"]
    print(f"\n{tokens:,} tokens; {args.reps} repetitions, a then b in each; median (min-max)")
    print("| run | tokens/s (engine start excluded) | engine start s | whole process s |\n|---|---|---|---|")
    for side, what in (("a", "eagle-extract, files written and fsynced"), ("b", "plain prefill of the same token ids")):
        print(f"| {side}: {what} | {rate(side)} | {col(side, 'start_s')} | {col(side, 'wall_s')} |")
    ratios = [r["ratio"] for r in runs]
    print(f"\na/b {statistics.median(ratios):.3f} (per repetition: {', '.join(f'{x:.3f}' for x in ratios)})")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
