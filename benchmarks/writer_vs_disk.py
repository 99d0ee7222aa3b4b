"""The row writer alone against the disk's own fsynced rate, in one folder, alternated.

    python benchmarks/writer_vs_disk.py --folder DIR [--gb 24] [--reps 3] [--tokens 2048] [--slots 4]
        [--hidden 7168] [--threads 0] [--with-save-file] [--without-fsync] [--without-early-writeback] [--json PATH]

Each repetition writes about --gb of rows with eagle-extract's own `BackgroundWriter` (checksum, fsync,
rename: what an extraction's worker does with a finished row), once as bf16 rows and once as twice as many FP8
rows, already quantised (as the capture hands them over on a GPU), and measures the disk with as many files
written side by side as writer threads (64 MiB blocks, each started on the disk as written, fsynced:
throughput.py's probe). --with-save-file adds the bf16 rows written the way eagle-extract wrote them
until 2026-12-04: the same writer, each file by safetensors' own `save_file` (whole, then fsynced);
--without-fsync adds the bf16 rows with no fsync of their own (what the per-row fsyncs cost: the page cache
is flushed by the variant's os.sync alone); --without-early-writeback adds the bf16 rows streamed without
starting each 8 MiB on the disk as it is written (what those starts gain or cost on this disk). Every variant
is timed until `os.sync()` returns, so the page cache cannot flatter it, and the order rotates between
repetitions. No engine: this isolates the writer, which an
extraction's b/a figure mixes with the GPU's ramp at the start and the last rows' tail. The disk probe runs
once first, uncounted: on a shared virtual disk the first variant of every run was slow, whichever it was.
Prints each variant's GB/s and the writer's share of the disk (median of per-repetition ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import disk_write_rate  # noqa: E402
from eagle_extract.atomic import fsync  # noqa: E402
from eagle_extract.files import safetensors_stream  # noqa: E402
from eagle_extract.files.fp8 import to_fp8  # noqa: E402
from eagle_extract.files.writer import BackgroundWriter, default_writer_threads  # noqa: E402
from eagle_extract.worker.hostmem import ByteBudget, Held, Rows  # noqa: E402


def write_rows(
    folder: Path, rows: Rows, token_ids: list[int], count: int, threads: int, fp8: bool, durable: bool = True
) -> float:
    """GB/s of `count` copies of `rows` written by the writer, timed until os.sync() returns."""
    shutil.rmtree(folder, ignore_errors=True)
    os.sync()  # the last variant's deletions are not charged to this one
    t = time.perf_counter()
    slots = list(range(rows.states.shape[1]))
    writer = BackgroundWriter(folder, fp8=fp8, threads=threads, layer_ids=slots, durable=durable)
    for index in range(count):
        writer.submit(index, rows, token_ids)
    report = writer.drain()
    writer.close()
    os.sync()
    seconds = time.perf_counter() - t
    if report["errors"] or len(report["written"]) != count:
        raise SystemExit(f"writer_vs_disk: the writer failed: {report['errors'][:3]}")
    nbytes = sum(f.stat().st_size for f in (folder / "hidden_states").iterdir())
    shutil.rmtree(folder)
    return nbytes / seconds / 1e9


def with_save_file(write):
    """`write` run with each row file written by safetensors' save_file instead of safetensors_stream."""
    from safetensors.torch import save_file

    ours = safetensors_stream.save

    def save(path, tensors, metadata, durable):
        save_file(tensors, str(path), metadata)
        if durable:
            fsync(path)  # as write_atomically did before the rename

    safetensors_stream.save = save
    try:
        return write()
    finally:
        safetensors_stream.save = ours


def without_early_writeback(write):
    """`write` run with the streamed writer starting no writeback as it goes: its fsync then writes each row whole."""
    ours = safetensors_stream.start_writeback
    safetensors_stream.start_writeback = lambda fd, offset, nbytes: None
    try:
        return write()
    finally:
        safetensors_stream.start_writeback = ours


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", type=Path, required=True, help="on the disk to measure; emptied and removed")
    ap.add_argument("--gb", type=float, default=24.0, help="GB of rows per variant and repetition (FP8: 2x rows)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per row")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=7168, help="Kimi-K2.5's width by default")
    ap.add_argument("--threads", type=int, default=0, help="writer threads, 0 for eagle-extract's default")
    ap.add_argument("--with-save-file", action="store_true", help="also the rows written by safetensors' save_file")
    ap.add_argument(
        "--without-fsync", action="store_true", help="also the bf16 rows without their fsyncs (the run's os.sync only)"
    )
    ap.add_argument(
        "--without-early-writeback",
        action="store_true",
        help="also the bf16 rows streamed without starting each 8 MiB on the disk as written",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.folder.exists() and any(args.folder.iterdir()):
        raise SystemExit(f"writer_vs_disk: {args.folder} is not empty: name a new folder (it is removed after)")
    threads = args.threads or default_writer_threads()
    if not args.folder.parent.is_dir():
        raise SystemExit(f"writer_vs_disk: {args.folder.parent} does not exist")
    free = shutil.disk_usage(args.folder.parent).free
    if args.gb * 1e9 > 0.8 * free:
        raise SystemExit(f"writer_vs_disk: --gb {args.gb:g} needs more than 80 % of the {free / 1e9:.1f} GB free")

    g = torch.Generator().manual_seed(0)
    states = torch.randn(args.tokens, args.slots, args.hidden, generator=g).to(torch.bfloat16)
    budget = ByteBudget(1 << 62)  # the rows share one buffer: nothing to bound here
    bf16 = Rows(Held(budget, 0, states, None), 0, args.tokens)
    quantised, scales = to_fp8(states)
    fp8 = Rows(Held(budget, 0, quantised, scales), 0, args.tokens)
    token_ids = list(range(args.tokens))
    count = max(1, int(args.gb * 1e9 // states.nbytes))

    variants = {
        "bf16 rows": lambda: write_rows(args.folder, bf16, token_ids, count, threads, False),
        "FP8 rows": lambda: write_rows(args.folder, fp8, token_ids, 2 * count, threads, True),  # the same bytes
        "bf16 rows, safetensors' save_file": lambda: with_save_file(
            lambda: write_rows(args.folder, bf16, token_ids, count, threads, False)
        ),
        "bf16 rows, no early writeback": lambda: without_early_writeback(
            lambda: write_rows(args.folder, bf16, token_ids, count, threads, False)
        ),
        "bf16 rows without their fsyncs": lambda: write_rows(
            args.folder, bf16, token_ids, count, threads, False, durable=False
        ),
        "disk": lambda: disk_write_rate(args.folder, int(args.gb * 1e9), threads),
    }
    if not args.with_save_file:
        del variants["bf16 rows, safetensors' save_file"]
    if not args.without_fsync:
        del variants["bf16 rows without their fsyncs"]
    if not args.without_early_writeback:
        del variants["bf16 rows, no early writeback"]
    rates: dict[str, list[float]] = {name: [] for name in variants}
    warm = disk_write_rate(args.folder, int(args.gb * 1e9), threads)  # untimed: a run's first pass was always slow
    print(f"warm-up: disk {warm:.2f} GB/s (not counted)", file=sys.stderr, flush=True)
    order = list(variants)
    for rep in range(args.reps):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:
            rates[name].append(variants[name]())
            print(f"rep {rep + 1}/{args.reps}: {name} {rates[name][-1]:.2f} GB/s", file=sys.stderr, flush=True)
    shutil.rmtree(args.folder, ignore_errors=True)

    share = {name: [w / d for w, d in zip(rates[name], rates["disk"])] for name in rates if name != "disk"}
    shape = f"[{args.tokens}, {args.slots}, {args.hidden}]"
    print(f"\n{count} bf16 rows ({2 * count} FP8) of {shape} per variant and repetition, {threads} writer threads")
    print("| variant | GB/s median (min-max) | of the disk's, median (per rep) |\n|---|---|---|")
    for name, values in rates.items():
        ratio = (
            f"{statistics.median(share[name]):.3f} ({', '.join(f'{x:.3f}' for x in share[name])})"
            if name in share
            else "1"
        )
        print(f"| {name} | {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}) | {ratio} |")
    if args.json:
        figures = {
            "warm_up_disk_GBps": warm,
            "rows_per_rep": count,
            "row_shape": [args.tokens, args.slots, args.hidden],
            "threads": threads,
            "GBps": rates,
            "of_disk": share,
        }
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
