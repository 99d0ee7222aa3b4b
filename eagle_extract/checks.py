"""What `verify` checks in a finished output, against its manifest, file by file.

Finds missing, truncated or unreadable hidden-state files (either layout), wrong shapes or dtypes,
`token_ids` that differ from the row's `input_ids`, NaN/Inf values, stray files, and a
`token_freq.pt` that does not match the rows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .fp8 import FP8, SCALES
from .writer import (
    HIDDEN_DIR,
    MANIFEST,
    completed_rows,
    hidden_state_path,
    read_manifest,
    token_frequencies,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float8_e4m3fn": FP8}


def check_legacy_row(output: Path, index: int, row: dict, slots: int, hidden: int, dtype) -> str | None:
    """The problem with row `index`'s data_{i}.pt (speculators 0.3/0.4 layout), or None."""
    path = hidden_state_path(output, index, legacy=True)
    if not path.exists():
        return "data file missing"
    try:
        sample = torch.load(path, weights_only=True)
        states, ids, mask = sample["hidden_states"], sample["input_ids"], sample["loss_mask"]
    except Exception as exc:
        return f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    if not torch.equal(ids, row["input_ids"]) or not torch.equal(mask, row["loss_mask"]):
        return "input_ids or loss_mask differ from the dataset row"
    expected = (len(ids), hidden)
    if len(states) != slots or any(tuple(t.shape) != expected or t.dtype != dtype for t in states):
        return f"hidden_states is not {slots} tensors of {expected} {dtype}"
    if not all(torch.isfinite(t).all() for t in states):
        return "hidden_states hold NaN or Inf"
    return None


def check_row(output: Path, index: int, input_ids: torch.Tensor, slots: int, hidden: int, dtype) -> str | None:
    """The problem with row `index`'s file, or None."""
    from safetensors import safe_open

    path = hidden_state_path(output, index)
    if not path.exists():
        return "hidden-state file missing"
    try:
        with safe_open(str(path), "pt") as f:
            hs, tok = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
            scales = f.get_tensor(SCALES) if dtype == FP8 else None
    except Exception as exc:
        return f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    expected = (len(input_ids), slots, hidden)
    if tuple(hs.shape) != expected:
        return f"hidden_states shape {tuple(hs.shape)}, expected {expected}"
    if hs.dtype != dtype:
        return f"hidden_states dtype {hs.dtype}, expected {dtype}"
    if tok.dtype != torch.int64 or not torch.equal(tok, input_ids):
        return "token_ids differ from the row's input_ids"
    if scales is not None:
        if tuple(scales.shape) != (len(input_ids), 1, 1) or scales.dtype != torch.float32:
            return f"{SCALES} shape {tuple(scales.shape)} {scales.dtype}, expected ({len(input_ids)}, 1, 1) float32"
        hs = hs.float() * scales
    if not torch.isfinite(hs).all():
        return "hidden_states hold NaN or Inf"
    return None


def find_problems(output: Path, progress: bool = True) -> list[tuple[int | None, str]]:
    """Every problem found, as (row or None, what is wrong)."""
    from datasets import load_from_disk
    from tqdm import tqdm

    output = Path(output)
    if not (output / MANIFEST).exists():
        hint = "rerun the extraction to finish it" if (output / HIDDEN_DIR).exists() else "not an eagle-extract output"
        return [(None, f"no {MANIFEST}: {hint}")]
    manifest = read_manifest(output)
    try:
        rows = load_from_disk(str(output))
    except Exception as exc:
        return [(None, f"Arrow dataset unreadable: {exc}")]
    problems: list[tuple[int | None, str]] = []
    if len(rows) != manifest["num_samples"]:
        problems.append((None, f"dataset has {len(rows)} rows, manifest says {manifest['num_samples']}"))
    stored = manifest.get("storage_dtype", manifest["dtype"])
    legacy = manifest.get("format") == "speculators-legacy"
    slots, hidden, dtype = len(manifest["slot_layer_ids"]), manifest["hidden_size"], DTYPES[stored]
    ids_all, masks_all = [], []
    for i in tqdm(range(len(rows)), desc="verify", unit="row", disable=not progress):
        row = rows[i]
        ids_all.append(row["input_ids"].tolist())
        masks_all.append(row["loss_mask"].tolist())
        if legacy:
            problem = check_legacy_row(output, i, row, slots, hidden, dtype)
        else:
            problem = check_row(output, i, row["input_ids"], slots, hidden, dtype)
        if problem:
            problems.append((i, problem))
    problems += [
        (i, "stray hidden-state file beyond the last row")
        for i in sorted(completed_rows(output, legacy))
        if i >= len(rows)
    ]
    try:
        freq = torch.load(output / "token_freq.pt")
        if freq != token_frequencies(ids_all, masks_all):
            problems.append((None, "token_freq.pt does not match the rows' loss-mask tokens"))
    except Exception as exc:
        problems.append((None, f"token_freq.pt unreadable: {exc}"))
    return problems
