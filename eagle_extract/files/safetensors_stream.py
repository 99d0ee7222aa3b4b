"""A safetensors file written in chunks, the disk started on each chunk as soon as it is in the page cache.

safetensors' own `save_file` hands the kernel the whole file at once, so with a row's fsync behind it the
disk only starts once the file is in the page cache, and idles while each writer thread copies its next
row. On a 2-core machine's disk, over 26 GB of Kimi-wide rows a run, rows written here went 1.05-1.50 times
as fast as by save_file, side by side (docs/results/NOTES_writer.md).

The bytes are the safetensors format, as its readers (speculators, safe_open) take it: an 8-byte
little-endian header length; the JSON header, `__metadata__` first, then each tensor's dtype, shape and
data_offsets, padded with spaces to a multiple of 8; then the tensors' bytes one after another in the
header's order, which is safetensors' own: the same bytes as its save_file, but for the metadata's key order.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import torch

# In the order of safetensors' own dtype enum, by which it lays tensors out (last first, then by name).
DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
}
RANK = {dtype: rank for rank, dtype in enumerate(DTYPES)}
CHUNK = 8 << 20
MAX_HEADER = 100_000_000  # safetensors' readers refuse a longer header
SYNC_FILE_RANGE_WRITE = 2  # start writing the range back, do not wait (linux/fs.h)


def _sync_file_range():
    """Linux's sync_file_range from the C library, or None where there is none."""
    try:
        call = ctypes.CDLL(None).sync_file_range
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


_sync_range = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing these bytes (nbytes > 0) to the disk now, without waiting for it;
    advisory (a filesystem may refuse, and where the call is missing nothing happens), so an fsync must follow."""
    if _sync_range is not None:
        _sync_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)


def header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    """The length prefix and the padded JSON header, and the tensors' names in file order; refuses what the
    format cannot hold before anything is written."""
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("safetensors metadata values must be strings")
    names = sorted(tensors, key=lambda name: (-RANK.get(tensors[name].dtype, 0), name))  # safetensors' order
    entries: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name here")
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: a contiguous host tensor is needed")
        entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER:
        raise ValueError(f"a safetensors header of {len(text):,} bytes is longer than its readers take")
    return len(text).to_bytes(8, "little") + text, names


def save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, durable: bool) -> None:
    """Write `tensors` (contiguous, on the host) to `path` from their own memory, no copy made.  `durable`: the
    disk is started on each whole CHUNK of the file as soon as it is written (never on a page still to be
    written), and the file is fsynced before it is closed."""
    head, names = header(tensors, metadata)
    parts = [memoryview(head)] + [memoryview(tensors[n].reshape(-1).view(torch.uint8).numpy()) for n in names]
    with open(path, "wb", buffering=0) as f:
        written = started = 0
        for part in parts:
            for first in range(0, len(part), CHUNK):
                chunk = part[first : first + CHUNK]
                while chunk:
                    n = f.write(chunk)
                    chunk, written = chunk[n:], written + n
                whole = written // CHUNK * CHUNK
                if durable and whole > started:
                    start_writeback(f.fileno(), started, whole - started)
                    started = whole
        if durable:
            os.fsync(f.fileno())  # on this descriptor: an error of the writeback started above is reported here
