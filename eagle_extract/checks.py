"""What `verify` checks in a finished output: the manifest against itself, the model's config.json and
the rows, then every row file against the manifest.

Finds a manifest that is not JSON or has missing or mistyped fields; layer ids that disagree between
its fields or fall out of range; counts that differ from the dataset; a final layer id or hidden size
other than the model folder's config.json says (when that folder is here); missing, truncated or
unreadable hidden-state files (either layout), wrong shapes or dtypes, `token_ids` that differ from the
row's `input_ids`, rows whose bytes changed since they were written (their checksum) or that hold other
layer ids than the manifest's, NaN/Inf values, stray files, and a `token_freq.pt` that does not match
the rows.  Each file is read once.

Rows written by an eagle-extract from before the rows recorded their layer ids and checksum are
accepted as they are: nothing is said about the missing record, so older outputs still pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import LEGACY
from .fp8 import FP8, SCALES
from .layers import LayerError, legacy_layer_ids, parse_layer_ids
from .runlog import counting
from .shards import ROWS_DIR, SHARDS_DIR
from .writer import (
    CHECKSUM,
    HIDDEN_DIR,
    LAYER_IDS,
    LEGACY_RECORD,
    MANIFEST,
    ManifestError,
    changed_since_written,
    completed_rows,
    hidden_state_path,
    layer_ids_text,
    legacy_tensors,
    read_manifest,
    read_row,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float8_e4m3fn": FP8}
MODEL_DTYPES = ("bfloat16", "float16", "float32")
FORMATS = ("speculators-offline", LEGACY)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no count


def _count(low: int):
    return lambda v: _int(v) and v >= low


def _ids(value) -> bool:
    return isinstance(value, list) and all(map(_int, value))


# field -> (test of its value, what it must be); the checks after these use only fields that pass
FIELDS = {
    "format": (lambda v: v in FORMATS, " or ".join(map(json.dumps, FORMATS))),
    "identity": (lambda v: isinstance(v, dict), "an object"),
    "config": (lambda v: isinstance(v, dict), "an object"),
    "model": (lambda v: isinstance(v, str), "a string"),
    "aux_layer_ids": (_ids, "a list of integers"),
    "final_layer_id": (_count(1), "a positive integer"),
    "slot_layer_ids": (_ids, "a list of integers"),
    "legacy_layer_ids": (lambda v: v is None or _ids(v), "a list of integers or null"),
    "dtype": (lambda v: v in MODEL_DTYPES, '"bfloat16", "float16" or "float32"'),
    "storage_dtype": (lambda v: v in (*MODEL_DTYPES, "float8_e4m3fn"), 'the dtype or "float8_e4m3fn"'),
    "hidden_size": (_count(1), "a positive integer"),
    "seq_length": (_count(1), "a positive integer"),
    "num_samples": (_count(0), "a non-negative integer"),
    "num_tokens": (_count(0), "a non-negative integer"),
    "num_loss_tokens": (_count(0), "a non-negative integer"),
}


def _json(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


LATER = {"format", "identity", "config", "storage_dtype", "legacy_layer_ids", "num_loss_tokens", "seq_length"}
# ^ fields manifests of earlier eagle-extract releases may lack: their outputs are checked without them


def manifest_fields(manifest: dict) -> tuple[dict, list[str]]:
    """The fields of the right type, and a problem for each missing or mistyped one."""
    good, problems = {}, []
    for name, (valid, what) in FIELDS.items():
        if name not in manifest:
            if name not in LATER:
                problems.append(f"{MANIFEST} has no {name!r} field")
        elif not valid(manifest[name]):
            problems.append(f"{MANIFEST}: {name} is {_json(manifest[name])}, expected {what}")
        else:
            good[name] = manifest[name]
    if "format" not in manifest:  # what the earlier releases wrote
        good["format"] = "speculators-offline"
    if "storage_dtype" not in manifest and "dtype" in good:
        good["storage_dtype"] = good["dtype"]
    return good, problems


def consistency_problems(m: dict) -> list[str]:
    """Where the manifest's fields (those of the right type) disagree with each other."""
    j = _json
    problems = []
    aux, final, slots = m.get("aux_layer_ids"), m.get("final_layer_id"), m.get("slot_layer_ids")
    identity, config = m.get("identity", {}), m.get("config", {})
    if aux is not None and "identity" in m and identity.get("aux_layer_ids") != aux:
        problems.append(f"aux_layer_ids {j(aux)} differ from identity.aux_layer_ids {j(identity.get('aux_layer_ids'))}")
    if aux is not None and final is not None:
        outside = [i for i in aux if not 0 <= i < final]
        if outside:
            problems.append(
                f"aux_layer_ids {j(aux)}: id {outside[0]} is out of range for final_layer_id {final} "
                f"(auxiliary ids are 0..{final - 1})"
            )
        elif aux != sorted(set(aux)):
            problems.append(f"aux_layer_ids {j(aux)} are not distinct and increasing")
        if slots is not None and slots != aux + [final]:
            problems.append(f"slot_layer_ids {j(slots)} are not aux_layer_ids + [final_layer_id] = {j(aux + [final])}")
        if "layers" in config:
            problems += _config_layers_problems(config["layers"], aux, final)
    if slots is not None and "format" in m and "legacy_layer_ids" in m:
        want = legacy_layer_ids(slots) if m["format"] == LEGACY else None
        if m["legacy_layer_ids"] != want:
            problems.append(f"legacy_layer_ids {j(m['legacy_layer_ids'])}, expected {j(want)} for {m['format']}")
    dtype, stored = m.get("dtype"), m.get("storage_dtype")
    asked = config.get("dtype") != "auto"  # with --dtype auto the engine may choose another than config.json's
    if dtype is not None and "identity" in m and asked and identity.get("dtype") != dtype:
        problems.append(f"dtype {j(dtype)} differs from identity.dtype {j(identity.get('dtype'))}")
    if dtype is not None and stored is not None and stored not in (dtype, "float8_e4m3fn"):
        problems.append(f'storage_dtype {j(stored)} is neither dtype {j(dtype)} nor "float8_e4m3fn"')
    return problems


def _config_layers_problems(layers, aux: list[int], final: int) -> list[str]:
    """config.layers is what --repair reruns with: it must give the same aux ids."""
    if layers is not None and not isinstance(layers, str):
        return [f"config.layers is {_json(layers)}, expected a string or null"]
    try:
        parsed = parse_layer_ids(layers, final)
    except LayerError as exc:
        return [f"config.layers {_json(layers)} is unusable ({exc})"]
    if parsed != aux:
        return [f"config.layers {_json(layers)} give aux ids {_json(parsed)}, not aux_layer_ids {_json(aux)}"]
    return []


def model_problems(m: dict) -> list[str]:
    """final_layer_id and hidden_size against the model folder's config.json (its text_config when it has
    one), read as JSON; nothing to say when the folder is not here or its config is unreadable."""
    model = m.get("identity", {}).get("model") or m.get("model")  # the identity's is the resolved path
    if not isinstance(model, str) or not model:
        return []
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(config, dict):
        return []
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    return [
        f"{field} {m[field]} differs from the model's {key} {_json(text[key])} ({path})"
        for field, key in (("final_layer_id", "num_hidden_layers"), ("hidden_size", "hidden_size"))
        if field in m and key in text and text[key] != m[field]
    ]


def _unreadable(exc: Exception) -> str:
    first = str(exc).splitlines()[0][:120] if str(exc).strip() else ""
    return f"unreadable ({type(exc).__name__}: {first})"


def _changed(now: str, meta: dict) -> str:
    return f"bytes changed since it was written (checksum {meta[CHECKSUM]} recorded, its data gives {now})"


NO_CHECKSUM = "its header records no checksum, which every row of this output's release carries"


def _lost_checksum(meta: dict, required: bool) -> bool:
    """A release that records layer ids records the checksum too, and the manifest says when every row has
    one: a header without it was changed, and the checksum cannot be switched off so."""
    return CHECKSUM not in meta and (required or LAYER_IDS in meta)


def check_legacy_row(
    output: Path, index: int, row: dict, slots: int, hidden: int, dtype, checksums: bool = False
) -> tuple[str | None, str | None]:
    """The problem with row `index`'s data_{i}.pt (speculators 0.3/0.4 layout) or None, and the layer
    ids the file records (None when it records none)."""
    path = hidden_state_path(output, index, legacy=True)
    if not path.exists():
        return "data file missing", None
    try:
        sample = torch.load(path, weights_only=True)
        states, ids, mask = sample["hidden_states"], sample["input_ids"], sample["loss_mask"]
        meta = {str(k): str(v) for k, v in sample.get(LEGACY_RECORD, {}).items()}
    except Exception as exc:
        return _unreadable(exc), None
    layer_ids = meta.get(LAYER_IDS)
    if not torch.equal(ids, row["input_ids"]) or not torch.equal(mask, row["loss_mask"]):
        return "input_ids or loss_mask differ from the dataset row", layer_ids
    expected = (len(ids), hidden)
    if len(states) != slots or any(tuple(t.shape) != expected or t.dtype != dtype for t in states):
        return f"hidden_states is not {slots} tensors of {expected} {dtype}", layer_ids
    if _lost_checksum(meta, checksums):
        return NO_CHECKSUM, layer_ids
    now = changed_since_written(legacy_tensors(sample), meta)
    if now:
        return _changed(now, meta), layer_ids
    if not all(torch.isfinite(t).all() for t in states):
        return "hidden_states hold NaN or Inf", layer_ids
    return None, layer_ids


def check_row(
    output: Path, index: int, input_ids: torch.Tensor, slots: int, hidden: int, dtype, checksums: bool = False
) -> tuple[str | None, str | None]:
    """The problem with row `index`'s file or None, and the layer ids it records (None when it records
    none).  The checksum is taken over the tensors read for the other checks: one read of the file."""
    path = hidden_state_path(output, index)
    if not path.exists():
        return "hidden-state file missing", None
    try:
        tensors, meta = read_row(path)
        hs, tok = tensors["hidden_states"], tensors["token_ids"]
        scales = tensors[SCALES] if dtype == FP8 else None
    except Exception as exc:
        return _unreadable(exc), None
    layer_ids = meta.get(LAYER_IDS)
    expected = (len(input_ids), slots, hidden)
    if tuple(hs.shape) != expected:
        return f"hidden_states shape {tuple(hs.shape)}, expected {expected}", layer_ids
    if hs.dtype != dtype:
        return f"hidden_states dtype {hs.dtype}, expected {dtype}", layer_ids
    if tok.dtype != torch.int64 or not torch.equal(tok, input_ids):
        return "token_ids differ from the row's input_ids", layer_ids
    if scales is not None:
        if tuple(scales.shape) != (len(input_ids), 1, 1) or scales.dtype != torch.float32:
            shape = f"{tuple(scales.shape)} {scales.dtype}"
            return f"{SCALES} shape {shape}, expected ({len(input_ids)}, 1, 1) float32", layer_ids
        hs = hs.float() * scales
    if _lost_checksum(meta, checksums):
        return NO_CHECKSUM, layer_ids
    now = changed_since_written(tensors, meta)
    if now:
        return _changed(now, meta), layer_ids
    if not torch.isfinite(hs).all():
        return "hidden_states hold NaN or Inf", layer_ids
    return None, layer_ids


def layer_id_problems(
    held: dict[int, str], recorded: int, slot_ids: list[int], foreign: set[int]
) -> list[tuple[int | None, str]]:
    """Rows that record other layer ids than the manifest's `slot_ids`.  When no row records the manifest's,
    one line: the rows are another extraction's when their token ids differ from the dataset's too
    (`foreign`), else the manifest is what changed.  Otherwise each such row is a row problem (for --repair)."""
    want = layer_ids_text(slot_ids)
    if held and len(held) == recorded:
        seen = " or ".join(sorted(set(held.values()))[:3])
        said = f"no row holds the manifest's slot_layer_ids {want} (the rows hold {seen})"
        if foreign >= set(held):
            return [(None, f"{said} and their token ids are not the dataset's: {HIDDEN_DIR}/ holds another "
                     "extraction's rows; put this output's own back, or extract again into a new --output")]
        return [(None, f"{said}: the manifest was changed after the extraction")]
    return [(i, f"holds layers {ids}, not the manifest's slot_layer_ids {want}") for i, ids in held.items()]


def count_problems(m: dict, samples: int, tokens: int, loss_tokens: int) -> list[str]:
    """The manifest's counts against the dataset's rows, seq_len summed and loss masks summed."""
    counts = (
        ("num_samples", samples, "rows"),
        ("num_tokens", tokens, "tokens"),
        ("num_loss_tokens", loss_tokens, "loss-mask tokens"),
    )
    return [
        f"dataset has {got} {what}, manifest says {m[name]} ({name})"
        for name, got, what in counts
        if name in m and m[name] != got
    ]


_REWRITTEN = ("token_freq.pt ", "Arrow dataset unreadable", "dataset has ")  # files a completion writes again


def repairable(row: int | None, problem: str) -> bool:
    """Whether a repair (rows rewritten, then the dataset files, from the manifest) fixes `problem`;
    not a problem of the manifest itself."""
    return row is not None or problem.startswith(_REWRITTEN)


def find_problems(output: Path, progress: bool = True) -> list[tuple[int | None, str]]:
    """Every problem found, as (row or None, what is wrong)."""
    from datasets import load_from_disk

    output = Path(output)
    if not (output / MANIFEST).exists():
        ours = [HIDDEN_DIR, ROWS_DIR, SHARDS_DIR]  # an unfinished run's, or a sharded one's
        unfinished = any((output / name).exists() for name in ours) or any(output.glob(".eagle_extract_run*"))
        hint = "rerun the extraction to finish it" if unfinished else "not an eagle-extract output"
        return [(None, f"no {MANIFEST}: {hint}")]
    try:
        manifest = read_manifest(output)
    except ManifestError as exc:
        return [(None, str(exc))]
    m, found = manifest_fields(manifest)
    problems: list[tuple[int | None, str]] = [(None, p) for p in found + consistency_problems(m) + model_problems(m)]
    try:
        rows = load_from_disk(str(output))
    except Exception as exc:
        return problems + [(None, f"Arrow dataset unreadable: {exc}")]
    legacy = m.get("format") == LEGACY
    layout = all(name in m for name in ("format", "slot_layer_ids", "hidden_size", "storage_dtype"))
    if layout:
        slots, hidden, dtype = len(m["slot_layer_ids"]), m["hidden_size"], DTYPES[m["storage_dtype"]]
        want = layer_ids_text(m["slot_layer_ids"])
    freq_now, tokens, loss_tokens = torch.zeros(0, dtype=torch.int64), 0, 0  # one row in memory at a time
    held, recorded, foreign = {}, 0, set()  # rows recording other layer ids than the manifest's; any; other tokens
    for i in counting(len(rows), "verify", "row", show=progress):
        row = rows[i]
        counted = row["input_ids"][row["loss_mask"].bool()]
        if len(counted) and int(counted.min()) >= 0:  # a negative id: token_freq.pt cannot match, said below
            freq_now = torch.cat([freq_now, freq_now.new_zeros(max(0, int(counted.max()) + 1 - len(freq_now)))])
            freq_now.index_add_(0, counted, torch.ones_like(counted))
        tokens, loss_tokens = tokens + int(row["seq_len"]), loss_tokens + int(row["loss_mask"].sum())
        if not layout:  # the manifest's problems above say why the files cannot be checked
            continue
        checksums = manifest.get("row_checksums") is True
        if legacy:
            problem, layer_ids = check_legacy_row(output, i, row, slots, hidden, dtype, checksums)
        else:
            problem, layer_ids = check_row(output, i, row["input_ids"], slots, hidden, dtype, checksums)
        if problem == "hidden-state file missing" and manifest.get("states") == "none":
            continue  # the online trainer asks the server for this row
        if problem:
            problems.append((i, problem))
            other_length = problem.startswith("hidden_states shape (") and not problem.startswith(
                f"hidden_states shape ({len(row['input_ids'])}, "
            )
            if other_length or problem.startswith(("token_ids differ", "input_ids or loss_mask differ")):
                foreign.add(i)
        if layer_ids is not None:
            recorded += 1
            if layer_ids != want:
                held[i] = layer_ids
    if layout:
        summary = layer_id_problems(held, recorded, m["slot_layer_ids"], foreign)
        if summary[:1] and summary[0][0] is None and foreign >= set(held):  # another run's rows: one line
            problems = [(i, p) for i, p in problems if i not in held]
        problems += summary
    problems += [(None, p) for p in count_problems(m, len(rows), tokens, loss_tokens)]
    problems += [
        (i, "stray hidden-state file beyond the last row")
        for i in sorted(completed_rows(output, legacy))
        if i >= len(rows)
    ]
    try:
        freq = torch.load(output / "token_freq.pt")
        if freq != {int(t): int(freq_now[t]) for t in torch.nonzero(freq_now).flatten()}:
            problems.append((None, "token_freq.pt does not match the rows' loss-mask tokens"))
    except Exception as exc:
        problems.append((None, f"token_freq.pt unreadable: {exc}"))
    return problems
