"""The token store's own costs at the users' scale, without a tokenizer or an engine.

Appends N synthetic rows (about 590 tokens each, 512 per chunk, as the stream writes them) to a token
store, then writes the dataset files and token_freq.pt from it as completion does. Prints the rows/s
of the appends (the stream's Arrow writing, fsync included), the completion's seconds, and the peak
RSS of this process in each phase, and its anonymous part (polled every 50 ms; the store's pages,
mapped from the disk, count in RSS as file pages, which are the page cache's).  With --shards N the
same rows go to N shards' stores (source row k modulo N, 512 a chunk each), and completion merges
them in source row order and renames one empty placeholder file per row to its dataset index.

    python benchmarks/dataset_files.py --rows 10000 100000 1000000 --work /tmp/eagle-store [--shards 8]
"""

from __future__ import annotations

import argparse
import random
import resource
import shutil
import threading
import time
from pathlib import Path

from eagle_extract.data.samples import Sample, Skipped
from eagle_extract.data.store import DatasetRows, TokenStore
from eagle_extract.files.rowfile import hidden_state_path
from eagle_extract.files.shards import rows_folder
from eagle_extract.files.writer import write_dataset
from eagle_extract.job.completion import _name_by_index
from eagle_extract.job.stream import CHUNK_ROWS


def _rss() -> tuple[int, int]:
    """(RSS, its anonymous part) in bytes: mapped file pages, such as the store's, count in RSS but are
    the page cache's, which the kernel takes back under pressure."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["RssAnon"].split()[0]) * 1024


class PeakRSS:
    """This process's RSS and anonymous RSS, polled every 50 ms (ru_maxrss only ever grows, so a later
    phase cannot be read apart)."""

    def __init__(self) -> None:
        self.peak = self.anon = 0
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while True:
            rss, anon = _rss()
            self.peak, self.anon = max(self.peak, rss), max(self.anon, anon)
            time.sleep(0.05)

    def take(self) -> str:
        taken = f"{self.peak / 2**20:.0f} ({self.anon / 2**20:.0f} anonymous)"
        self.peak, self.anon = _rss()
        return taken


def chunk(rng: random.Random, first_row: int) -> list:
    got = []
    for row in range(first_row, first_row + CHUNK_ROWS):
        if row % 100 == 7:
            got.append(Skipped(row, "malformed JSON line (synthetic)"))
            continue
        n = rng.randint(400, 780)
        ids = [rng.randrange(49152) for _ in range(n)]
        got.append(Sample(row, ids, [0] * (n // 3) + [1] * (n - n // 3), n == 780))
    return got


def fill(stores: list[TokenStore], rows: int, chunks: list[list]) -> None:
    """`rows` rows from the template `chunks` (row numbers shifted), row r to stores[r % len(stores)]."""
    n, pending = len(stores), [[] for _ in stores]
    total = -(-rows // CHUNK_ROWS)
    for k in range(total):
        for s in chunks[k % len(chunks)]:
            row = s.row + k * CHUNK_ROWS
            if isinstance(s, Sample):
                shifted = Sample(row, s.input_ids, s.loss_mask, s.truncated)
            else:
                shifted = Skipped(row, s.reason)
            pending[row % n].append(shifted)
        for store, got in zip(stores, pending):
            if len(got) >= CHUNK_ROWS or (k == total - 1 and got):
                store.append(got, store.read + len(got), last=k == total - 1)
                got.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--work", type=Path, default=Path("/tmp/eagle-store"))
    parser.add_argument("--shards", type=int, default=1)
    a = parser.parse_args()
    rss = PeakRSS()
    print(
        f"{a.shards} store(s). | rows | tokens | store GiB | append rows/s | append peak RSS MiB | completion s "
        "| completion peak RSS MiB | renames s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rng = random.Random(0)
    # made once (rows 0-511, shifted): the appends, not the making, are timed
    chunks = [chunk(rng, 0) for _ in range(4)]
    for rows in a.rows:
        shutil.rmtree(a.work, ignore_errors=True)
        out = a.work / "out"
        out.mkdir(parents=True)
        stores = [TokenStore(a.work / f"store.{k}") for k in range(a.shards)]
        rss.take()
        t0 = time.perf_counter()
        fill(stores, rows, chunks)
        append_s, append_rss = time.perf_counter() - t0, rss.take()
        size = sum(p.stat().st_size for store in stores for p in store.folder.iterdir())
        t0 = time.perf_counter()
        merged = DatasetRows(stores)
        write_dataset(out, merged.dataset(), merged.token_freq())
        complete_s, complete_rss = time.perf_counter() - t0, rss.take()
        renames = "-"
        if a.shards > 1:
            folder = hidden_state_path(rows_folder(out, (0, a.shards)), 0).parent
            folder.mkdir(parents=True)
            for row in merged.source_rows.tolist():
                (folder / f"hs_{row}.safetensors").touch()
            t0 = time.perf_counter()
            _name_by_index(out, merged, False, a.shards)
            renames = f"{time.perf_counter() - t0:.1f}"
        read = sum(store.read for store in stores)
        print(
            f"| {rows:,} | {sum(s.tokens for s in stores):,} | {size / 2**30:.2f} | {read / append_s:,.0f} | "
            f"{append_rss} | {complete_s:.1f} | {complete_rss} | {renames} |",
            flush=True,
        )
    shutil.rmtree(a.work, ignore_errors=True)
    print(f"(ru_maxrss over the whole script: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB)")


if __name__ == "__main__":
    main()
