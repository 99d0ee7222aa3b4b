"""Writes speculators' offline-training layout (FACTS §1), atomically.

    DIR/                       Arrow dataset: input_ids, loss_mask, seq_len (torch format)
    DIR/token_freq.pt          {token_id: count} over loss-mask tokens
    DIR/hidden_states/hs_{i}.safetensors   one row's states (rowfile.py: its layout and header)
    DIR/eagle_extract.json     manifest, written last: its presence marks the output complete (manifest.py)

With `--format speculators-legacy` (speculators 0.3/0.4) each row is instead DIR/data_{i}.pt.

Every file is written under a dot-prefixed temporary name and renamed into place, so a
crash never leaves a partial file under a final name.
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from ..atomic import fsync, write_atomically
from . import safetensors_stream
from .fp8 import SCALES, to_fp8
from .rowfile import HIDDEN_DIR, LEGACY_RECORD, hidden_state_path, legacy_tensors, row_metadata


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
    write_atomically(path, lambda tmp: safetensors_stream.save(tmp, tensors, meta, durable), nbytes)  # save fsyncs


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
    write_atomically(hidden_state_path(output, index, True), lambda tmp: _torch_save(sample, tmp), hidden.nbytes, True)


def _torch_save(obj, path: Path) -> None:
    """torch.save through a file object, so a full disk raises the disk's own OSError (ENOSPC, which
    write_atomically makes one line). Given a path, torch raises only its own "unexpected pos"; given a file,
    it may still raise that while closing the archive after the OSError, which is then the cause."""
    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as exc:
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from None
            raise


def default_writer_threads() -> int:
    """One writer thread per two cores, 2 to 8.  On a 2 x H200 host (32 cores) 8 threads kept
    extraction closest to plain prefill (b/a 0.985, against 0.963 with 2); on a 2-core machine
    the engine's own threads need both cores and 2 did best (docs/results/NOTES_writer.md)."""
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
        rows_fail_alone: bool = False,
    ) -> None:
        self.output = Path(output)
        self.durable = durable
        self.rows_fail_alone = rows_fail_alone  # a row's write failure is that row's (a server's), not the run's
        self.fp8 = fp8
        self.legacy = legacy
        self.layer_ids = layer_ids
        self.loss_masks: dict[int, list[int]] = {}  # legacy files carry the mask; filled by the driver
        (self.output / HIDDEN_DIR).mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Condition()  # guards the fields below; notified as each row is written or fails
        self.written: list[int] = []
        self.errors: list[str] = []
        self.failed: list[tuple] = []  # rows_fail_alone: (row, why its file could not be written, its errno)
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
                if self.rows_fail_alone:
                    self.failed.append((index, _why(exc), getattr(exc, "errno", None)))
                else:
                    self.errors.append(said)
                self._lock.notify_all()
            return
        with self._lock:
            self.written.append(index)
            self._lock.notify_all()

    def drain(self, wait: bool = True, patience: float = 0.0) -> dict:
        """Report and reset what was written since the last drain; `wait` first lets the queue empty, else
        `patience` waits up to that long for a row to be written when none was since the last drain."""
        if wait:
            self._queue.join()
        with self._lock:
            if patience > 0 and not wait and not self.written and not self.errors and not self.failed:
                self._lock.wait(patience)
            report = {"written": self.written, "errors": list(self.errors), "failed": self.failed}
            self.written, self.failed = [], []
        return report

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()


def _why(exc: BaseException) -> str:
    """A row's write failure in a few words, for the one request it fails."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return "no space left on the spool's filesystem"
    if isinstance(exc, OSError):
        return f"I/O error writing the row ({exc.strerror or exc})"
    return f"{type(exc).__name__}: {exc}"


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
    write_atomically(output / "token_freq.pt", lambda tmp: _torch_save(freq, tmp), durable=True)
