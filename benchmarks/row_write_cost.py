"""What a row's guarantees cost: its xxh3-128 checksum, and its fsync, at Kimi-K2.5 width.

    python benchmarks/row_write_cost.py [--without checksum|fsync] [--dir PATH] [--tokens 1000] [--reps 7]
                                        [--threads 1,2] [--writers 2]

A row is [tokens, 4, 7168] bfloat16 (57 KB a token, 57 MB for 1,000 tokens).  Prints:
- the hash alone, GB/s in all, on each --threads count (each thread hashing its own row);
- rows written to --dir as the writer writes them (checksum, then fsync before the rename) against the
  same write `--without` one of the two, alternated, median of --reps, and their ratio: one row at a
  time (a row's latency), then --writers threads writing 4 rows each at once (the writer's
  throughput).  `--without fsync` leaves the bytes in the page cache, so each of its repetitions, and
  each of the writer's beside it, ends with os.sync() inside the timing: both then count the disk.
  --dir on a tmpfs gives the cost without a disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from eagle_extract.atomic import write_atomically
from eagle_extract.files import safetensors_stream
from eagle_extract.files.rowfile import checksum, hidden_state_path, row_metadata
from eagle_extract.files.writer import write_hidden_states

LAYER_IDS = [2, 30, 58, 61]


def _hash_rate(rows: list[torch.Tensor], reps: int) -> float:
    def one(row):
        checksum({"hidden_states": row}, ",".join(map(str, LAYER_IDS)))

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


def _write_row(folder: Path, index: int, row: torch.Tensor, ids: list[int], without: str | None = None) -> None:
    """The writer's row write (`write_hidden_states`), or the same `without` its checksum or its fsync."""
    if without is None:
        return write_hidden_states(folder, index, row, ids, layer_ids=LAYER_IDS)
    tensors = {"token_ids": torch.tensor(ids, dtype=torch.int64), "hidden_states": row}
    meta = row_metadata(tensors, LAYER_IDS) if without == "fsync" else None
    path = hidden_state_path(folder, index)
    write_atomically(path, lambda tmp: safetensors_stream.save(tmp, tensors, meta, durable=without != "fsync"))


def _timed(write, nbytes: int, sync: bool) -> float:
    """GB/s of `write()`, until os.sync() has returned when `sync`."""
    t0 = time.perf_counter()
    write()
    if sync:
        os.sync()
    return nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="where rows are written [default: a temporary folder]")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts for the hash alone")
    ap.add_argument("--writers", type=int, default=2, help="writer threads for the throughput comparison")
    ap.add_argument("--without", choices=("checksum", "fsync"), default="checksum", help="what the baseline leaves out")
    args = ap.parse_args()
    sync = args.without == "fsync"
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
        full, without = [], []
        for rep in range(args.reps):  # alternated, so drift hits both
            one = rows[0].nbytes
            full.append(_timed(lambda: _write_row(folder, rep, rows[0], ids), one, sync))
            without.append(_timed(lambda: _write_row(folder, 1000 + rep, rows[0], ids, args.without), one, sync))
        _report("one row at a time", args, full, without)
        full, without = [], []
        for rep in range(args.reps):
            full.append(_parallel(folder, rows[: args.writers], ids, rep, None, sync))
            without.append(_parallel(folder, rows[: args.writers], ids, rep, args.without, sync))
        _report(f"{args.writers} writer threads, 4 rows each", args, full, without)


def _parallel(folder: Path, rows: list[torch.Tensor], ids: list[int], rep: int, without, sync: bool) -> float:
    """GB/s of len(rows) threads each writing its row four times, as the background writer's threads do."""

    def write(k: int) -> None:
        for j in range(4):
            _write_row(folder, 10_000 * (2 + rep) + 100 * k + j + (50 if without else 0), rows[k], ids, without)

    def all_threads() -> None:
        threads = [threading.Thread(target=write, args=(k,)) for k in range(len(rows))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    rate = _timed(all_threads, 4 * sum(r.nbytes for r in rows), sync)
    for path in (folder / "hidden_states").glob(f"hs_{10_000 * (2 + rep)}*"):
        path.unlink()
    return rate


def _report(what: str, args, full: list[float], without: list[float]) -> None:
    a, b = statistics.median(full), statistics.median(without)
    ratio = statistics.median(x / y for x, y in zip(full, without))
    where = args.dir or tempfile.gettempdir()
    disk = ", each until os.sync() returned" if args.without == "fsync" else ", fsynced"
    print(f"row writes in {where}{disk}, {what}: the writer's {a:.2f} GB/s, without the {args.without} {b:.2f} GB/s; "
          f"ratio {ratio:.3f} (median of per-repetition ratios, {args.reps} repetitions)")  # fmt: skip


if __name__ == "__main__":
    main()
