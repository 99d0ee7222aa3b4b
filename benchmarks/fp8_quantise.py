"""FP8 quantisation of one capture step on the GPU: `files/fp8.to_fp8` against the form before 1cfd54e
(each slot upcast to float32, divided, then cast), alternated, timed with CUDA events.

    python benchmarks/fp8_quantise.py [--tokens 16384] [--slots 4] [--hidden 7168] [--reps 20] [--json PATH]

Also checks the bytes (FP8 values and float32 scales): the two forms on the GPU, and the GPU's against the
CPU's on the first 256 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle_extract.files.fp8 import FP8, to_fp8  # noqa: E402


def to_fp8_before(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantisation as it was before 1cfd54e: a float32 copy of each slot, then the cast."""
    amax = torch.linalg.vector_norm(hidden, ord=float("inf"), dim=(1, 2), keepdim=True).float()
    scale = (amax / torch.full((), torch.finfo(FP8).max, device=amax.device)).clamp(min=1e-12)
    out = torch.empty(hidden.shape, dtype=FP8, device=hidden.device)
    for k in range(hidden.shape[1]):
        out[:, k] = (hidden[:, k].float() / scale[:, 0]).to(FP8)
    return out, scale


def timed_ms(fn, hidden: torch.Tensor) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(hidden)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="a step's tokens (vLLM's budget on an H200)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=7168, help="Kimi-K2.5's width by default")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.tokens, args.slots, args.hidden)
    magnitude = 10 ** torch.empty(shape[0], 1, 1, device="cuda").uniform_(-3, 3, generator=gen)  # a token's: 1e-3-1e3
    hidden = (torch.randn(shape, device="cuda", generator=gen) * magnitude).bfloat16()
    now, before = to_fp8(hidden), to_fp8_before(hidden)
    same_forms = torch.equal(now[0].view(torch.uint8), before[0].view(torch.uint8)) and torch.equal(now[1], before[1])
    cpu = to_fp8(hidden[:256].cpu())
    same_cpu = torch.equal(now[0][:256].cpu().view(torch.uint8), cpu[0].view(torch.uint8)) and torch.equal(
        now[1][:256].cpu(), cpu[1]
    )
    times = {"now": [], "before": []}
    for _ in range(3):  # warm-up
        timed_ms(to_fp8, hidden), timed_ms(to_fp8_before, hidden)
    for rep in range(args.reps):  # alternated, each form first in every other repetition
        order = [("now", to_fp8), ("before", to_fp8_before)][:: 1 if rep % 2 == 0 else -1]
        for name, fn in order:
            times[name].append(timed_ms(fn, hidden))
    gb = hidden.numel() * hidden.element_size() / 1e9
    print(f"to_fp8 of bf16 {list(shape)} ({gb:.2f} GB) on {torch.cuda.get_device_name(0)}, {args.reps} reps alternated")
    for name, ms in times.items():
        print(f"  {name:6s} median {statistics.median(ms):.2f} ms (min {min(ms):.2f}, max {max(ms):.2f})")
    print(f"  now / before {statistics.median(times['now']) / statistics.median(times['before']):.3f}; "
          f"bytes equal between the forms: {same_forms}; GPU equal to CPU on 256 tokens: {same_cpu}")
    if args.json:
        figures = {"shape": shape, "ms": times, "same_forms": same_forms, "same_cpu": same_cpu}
        figures.update(device=torch.cuda.get_device_name(0), torch=torch.__version__)
        args.json.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
