"""What the row checksum costs: xxh3-128 over Kimi-K2.5-wide rows, alone and inside the row write.

    python benchmarks/checksum_cost.py [--dir PATH] [--tokens 1000] [--reps 7] [--threads 1,2]

A row is [tokens, 4, 7168] bfloat16 (57 KB a token, 57 MB for 1,000 tokens).  Prints:
- the hash alone, GB/s in all, on each --threads count (each thread hashing its own row);
- writing rows to --dir (the disk: every file fsynced, as the writer does) with the checksum and
  without it, alternated, median of --reps, and their ratio: one row at a time (a row's latency:
  the hash runs before its write), then --writers threads writing 4 rows each at once (the
  writer's throughput, where one thread's hash overlaps the others' writes); --dir on a tmpfs
  gives the cost without a disk.
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
    ap.add_argument("--writers", type=int, default=2, help="writer threads for the throughput comparison")
    args = ap.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    torch.manual_seed(0)
    rows = [torch.randn(args.tokens, 4, 7168).to(torch.bfloat16) for _ in range(max(counts + [args.writers]))]
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
        _report("one row at a time", args, with_sum, without)
        with_sum, without = [], []
        for rep in range(args.reps):
            with_sum.append(_parallel(folder, rows[: args.writers], ids, rep, checked=True))
            without.append(_parallel(folder, rows[: args.writers], ids, rep, checked=False))
        _report(f"{args.writers} writer threads, 4 rows each", args, with_sum, without)


def _parallel(folder: Path, rows: list[torch.Tensor], ids: list[int], rep: int, checked: bool) -> float:
    """GB/s of len(rows) threads each writing its row four times, as the background writer's threads do."""

    def write(k: int) -> None:
        for j in range(4):
            index = 10_000 * (2 + rep) + 100 * k + j + (50 if checked else 0)
            if checked:
                write_hidden_states(folder, index, rows[k], ids, layer_ids=[2, 30, 58, 61])
            else:
                _write_plain(folder / "hidden_states", index, rows[k], ids)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(len(rows))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    for path in (folder / "hidden_states").glob(f"hs_{10_000 * (2 + rep)}*"):
        path.unlink()
    return 4 * sum(r.nbytes for r in rows) / seconds / 1e9


def _report(what: str, args, with_sum: list[float], without: list[float]) -> None:
    a, b = statistics.median(with_sum), statistics.median(without)
    ratio = statistics.median(x / y for x, y in zip(with_sum, without))
    where = args.dir or tempfile.gettempdir()
    print(f"row writes, fsynced, in {where}, {what}: with checksum {a:.2f} GB/s, without {b:.2f} GB/s; "
          f"with/without {ratio:.3f} (median of per-repetition ratios, {args.reps} repetitions)")  # fmt: skip


if __name__ == "__main__":
    main()
