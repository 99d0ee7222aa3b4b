"""The token store: the source rows as the run tokenized them (a shard's: its own), on the disk inside the output.

`stream.py` writes it ahead of the engine; the capture loop reads it back batch by batch; completion
turns it into the dataset files.  So the driver never holds the dataset, and a resumed run never
tokenizes a row twice.  Chunk n is two files:

    chunk_{n:08d}.arrow   the chunk's usable rows (input_ids, loss_mask, seq_len), an Arrow stream
                          in the dataset's own schema, so completion maps the chunks without copying
    chunk_{n:08d}.json    written after it, and what makes the chunk count: how many rows the
                          stream had read after it and how many of them were usable, whether it
                          ended there, the usable rows' source row numbers, how many were
                          truncated, and the skipped rows with why

Both are written whole or not at all (fsynced, then renamed).  A shard's store holds its own rows
only (`stream.py`); `DatasetRows` merges the shards' stores in source row order at completion.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from ..atomic import write_atomically, write_json
from .samples import Sample, Skipped

STORE = ".eagle_extract_tokens"  # a shard's: .eagle_extract_tokens.I-of-N
COLUMNS = ("input_ids", "loss_mask", "seq_len")


def store_name(shard: tuple[int, int] | None) -> str:
    return STORE if shard is None else f"{STORE}.{shard[0]}-of-{shard[1]}"


def _schema():
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    return pa.schema([("input_ids", ids), ("loss_mask", ids), ("seq_len", pa.int64())])


@dataclass
class Chunk:
    number: int
    first: int  # dataset index of its first usable row
    usable: int
    read: int  # rows the stream had read after it
    seen: int  # usable rows among them, this shard's or not (--max-samples counts them all)
    tokens: int
    last: bool


class TokenStore:
    """The chunks on the disk, appended by one thread and read by another."""

    def __init__(self, folder: Path, change: bool = True) -> None:
        """The chunks a run kept in `folder`; unless told not to `change` it, what a killed run left half
        written goes (a temporary file, an Arrow file without its marker)."""
        self.folder = Path(folder)
        self.chunks: list[Chunk] = []
        for marker in sorted(self.folder.glob("chunk_*.json")):
            if int(marker.stem[6:]) != len(self.chunks) or not marker.with_suffix(".arrow").is_file():
                break  # a chunk is only ever written after the one before it
            try:
                meta = json.loads(marker.read_text())
            except ValueError:  # emptied by a filesystem that lost it: this chunk and those after are redone
                break
            if "seen" not in meta and self.folder.name != STORE:  # a shard's from before shards kept their own
                break  # rows only: it holds every row, so it is started over
            self.chunks.append(self._chunk(len(self.chunks), meta))
        if change:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in self.folder.glob(".*.tmp"):
                stale.unlink()
            for extra in self.folder.glob("chunk_*"):  # past the last whole chunk
                if int(extra.name[6:14]) >= len(self.chunks):
                    extra.unlink()
        self.error: BaseException | None = None
        self._changed = threading.Condition()

    def _chunk(self, number: int, meta: dict) -> Chunk:
        first, usable = self.usable, len(meta["rows"])
        seen = meta.get("seen", first + usable)  # written before the field was: every row is kept
        return Chunk(number, first, usable, meta["read"], seen, meta["tokens"], meta["last"])

    @property
    def usable(self) -> int:
        return self.chunks[-1].first + self.chunks[-1].usable if self.chunks else 0

    @property
    def read(self) -> int:
        return self.chunks[-1].read if self.chunks else 0

    @property
    def seen(self) -> int:
        return self.chunks[-1].seen if self.chunks else 0

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    @property
    def ended(self) -> bool:
        return bool(self.chunks) and self.chunks[-1].last

    def path(self, number: int, suffix: str) -> Path:
        return self.folder / f"chunk_{number:08d}.{suffix}"

    def append(self, got: list[Sample | Skipped], read: int, last: bool, seen: int | None = None) -> None:
        """One chunk: the results for the rows read since the last one that the store keeps, in source
        order; `seen` counts the usable rows read so far, kept or not (by default, those kept)."""
        import pyarrow as pa

        samples = [s for s in got if isinstance(s, Sample)]
        table = pa.table(
            {
                "input_ids": [s.input_ids for s in samples],
                "loss_mask": [s.loss_mask for s in samples],
                "seq_len": [len(s.input_ids) for s in samples],
            },
            schema=_schema(),
        )

        def save(tmp: Path) -> None:
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as stream:
                stream.write_table(table)

        meta = {
            "read": read,
            "seen": self.usable + len(samples) if seen is None else seen,
            "last": last,
            "tokens": sum(len(s.input_ids) for s in samples),
            "loss_tokens": sum(sum(s.loss_mask) for s in samples),
            "rows": [s.row for s in samples],
            "truncated": sum(s.truncated for s in samples),
            "skipped": [[s.row, s.reason, s.long] for s in got if isinstance(s, Skipped)],
        }
        number = len(self.chunks)
        write_atomically(self.path(number, "arrow"), save, durable=True)
        write_json(self.path(number, "json"), meta, durable=True)
        with self._changed:
            self.chunks.append(self._chunk(number, meta))
            self._changed.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The writer stopped on `exc`: a reader waiting for more raises it."""
        with self._changed:
            self.error = exc
            self._changed.notify_all()

    def wait(self, number: int, timeout: float | None = None) -> Chunk | None:
        """Chunk `number` once written; None after `timeout`, or when the stream ended before it."""
        with self._changed:
            while len(self.chunks) <= number and not self.ended and self.error is None:
                if not self._changed.wait(timeout):
                    return None
            if len(self.chunks) > number:
                return self.chunks[number]
            if self.error is not None:
                raise self.error
            return None

    def table(self, number: int):
        """Chunk `number`'s usable rows, mapped from the disk."""
        import pyarrow as pa

        with pa.memory_map(str(self.path(number, "arrow"))) as source:
            return pa.ipc.open_stream(source).read_all()

    def meta(self, number: int) -> dict:
        return json.loads(self.path(number, "json").read_text())

    def rows(self, chunk: Chunk):
        """(dataset index, source row, input_ids, loss_mask) for each usable row of `chunk`."""
        table, meta = self.table(chunk.number), self.meta(chunk.number)
        ids, masks = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
        for k, (row, i, m) in enumerate(zip(meta["rows"], ids, masks)):
            yield chunk.first + k, row, i, m

    def seq_lens(self, chunk: Chunk) -> list[int]:
        return self.table(chunk.number).column("seq_len").to_pylist()



class DatasetRows:
    """The dataset's rows, from one run's store or from every shard's, merged in source row order: a row's
    dataset index is its place in that order.  What is read whole is one source row number per row."""

    def __init__(self, stores: list[TokenStore]) -> None:
        import numpy as np

        self.stores = stores
        rows, self.counts = [], dict.fromkeys(("tokens", "loss_tokens", "truncated", "skipped", "skipped_long"), 0)
        for store in stores:
            for chunk in store.chunks:
                meta = store.meta(chunk.number)
                rows.append(np.asarray(meta["rows"], np.int64))
                for key in ("tokens", "loss_tokens", "truncated"):
                    self.counts[key] += meta[key]
                self.counts["skipped"] += len(meta["skipped"])
                self.counts["skipped_long"] += sum(1 for s in meta["skipped"] if s[2])
        rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        self.counts["samples"] = len(rows)
        # the dataset index of the k-th row the stores hold, one after the other; None: the same order
        self.order = None if (np.diff(rows) > 0).all() else np.argsort(rows, kind="stable")
        self.source_rows = rows if self.order is None else rows[self.order]

    def skipped(self):
        """(source row, why) for every skipped row, in source order."""
        import heapq

        def of(store: TokenStore):
            for chunk in store.chunks:
                for row, reason, _ in store.meta(chunk.number)["skipped"]:
                    yield row, reason

        return heapq.merge(*map(of, self.stores))

    def source_row_ranges(self) -> list[list[int]]:
        """The usable rows' source row numbers as [first, last + 1] runs: short unless many rows were skipped."""
        import numpy as np

        rows = self.source_rows
        starts = np.flatnonzero(np.diff(rows, prepend=-2) != 1)
        ends = np.append(starts[1:], len(rows))
        return [[int(rows[a]), int(rows[b - 1]) + 1] for a, b in zip(starts, ends)]

    def dataset(self):
        """Every usable row as one `datasets.Dataset`, in dataset order, mapped from the chunk files."""
        import datasets

        info = datasets.DatasetInfo(features=datasets.Features.from_arrow_schema(_schema()))
        parts = [
            datasets.Dataset.from_file(str(store.path(c.number, "arrow")), info=info)
            for store in self.stores
            for c in store.chunks
        ]
        rows = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
        return rows if self.order is None else rows.select(self.order)

    def token_freq(self) -> dict[int, int]:
        """{token id: count} over loss-mask tokens, in the order each id first occurs (as a Counter fed row
        by row has it), a batch of rows in memory at a time."""
        import numpy as np

        counts, first = np.zeros(0, np.int64), np.zeros(0, np.int64)
        seen = 0
        for table in self.dataset().with_format("arrow").iter(batch_size=512):  # a chunk's worth
            ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
            mask = table.column("loss_mask").combine_chunks().flatten().to_numpy()
            ids = ids[mask != 0]
            if not len(ids):
                continue
            if ids.max() >= len(counts):
                grow = int(ids.max()) + 1 - len(counts)
                counts = np.concatenate([counts, np.zeros(grow, np.int64)])
                first = np.concatenate([first, np.full(grow, np.iinfo(np.int64).max)])
            counts += np.bincount(ids, minlength=len(counts))
            unique, at = np.unique(ids, return_index=True)
            first[unique] = np.minimum(first[unique], seen + at)
            seen += len(ids)
        present = np.flatnonzero(counts)
        order = present[np.argsort(first[present], kind="stable")]
        return {int(t): int(counts[t]) for t in order}
