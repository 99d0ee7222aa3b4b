"""A row's hidden-state file: its name, what its header records, and what can be wrong with it.

    DIR/hidden_states/hs_{i}.safetensors   hidden_states [T, K, H], token_ids int64 [T]
                                           (FP8: hidden_states float8_e4m3fn and per-token scales)
    DIR/data_{i}.pt                        --format speculators-legacy (speculators 0.3/0.4): a
                                           torch.save'd {"input_ids", "hidden_states": [K tensors
                                           of [T, H]], "loss_mask"}

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

Rows written by an eagle-extract from before the rows recorded their layer ids and checksum are
accepted as they are: nothing is said about the missing record, so older outputs still pass.
"""

from __future__ import annotations

import json
import re
import stat
import zipfile
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from .fp8 import FP8, SCALES

HIDDEN_DIR = "hidden_states"
HEADER_BOUND = 4096  # a row file's bytes besides its tensors: the header's length word and JSON (about 260 bytes at
# 3 slots, 1.1 KiB with FP8 scales at 200: its slot ids are listed)
LAYER_IDS = "slot_layer_ids"  # row metadata keys
CHECKSUM = "checksum"
LEGACY_RECORD = "eagle_extract"  # data_{i}.pt's key for the row metadata
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def row_file_bytes(tokens: int, per_token: int) -> int:
    """A bound on a row file's size: its tensors' bytes and HEADER_BOUND."""
    return tokens * per_token + HEADER_BOUND


def hidden_state_path(output: Path, index: int, legacy: bool = False) -> Path:
    if legacy:
        return Path(output) / f"data_{index}.pt"
    return Path(output) / HIDDEN_DIR / f"hs_{index}.safetensors"


def completed_rows(output: Path, legacy: bool = False) -> set[int]:
    """Rows whose hidden-state file is complete (a final name is only ever a whole file)."""
    folder = Path(output) if legacy else Path(output) / HIDDEN_DIR
    if not folder.is_dir():
        return set()
    pattern = r"data_(\d+)\.pt" if legacy else r"hs_(\d+)\.safetensors"
    names = (re.fullmatch(pattern, p.name) for p in folder.iterdir())
    return {int(m.group(1)) for m in names if m}


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


def legacy_tensors(sample: dict) -> dict[str, torch.Tensor]:
    """A data_{i}.pt sample's tensors by name, as its checksum covers them."""
    slots = {f"hidden_states.{k}": t for k, t in enumerate(sample["hidden_states"])}
    return {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"], **slots}


def read_row(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A hs_{i}.safetensors file's tensors and metadata, from one read of the file."""
    with safe_open(str(path), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}


def _read_header(path: Path, size: int) -> tuple[dict, int] | None:
    """A hs_{i}.safetensors file's JSON header, read by hand (no tensor touched), and its length; None
    when the file (of `size` bytes) is cut inside it."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return (json.loads(f.read(n)), n) if 0 < n <= size - 8 else None


def _regular_size(path: Path) -> int | None:
    """The file's size from one stat, None when it is no regular file (a pipe would block its reader for ever)."""
    st = path.stat()
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def header_dtype(output: Path, index: int) -> str | None:
    """The model dtype row `index`'s file holds its states in, from its header (None when unreadable)."""
    path = hidden_state_path(output, index)
    try:
        size = _regular_size(path)
        read = _read_header(path, size) if size is not None else None
        return SAFETENSORS_DTYPES.get(read[0]["hidden_states"]["dtype"]) if read else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def header_problem(path: Path, tokens: int, slots: int, hidden: int, legacy: bool) -> str | None:
    """What a look at a row file's own header (no tensor read) finds wrong, as a power cut leaves it:
    cut, emptied, its length other than its header says, or shapes other than the run's.  (Not the
    dtype: with --dtype auto the engine's may differ from the config's, which the identity holds.)"""
    try:
        size = _regular_size(path)
        if size is None:
            return NOT_A_FILE
        if legacy:  # a torch.save zip: its directory, at the end, is the first thing a cut loses
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
            return None
        read = _read_header(path, size)
        if read is None:
            return "cut inside its header"
        header, n = read
    except (OSError, ValueError, zipfile.BadZipFile):
        return "unreadable"
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        end = max(v["data_offsets"][1] for v in tensors.values())
        shapes = {k: (v["shape"], v["dtype"]) for k, v in tensors.items()}
    except (TypeError, KeyError, IndexError, ValueError):
        return "header unreadable"
    if size != 8 + n + end:
        return f"{size} bytes, its header says {8 + n + end}"
    if shapes.get("hidden_states", [None])[0] != [tokens, slots, hidden]:
        return f"hidden_states {shapes.get('hidden_states')}, the run writes {[tokens, slots, hidden]}"
    if shapes.get("token_ids") != ([tokens], "I64"):
        return f"token_ids {shapes.get('token_ids')}, the run writes [{tokens}] I64"
    return None


NOT_A_FILE = "not a regular file (a folder, a pipe or a device)"
NO_CHECKSUM = "its header records no checksum, which every row of this output's release carries"


def check_row(
    output: Path, index: int, row: dict, slots: int, hidden: int, dtype, legacy: bool, checksums: bool = False
) -> tuple[str | None, str | None]:
    """Everything wrong with row `index`'s file (either layout) against its dataset `row` (input_ids,
    loss_mask), the first problem or None, and the layer ids the file records (None when it records
    none).  `checksums`: the manifest says every row carries one.  The checksum is taken over the
    tensors read for the other checks: one read of the file."""
    path = hidden_state_path(output, index, legacy)
    if not path.exists():
        return ("data file missing" if legacy else "hidden-state file missing"), None
    if not path.is_file():  # a pipe would block its reader for ever
        return NOT_A_FILE, None
    try:
        if legacy:
            sample = torch.load(path, weights_only=True)
            states, ids, mask = sample["hidden_states"], sample["input_ids"], sample["loss_mask"]
            tensors = legacy_tensors(sample)
            meta = {str(k): str(v) for k, v in sample.get(LEGACY_RECORD, {}).items()}
        else:
            tensors, meta = read_row(path)
            hs, tok = tensors["hidden_states"], tensors["token_ids"]
            scales = tensors[SCALES] if dtype == FP8 else None
    except Exception as exc:
        return unreadable(exc), None
    layer_ids = meta.get(LAYER_IDS)
    if legacy:
        problem = _legacy_problem(row, states, ids, mask, slots, hidden, dtype)
    else:
        problem, hs = _offline_problem(row["input_ids"], hs, tok, scales, slots, hidden, dtype)
        states = [hs]
    if problem:
        return problem, layer_ids
    if _lost_checksum(meta, checksums):
        return NO_CHECKSUM, layer_ids
    now = changed_since_written(tensors, meta)
    if now:
        said = f"bytes changed since it was written (checksum {meta[CHECKSUM]} recorded, its data gives {now})"
        return said, layer_ids
    if not all(torch.isfinite(t).all() for t in states):
        return "hidden_states hold NaN or Inf", layer_ids
    return None, layer_ids


def _legacy_problem(row: dict, states, ids, mask, slots: int, hidden: int, dtype) -> str | None:
    if not torch.equal(ids, row["input_ids"]) or not torch.equal(mask, row["loss_mask"]):
        return "input_ids or loss_mask differ from the dataset row"
    expected = (len(ids), hidden)
    if len(states) != slots or any(tuple(t.shape) != expected or t.dtype != dtype for t in states):
        return f"hidden_states is not {slots} tensors of {expected} {dtype}"
    return None


def _offline_problem(input_ids, hs, tok, scales, slots: int, hidden: int, dtype) -> tuple[str | None, torch.Tensor]:
    """The problem with a hs_{i}.safetensors row's tensors, and its states (dequantised, with FP8 scales)."""
    expected = (len(input_ids), slots, hidden)
    if tuple(hs.shape) != expected:
        return f"hidden_states shape {tuple(hs.shape)}, expected {expected}", hs
    if hs.dtype != dtype:
        return f"hidden_states dtype {hs.dtype}, expected {dtype}", hs
    if tok.dtype != torch.int64 or not torch.equal(tok, input_ids):
        return "token_ids differ from the row's input_ids", hs
    if scales is not None:
        if tuple(scales.shape) != (len(input_ids), 1, 1) or scales.dtype != torch.float32:
            shape = f"{tuple(scales.shape)} {scales.dtype}"
            return f"{SCALES} shape {shape}, expected ({len(input_ids)}, 1, 1) float32", hs
        hs = hs.float() * scales
    return None, hs


def unreadable(exc: Exception) -> str:
    first = str(exc).splitlines()[0][:120] if str(exc).strip() else ""
    return f"unreadable ({type(exc).__name__}: {first})"


def _lost_checksum(meta: dict, required: bool) -> bool:
    """A release that records layer ids records the checksum too, and the manifest says when every row has
    one: a header without it was changed, and the checksum cannot be switched off so."""
    return CHECKSUM not in meta and (required or LAYER_IDS in meta)
