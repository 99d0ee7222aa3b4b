"""What the row checksum costs: xxh3-128 over Kimi-K2.5-wide rows, alone and inside the row write.

    python benchmarks/checksum_cost.py [--dir PATH] [--tokens 1000] [--reps 7] [--threads 1,2]

A row is [tokens, 4, 7168] bfloat16 (57 KB a token, 57 MB for 1,000 tokens).  Prints:
- the hash alone, GB/s in all, on each --threads count (each thread hashing its own row);
- writing rows to --dir (the disk: every file fsynced, as the writer does) with the checksum and
  without it, alternated, median of --reps, and their ratio; --dir on a tmpfs gives the cost
  without a disk.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle_extract.atomic import write_atomically
from eagle_extract.writer import checksum, write_hidden_states


def _hash_rate(rows: list[torch.Tensor], reps: int) -> float:
    def one(row):
        checksum({"hidden_states": row}, "2,30,58,61")

    rates = []
    for _ in range(reps):
        threads = [threading.Thread(target=one, args=(row,)) for row in rows]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rates.append(sum(r.nbytes for r in rows) / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def _write_plain(folder: Path, index: int, row: torch.Tensor, ids: list[int]) -> None:
    """The writer's row write without the checksum and metadata: the baseline."""
    tensors = {"token_ids": torch.tensor(ids, dtype=torch.int64), "hidden_states": row}
    write_atomically(folder / f"hs_{index}.safetensors", lambda tmp: save_file(tensors, str(tmp)), durable=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="where rows are written [default: a temporary folder]")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts for the hash alone")
    args = ap.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    torch.manual_seed(0)
    rows = [torch.randn(args.tokens, 4, 7168).to(torch.bfloat16) for _ in range(max(counts))]
    ids = list(range(args.tokens))
    print(f"row: {tuple(rows[0].shape)} bfloat16, {rows[0].nbytes / 1e6:.1f} MB")
    rates = ", ".join(f"{n} thread(s) {_hash_rate(rows[:n], args.reps):.2f} GB/s" for n in counts)
    print(f"xxh3-128 alone, in all: {rates} (median of {args.reps})")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        (folder / "hidden_states").mkdir()
        with_sum, without = [], []
        for rep in range(args.reps):  # alternated, so drift hits both
            t0 = time.perf_counter()
            write_hidden_states(folder, rep, rows[0], ids, layer_ids=[2, 30, 58, 61])
            with_sum.append(rows[0].nbytes / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            _write_plain(folder / "hidden_states", 1000 + rep, rows[0], ids)
            without.append(rows[0].nbytes / (time.perf_counter() - t0) / 1e9)
        a, b = statistics.median(with_sum), statistics.median(without)
        ratios = statistics.median(x / y for x, y in zip(with_sum, without))
        print(f"row write, fsynced, in {args.dir or tempfile.gettempdir()}: with checksum {a:.2f} GB/s, "
              f"without {b:.2f} GB/s; with/without {ratios:.3f} (median of per-repetition ratios)")  # fmt: skip


if __name__ == "__main__":
    main()
