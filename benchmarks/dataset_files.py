"""The token store's own costs at the users' scale, without a tokenizer or an engine.

Appends N synthetic rows (about 590 tokens each, 512 per chunk, as the stream writes them) to a token
store, then writes the dataset files and token_freq.pt from it as completion does. Prints the rows/s
of the appends (the stream's Arrow writing, fsync included), the completion's seconds, and the peak
RSS of this process in each phase (polled every 50 ms; the page cache is not RSS).

    python benchmarks/dataset_files.py --rows 10000 100000 1000000 --work /tmp/eagle-store
"""

from __future__ import annotations

import argparse
import random
import resource
import shutil
import threading
import time
from pathlib import Path

import psutil

from eagle_extract.data import Sample, Skipped
from eagle_extract.store import TokenStore
from eagle_extract.stream import CHUNK_ROWS
from eagle_extract.writer import write_dataset


class PeakRSS:
    """This process's RSS, polled every 50 ms (ru_maxrss only ever grows, so a later phase cannot be read apart)."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, me.memory_info().rss)
            time.sleep(0.05)

    def take(self) -> int:
        peak, self.peak = self.peak, psutil.Process().memory_info().rss
        return peak


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--work", type=Path, default=Path("/tmp/eagle-store"))
    a = parser.parse_args()
    rss = PeakRSS()
    print(
        "| rows | tokens | store GiB | append rows/s | append peak RSS MiB | completion s | completion peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    rng = random.Random(0)
    chunks = [chunk(rng, k * CHUNK_ROWS) for k in range(4)]  # made once: the appends, not the making, are timed
    for rows in a.rows:
        shutil.rmtree(a.work, ignore_errors=True)
        (a.work / "out").mkdir(parents=True)
        store = TokenStore(a.work / "store")
        rss.take()
        t0 = time.perf_counter()
        for k in range(-(-rows // CHUNK_ROWS)):
            got = [
                Sample(s.row + k * CHUNK_ROWS, s.input_ids, s.loss_mask, s.truncated)
                if isinstance(s, Sample)
                else Skipped(s.row + k * CHUNK_ROWS, s.reason)
                for s in chunks[k % len(chunks)]
            ]
            store.append(got, store.read + len(got), last=k == -(-rows // CHUNK_ROWS) - 1)
        append_s, append_rss = time.perf_counter() - t0, rss.take()
        size = sum(p.stat().st_size for p in store.folder.iterdir())
        t0 = time.perf_counter()
        write_dataset(a.work / "out", store.dataset(), store.token_freq())
        complete_s, complete_rss = time.perf_counter() - t0, rss.take()
        print(
            f"| {rows:,} | {store.tokens:,} | {size / 2**30:.2f} | {store.read / append_s:,.0f} | "
            f"{append_rss / 2**20:.0f} | {complete_s:.1f} | {complete_rss / 2**20:.0f} |",
            flush=True,
        )
    shutil.rmtree(a.work, ignore_errors=True)
    print(f"(ru_maxrss over the whole script: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB)")


if __name__ == "__main__":
    main()
