"""The output folder's life without an engine: the lock, --overwrite's replacement and swap, reruns.

The same paths with a real engine and two real processes are in test_reliability.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from eagle_extract import output as out
from eagle_extract.errors import ExtractError
from eagle_extract.lock import MAIN, holding

IDENTITY = {"model": "m", "aux_layer_ids": [2, 15, 27]}


def _complete(folder, rows: str, identity=IDENTITY):
    """A folder that looks like a complete output; `rows` marks whose files these are."""
    (folder / "hidden_states").mkdir(parents=True)
    (folder / "hidden_states" / "hs_0.safetensors").write_text(rows)
    (folder / "token_freq.pt").write_text(rows)
    manifest = {"identity": identity, "config": {"output": str(folder)}, "rows": rows}
    (folder / out.MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_one_run_per_output_and_per_shard(tmp_path):
    with holding(tmp_path):
        with pytest.raises(ExtractError, match=rf"being written by another eagle-extract run \(pid {os.getpid()} on "):
            with holding(tmp_path):
                pass
        with pytest.raises(ExtractError, match="another eagle-extract run"):
            with holding(tmp_path, (0, 2)):
                pass
    with holding(tmp_path, (0, 2)), holding(tmp_path, (1, 2)):  # shards share the folder
        with pytest.raises(ExtractError, match=r"another eagle-extract run \(one or more --shard jobs\)"):
            with holding(tmp_path):
                pass
        with pytest.raises(ExtractError, match="another eagle-extract run"):
            with holding(tmp_path, (1, 2)):
                pass
    assert (tmp_path / MAIN).read_text() == ""  # an unheld lock names nobody


def test_a_killed_holders_lock_does_not_block(tmp_path):
    code = "import sys, time\nfrom eagle_extract.lock import holding\nwith holding(sys.argv[1]):\n"
    code += "    print(1, flush=True)\n    time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "1\n"
    with pytest.raises(ExtractError, match=f"pid {proc.pid}"):
        with holding(tmp_path):
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert f"pid {proc.pid}" in (tmp_path / MAIN).read_text()  # it left its name behind, and no hold
    with holding(tmp_path):
        pass


def test_overwrite_swaps_a_complete_replacement_in_and_keeps_the_users_files(tmp_path):
    output = _complete(tmp_path / "o", "old")
    (output / "notes.txt").write_text("mine")
    with out.claimed(output, None):
        staged = out.writing_folder(output, {**IDENTITY, "aux_layer_ids": [3]}, overwrite=True)
        assert staged == output / out.REPLACEMENT and json.loads((output / out.MANIFEST).read_text())["rows"] == "old"
        _complete(staged, "new")
        manifest = out.replace_complete(staged, output)
    assert manifest["rows"] == "new" and manifest["config"]["output"] == str(output)
    assert (output / "hidden_states" / "hs_0.safetensors").read_text() == "new"
    assert (output / "token_freq.pt").read_text() == "new" and (output / "notes.txt").read_text() == "mine"
    assert not (output / out.REPLACEMENT).exists() and not (output / out.REPLACED).exists()


def test_a_swap_cut_halfway_is_finished_by_the_next_run(tmp_path):
    output = _complete(tmp_path / "o", "old")
    staged = _complete(output / out.REPLACEMENT, "new")
    aside = output / out.REPLACED
    aside.mkdir()
    for name in (out.MANIFEST, "hidden_states", "token_freq.pt"):  # the old files moved aside ...
        os.replace(output / name, aside / name)
    os.replace(staged / "hidden_states", output / "hidden_states")  # ... and one new one moved in: then the cut
    with out.claimed(output, None):
        pass
    manifest = json.loads((output / out.MANIFEST).read_text())
    assert manifest["rows"] == "new" and (output / "token_freq.pt").read_text() == "new"
    assert sorted(p.name for p in output.iterdir()) == [MAIN, out.MANIFEST, "hidden_states", "token_freq.pt"]


def test_an_unfinished_replacement_resumes_or_starts_over(tmp_path):
    output = _complete(tmp_path / "o", "old")
    staged = output / out.REPLACEMENT
    staged.mkdir()
    (staged / out.RUN_FILE).write_text(json.dumps(IDENTITY))
    (staged / "kept").write_text("")
    assert out.writing_folder(output, IDENTITY, overwrite=True) == staged and (staged / "kept").exists()
    assert out.writing_folder(output, {**IDENTITY, "model": "other"}, overwrite=True) == staged
    assert not (staged / "kept").exists()


def test_rerunning_a_complete_run_has_nothing_to_do_and_another_is_refused(tmp_path):
    output = _complete(tmp_path / "o", "old")
    assert out.identical_complete(output, IDENTITY, overwrite=False)["rows"] == "old"
    assert out.identical_complete(output, IDENTITY, overwrite=True) is None
    with pytest.raises(ExtractError, match="already holds a complete extraction; pass --overwrite"):
        out.identical_complete(output, {**IDENTITY, "aux_layer_ids": [3]}, overwrite=False)


def test_overwriting_an_unfinished_run_removes_only_its_files(tmp_path):
    output = tmp_path / "o"
    (output / "hidden_states").mkdir(parents=True)
    (output / "hidden_states" / "hs_0.safetensors").write_text("")
    (output / out.RUN_FILE).write_text(json.dumps({**IDENTITY, "model": "other"}))
    (output / "notes.txt").write_text("mine")
    assert out.prepare_output(output, IDENTITY, overwrite=True) == set()
    assert (output / "notes.txt").read_text() == "mine" and not (output / "hidden_states").exists()
    assert json.loads((output / out.RUN_FILE).read_text()) == IDENTITY


def test_a_run_that_wrote_nothing_leaves_no_record(tmp_path):
    out.prepare_output(tmp_path, IDENTITY, overwrite=False)
    out.abandon_if_empty(tmp_path, None)
    assert not (tmp_path / out.RUN_FILE).exists()
    out.prepare_output(tmp_path, IDENTITY, overwrite=False)
    (tmp_path / "hidden_states").mkdir()
    (tmp_path / "hidden_states" / "hs_0.safetensors").write_text("")
    out.abandon_if_empty(tmp_path, None)  # a row was written: the run stays resumable
    assert (tmp_path / out.RUN_FILE).exists()


def test_a_folder_of_someone_elses_files_is_left_alone(tmp_path):
    (tmp_path / "state.json").write_text("{}")  # one of our names, but no sign of a run of ours
    with pytest.raises(ExtractError, match="not an eagle-extract output; choose an empty folder"):
        with out.claimed(tmp_path, None):
            pass
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
