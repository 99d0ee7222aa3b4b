"""Tokenizing ahead of the engine: the data source's rows, in source order, into the token store.

A background thread reads the rows and hands chunks of them to worker processes (chat-template
rendering is pure Python, so threads would share one core), keeping a few chunks in flight, and
appends each chunk's result to the store in order.  The engine starts once the first chunk is
there, and reads the store while the rest is tokenized.  A resumed run continues after the rows
its store already holds.  A shard tokenizes its own rows only, unless --max-samples needs every row
counted up to its cut; either way its store keeps only its own.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections import deque

from ..data.formats import BadRow, Record, count_rows, read_rows, to_record
from ..data.samples import LoadReport, Sample, Skipped, no_usable_rows, sample_from
from ..data.store import TokenStore
from ..errors import ExtractError
from ..files.shards import owns
from .preflight import check_context

CHUNK_ROWS = 512  # source rows per chunk: one worker task, one store chunk
SMALL_SOURCE = 32 * 2**20  # bytes: a smaller data source is tokenized by the background thread itself


def default_processes(source_bytes: int, replicas: int = 1) -> int:
    """Worker processes: none for a small source (starting them costs more than they save), else one per
    four CPU cores (of this replica's share), 1 to 8: the engine's own processes need the rest."""
    if source_bytes < SMALL_SOURCE:
        return 0
    return max(1, min(8, (os.cpu_count() or 1) // (4 * replicas)))


_worker: dict = {}


def _start_worker(cfg, settings: tuple) -> None:
    from .preflight import load_tokenizer

    die_with_parent()
    _worker["tokenizer"], _worker["settings"] = load_tokenizer(cfg), settings


def die_with_parent() -> None:
    """A pool worker whose parent was killed would wait on its task queue for ever (it holds the queue's other
    end itself), and keep Python's resource tracker from cleaning up after the engine: it ends with the parent."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="eagle-parent-watch").start()


def _worker_chunk(rows: list) -> list:
    return tokenize_rows(_worker["tokenizer"], rows, *_worker["settings"])


def tokenize_rows(tokenizer, rows: list, seq_length: int, options: dict, data_format: str, need_assistant: bool):
    """(source row number, parsed row, a BadRow or a Record) pairs to samples and skips, in order."""
    got = []
    for number, row in rows:
        record, reason = row if isinstance(row, Record) else None, None
        if record is None:
            try:
                record = to_record(number, row, data_format, need_assistant)
            except BadRow as exc:
                reason = str(exc)
        got.append(sample_from(record, number, reason, tokenizer, seq_length, options))
    return got


def settings(cfg, need_assistant: bool) -> tuple:
    """What tokenize_rows needs besides the tokenizer and the rows, as a worker process gets it."""
    options = {"long_samples": cfg.long_samples, "strict": cfg.strict, "source": str(cfg.data)}
    return cfg.seq_length, options, cfg.data_format, need_assistant


def own_rows_only(cfg, shard: tuple[int, int] | None) -> bool:
    """Whether this job reads only its own rows: a shard without --max-samples (which rows make the first
    N usable ones depends on every row before them)."""
    return shard is not None and cfg.max_samples is None


def job_rows(cfg, shard: tuple[int, int] | None):
    """(source row number, parsed row) for the rows this job tokenizes."""
    rows = read_rows(cfg.data)
    return ((n, row) for n, row in rows if owns(shard, n)) if own_rows_only(cfg, shard) else rows


def first_chunks(plan, rows, require_usable: bool = True) -> list[list]:
    """The first chunks of `rows`, tokenized here before anything is created, up to the first that holds a
    usable row: their errors come before the engine starts, and their sizes make the disk estimate.  Rows
    that end without one are refused when `require_usable` (not for a shard's own rows: the others may)."""
    cfg, rows, got_chunks = plan.cfg, iter(rows), []
    for chunk in iter(lambda: list(itertools.islice(rows, CHUNK_ROWS)), []):
        got = tokenize_rows(plan.tokenizer, chunk, *settings(cfg, True))
        check_chunk(got, plan.shape)
        got_chunks.append(got)
        if any(isinstance(s, Sample) for s in got):
            return got_chunks
    if not require_usable:
        return got_chunks
    skipped = [(s.row, s.reason) for got in got_chunks for s in got if isinstance(s, Skipped)]
    raise no_usable_rows(LoadReport(skipped=skipped), cfg.data)


def first_counts(first: list[list]) -> tuple[int, int, int, bool]:
    """(rows read, usable rows, their tokens, whether the rows ended) of the first chunks."""
    got = [s for chunk in first for s in chunk]
    samples = [s for s in got if isinstance(s, Sample)]
    return len(got), len(samples), sum(len(s.input_ids) for s in samples), len(got) < CHUNK_ROWS * len(first)


def expected_rows(cfg, read: int, usable: int, ended: bool, shard: tuple[int, int] | None = None) -> int:
    """About how many samples the dataset will hold, `usable` of the first `read` rows this job read being
    usable: the source's rows (counted without parsing them) times that share, at most --max-samples."""
    whole = ended and not own_rows_only(cfg, shard)  # every row was read: `usable` is the count
    expected = usable if whole else round(max(count_rows(cfg.data), read) * usable / max(read, 1))
    return min(expected, cfg.max_samples or expected)


def check_chunk(got: list, shape) -> None:
    lengths = [len(s.input_ids) for s in got if isinstance(s, Sample)]
    if lengths:
        check_context(max(lengths), shape)


class Tokenizing:
    """The background thread that writes `store` from `rows`, (source row number, parsed row) pairs."""

    def __init__(self, store: TokenStore, rows, plan, processes: int, first: list, need_assistant: bool = True):
        self.store, self.cfg, self.shape, self.processes = store, plan.cfg, plan.shape, processes
        self.shard = plan.shard
        self.tokenizer, self.settings = plan.tokenizer, settings(plan.cfg, need_assistant)
        self.first = [] if store.chunks else first  # chunks tokenized before the store existed
        self.kept = store.read  # rows an interrupted run tokenized: not tokenized again
        skip = store.read + sum(map(len, self.first))
        self.rows = itertools.islice(rows, skip, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="eagle-tokenize")

    def start(self) -> Tokenizing:
        if not self.store.ended:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)  # a worker's chunk finishes first; a hung source read is left behind

    def _run(self) -> None:
        from concurrent.futures.process import BrokenProcessPool

        try:
            self._fill()
        except OSError as exc:  # writing the store: a full disk, say
            why = exc.strerror or str(exc)
            self.store.fail(
                ExtractError(f"writing the token store {self.store.folder}: {why}; fix it and rerun to resume")
            )
        except BrokenProcessPool:
            self.store.fail(
                ExtractError(
                    "a tokenizing worker process died (killed, out of memory, or a script calling extract() "
                    "without `if __name__ == '__main__':`, which each worker process runs again); fix that, or "
                    "pass --tokenize-processes 0 to tokenize in the driver"
                )
            )
        except BaseException as exc:  # the reader raises it where it waits
            self.store.fail(exc)

    def _fill(self) -> None:
        chunks = iter(lambda: list(itertools.islice(self.rows, CHUNK_ROWS)), [])
        results = self._pooled(chunks) if self.processes else self._inline(chunks)
        try:  # closing `results` stops the worker processes, however this ends
            for got in itertools.chain(self.first, results):
                try:
                    check_chunk(got, self.shape)
                except ExtractError as exc:  # rows may be written by now: --seq-length is the run's identity
                    raise ExtractError(f"{exc}, with --overwrite if rows were written") from None
                if self._stop.is_set() or self._append(got):
                    return
            self.store.append([], self.store.read, last=True, seen=self.store.seen)
        finally:
            results.close()

    def _inline(self, chunks):
        for chunk in chunks:
            yield tokenize_rows(self.tokenizer, chunk, *self.settings)

    def _pooled(self, chunks):
        from concurrent.futures import ProcessPoolExecutor

        spawn = multiprocessing.get_context("spawn")  # not fork: this process holds threads and the engine's client
        with ProcessPoolExecutor(self.processes, spawn, _start_worker, (self.cfg, self.settings)) as pool:
            pending: deque = deque()
            try:
                for chunk in chunks:
                    pending.append(pool.submit(_worker_chunk, chunk))
                    # a few in flight, so the source is read as it is needed; what is done goes to the store now
                    while pending and (pending[0].done() or len(pending) > 2 * self.processes):
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()

    def _append(self, got: list) -> bool:
        """Append one chunk's results (one per row read), this job's own; True when --max-samples ends the
        stream here."""
        store, cap = self.store, self.cfg.max_samples
        usable = [k for k, s in enumerate(got) if isinstance(s, Sample)]
        end, last = len(got), False
        if cap is not None and store.seen + len(usable) >= cap:
            end, last = usable[cap - store.seen - 1] + 1, True
        own = [s for s in got[:end] if owns(self.shard, s.row)]
        store.append(own, store.read + end, last, seen=store.seen + sum(k < end for k in usable))
        return last
