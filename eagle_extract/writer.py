"""Writes speculators' offline-training layout (FACTS §1), atomically.

    DIR/                       Arrow dataset: input_ids, loss_mask, seq_len (torch format)
    DIR/token_freq.pt          {token_id: count} over loss-mask tokens
    DIR/hidden_states/hs_{i}.safetensors   hidden_states [T, K, H], token_ids int64 [T]
    DIR/eagle_extract.json     manifest, written last: its presence marks the output complete

With `--format speculators-legacy` (speculators 0.3/0.4) each row is instead DIR/data_{i}.pt,
a torch.save'd {"input_ids", "hidden_states": [K tensors of [T, H]], "loss_mask"}.

Every row records what `verify` needs to see that it changed or belongs to other layers: in
hs_{i}.safetensors' header metadata (which speculators and safetensors' load_file ignore), in
data_{i}.pt under the key "eagle_extract" (speculators 0.3/0.4 read only the three keys above), two
strings:

    slot_layer_ids   each slot's layer id in vLLM's convention (layers.py), "2,15,27,30": the
                     final slot is num_hidden_layers; data_{i}.pt too (not its legacy numbering)
    checksum         "xxh3_128:<hex>" of the slot_layer_ids string, then of each tensor's raw bytes
                     in the order of the tensors' names (data_{i}.pt: "hidden_states.{k}" per slot)

The bytes hashed are those the file holds, so `verify` hashes the tensors it reads anyway.  xxh3-128
hashes about 14 GB/s on one core here and releases the GIL, so writer threads hash in parallel, far
faster than a disk writes.  A hand-edit of a row's layer ids breaks its checksum.

Every file is written under a dot-prefixed temporary name and renamed into place, so a
crash never leaves a partial file under a final name.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import tempfile
import threading
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from .atomic import fsync, write_atomically, write_record
from .errors import ExtractError
from .fp8 import SCALES, to_fp8

HIDDEN_DIR = "hidden_states"
MANIFEST = "eagle_extract.json"
LAYER_IDS = "slot_layer_ids"  # row metadata keys
CHECKSUM = "checksum"
LEGACY_RECORD = "eagle_extract"  # data_{i}.pt's key for the row metadata


class ManifestError(ExtractError, ValueError):
    pass


def layer_ids_text(layer_ids: list[int]) -> str:
    return ",".join(map(str, layer_ids))


def checksum(tensors: dict[str, torch.Tensor], layer_ids: str) -> str:
    """xxh3-128 of `layer_ids` and the tensors' bytes in name order, read in place (no copy)."""
    digest = xxhash.xxh3_128(layer_ids.encode())
    for name in sorted(tensors):
        digest.update(tensors[name].reshape(-1).view(torch.uint8).numpy())
    return f"xxh3_128:{digest.hexdigest()}"


def row_metadata(tensors: dict[str, torch.Tensor], layer_ids: list[int] | None) -> dict[str, str]:
    """What a row records about itself; without `layer_ids` (a writer not told them) the checksum only."""
    ids = "" if layer_ids is None else layer_ids_text(layer_ids)
    meta = {CHECKSUM: checksum(tensors, ids)}
    if layer_ids is not None:
        meta[LAYER_IDS] = ids
    return meta


def changed_since_written(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str | None:
    """The checksum the data gives now, when it is not the recorded one; None when it is, or when the
    row records none (written by an eagle-extract before checksums)."""
    if CHECKSUM not in metadata:
        return None
    now = checksum(tensors, metadata.get(LAYER_IDS, ""))
    return None if now == metadata[CHECKSUM] else now


def read_row(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A hs_{i}.safetensors file's tensors and metadata, from one read of the file."""
    with safe_open(str(path), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}


def hidden_state_path(output: Path, index: int, legacy: bool = False) -> Path:
    if legacy:
        return Path(output) / f"data_{index}.pt"
    return Path(output) / HIDDEN_DIR / f"hs_{index}.safetensors"


def write_hidden_states(
    output: Path,
    index: int,
    hidden: torch.Tensor,
    token_ids: list[int],
    fp8: bool = False,
    scales=None,
    layer_ids: list[int] | None = None,
    durable: bool = True,
) -> None:
    """Write one row's file: in the model dtype, already quantised (`scales` given: the capture
    quantised on the model's device), or (fp8) quantised here with per-token scales; `layer_ids`
    (one per slot) and the checksum go into its metadata.  `durable`: fsynced before its rename (a
    dataset's rows; not the server's spool, whose files live seconds)."""
    tensors = {"token_ids": torch.tensor(token_ids, dtype=torch.int64)}
    if scales is not None:
        tensors["hidden_states"], tensors[SCALES] = hidden.contiguous(), scales.contiguous()
    elif fp8:
        tensors["hidden_states"], tensors[SCALES] = to_fp8(hidden)
    else:
        tensors["hidden_states"] = hidden.contiguous()
    nbytes = sum(t.nbytes for t in tensors.values())
    meta = row_metadata(tensors, layer_ids)
    path = hidden_state_path(output, index)
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta), nbytes, durable=durable)


def legacy_tensors(sample: dict) -> dict[str, torch.Tensor]:
    """A data_{i}.pt sample's tensors by name, as its checksum covers them."""
    slots = {f"hidden_states.{k}": t for k, t in enumerate(sample["hidden_states"])}
    return {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"], **slots}


def write_legacy(
    output: Path,
    index: int,
    hidden: torch.Tensor,
    token_ids: list[int],
    loss_mask: list[int],
    layer_ids: list[int] | None = None,
) -> None:
    """Write one row as speculators 0.3/0.4's data_{i}.pt: one [T, H] tensor per slot."""
    sample = {
        "input_ids": torch.tensor(token_ids, dtype=torch.long),
        "hidden_states": [hidden[:, k].clone() for k in range(hidden.shape[1])],
        "loss_mask": torch.tensor(loss_mask, dtype=torch.long),
    }
    sample[LEGACY_RECORD] = row_metadata(legacy_tensors(sample), layer_ids)
    write_atomically(hidden_state_path(output, index, True), lambda tmp: torch.save(sample, tmp), hidden.nbytes, True)


def default_writer_threads() -> int:
    """One writer thread per two cores, 2 to 8.  On a 2 x H200 host (32 cores) 8 threads kept
    extraction closest to plain prefill (b/a 0.985, against 0.963 with 2); on a 2-core machine
    the engine's own threads need both cores and 2 did best (docs/benchmarks.md)."""
    return min(8, max(2, (os.cpu_count() or 2) // 2))


class BackgroundWriter:
    """Writes hidden-state files on worker threads so the forward pass never waits for disk.

    Each queued row holds its host memory until written; the capture's byte budget (hostmem.py), not
    this queue, bounds how much that is, and makes the forward pass wait when the disk falls behind.
    `layer_ids` are the layer ids of the slots the rows hold, recorded in every file.
    """

    def __init__(
        self,
        output: Path,
        fp8: bool = False,
        legacy: bool = False,
        threads: int | None = None,
        layer_ids: list[int] | None = None,
        durable: bool = True,
    ) -> None:
        self.output = Path(output)
        self.durable = durable
        self.fp8 = fp8
        self.legacy = legacy
        self.layer_ids = layer_ids
        self.loss_masks: dict[int, list[int]] = {}  # legacy files carry the mask; filled by the driver
        (self.output / HIDDEN_DIR).mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.written: list[int] = []
        self.errors: list[str] = []
        count = threads or default_writer_threads()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]
        for t in self._threads:
            t.start()

    def expect_loss_masks(self, masks: list[tuple[int, list[int]]]) -> None:
        with self._lock:
            self.loss_masks.update(masks)

    def submit(self, index: int, rows, token_ids: list[int]) -> None:
        """Queue one row: `rows.states` [T, K, H] (and `rows.scales` when already quantised to FP8)."""
        self._queue.put((index, rows, token_ids))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            self._write(*item)
            del item  # the row's host memory goes back to the budget now, not at the next row
            self._queue.task_done()

    def _write(self, index: int, rows, token_ids: list[int]) -> None:
        if self.errors:  # after a failure keep draining, write nothing more
            return
        try:
            if self.legacy:
                with self._lock:
                    mask = self.loss_masks.pop(index)
                write_legacy(self.output, index, rows.states, token_ids, mask, self.layer_ids)
            else:
                write_hidden_states(
                    self.output, index, rows.states, token_ids, self.fp8, rows.scales, self.layer_ids, self.durable
                )
        except Exception as exc:  # reported to the driver by drain()
            folder = hidden_state_path(self.output, index, self.legacy).parent
            if not folder.is_dir():
                said = (
                    f"{folder} disappeared while rows were being written (removed or renamed): rename it back and "
                    "rerun the same command to resume, or rerun it to start again"
                )
            else:
                said = f"row {index}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"
            with self._lock:
                self.errors.append(said)
            return
        with self._lock:
            self.written.append(index)

    def drain(self, wait: bool = True) -> dict:
        """Report and reset what was written since the last drain; `wait` first lets the queue empty."""
        if wait:
            self._queue.join()
        with self._lock:
            report = {"written": self.written, "errors": list(self.errors)}
            self.written = []
        return report

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()


def completed_rows(output: Path, legacy: bool = False) -> set[int]:
    """Rows whose hidden-state file is complete (a final name is only ever a whole file)."""
    folder = Path(output) if legacy else Path(output) / HIDDEN_DIR
    if not folder.is_dir():
        return set()
    pattern = r"data_(\d+)\.pt" if legacy else r"hs_(\d+)\.safetensors"
    names = (re.fullmatch(pattern, p.name) for p in folder.iterdir())
    return {int(m.group(1)) for m in names if m}


def write_dataset(output: Path, rows, freq: dict[int, int]) -> None:
    """Write the Arrow rows (a `datasets.Dataset` of input_ids, loss_mask and seq_len, mapped from the token
    store, so it is copied batch by batch) and token_freq.pt, which speculators' trainer reads beside
    hidden_states/."""
    output = Path(output)
    rows.set_format(type="torch")
    staging = Path(tempfile.mkdtemp(prefix=".dataset-", dir=output))
    try:
        rows.save_to_disk(str(staging))
        for item in staging.iterdir():
            fsync(item)  # on the disk before the manifest says the output is complete
            os.replace(item, output / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    write_atomically(output / "token_freq.pt", lambda tmp: torch.save(freq, tmp), durable=True)


def write_manifest(output: Path, manifest: dict) -> None:
    write_record(Path(output) / MANIFEST, manifest)


def read_manifest(output: Path) -> dict:
    """The manifest as a JSON object; a damaged or hand-broken one raises ManifestError (one line)."""
    path = Path(output) / MANIFEST
    fix = "restore it from a copy, or rerun the extraction with --overwrite"
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno} col {exc.colno}): {fix}") from None
    except UnicodeDecodeError:
        raise ManifestError(f"{path} is not text: {fix}") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path} is JSON but not an object: {fix}")
    return manifest
