"""The token store: every source row as the run tokenized it, on the disk inside the output.

`stream.py` writes it ahead of the engine; the capture loop reads it back batch by batch; completion
turns it into the dataset files.  So the driver never holds the dataset, and a resumed run never
tokenizes a row twice.  Chunk n is two files:

    chunk_{n:08d}.arrow   the chunk's usable rows (input_ids, loss_mask, seq_len), an Arrow stream
                          in the dataset's own schema, so completion maps the chunks without copying
    chunk_{n:08d}.json    written after it, and what makes the chunk count: how many source rows
                          the stream had read after it, whether it ended there, the usable rows'
                          source row numbers, which were truncated, and the skipped rows with why

Both are written whole or not at all (fsynced, then renamed).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from .atomic import write_atomically, write_json
from .data import Sample, Skipped

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
    read: int  # source rows the stream had read after it
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
            meta = json.loads(marker.read_text())
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
        first = self.usable
        return Chunk(number, first, len(meta["rows"]), meta["read"], meta["tokens"], meta["last"])

    @property
    def usable(self) -> int:
        return self.chunks[-1].first + self.chunks[-1].usable if self.chunks else 0

    @property
    def read(self) -> int:
        return self.chunks[-1].read if self.chunks else 0

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    @property
    def ended(self) -> bool:
        return bool(self.chunks) and self.chunks[-1].last

    def path(self, number: int, suffix: str) -> Path:
        return self.folder / f"chunk_{number:08d}.{suffix}"

    def append(self, got: list[Sample | Skipped], read: int, last: bool) -> None:
        """One chunk: the results for the source rows read since the last one, in source order."""
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

    def counts(self) -> dict:
        """The stream's counts: rows read, usable, truncated, skipped (over-long among them), tokens."""
        metas = [self.meta(c.number) for c in self.chunks]
        return {
            "rows": self.read,
            "samples": self.usable,
            "tokens": self.tokens,
            "loss_tokens": sum(m["loss_tokens"] for m in metas),
            "truncated": sum(m["truncated"] for m in metas),
            "skipped": sum(len(m["skipped"]) for m in metas),
            "skipped_long": sum(1 for m in metas for s in m["skipped"] if s[2]),
        }

    def skipped(self):
        for chunk in self.chunks:
            for row, reason, _ in self.meta(chunk.number)["skipped"]:
                yield row, reason

    def source_row_ranges(self) -> list[list[int]]:
        """The usable rows' source row numbers as [first, last + 1] runs: short unless many rows were skipped."""
        ranges: list[list[int]] = []
        for chunk in self.chunks:
            for row in self.meta(chunk.number)["rows"]:
                if ranges and ranges[-1][1] == row:
                    ranges[-1][1] = row + 1
                else:
                    ranges.append([row, row + 1])
        return ranges

    def token_freq(self) -> dict[int, int]:
        """{token id: count} over loss-mask tokens, in the order each id first occurs (as a Counter fed row
        by row has it), one chunk in memory at a time."""
        import numpy as np

        counts, first = np.zeros(0, np.int64), np.zeros(0, np.int64)
        seen = 0
        for chunk in self.chunks:
            table = self.table(chunk.number)
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

    def dataset(self):
        """Every usable row as one `datasets.Dataset`, mapped from the chunk files (nothing copied)."""
        import datasets

        info = datasets.DatasetInfo(features=datasets.Features.from_arrow_schema(_schema()))
        parts = [datasets.Dataset.from_file(str(self.path(c.number, "arrow")), info=info) for c in self.chunks]
        return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
