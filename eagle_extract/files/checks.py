"""What `verify` checks in a finished output: the manifest against itself, the model's config.json and
the rows, then every row file against the manifest.

Finds a manifest that is not JSON or has missing or mistyped fields; layer ids that disagree between
its fields or fall out of range; counts that differ from the dataset; a final layer id or hidden size
other than the model folder's config.json says (when that folder is here); missing, truncated or
unreadable hidden-state files (either layout), wrong shapes or dtypes, `token_ids` that differ from the
row's `input_ids`, rows whose bytes changed since they were written (their checksum) or that hold other
layer ids than the manifest's, NaN/Inf values, stray files, and a `token_freq.pt` that does not match
the rows.  Each file is read once.  The manifest's fields and what each must be are declared in
manifest.py, what a row file must be in rowfile.py.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch

from ..config import LEGACY
from ..layers import LayerError, legacy_layer_ids, parse_layer_ids
from ..runlog import counting
from .fp8 import FP8
from .manifest import MANIFEST, OFFLINE, Manifest, ManifestError, read_manifest
from .rowfile import HIDDEN_DIR, NOT_A_FILE, check_row, completed_rows, layer_ids_text, unreadable
from .shards import ROWS_DIR, SHARDS_DIR

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float8_e4m3fn": FP8}


def _json(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def manifest_fields(manifest: dict) -> tuple[dict, list[str]]:
    """The fields of the right type, and a problem for each missing or mistyped one; the checks after
    these use only fields that pass.  A field earlier releases did not write may be missing."""
    good, problems = {}, []
    for f in fields(Manifest):
        valid, name = f.metadata["test"], f.name
        if valid is None:
            continue
        if name not in manifest:
            if f.metadata["always"]:
                problems.append(f"{MANIFEST} has no {name!r} field")
        elif not valid(manifest[name]):
            problems.append(f"{MANIFEST}: {name} is {_json(manifest[name])}, expected {f.metadata['what']}")
        else:
            good[name] = manifest[name]
    if "format" not in manifest:  # what the earlier releases wrote
        good["format"] = OFFLINE
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
    odd = next((p.name for p in output.glob("*.arrow") if not p.is_file()), None)
    if odd:  # a pipe would block the dataset's reader for ever
        return problems + [(None, f"Arrow dataset unreadable: {odd} is {NOT_A_FILE}")]
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
        problem, layer_ids = check_row(output, i, row, slots, hidden, dtype, legacy, checksums)
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
    freq_path = output / "token_freq.pt"
    try:
        if freq_path.exists() and not freq_path.is_file():
            problems.append((None, f"token_freq.pt {NOT_A_FILE}"))  # a pipe would block torch.load for ever
        elif torch.load(freq_path) != {int(t): int(freq_now[t]) for t in torch.nonzero(freq_now).flatten()}:
            problems.append((None, "token_freq.pt does not match the rows' loss-mask tokens"))
    except Exception as exc:
        problems.append((None, f"token_freq.pt {unreadable(exc)}"))
    return problems
