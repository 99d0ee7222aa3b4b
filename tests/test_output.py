"""The output folder's life without an engine: the lock, --overwrite's replacement and swap, reruns.

The same paths with a real engine and two real processes are in test_reliability.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

from eagle_extract.errors import ExtractError
from eagle_extract.job import output as out
from eagle_extract.job.lock import MAIN, holding

from .common import assert_documented

IDENTITY = {"model": "m", "aux_layer_ids": [2, 15, 27]}


def _complete(folder, rows: str, identity=IDENTITY):
    """A folder that looks like a complete output; `rows` marks whose files these are."""
    (folder / "hidden_states").mkdir(parents=True)
    (folder / "hidden_states" / "hs_0.safetensors").write_text(rows)
    (folder / "token_freq.pt").write_text(rows)
    manifest = {"identity": identity, "config": {"output": str(folder)}, "rows": rows}
    (folder / out.MANIFEST).write_text(json.dumps(manifest))
    return folder


def _holder(folder, shard=None) -> subprocess.Popen:
    """Another process holding `folder`'s lock (a shard's when `shard`) until killed."""
    code = "import sys, time\nfrom eagle_extract.job.lock import holding\n"
    code += f"with holding(sys.argv[1], {shard!r}):\n    print(1, flush=True)\n    time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "1\n"
    return proc


def _stop(*procs) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_one_run_per_output_and_per_shard(tmp_path):
    whole = _holder(tmp_path)
    try:
        with pytest.raises(ExtractError, match=rf"being written by another eagle-extract run \(pid {whole.pid} on "):
            with holding(tmp_path):
                pass
        with pytest.raises(ExtractError, match=f"pid {whole.pid}"):
            with holding(tmp_path, (0, 2)):
                pass
    finally:
        _stop(whole)
    shard = _holder(tmp_path, (0, 2))
    try:
        with holding(tmp_path, (1, 2)):  # shards share the folder
            pass
        with pytest.raises(ExtractError, match=r"another eagle-extract run \(one or more --shard jobs\)"):
            with holding(tmp_path):
                pass
        with pytest.raises(ExtractError, match="another eagle-extract run"):
            with holding(tmp_path, (0, 2)):
                pass
    finally:
        _stop(shard)
    with holding(tmp_path), holding(tmp_path):  # a run inside a repair: this process holds it already
        pass
    assert not (tmp_path / MAIN).exists()  # the last holder removes its lock file (a killed one cannot)


def test_a_killed_holders_lock_does_not_block(tmp_path):
    proc = _holder(tmp_path)
    with pytest.raises(ExtractError, match=f"pid {proc.pid}"):
        with holding(tmp_path):
            pass
    _stop(proc)
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


@pytest.mark.parametrize("cut", ["moving the old files aside", "moving the new ones in", "removing the old ones"])
def test_a_swap_cut_anywhere_is_finished_by_the_next_run(tmp_path, cut):
    output = _complete(tmp_path / "o", "old")
    staged = _complete(output / out.REPLACEMENT, "new")
    moving = output / f"{out.REPLACED}.tmp"
    moving.mkdir()
    os.replace(output / out.MANIFEST, moving / out.MANIFEST)  # the manifest goes first
    if cut != "moving the old files aside":
        for name in ("hidden_states", "token_freq.pt"):
            os.replace(output / name, moving / name)
        os.replace(moving, output / out.REPLACED)
        os.replace(staged / "hidden_states", output / "hidden_states")
    if cut == "removing the old ones":
        os.replace(staged / "token_freq.pt", output / "token_freq.pt")
        (output / out.MANIFEST).write_text((staged / out.MANIFEST).read_text())
        (staged / out.MANIFEST).unlink()
    with out.claimed(output, None):
        pass
    manifest = json.loads((output / out.MANIFEST).read_text())
    assert manifest["rows"] == "new" and (output / "token_freq.pt").read_text() == "new"
    assert (output / "hidden_states" / "hs_0.safetensors").read_text() == "new"
    assert sorted(p.name for p in output.iterdir()) == [out.MANIFEST, "hidden_states", "token_freq.pt"]


def test_shards_leave_a_cut_swap_to_an_unsharded_run(tmp_path):
    output = _complete(tmp_path / "o", "old")
    _complete(output / out.REPLACEMENT, "new")
    with pytest.raises(ExtractError, match="an --overwrite run was cut while swapping its replacement in"):
        with out.claimed(output, (0, 2)):
            pass


def test_an_unfinished_replacement_resumes_or_starts_over(tmp_path):
    output = _complete(tmp_path / "o", "old")
    staged = output / out.REPLACEMENT
    (staged / "shards").mkdir(parents=True)
    (staged / out.RUN_FILE).write_text(json.dumps(IDENTITY))
    (staged / "kept").write_text("")
    assert out.writing_folder(output, IDENTITY, overwrite=True) == staged and (staged / "kept").exists()
    (staged / out.RUN_FILE).unlink()  # a --dp replacement: its replicas' records, not the parent's
    (staged / ".eagle_extract_run.1-of-2.json").write_text(json.dumps(IDENTITY))
    (staged / "shards" / "0-of-2.json").write_text(json.dumps({"identity": IDENTITY}))
    assert out.writing_folder(output, IDENTITY, overwrite=True) == staged and (staged / "kept").exists()
    assert out.writing_folder(output, {**IDENTITY, "model": "other"}, overwrite=True) == staged
    assert not (staged / "kept").exists()


def test_rerunning_a_complete_run_has_nothing_to_do_and_another_is_refused(tmp_path):
    output = _complete(tmp_path / "o", "old")
    assert out.identical_complete(output, IDENTITY, overwrite=False)["rows"] == "old"
    assert out.identical_complete(output, IDENTITY, overwrite=True) is None
    said = "already holds a complete extraction with a different aux_layer_ids .*; pass --overwrite"
    with pytest.raises(ExtractError, match=said):
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


def test_a_folder_with_only_a_failed_shards_log_is_ours(tmp_path):
    for name in ("eagle_extract.0-of-2.log", "eagle_extract.log"):  # a run that failed before writing a row
        (tmp_path / name).write_text("")
        with out.claimed(tmp_path, (0, 2)):
            pass
        (tmp_path / name).unlink()


def test_a_folder_of_someone_elses_files_is_left_alone(tmp_path):
    (tmp_path / "state.json").write_text("{}")  # one of our names, but no sign of a run of ours
    with pytest.raises(ExtractError, match="not an eagle-extract output; choose an empty folder"):
        with out.claimed(tmp_path, None):
            pass
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_run_record_a_power_cut_emptied_is_one_line(tmp_path):
    (tmp_path / out.RUN_FILE).write_text("")
    with pytest.raises(ExtractError, match=r"\.eagle_extract_run\.json is unreadable \(JSONDecodeError\); delete it"):
        out.prepare_output(tmp_path, IDENTITY, overwrite=False)


def test_a_dp_run_resumed_with_another_count_forgets_the_old_replicas_records(tmp_path):
    (tmp_path / "shards").mkdir()
    for name in (".eagle_extract_run.1-of-8.json", "shards/0-of-8.json", "shards/0-of-4.json", "shards/0-of-4.log"):
        (tmp_path / name).write_text(json.dumps({"identity": IDENTITY}))
    out.forget_other_counts(tmp_path, 4)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "shards/0-of-4.json",
        "shards/0-of-4.log",
    ]


def test_a_resume_must_share_what_changes_the_states_and_is_told_of_other_releases(tmp_path):
    recorded = {**IDENTITY, "engine_args": {}, "versions": {"vllm": "0.30.0", "torch": "2.9.0"}}
    (tmp_path / out.RUN_FILE).write_text(json.dumps(recorded))
    quantized = {**recorded, "engine_args": {"quantization": "fp8"}}
    with pytest.raises(ExtractError, match=r"a different engine_args \(\{\}, now \{'quantization': 'fp8'\}\)"):
        out.refuse_other_runs(tmp_path, quantized, None)
    upgraded = {**recorded, "versions": {"vllm": "0.32.0", "torch": "2.9.0"}}
    out.refuse_other_runs(tmp_path, upgraded, None)
    assert "written with other releases (vllm 0.30.0 -> 0.32.0)" in out.other_releases(tmp_path, upgraded, None)
    assert out.other_releases(tmp_path, recorded, None) is None
    # a key an earlier eagle-extract did not record is not compared: its unfinished runs still resume ...
    out.refuse_other_runs(tmp_path, {**upgraded, "decoder_path": None}, None)
    # ... but for the tokenizer its records held as a key of its own
    (tmp_path / out.RUN_FILE).write_text(json.dumps({**IDENTITY, "tokenizer": "/tok"}))
    out.refuse_other_runs(tmp_path, {**IDENTITY, "engine_args": {"tokenizer": "/tok"}}, None)
    with pytest.raises(ExtractError, match="a different engine_args"):
        out.refuse_other_runs(tmp_path, {**IDENTITY, "engine_args": {"tokenizer": "/other"}}, None)


def test_the_identity_holds_the_tokenizer_and_template_and_only_engine_arguments_that_change_states(tmp_path, smollm2):
    from eagle_extract.config import ExtractConfig
    from eagle_extract.job.plan import make_plan

    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})
    )
    copy = tmp_path / "model"
    shutil.copytree(smollm2, copy)

    def identity(**options):
        cfg = ExtractConfig(model=str(copy), data=data, output=tmp_path / "o", **options)
        return make_plan(cfg).identity

    before = identity(engine_args={"gpu_memory_utilization": 0.5, "quantization": "fp8"})
    assert before["engine_args"] == {"quantization": "fp8"}  # memory may change between runs, numerics not
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = config.get("chat_template", "") + "{# another template #}"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    after = identity(engine_args={"quantization": "fp8"})
    assert after["tokenizer_sha256"] != before["tokenizer_sha256"]
    assert {k for k in before if before[k] != after[k]} == {"tokenizer_sha256"}


def test_merge_checks_the_recorded_settings_but_not_the_engine_arguments(tmp_path, smollm2):
    """`merge` starts no engine: an engine argument this vLLM does not know (the shards may have run on
    another) is not refused, while the other checks still are made."""
    from eagle_extract.config import ExtractConfig
    from eagle_extract.job.plan import make_plan

    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})
    )
    cfg = ExtractConfig(model=str(smollm2), data=data, output=tmp_path / "o", engine_args={"no_such_arg": 1})
    with pytest.raises(ExtractError, match="engine argument no_such_arg is not one of"):
        make_plan(cfg)
    assert make_plan(cfg, engine=False).identity["engine_args"] == {"no_such_arg": 1}
    with pytest.raises(ExtractError, match="--layers: id 99 is out of range"):
        make_plan(replace(cfg, layers="99"), engine=False)


def test_merge_refuses_shards_of_other_settings_and_data_that_changed_or_went(tmp_path, smollm2):
    """Shards run apart and copied into one folder were never compared with each other; nor is the data file
    that merge reads again the one they ran on, unless checked."""
    from eagle_extract.config import ExtractConfig
    from eagle_extract.files import shards
    from eagle_extract.job.completion import merge
    from eagle_extract.job.plan import make_plan

    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})
    )
    out = tmp_path / "o"
    out.mkdir()

    def finished(k: int, layers: str) -> None:
        cfg = ExtractConfig(model=str(smollm2), data=data, output=out, layers=layers, shard=f"{k}/2").resolved()
        summary = {"shard": cfg.shard, "identity": make_plan(cfg, engine=False).identity, "config": cfg.record()}
        shards.record_finished(out, (k, 2), summary)

    finished(0, "2,3")
    finished(1, "1")
    cases = [
        "the last shard (or `merge`) finds shards that ran with different options (run apart, then copied into "
        "one folder)",
        "`merge` finds the data file (or the model's files) changed since the shards ran",
        "`merge` finds the shards' data file gone",
    ]
    with pytest.raises(ExtractError) as err:
        merge(out)
    assert "aux_layer_ids ([2, 3], then [1])" in str(err.value)
    assert_documented("During the run", cases[0], f"Error: {err.value}")
    finished(1, "2,3")
    data.write_text(data.read_text() + "\n")
    with pytest.raises(ExtractError) as err:
        merge(out)
    assert "the data_sha256 is not" in str(err.value)
    assert_documented("During the run", cases[1], f"Error: {err.value}")
    data.unlink()
    with pytest.raises(ExtractError) as err:
        merge(out)
    assert_documented("During the run", cases[2], f"Error: {err.value}")
    assert not (out / "eagle_extract.json").exists()
    for k, layers in ((0, [2, 3]), (1, [1])):  # records of an earlier release: a tokenizer, no engine_args
        path = out / "shards" / f"{k}-of-2.json"
        record = json.loads(path.read_text())
        record["identity"] = {**{n: v for n, v in record["identity"].items() if n != "engine_args"},
                              "tokenizer": None, "aux_layer_ids": layers}  # fmt: skip
        path.write_text(json.dumps(record))
    with pytest.raises(ExtractError, match=r"ran with a different aux_layer_ids \(\[2, 3\], then \[1\]\)"):
        merge(out)


def test_overwrite_passes_what_eagle_extract_writes_and_refuses_what_it_does_not(tmp_path):
    """What --dp, --pp and shards leave in the folders --overwrite deletes whole is eagle-extract's; a file of
    the user's there, or --data among what goes, is refused before anything is deleted."""
    output = tmp_path / "o"
    for name in ("shards/0-of-2.json", "shards/0-of-2.log", "shards/.1-of-2.progress", "shards/.1-of-2.progress.tmp",
                 "hidden_states/hs_0.safetensors", "hidden_states/.hs_1.safetensors.tmp",
                 ".pp_parts/layers_0-3/hidden_states/hs_0.safetensors", ".eagle_extract_rows/data_7.pt",
                 ".eagle_extract_rows/hidden_states/hs_7.safetensors", "regenerated.jsonl", "notes.txt"):  # fmt: skip
        (output / name).parent.mkdir(parents=True, exist_ok=True)
        (output / name).write_text("")
    out.refuse_foreign_files(output, tmp_path / "data.jsonl")
    out.refuse_foreign_files(output, output / "notes.txt")  # the user's, and kept: not among what goes
    with pytest.raises(ExtractError, match="--data .*regenerated.jsonl is inside --output"):
        out.refuse_foreign_files(output, output / "regenerated.jsonl")
    with pytest.raises(ExtractError, match="is inside --output"):  # an unfinished run's dataset files go at once
        out.refuse_foreign_files(output, output)
    (output / "eagle_extract.json").write_text("{}")
    out.refuse_foreign_files(output, output)  # a complete one's are replaced once the new output is whole
    (output / ".eagle_extract_rows" / "hidden_states" / "mine.txt").write_text("")
    with pytest.raises(ExtractError, match=r"mine.txt is not eagle-extract's, and --overwrite replaces .*rows whole"):
        out.refuse_foreign_files(output, None)
    (output / ".eagle_extract_rows" / "hidden_states" / "mine.txt").unlink()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "hidden_states").mkdir(parents=True)
    (elsewhere / "hidden_states" / "hs_0.safetensors").write_text("the user's")
    (output / "hidden_states" / "theirs").symlink_to(elsewhere)  # os.walk lists it and does not go in
    with pytest.raises(ExtractError, match=r"hidden_states/theirs is a link, not eagle-extract's"):
        out.refuse_foreign_files(output, None)
    (output / "hidden_states" / "theirs").unlink()
    (output / ".pp_parts").rename(tmp_path / "parts")
    (output / ".pp_parts").symlink_to(tmp_path / "parts")  # only our names behind it, and still not replaced whole
    with pytest.raises(ExtractError, match=r"\.pp_parts is a link \(to .*parts\), and --overwrite replaces that"):
        out.refuse_foreign_files(output, None)
    assert (elsewhere / "hidden_states" / "hs_0.safetensors").read_text() == "the user's"


def test_an_unreadable_record_is_one_line_naming_it_and_losing_no_row(tmp_path):
    """An emptied shard record at `merge` and an emptied run file at a rerun: one line that names the file to
    delete (never --overwrite, which would throw rows away), no traceback."""
    from .conftest import run_cli

    merged = tmp_path / "merged"
    (merged / "shards").mkdir(parents=True)
    (merged / "shards" / "1-of-2.json").write_text("")
    rerun = tmp_path / "rerun"
    rerun.mkdir()
    (rerun / ".eagle_extract_run.json").write_text("{")
    for args, fix in (
        (["merge", str(merged)], "delete it and rerun that shard's job (--shard 1/2): its rows are kept"),
        (["--output", str(rerun), "--max-samples", "3"], "delete it and rerun the same command"),
    ):
        proc = run_cli(*args, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "is unreadable (JSONDecodeError)" in lines[0] and fix in lines[0] and "--overwrite" not in lines[0]


def test_a_complete_output_that_lost_a_row_file_is_not_reported_complete(tmp_path, smollm2_fp32_out, smollm2,
                                                                       mixed_conversations):  # fmt: skip
    from .conftest import BUDGET, run_cli

    copy = tmp_path / "copy"
    shutil.copytree(smollm2_fp32_out, copy)
    (copy / "hidden_states" / "hs_3.safetensors").unlink()
    proc = run_cli("--model", str(smollm2), "--data", str(mixed_conversations), "--output", str(copy), "--dtype",
                   "float32", "--layers", "0,2,15,27,29", *BUDGET, check=False)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"Error: --output {copy} is complete but row 3's file is gone; `eagle-extract verify --repair {copy}` "
        "writes the missing rows again"
    )


def test_the_same_model_in_another_folder_is_the_same_model_and_a_changed_weight_is_not(tmp_path):
    """Shards run on nodes that keep the checkpoint at other paths merge, and a moved checkpoint resumes, told;
    a checkpoint whose sampled weights or settings differ, though its names and sizes do not, is refused."""
    from eagle_extract.job.completion import same_settings
    from eagle_extract.job.plan import model_sha256

    here, there = tmp_path / "node0" / "m", tmp_path / "node1" / "models" / "m"
    here.mkdir(parents=True)
    (here / "config.json").write_text('{"hidden_size": 8, "auto_map": {"AutoModel": "modeling_m.M"}}')
    (here / "modeling_m.py").write_text("class M: ...")
    weights = bytes(range(256)) * 16384  # 4 MiB
    (here / "model-00001-of-00001.safetensors").write_bytes(weights)
    (here / "notes.md").write_text("the user's")
    (here / "train.py").write_text("# the user's script")
    shutil.copytree(here, there)
    (there / "notes.md").write_text("changed, and not the model's")
    (there / "train.py").write_text("# changed, and no module of the model's")
    assert model_sha256(here) == model_sha256(there)
    (there / "modeling_m.py").write_text("class M: pass  # the model's own code, named by auto_map")
    assert model_sha256(here) != model_sha256(there)
    (there / "modeling_m.py").write_text("class M: ...")

    def record(k: int, model) -> dict:
        return {"shard": f"{k}/2", "identity": {"model": str(model), "model_sha256": model_sha256(model), "dtype": "x"}}

    same_settings(tmp_path, [record(0, here), record(1, there)])
    output = tmp_path / "out"
    output.mkdir()
    (output / out.RUN_FILE).write_text(json.dumps(record(0, here)["identity"]))
    said = out.moved_model(output, record(1, there)["identity"], None)
    assert said == (f"{output}'s rows so far were written with the model in {here}, now {there}; its files sample "
                    "the same, so the run goes on: pass --overwrite if it is not the same checkpoint")  # docs/errors.md
    assert out.moved_model(output, record(0, here)["identity"], None) is None
    fine_tuned = bytearray(weights)
    fine_tuned[-7] ^= 1  # the last bytes are always among those sampled
    (there / "model-00001-of-00001.safetensors").write_bytes(bytes(fine_tuned))
    said = rf"shards 0/2 and 1/2 in .* ran with a different model \(the files in {here} and in {there} differ\), so"
    with pytest.raises(ExtractError, match=said):
        same_settings(tmp_path, [record(0, here), record(1, there)])
    (there / "model-00001-of-00001.safetensors").write_bytes(weights)
    (there / "quantize_config.json").write_text('{"bits": 4}')  # a loader's settings, hashed whole
    assert model_sha256(there) != model_sha256(here)
    earlier = {"shard": "1/2", "identity": {"model": str(there), "dtype": "x"}}  # an earlier release's: no digest
    with pytest.raises(ExtractError, match=r"ran with a different model \("):
        same_settings(tmp_path, [record(0, here), earlier])
    edited = {**record(1, here), "identity": {**record(1, here)["identity"], "model_sha256": "0" * 64}}
    with pytest.raises(ExtractError, match=rf"a different model \(the files in {here} changed since: weights, or"):
        same_settings(tmp_path, [record(0, here), edited])


def test_merge_without_the_shards_model_says_so_in_its_own_words(tmp_path, smollm2):
    """merge takes no --model: a model folder gone since the shards ran is named as the shards' recorded one."""
    from eagle_extract.config import ExtractConfig
    from eagle_extract.files import shards
    from eagle_extract.job.completion import merge
    from eagle_extract.job.plan import make_plan

    model = tmp_path / "model"
    model.mkdir()
    for f in smollm2.iterdir():
        (model / f.name).symlink_to(f)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}))
    out = tmp_path / "o"
    out.mkdir()
    for k in range(2):
        cfg = ExtractConfig(model=str(model), data=data, output=out, shard=f"{k}/2").resolved()
        summary = {"shard": cfg.shard, "identity": make_plan(cfg, engine=False).identity, "config": cfg.record()}
        shards.record_finished(out, (k, 2), summary)
    shutil.rmtree(model)
    with pytest.raises(ExtractError) as err:
        merge(out)
    assert f"--model {model}" in str(err.value)
    case = "`merge` finds no shard's model folder here (nor one it can read)"
    assert_documented("During the run", case, f"Error: {err.value}")
    assert not (out / "eagle_extract.json").exists()
