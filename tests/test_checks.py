"""`verify` against hand-edited manifests and changed row bytes, on small real outputs written by the
writer's own functions (no engine)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from eagle_extract.data.samples import Sample
from eagle_extract.data.store import DatasetRows, TokenStore
from eagle_extract.files.checks import find_problems
from eagle_extract.files.manifest import write_manifest
from eagle_extract.files.rowfile import hidden_state_path, read_row
from eagle_extract.files.writer import write_dataset, write_hidden_states, write_legacy
from eagle_extract.worker.stages import join_row, part_root

AUX, FINAL, HIDDEN = [2, 15, 27], 30, 8
SLOTS = AUX + [FINAL]
INPUT_IDS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
MASKS = [[0, 0, 1, 1, 1], [0, 1, 1], [0, 0, 0, 1]]


def make_output(tmp_path, legacy: bool = False) -> tuple:
    """A complete three-row output of a 30-layer model whose folder (config.json only) is beside it;
    returns (output, manifest)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": FINAL, "hidden_size": HIDDEN}))
    out = tmp_path / "out"
    (out / "hidden_states").mkdir(parents=True)
    torch.manual_seed(0)
    for i, (ids, mask) in enumerate(zip(INPUT_IDS, MASKS)):
        states = torch.randn(len(ids), len(SLOTS), HIDDEN).to(torch.bfloat16)
        if legacy:
            write_legacy(out, i, states, ids, mask, SLOTS)
        else:
            write_hidden_states(out, i, states, ids, layer_ids=SLOTS)
    store = TokenStore(tmp_path / "store")
    store.append([Sample(i, ids, mask) for i, (ids, mask) in enumerate(zip(INPUT_IDS, MASKS))], 3, last=True)
    rows = DatasetRows([store])
    write_dataset(out, rows.dataset(), rows.token_freq())
    fmt = "speculators-legacy" if legacy else "speculators-offline"
    manifest = {
        "format": fmt,
        "identity": {"model": str(model), "aux_layer_ids": AUX, "dtype": "bfloat16", "format": fmt},
        "config": {"model": str(model), "layers": ",".join(map(str, AUX)), "format": fmt},
        "model": str(model),
        "aux_layer_ids": AUX,
        "final_layer_id": FINAL,
        "slot_layer_ids": SLOTS,
        "legacy_layer_ids": [i - 1 for i in SLOTS] if legacy else None,
        "dtype": "bfloat16",
        "storage_dtype": "bfloat16",
        "hidden_size": HIDDEN,
        "seq_length": 2048,
        "num_samples": len(INPUT_IDS),
        "num_tokens": sum(map(len, INPUT_IDS)),
        "num_loss_tokens": sum(map(sum, MASKS)),
    }
    write_manifest(out, manifest)
    return out, manifest


def edited(out, manifest: dict, **fields) -> list:
    write_manifest(out, {**manifest, **fields})
    return find_problems(out, progress=False)


def flip_a_bit(path, tensor: str = "hidden_states") -> None:
    """Flip the lowest mantissa bit of the tensor's first value, in the file's data section: still finite."""
    raw = bytearray(path.read_bytes())
    size = int.from_bytes(raw[:8], "little")
    start, _ = json.loads(raw[8 : 8 + size])[tensor]["data_offsets"]
    raw[8 + size + start] ^= 0x01
    path.write_bytes(raw)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_clean_output_has_no_problems(tmp_path, legacy):
    out, _ = make_output(tmp_path, legacy)
    assert find_problems(out, progress=False) == []


def test_a_flipped_bit_in_a_row_names_that_row(tmp_path):
    out, _ = make_output(tmp_path)
    flip_a_bit(hidden_state_path(out, 1))
    [(row, problem)] = find_problems(out, progress=False)
    assert row == 1 and problem.startswith("bytes changed since it was written (checksum xxh3_128:")


def test_a_changed_value_in_a_legacy_row_names_that_row(tmp_path):
    out, _ = make_output(tmp_path, legacy=True)
    path = hidden_state_path(out, 2, legacy=True)
    sample = torch.load(path, weights_only=True)
    sample["hidden_states"][1][0, 0] += 1
    torch.save(sample, path)
    [(row, problem)] = find_problems(out, progress=False)
    assert row == 2 and "bytes changed since it was written" in problem


def test_an_edited_row_layer_id_breaks_its_checksum(tmp_path):
    out, _ = make_output(tmp_path)
    path = hidden_state_path(out, 0)
    tensors, meta = read_row(path)
    save_file(tensors, str(path), metadata={**meta, "slot_layer_ids": "2,14,27,30"})
    [(row, changed), (same, held)] = find_problems(out, progress=False)
    assert row == same == 0 and changed.startswith("bytes changed since it was written")
    assert held.startswith("holds layers 2,14,27,30")  # this row only: a row problem, for --repair


def test_one_edited_aux_id_disagrees_with_the_other_fields(tmp_path):
    out, manifest = make_output(tmp_path)
    problems = edited(out, manifest, aux_layer_ids=[2, 14, 27])
    assert problems == [
        (None, "aux_layer_ids [2, 14, 27] differ from identity.aux_layer_ids [2, 15, 27]"),
        (None, "slot_layer_ids [2, 15, 27, 30] are not aux_layer_ids + [final_layer_id] = [2, 14, 27, 30]"),
        (None, 'config.layers "2,15,27" give aux ids [2, 15, 27], not aux_layer_ids [2, 14, 27]'),
    ]


def test_an_aux_id_out_of_range_is_named(tmp_path):
    out, manifest = make_output(tmp_path)
    ids = [2, 15, 31]
    problems = [
        p for _, p in edited(out, manifest, aux_layer_ids=ids, identity={**manifest["identity"], "aux_layer_ids": ids})
    ]
    assert (
        problems[0]
        == "aux_layer_ids [2, 15, 31]: id 31 is out of range for final_layer_id 30 (auxiliary ids are 0..29)"
    )
    unordered = [p for _, p in edited(out, manifest, aux_layer_ids=[15, 2, 27])]
    assert "aux_layer_ids [15, 2, 27] are not distinct and increasing" in unordered


def test_a_consistent_edit_of_every_layer_id_field_disagrees_with_the_rows(tmp_path):
    out, manifest = make_output(tmp_path)
    ids = [2, 14, 27]
    problems = edited(
        out,
        manifest,
        aux_layer_ids=ids,
        slot_layer_ids=ids + [FINAL],
        identity={**manifest["identity"], "aux_layer_ids": ids},
        config={**manifest["config"], "layers": "2,14,27"},
    )
    said = "no row holds the manifest's slot_layer_ids 2,14,27,30 (the rows hold 2,15,27,30)"
    assert problems == [(None, f"{said}: the manifest was changed after the extraction")]


def test_a_row_from_another_extraction_is_a_row_problem(tmp_path):
    out, _ = make_output(tmp_path)
    states = torch.zeros(len(INPUT_IDS[1]), len(SLOTS), HIDDEN, dtype=torch.bfloat16)
    write_hidden_states(out, 1, states, INPUT_IDS[1], layer_ids=[2, 15, 28, 30])
    assert find_problems(out, progress=False) == [
        (1, "holds layers 2,15,28,30, not the manifest's slot_layer_ids 2,15,27,30")
    ]


def test_hidden_states_swapped_in_from_another_extraction_is_one_line_that_says_so(tmp_path):
    out, _ = make_output(tmp_path)
    for i, ids in enumerate(INPUT_IDS):  # another run's rows: other layers, other prompts
        other = [t + 100 for t in ids]
        states = torch.zeros(len(other), len(SLOTS), HIDDEN, dtype=torch.bfloat16)
        write_hidden_states(out, i, states, other, layer_ids=[3, 9, 20, 30])
    [(row, said)] = find_problems(out, progress=False)
    assert row is None and "hidden_states/ holds another extraction's rows" in said, said
    assert "the manifest was changed" not in said


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"format": "speculators-offline",', "is not valid JSON (Expecting property name enclosed in double quotes"),
        ("[1, 2]", "is JSON but not an object"),
        (b"\xff\xfe\x00garbage", "is not text"),
    ],
)
def test_a_manifest_that_is_not_a_json_object_is_one_line(tmp_path, text, words):
    out, _ = make_output(tmp_path)
    manifest = out / "eagle_extract.json"
    manifest.write_bytes(text if isinstance(text, bytes) else text.encode())
    [(row, problem)] = find_problems(out, progress=False)
    assert row is None and words in problem and "\n" not in problem
    assert problem.endswith("restore it from a copy, or rerun the extraction with --overwrite")


def test_missing_and_mistyped_fields_are_one_line_each_and_nothing_crashes(tmp_path):
    out, manifest = make_output(tmp_path)
    broken = {k: v for k, v in manifest.items() if k != "hidden_size"}
    broken.update(slot_layer_ids="2,15,27,30", final_layer_id=True, storage_dtype="int4", num_tokens=None)
    write_manifest(out, broken)
    assert find_problems(out, progress=False) == [
        (None, "eagle_extract.json: final_layer_id is true, expected a positive integer"),
        (None, 'eagle_extract.json: slot_layer_ids is "2,15,27,30", expected a list of integers'),
        (None, 'eagle_extract.json: storage_dtype is "int4", expected the dtype or "float8_e4m3fn"'),
        (None, "eagle_extract.json has no 'hidden_size' field"),
        (None, "eagle_extract.json: num_tokens is null, expected a non-negative integer"),
    ]


@pytest.mark.parametrize("nested", [False, True])
def test_final_layer_id_and_hidden_size_are_held_to_the_models_config(tmp_path, nested):
    out, manifest = make_output(tmp_path)
    config = {"num_hidden_layers": 32, "hidden_size": 16}
    config = {"text_config": config, "num_hidden_layers": 99} if nested else config
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    path = tmp_path / "model" / "config.json"
    assert find_problems(out, progress=False) == [
        (None, f"final_layer_id 30 differs from the model's num_hidden_layers 32 ({path})"),
        (None, f"hidden_size 8 differs from the model's hidden_size 16 ({path})"),
    ]
    (tmp_path / "model" / "config.json").unlink()  # the model folder is not here: nothing to hold it to
    assert find_problems(out, progress=False) == []


def test_counts_and_legacy_ids_are_held_to_the_dataset_and_slots(tmp_path):
    out, manifest = make_output(tmp_path, legacy=True)
    assert edited(out, manifest, num_tokens=11, num_loss_tokens=7, legacy_layer_ids=[2, 15, 27, 30]) == [
        (None, "legacy_layer_ids [2, 15, 27, 30], expected [1, 14, 26, 29] for speculators-legacy"),
        (None, "dataset has 12 tokens, manifest says 11 (num_tokens)"),
        (None, "dataset has 6 loss-mask tokens, manifest says 7 (num_loss_tokens)"),
    ]


def test_rows_written_before_rows_recorded_checksums_still_pass(tmp_path):
    out, _ = make_output(tmp_path)
    for i in range(len(INPUT_IDS)):
        tensors, _ = read_row(hidden_state_path(out, i))
        save_file(tensors, str(hidden_state_path(out, i)))
    assert find_problems(out, progress=False) == []


def test_a_header_that_lost_its_checksum_cannot_hide_a_changed_byte(tmp_path):
    """Dropping the key and flipping a state bit: the row still records its layer ids, which the same
    release writes with the checksum; and the manifest of this release says every row carries one."""
    from eagle_extract.files.rowfile import NO_CHECKSUM

    out, manifest = make_output(tmp_path)
    path = hidden_state_path(out, 1)
    tensors, meta = read_row(path)
    save_file(tensors, str(path), metadata={k: v for k, v in meta.items() if k != "checksum"})
    flip_a_bit(path)
    assert find_problems(out, progress=False) == [(1, NO_CHECKSUM)]
    save_file(read_row(path)[0], str(path))  # the whole header gone: the manifest's promise still holds it
    assert edited(out, manifest, row_checksums=True) == [(1, NO_CHECKSUM)]


def test_joined_pipeline_rows_record_every_slot_and_parts_are_checked(tmp_path):
    out = tmp_path / "out"
    (out / "hidden_states").mkdir(parents=True)
    states = torch.randn(4, len(SLOTS), HIDDEN).to(torch.bfloat16)
    parts = [(part_root(out, 0, 16), [0, 1]), (part_root(out, 16, 30), [2, 3])]
    for root, slots in parts:
        (root / "hidden_states").mkdir(parents=True)
        write_hidden_states(root, 0, states[:, slots].contiguous(), [1, 2, 3, 4], layer_ids=[SLOTS[k] for k in slots])
        write_hidden_states(root, 1, states[:, slots].contiguous(), [1, 2, 3, 4], layer_ids=[SLOTS[k] for k in slots])
    join_row(out, 0, parts, fp8=False, legacy_mask=None)
    tensors, meta = read_row(hidden_state_path(out, 0))
    assert torch.equal(tensors["hidden_states"], states) and meta["slot_layer_ids"] == "2,15,27,30"
    flip_a_bit(hidden_state_path(parts[1][0], 1))
    with pytest.raises(ValueError, match="row 1: its part in .*layers_16-30 changed since it was written"):
        join_row(out, 1, parts, fp8=False, legacy_mask=None)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_resume_finds_what_a_power_cut_leaves_by_the_headers(tmp_path, legacy):
    from eagle_extract.files.rowfile import header_problem

    out, _ = make_output(tmp_path, legacy)
    path = hidden_state_path(out, 0, legacy)
    whole = path.read_bytes()
    assert header_problem(path, len(INPUT_IDS[0]), len(SLOTS), HIDDEN, legacy) is None
    for torn in (whole[:-10], b"", whole[:20]):  # cut short, emptied, cut inside the header
        path.write_bytes(torn)
        assert header_problem(path, len(INPUT_IDS[0]), len(SLOTS), HIDDEN, legacy), len(torn)
    if not legacy:  # a whole file of another run's shape
        path.write_bytes(whole)
        assert "the run writes [5, 4, 16]" in header_problem(path, 5, len(SLOTS), 16, legacy)


def _verify_cli(out) -> tuple[int, list[str]]:
    from click.testing import CliRunner

    from eagle_extract.faces.cli import main

    result = CliRunner().invoke(main, ["verify", str(out)])
    return result.exit_code, [line for line in result.stderr.splitlines() if line.strip()]


def test_verify_says_one_line_and_offers_no_repair_it_cannot_do(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _verify_cli(empty) == (1, ["Error: no eagle_extract.json: not an eagle-extract output"])
    out, manifest = make_output(tmp_path)
    (out / "eagle_extract.json").write_text("{oops")
    rc, lines = _verify_cli(out)
    assert rc == 1 and len(lines) == 1 and "is not valid JSON" in lines[0] and "--repair" not in lines[0], lines
    write_manifest(out, {**manifest, "aux_layer_ids": [2, 14, 27]})
    rc, lines = _verify_cli(out)
    assert rc == 1 and "--repair" not in lines[-1] and "rerun the extraction with --overwrite" in lines[-1], lines
    write_manifest(out, manifest)
    flip_a_bit(hidden_state_path(out, 1))
    rc, lines = _verify_cli(out)
    assert rc == 1 and lines[-2].startswith("row 1: bytes changed") and "verify --repair" in lines[-1], lines
    assert lines[0].endswith("verify: 3/3 rows")  # plain progress where stderr is not a terminal


def test_verify_names_what_is_not_a_file_and_never_waits_on_a_pipe(tmp_path):
    """A pipe where a row file or token_freq.pt should be would block its reader for ever; a folder where the
    manifest should be, or a token_freq.pt torch cannot read, is one line too, not a traceback."""
    import subprocess
    import sys

    out, manifest = make_output(tmp_path)
    hidden_state_path(out, 1).unlink()
    os.mkfifo(hidden_state_path(out, 1))
    (out / "token_freq.pt").write_bytes(b"PK\x03\x04 not a zip")
    proc = subprocess.run([sys.executable, "-m", "eagle_extract", "verify", str(out)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "row 1: not a regular file (a folder, a pipe or a device)" in lines, lines
    assert any(line.startswith("output: token_freq.pt unreadable (") for line in lines), lines
    (out / "token_freq.pt").unlink()
    os.mkfifo(out / "token_freq.pt")
    proc = subprocess.run([sys.executable, "-m", "eagle_extract", "verify", str(out)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert "token_freq.pt not a regular file (a folder, a pipe or a device)" in proc.stderr, proc.stderr
    (out / "eagle_extract.json").unlink()
    (out / "eagle_extract.json").mkdir()
    rc, lines = _verify_cli(out)
    fix = "eagle_extract.json is not a regular file: restore it from a copy, or rerun the extraction with --overwrite"
    assert rc == 1 and len(lines) == 1 and lines[0].endswith(fix), lines


def test_repair_refuses_an_earlier_manifest_before_deleting_anything(tmp_path):
    from eagle_extract import repair
    from eagle_extract.errors import ExtractError

    out, manifest = make_output(tmp_path)
    write_manifest(out, {k: v for k, v in manifest.items() if k not in ("identity", "config")})
    with pytest.raises(ExtractError, match="records no run to repeat; rerun the extraction with --overwrite"):
        repair(out, [0])
    assert hidden_state_path(out, 0).exists() and (out / "eagle_extract.json").exists()
