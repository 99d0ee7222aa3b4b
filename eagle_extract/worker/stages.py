"""Pipeline-parallel capture: which slots a stage holds, and joining the stages' files into one.

With `--pp N` every stage's writing rank hooks only its own layers and writes the slots it
holds to OUT/.pp_parts/layers_{start}-{end}/hidden_states/hs_{i}.safetensors.  Once every stage
has written a row, the driver joins the parts into the row's final file (in the requested
storage format) and deletes them, so the output is laid out exactly as a one-stage run's and a
final name still only ever holds a whole row.  Part files record their slots' layer ids and a
checksum as rows do (rowfile.py): the joiner checks each part against its checksum and records the
parts' layer ids, in slot order, in the joined row.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..files.rowfile import HIDDEN_DIR, LAYER_IDS, changed_since_written, hidden_state_path, read_row
from ..files.writer import write_hidden_states, write_legacy

PARTS_DIR = ".pp_parts"


def stage_slots(aux_ids: list[int], num_layers: int, start: int, end: int) -> list[int]:
    """The slots a stage running layers [start, end) captures, in slot order.

    Slot k holds the input of layer aux_ids[k], so it belongs to the stage that runs that
    layer (at a stage boundary: the later stage, which receives it from the earlier one);
    the final slot, the last layer's output, belongs to the last stage."""
    slots = [k for k, layer in enumerate(aux_ids) if start <= layer < end]
    if end == num_layers:
        slots.append(len(aux_ids))
    return slots


def part_root(output: Path, start: int, end: int) -> Path:
    return Path(output) / PARTS_DIR / f"layers_{start}-{end}"


def check_layout(writers: list[dict], num_layers: int, num_slots: int) -> None:
    """Every slot written by exactly one stage, every stage seeing the whole model's layer count."""
    counts = {w["num_layers"] for w in writers}
    if counts != {num_layers}:
        raise ValueError(f"the writing workers hooked {sorted(counts)} layers, the model has {num_layers}")
    held = sorted(s for w in writers for s in w["slots"])
    if held != list(range(num_slots)):
        stages = ", ".join(f"layers {w['start']}-{w['end']}: slots {w['slots']}" for w in writers)
        raise ValueError(f"the writing workers do not hold each of the {num_slots} slots once ({stages})")


def join_row(output: Path, index: int, parts: list[tuple[Path, list[int]]], fp8: bool, legacy_mask) -> None:
    """Write row `index` from its stage parts, then delete them.  `legacy_mask` (a loss mask)
    selects speculators 0.3/0.4's format, else `fp8` picks the storage dtype."""
    pieces, layer_ids = [], {}
    for root, slots in parts:
        tensors, meta = read_row(hidden_state_path(root, index))
        if changed_since_written(tensors, meta):
            raise ValueError(
                f"row {index}: its part in {root} changed since it was written (checksum); rerun to redo it"
            )
        if LAYER_IDS in meta:
            layer_ids.update(zip(slots, map(int, meta[LAYER_IDS].split(",")), strict=True))
        pieces.append((slots, tensors["hidden_states"], tensors["token_ids"]))
    token_ids = pieces[0][2]
    if any(not torch.equal(ids, token_ids) for _, _, ids in pieces):
        raise ValueError(f"row {index}: the pipeline stages captured different tokens")
    first = pieces[0][1]
    num_slots = sum(len(slots) for slots, _, _ in pieces)
    hidden = torch.empty((first.shape[0], num_slots, first.shape[2]), dtype=first.dtype)
    for slots, part, _ in pieces:
        hidden[:, slots] = part
    # parts that record no layer ids (a writer not told them) make a row without them
    ids = [layer_ids[k] for k in range(num_slots)] if len(layer_ids) == num_slots else None
    if legacy_mask is not None:
        write_legacy(output, index, hidden, token_ids.tolist(), legacy_mask, ids)
    else:
        write_hidden_states(output, index, hidden, token_ids.tolist(), fp8, layer_ids=ids)
    for root, _ in parts:
        hidden_state_path(root, index).unlink()


class PartJoiner:
    """Joins each row once every stage has reported it written, on a few background threads."""

    def __init__(self, output: Path, writers: list[dict], fp8: bool, loss_masks: dict | None, threads: int = 4):
        self.output = Path(output)
        self.parts = [(Path(w["part"]), w["slots"]) for w in writers]
        self.fp8 = fp8
        self.loss_masks = loss_masks  # row -> loss mask, for the legacy format only
        self._seen: list[set[int]] = [set() for _ in writers]
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="eagle-join")
        self._futures = []
        self._lock = threading.Lock()
        self.joined: set[int] = set()
        (self.output / HIDDEN_DIR).mkdir(parents=True, exist_ok=True)  # as a one-stage writer makes it

    def add(self, written_by_stage: list[list[int]]) -> None:
        """Take each stage's newly written rows (in writer order); join the rows all stages have."""
        for seen, rows in zip(self._seen, written_by_stage):
            seen.update(rows)
        ready = set.intersection(*self._seen)
        for seen in self._seen:
            seen -= ready
        for index in sorted(ready):
            self._futures.append(self._pool.submit(self._join, index))
        pending = []
        for future in self._futures:  # a failed join (a full disk, say) stops the run now
            if future.done():
                future.result()
            else:
                pending.append(future)
        self._futures = pending

    def _join(self, index: int) -> None:
        mask = None if self.loss_masks is None else self.loss_masks.pop(index)
        join_row(self.output, index, self.parts, self.fp8, mask)
        with self._lock:
            self.joined.add(index)

    def take_joined(self) -> set[int]:
        """The rows joined since the last call (so no caller holds every row of a run)."""
        with self._lock:
            taken, self.joined = self.joined, set()
        return taken

    def finish(self) -> set[int]:
        """Wait for every join, raise the first failure, and remove the part folders once empty
        (shards of the same output may still be writing theirs); returns the rows joined since the last take."""
        self._pool.shutdown(wait=True)
        for future in self._futures:
            future.result()
        for folder, _, _ in os.walk(self.output / PARTS_DIR, topdown=False):
            try:
                os.rmdir(folder)
            except OSError:  # not empty
                pass
        return self.take_joined()
