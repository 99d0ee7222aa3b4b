"""A safetensors file written in chunks, the disk started on each chunk as soon as it is in the page cache.

safetensors' own `save_file` hands the kernel the whole file at once, so with a row's fsync behind it the
disk only starts once the file is in the page cache, and idles while each writer thread copies its next
row. On a 2-core machine's disk, with 28 GB of Kimi-wide rows a run, the writer went from 0.70 of the
disk's rate to 0.90 (docs/benchmarks.md, "The writer against the disk").

The bytes are the safetensors format, as its readers (speculators, safe_open) take it: an 8-byte
little-endian header length; the JSON header, `__metadata__` first, then each tensor's dtype, shape and
data_offsets, padded with spaces to a multiple of 8; then the tensors' bytes one after another in the
header's order, which is safetensors' own: the same bytes as its save_file, but for the metadata's key order.
"""

from __future__ import annotations

import ctypes
import json
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
SYNC_FILE_RANGE_WRITE = 2  # start writing the range back, do not wait (linux/fs.h)


def _sync_file_range():
    """Linux's sync_file_range from the C library, or None where there is none."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


_sync_range = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing these bytes to the disk now, without waiting for it; advisory (a
    filesystem may refuse, and where the call is missing nothing happens), so an fsync must still follow."""
    if _sync_range is not None:
        _sync_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)


def ordered(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names in file order, as safetensors lays them out."""
    return sorted(tensors, key=lambda name: (-RANK.get(tensors[name].dtype, 0), name))


def header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    """The length prefix and the padded JSON header for `tensors` laid out in `ordered` order."""
    entries: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name in ordered(tensors):
        t = tensors[name]
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name here")
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: a contiguous host tensor is needed")
        entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, start_disk: bool) -> None:
    """Write `tensors` (contiguous, on the host) to `path` from their own memory, no copy made; with
    `start_disk` each chunk's writeback is started behind it (the caller fsyncs)."""
    head = header(tensors, metadata)  # checks every tensor before the file is made
    with open(path, "wb", buffering=0) as f:
        done = _write_all(f, memoryview(head), 0, False)
        for name in ordered(tensors):
            t = tensors[name]
            if t.numel():
                data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                done = _write_all(f, data, done, start_disk)


def _write_all(f, data: memoryview, at: int, start_disk: bool) -> int:
    """Write `data` at file position `at` in chunks; returns the position after it."""
    for first in range(0, len(data), CHUNK):
        chunk = data[first : first + CHUNK]
        size = len(chunk)
        while chunk:
            chunk = chunk[f.write(chunk) :]
        at += size
        if start_disk:
            start_writeback(f.fileno(), at - size, size)
    return at
