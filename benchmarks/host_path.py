"""What the host side of a capture costs per gigabyte, without an engine.

    python benchmarks/host_path.py [--dir /tmp/eagle-host] [--hidden 4096] [--tokens 1024] [--rows 64]

After the GPU has copied a step into host memory, eagle-extract's worker cuts it into rows and
writes one safetensors file per row. This times each piece in isolation, on rows shaped like the
throughput benchmark's (T tokens x K slots x H, bf16), so the ceiling of every stage is known:

  relayout   a [K, N, H] slot-major step buffer cut into [T, K, H] rows (`transpose().contiguous()`),
             what the worker did before it staged steps token-major on the GPU (now: views, no copy)
  save_file  safetensors' `save_file` of each row to --dir, with 1, 2, 4 and 8 writer threads

A stage whose GB/s is below what the forward pass produces (tokens/s x bytes/token) caps b/a.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file


def rate(nbytes: int, run, reps: int = 3) -> float:
    """Median GB/s of `run()` over `reps` repetitions."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/eagle-host"))
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per row")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    opts = ap.parse_args()
    k, t, h, n = opts.slots, opts.tokens, opts.hidden, opts.rows
    step = torch.randn(k, n * t, h).to(torch.bfloat16)  # all rows in one buffer, as one big step
    nbytes = step.nbytes
    token_major = step.transpose(0, 1).contiguous()
    rows = [token_major[i * t : (i + 1) * t] for i in range(n)]  # what the worker now writes: views
    ids = torch.arange(t, dtype=torch.int64)
    figures = {
        "row_mib": rows[0].nbytes / 2**20,
        "rows": n,
        "relayout_gbps": rate(
            nbytes, lambda: [step[:, i * t : (i + 1) * t].transpose(0, 1).contiguous() for i in range(n)]
        ),
    }
    opts.dir.mkdir(parents=True, exist_ok=True)

    def write(i: int) -> None:
        save_file({"hidden_states": rows[i], "token_ids": ids}, str(opts.dir / f"hs_{i}.safetensors"))

    for threads in (1, 2, 4, 8):
        with ThreadPoolExecutor(threads) as pool:
            figures[f"save_file_{threads}t_gbps"] = rate(nbytes, lambda: list(pool.map(write, range(n))))
    shutil.rmtree(opts.dir, ignore_errors=True)
    print(f"rows of {figures['row_mib']:.0f} MiB ([{t}, {k}, {h}] bf16), {n} per repetition, median of 3:")
    for key, value in figures.items():
        if key.endswith("gbps"):
            print(f"  {key[:-5]:14s} {value:8.2f} GB/s")
    if opts.json:
        opts.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
