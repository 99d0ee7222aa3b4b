"""The training stage on the CPU: speculators builds the draft from our manifest, vLLM runs it.

speculators' trainer needs an accelerator for real steps, so the CPU test uses its own
`--dry-run` (the draft built and saved untrained); vLLM then serves it as an EAGLE-3 draft.
Greedy speculative decoding must give the text plain decoding gives.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from .conftest import ONE_PROCESS

TRAIN = Path(__file__).resolve().parents[1] / "train"


def run_script(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, str(TRAIN / name), *args], capture_output=True, text=True, env=env)


def failure(proc: subprocess.CompletedProcess) -> str:
    """The lines naming an error anywhere in the output: an engine's root cause is logged far above the end,
    and vLLM logs to stdout."""
    named = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line or "error:" in line]
    return "\n".join(named[:20]) + "\n...\n" + proc.stderr[-1500:]


def test_draft_takes_the_extracted_layers_and_vllm_serves_it(tmp_path, smollm2_bf16_out):
    manifest = json.loads((smollm2_bf16_out / "eagle_extract.json").read_text())
    draft = tmp_path / "draft"
    proc = run_script("train_draft.py", str(smollm2_bf16_out), "--save-path", str(draft), "--draft-vocab-size", "2048",
                      "--dry-run")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((draft / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == manifest["aux_layer_ids"] == [2, 15, 27]
    assert config["draft_vocab_size"] == 2048
    assert config["speculators_config"]["verifier"]["name_or_path"] == manifest["model"]
    assert config["norm_output"] is False  # what every vLLM serves (older releases drop the field)

    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in ["Name three colours.", "What is 2+2?"]))
    out = tmp_path / "check.json"
    args = ["--verifier", manifest["model"], "--draft", str(draft), "--prompts", str(prompts), "--max-tokens", "24"]
    proc = run_script("check_draft.py", *args, "--modes", "plain,eagle3", "--engine-arg", 'dtype="float32"',
                      "--json", str(out), env=ONE_PROCESS)  # fmt: skip
    assert proc.returncode == 0, failure(proc)
    plain, eagle = json.loads(out.read_text())["results"]
    assert eagle["drafts"] > 0  # the draft was asked
    assert (plain["proposed_tokens"], eagle["proposed_tokens"]) == (0, 3)  # the draft's own count, its config's
    rates = eagle["acceptance_rate_per_position"]
    assert len(rates) == 3 and abs(1 + sum(rates) - eagle["mean_acceptance_length"]) < 2e-3
    # Over all steps: 1 without speculation; an EAGLE-3 draft proposes at every step, so it agrees with vLLM's
    # figure (which leaves out steps without a proposal) up to the prefill steps.
    assert plain["tokens_per_step"] == 1.0
    assert abs(eagle["tokens_per_step"] - eagle["mean_acceptance_length"]) < 0.05
    assert eagle["texts"] == plain["texts"] and all(plain["texts"])


def test_a_draft_layout_the_engine_drops_is_named():
    """vLLM 0.22 builds its draft config without `norm_output` and `fc_norm`; a draft trained with
    norm_output=true would silently run its later steps on other inputs than in training."""
    sys.path.insert(0, str(TRAIN))
    from check_draft import unhonoured_fields

    draft = {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": False, "norm_output": True}
    served_by_0_22 = SimpleNamespace(norm_before_residual=True, norm_before_fc=True)
    assert unhonoured_fields(draft, served_by_0_22) == ["norm_output=True"]
    assert unhonoured_fields({**draft, "norm_output": False}, served_by_0_22) == []
    assert unhonoured_fields(draft, SimpleNamespace(**draft)) == []


def test_outputs_the_trainer_cannot_read_are_refused_in_one_line(tmp_path):
    proc = run_script("train_draft.py", str(tmp_path), "--save-path", str(tmp_path / "d"))
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"Error: {tmp_path} is not a complete eagle-extract output (no eagle_extract.json); finish it or check it "
        f"with `eagle-extract verify {tmp_path}`"
    ]
    (tmp_path / "eagle_extract.json").write_text(json.dumps({"format": "speculators-legacy"}))
    proc = run_script("train_draft.py", str(tmp_path), "--save-path", str(tmp_path / "d"))
    assert proc.returncode == 1 and "extract again without --format speculators-legacy" in proc.stderr


def test_prompt_copies_are_adjacent_so_the_validation_rows_are_unseen_conversations(tmp_path):
    """speculators validates on the last 10 % of rows, unshuffled: apart from the one conversation the cut
    falls inside, none of them may repeat a training row's prompt."""
    data = Path(__file__).resolve().parents[1] / "eagle_extract/sample_data"
    out = tmp_path / "prompts.jsonl"
    proc = run_script("build_prompts.py", str(out), "--copies", "4", str(data / "vicuna_bench_questions.jsonl"),
                      str(data / "sharegpt_dummy_conversations.json"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line]
    chats = set(rows)
    assert len(rows) == 4 * len(chats) == 4 * (80 + 154)  # vicuna's 80 and the sample's 154 distinct conversations
    assert "234 conversations (346 repeated ones dropped)" in proc.stdout
    cut = int(len(rows) * 0.9)  # speculators' ArrowDataset split: train rows [0, cut), validation [cut, n)
    assert len(set(rows[cut:]) & set(rows[:cut])) <= 1  # only the conversation the cut falls inside


def test_synthesized_prompts_are_complete_distinct_and_never_a_held_out_one(tmp_path):
    sys.path.insert(0, str(TRAIN))
    import synthesize_prompts as synth
    from transformers import AutoTokenizer

    from eagle_extract.smollm2 import ensure_smollm2

    prefix = synth.pre_query_prefix(AutoTokenizer.from_pretrained(ensure_smollm2()))
    assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_end|>\n<|im_start|>user\n")

    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"turns": ["What is  the Capital of France?", "And of Spain?"]}) + "\n")
    candidates = [
        ("Write a poem about the sea.", "stop"),
        ("  write a poem\nabout the SEA. ", "stop"),  # the same request, spaced and cased differently
        ("what is the capital of france?", "stop"),  # a held-out question
        ("Hi there", "stop"),  # shorter than min_chars
        ("Tell me everything about the history of", "length"),  # cut at max_tokens
        ("Explain how tides work.", "stop"),
        ("List three prime numbers.", "stop"),
    ]
    kept, dropped = synth.keep_distinct(candidates, 2, 12, synth.held_out_texts([held]))
    assert kept == ["Write a poem about the sea.", "Explain how tides work."]
    assert dropped == {"cut_at_max_tokens": 1, "too_short": 1, "repeated": 1, "held_out": 1}


def test_every_kind_speculators_trains_builds_its_draft_from_the_extracted_layers(tmp_path, smollm2_bf16_out):
    """The same output trains every kind (eagle3 above); a dry run builds each untrained draft on the CPU (two at
    a time: each is a process of its own that mostly loads the verifier)."""
    from concurrent.futures import ThreadPoolExecutor

    manifest = json.loads((smollm2_bf16_out / "eagle_extract.json").read_text())

    def dry_run(kind: str):
        return run_script("train_draft.py", str(smollm2_bf16_out), "--save-path", str(tmp_path / kind),
                          "--speculator-type", kind, "--dry-run", "--", "--num-layers", "1")  # fmt: skip

    kinds = ["peagle", "dflash", "dflash2", "dspark"]
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(kinds, pool.map(dry_run, kinds)))
    for kind, proc in runs.items():
        assert proc.returncode == 0, (kind, failure(proc))
        config = json.loads((tmp_path / kind / "config.json").read_text())
        assert config["speculators_model_type"] == kind
        assert config["speculators_config"]["verifier"]["name_or_path"] == manifest["model"]
        assert json.dumps(manifest["aux_layer_ids"])[1:-1] in json.dumps(config)  # the ids the output holds
        said = proc.stdout.strip().splitlines()[-1]
        method = json.loads(said.split("'")[1])["method"]
        assert said.startswith("serve: vllm serve ") and method == {"peagle": "eagle3", "dflash2": "dflash"}.get(
            kind, kind)  # fmt: skip


def test_a_kind_the_output_or_the_verifier_cannot_train_is_refused_in_one_line(tmp_path, smollm2_bf16_out):
    proc = run_script("train_draft.py", str(smollm2_bf16_out), "--save-path", str(tmp_path / "d"),
                      "--speculator-type", "mtp", "--dry-run")  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith(
        "Error: --speculator-type mtp builds the draft from the verifier's own MTP weights (mtp.*)"
    ), proc.stderr
    layers = ["--target-layer-ids", "1", "9", "15"]
    proc = run_script("train_draft.py", str(smollm2_bf16_out), "--save-path", str(tmp_path / "d"),
                      "--speculator-type", "dflash", "--dry-run", "--", *layers)  # fmt: skip
    assert proc.returncode == 1 and "the output holds layers 2 15 27 (and the final slot), not [1, 9]" in proc.stderr


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash", "dflash2", "dspark", "mtp"])
def test_the_printed_training_command_of_every_kind_parses_as_speculators_own(kind):
    import shlex

    from speculators.train.config.resolution import build_parser

    from eagle_extract.drafts import train_flags

    line = "speculators train --verifier-name-or-path M --data-path OUT " + shlex.join(train_flags(kind, [2, 15, 27]))
    parsed = build_parser().parse_args(shlex.split(line)[2:])
    assert parsed.speculator_type == kind
    assert getattr(parsed, "target_layer_ids", None) == (None if kind == "mtp" else [2, 15, 27])


def test_the_layer_ids_a_training_command_asks_for_are_read_up_to_the_next_flag():
    import click

    sys.path.insert(0, str(TRAIN))
    from train_draft import refuse_unheld_layers

    held = {"aux_layer_ids": [2, 15, 27]}
    refuse_unheld_layers("dflash", held, ("--target-layer-ids", "2", "15", "--block-size", "16", "--num-layers", "5"))
    refuse_unheld_layers("dflash", held, ("--target-layer-ids=27", "--num-layers", "5"))
    refuse_unheld_layers("mtp", held, ("--target-layer-ids", "9"))  # mtp reads the final slot alone
    for asked in [("--target-layer-ids", "2", "9"), ("--target-layer-ids=9", "--block-size", "16")]:
        with pytest.raises(click.ClickException, match="not \\[9\\]"):
            refuse_unheld_layers("dflash", held, asked)


def speculators_draft(folder: Path, kind: str, tokens: int = 3) -> str:
    """A draft folder holding the config.json speculators saves for a draft of `kind` proposing `tokens` a step (no
    weights: nothing here loads them)."""
    from speculators import SpeculatorModelConfig, SpeculatorsConfig, VerifierConfig
    from speculators.proposals import GreedyTokenProposalConfig

    proposal = SpeculatorsConfig(
        algorithm=kind,
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=tokens)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path="verifier", architectures=["LlamaForCausalLM"]),
    )
    SpeculatorModelConfig.registry[kind](speculators_config=proposal).save_pretrained(str(folder))
    return str(folder)


def model_config(folder: Path, **config) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128}  # fmt: skip
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_nextn_predict_layers": 1}


def check_plan(modes: str, drafts=(), verifier: str = "unread", num_spec: int | None = None) -> list:
    sys.path.insert(0, str(TRAIN))
    from check_draft import plan

    return plan(SimpleNamespace(modes=modes, draft=tuple(drafts), verifier=verifier, engine_args={}, num_spec=num_spec))


def refusal(modes: str, drafts=(), verifier: str = "unread", num_spec: int | None = None) -> str:
    with pytest.raises(SystemExit) as refused:
        check_plan(modes, drafts, verifier, num_spec)
    return str(refused.value.code)


def test_each_draft_kind_is_measured_with_a_speculative_config_the_installed_vllm_accepts(tmp_path):
    """Each kind's mode takes the --draft of its kind, and every key and value of the config the engine gets is
    one vLLM's own SpeculativeConfig field type accepts (its `method` Literal among them)."""
    from pydantic import TypeAdapter
    from vllm.config.speculative import SpeculativeConfig

    sys.path.insert(0, str(TRAIN))
    from check_draft import served_methods, speculative_config

    from eagle_extract.drafts import speculative_config as printed_config

    kinds = ["eagle3", "peagle", "dflash", "dflash2", "dspark"]
    drafts = {kind: speculators_draft(tmp_path / kind, kind, tokens=3 + i) for i, kind in enumerate(kinds)}
    verifier = model_config(tmp_path / "deepseek-v3", **DEEPSEEK_V3)  # one MTP layer, for the mtp mode
    planned = check_plan(f"plain,{','.join(reversed(kinds))},mtp,ngram", drafts.values(), verifier)
    assert planned == [("plain", None), *((kind, drafts[kind]) for kind in reversed(kinds)), ("mtp", None),
                       ("ngram", None)]  # fmt: skip
    field = {name: TypeAdapter(f.type) for name, f in SpeculativeConfig.__dataclass_fields__.items()}
    served_as = {"peagle": "eagle3", "dflash2": "dflash"}  # vLLM's speculators reader (README's table)
    for i, kind in enumerate([*kinds, "mtp"]):
        config = speculative_config(kind, drafts.get(kind), 2)
        for key, value in config.items():
            field[key].validate_python(value)
        assert config["method"] == served_as.get(kind, kind) and config["num_speculative_tokens"] == 2
        assert config.get("model") == drafts.get(kind)  # mtp's layers are the verifier's own
        assert config.get("parallel_drafting", False) == (kind == "peagle")  # as `vllm serve DRAFT` sets it
        if kind != "mtp":  # without --num-spec, each draft proposes what its own config says (3 + i here) ...
            assert speculative_config(kind, drafts[kind], None)["num_speculative_tokens"] == 3 + i
            # ... and train_draft.py prints the same config for serving it
            printed = printed_config(kind, drafts[kind], json.loads((Path(drafts[kind]) / "config.json").read_text()))
            assert printed == {**config, "num_speculative_tokens": 3 + i}
    assert "num_speculative_tokens" not in speculative_config("mtp", None, None)  # vLLM then takes the MTP layers
    for name in served_as:  # the speculators names themselves are no vLLM method
        with pytest.raises(ValueError):
            field["method"].validate_python(name)
    assert {"eagle3", "dflash", "dspark", "mtp", "deepseek_mtp"} <= served_methods()  # MTP names are a nested Literal


def test_a_draft_mode_without_a_draft_of_its_kind_is_refused_in_one_line_before_any_engine(tmp_path):
    eagle3 = speculators_draft(tmp_path / "eagle3", "eagle3")
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"turns": ["What is 2+2?"]}) + "\n")
    out = tmp_path / "check.json"
    proc = run_script("check_draft.py", "--verifier", str(tmp_path), "--draft", eagle3, "--prompts", str(prompts),
                      "--modes", "plain,dflash,ngram", "--json", str(out))  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        f"Error: --modes dflash measures a draft of kind dflash, and no --draft is one ({eagle3}: eagle3, by "
        "config.json's speculators_model_type); pass a draft folder of kind dflash, or measure each draft with the "
        "mode of its kind"
    ), proc.stderr
    assert proc.stdout == "" and not out.exists()  # no engine started, no mode measured


def test_draft_kinds_and_verifiers_a_mode_cannot_measure_are_refused_in_one_line(tmp_path):
    import vllm

    dflash = speculators_draft(tmp_path / "dflash", "dflash")
    dflash_too = speculators_draft(tmp_path / "dflash-b", "dflash")
    dspark = speculators_draft(tmp_path / "dspark", "dspark")
    mtp = speculators_draft(tmp_path / "mtp", "mtp")
    assert refusal("plain,xpress") == (  # speculators 0.9 trains xpress drafts; no vLLM here serves them
        f"Error: --modes xpress: this vLLM ({vllm.__version__}) does not serve xpress drafts; no release to 0.34.0 "
        "reads speculators' xpress folders; measure a draft of another kind"
    )
    assert refusal("plain,dflash", [dflash, dflash_too]) == (
        f"Error: --modes dflash: 2 --draft folders are of kind dflash ({dflash}, {dflash_too}); measure one per run"
    )
    assert refusal("dflash,dspark") == (
        "Error: --modes dflash measures a draft: pass --draft, a draft folder of kind dflash"
    )
    assert refusal("eagle3", [dflash, dspark]) == (
        f"Error: --modes eagle3 measures a draft of kind eagle3, and no --draft is one ({dflash}: dflash, {dspark}: "
        "dspark, by config.json's speculators_model_type); pass a draft folder of kind eagle3, or measure each draft "
        "with the mode of its kind"
    )
    assert refusal("plain,mtp", [mtp]) == (
        f"Error: --draft {mtp} is an mtp draft, which vLLM serves inside its verifier: `speculators stitch-mtp {mtp} "
        "VERIFIER` writes VERIFIER-stitched; measure that as --verifier with --modes mtp and no --draft"
    )
    assert refusal("eagle3", [str(tmp_path)]) == (
        f"Error: --draft {tmp_path}: no config.json there; pass the draft folder train_draft.py prints"
    )
    assert refusal("plain,eagle-3") == (
        "Error: unknown mode eagle-3; use plain, ngram, eagle3, peagle, dflash, dflash2, dspark, mtp or xpress"
    )
    # A draft whose config names no kind (not saved by speculators) is the only --draft: vLLM reads it as asked.
    foreign = model_config(tmp_path / "foreign", **LLAMA)
    assert check_plan("plain,eagle3", [foreign]) == [("plain", None), ("eagle3", foreign)]
    assert refusal("eagle3,dflash", [foreign]) == (  # but not for two kinds at once
        f"Error: --draft {foreign}: its config.json names no kind (speculators_model_type), so it is measured with "
        "one draft mode, and --modes asks for 2 (eagle3, dflash)"
    )
    assert refusal("plain,mtp", verifier=str(tmp_path / "absent")).startswith(
        f"Error: --modes mtp: vLLM cannot read the config of --verifier {tmp_path / 'absent'} ("
    )


def test_a_kind_an_older_or_newer_release_serves_is_refused_naming_the_releases_that_do(monkeypatch):
    """A release whose speculators reader lacks the kind (dspark before 0.25: taken out of the installed reader's
    table here), and one whose reader refuses it (0.34 on P-EAGLE, with 0.34's own message)."""
    import vllm
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    monkeypatch.delitem(SUPPORTED_SPECULATORS_TYPES, "dspark")
    assert refusal("plain,dspark") == (
        f"Error: --modes dspark: this vLLM ({vllm.__version__}) does not serve dspark drafts; vLLM 0.25.0 and later do"
    )
    reader = SpeculatorsConfig.build_vllm_speculative_config

    def as_on_034(config):
        if config["speculators_model_type"] == "peagle":
            raise ValueError("P-EAGLE (parallel drafting EAGLE-3) is not supported.")
        return reader(config)

    monkeypatch.setattr(SpeculatorsConfig, "build_vllm_speculative_config", as_on_034)
    assert refusal("plain,peagle") == (
        f"Error: --modes peagle: this vLLM ({vllm.__version__}) does not serve peagle drafts; vLLM 0.22.0 to 0.33.0 do"
    )


def test_a_draft_config_vllm_cannot_read_is_refused_before_any_mode_runs(tmp_path):
    draft = speculators_draft(tmp_path / "eagle3", "eagle3")
    config = json.loads((Path(draft) / "config.json").read_text())
    config["speculators_config"]["proposal_methods"] = []  # no proposal: vLLM's reader cannot take it
    (Path(draft) / "config.json").write_text(json.dumps(config))
    assert refusal("plain,eagle3", [draft]).startswith(
        f"Error: --draft {draft}: this vLLM cannot read its config.json as a eagle3 draft ("
    )


@pytest.mark.parametrize("name, config, layers", [
    ("llama", LLAMA, 0),  # no MTP in vLLM for this model type
    ("deepseek-v3-without", {**DEEPSEEK_V3, "num_nextn_predict_layers": 0}, 0),
    ("deepseek-v3", DEEPSEEK_V3, 1),
])  # fmt: skip
def test_mtp_is_refused_for_a_verifier_in_whose_config_vllm_finds_no_mtp_layers(tmp_path, name, config, layers):
    verifier = model_config(tmp_path / name, **config)
    if layers:
        assert check_plan("plain,mtp", verifier=verifier) == [("plain", None), ("mtp", None)]
        two = model_config(tmp_path / "two", **{**config, "num_nextn_predict_layers": 2})
        assert check_plan("mtp", verifier=two, num_spec=4) == [("mtp", None)]  # two steps of the two layers
        assert check_plan("mtp", verifier=two, num_spec=1) == [("mtp", None)]  # fewer than the layers
        assert refusal("mtp", verifier=two, num_spec=3) == (  # vLLM refuses it only once the engine starts
            "Error: --num-spec 3: the verifier's 2 MTP layers propose a multiple of 2 tokens a step (or fewer); pass "
            "such a --num-spec, or none for their own"
        )
    else:
        assert refusal("plain,mtp", verifier=verifier) == (
            f"Error: --modes mtp measures the verifier's own MTP layers, and vLLM finds none in {verifier} "
            f"(model_type {config['model_type']}); measure a verifier with MTP weights, or a draft of another kind"
        )


@pytest.mark.parametrize("kinds, said", [
    ("eagle3,dlfash", "unknown kind 'dlfash'; use eagle3, peagle, dflash, dflash2 or dspark"),
    ("eagle3,,dspark", "unknown kind ''; use eagle3, peagle, dflash, dflash2 or dspark"),
    ("eagle3, mtp", "mtp trains only for a verifier with MTP weights, which SmolLM2 has not"),
])  # fmt: skip
def test_end_to_end_refuses_a_kind_it_cannot_train_before_any_stage(tmp_path, kinds, said):
    """Checked before the extraction, which a misspelt kind would otherwise fail only after."""
    work = tmp_path / "work"
    proc = subprocess.run(["bash", str(TRAIN / "end_to_end.sh"), str(tmp_path), str(work)], capture_output=True,
                          text=True, env={**os.environ, "KINDS": kinds})  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.strip() == f"end_to_end.sh: KINDS={kinds}: {said}", proc.stderr
    assert proc.stdout == "" and not work.exists()


def test_end_to_end_measures_only_when_every_kind_has_a_trained_draft(tmp_path):
    work = tmp_path / "work"
    (work / "draft").mkdir(parents=True)  # eagle3 trained, dflash not
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # its python3 is the one with eagle_extract
    env = {**os.environ, "KINDS": "eagle3,dflash", "STAGES": "measure", "PATH": path}
    proc = subprocess.run(["bash", str(TRAIN / "end_to_end.sh"), str(tmp_path), str(work)], capture_output=True,
                          text=True, env=env)  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        f"end_to_end.sh: no trained draft in {work}/draft-dflash: run the train (or online) stage for "
        "KINDS=eagle3,dflash"
    ), proc.stderr
    assert not list(work.glob("check_*.json"))


# speculators' own console handlers print a trainer's records as train/end_to_end.sh keeps them (a wide console, the
# padding squeezed): each step's profile (fetch_ms is the wait for its batch), and the line before a checkpoint save.
TRAINER_CONSOLE = r"""
import logging, sys
from speculators.train.logger import setup_metric_logger, setup_root_logger
setup_root_logger()
setup_metric_logger("", "run", sys.argv[1])
metrics = logging.getLogger("speculators.metrics")
for step, (epoch, fetch_ms, step_ms) in enumerate([(0, 5.0, 80000.0), (0, 20.0, 60.0), (1, 30.0, 70.0),
                                                   (1, 900.0, 950.0), (1, 50.0, 90.0), (2, 40.0, 80.0)]):
    if step == 3:
        logging.getLogger().info("Saving checkpoint to /drafts/1")
    profile = {"fetch_ms": fetch_ms, "step_ms": step_ms, "memory_mb": {"start": 1.0}}
    record = {"train": {"loss": 2.5}, "profile": profile, "epoch": epoch, "lr": 0.001, "global_step": step}
    metrics.info(record, extra={"step": step})
metrics.info({"val": {"loss_epoch": 9.7}, "epoch": 1})
"""


def test_the_trainers_wait_for_data_is_read_from_speculators_own_console(tmp_path):
    """Per epoch, the steps' fetch_ms summed, a step after a checkpoint save left out (the save is in its fetch),
    the mean after the first epoch (the trainer's warm-up); colours that FORCE_COLOR puts in are read through; a
    record the console's width cut is one line naming the fix."""
    wide = {"COLUMNS": "4000"}
    consoles = {"wide": wide, "colour": {**wide, "FORCE_COLOR": "1"}, "narrow": {"COLUMNS": "100"}}
    running = {
        name: subprocess.Popen([sys.executable, "-c", TRAINER_CONSOLE, str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, **env})
        for name, env in consoles.items()
    }  # fmt: skip
    logs = {name: tmp_path / f"{name}.log" for name in consoles}
    for name, proc in running.items():
        printed = proc.communicate()[0]
        assert proc.returncode == 0, printed
        logs[name].write_text(re.sub(" {8,}", "   ", printed))
    got = run_script("trainer_wait.py", str(logs["wide"]), str(logs["colour"]), "--json", str(tmp_path / "w.json"))
    assert got.returncode == 0, got.stderr
    figures = json.loads((tmp_path / "w.json").read_text())
    counted = [(e["epoch"], e["steps"], e["left_out"]) for e in figures["offline"]["epochs"]]
    assert counted == [(0, 2, 0), (1, 2, 1), (2, 1, 0)]
    assert figures["offline"]["epochs"][1]["waiting_s"] == pytest.approx(0.08)
    assert figures["offline"]["waiting_s_after_first"] == pytest.approx((0.08 + 0.04) / 2)
    assert figures["online"] == {**figures["offline"], "log": str(logs["colour"])}
    assert "online 0.06 s (1.00x offline's; +0.00 s)" in got.stdout
    cut = run_script("trainer_wait.py", str(logs["narrow"]))
    assert cut.returncode == 1 and "a step's record is cut" in cut.stderr and "COLUMNS=4000" in cut.stderr


def test_the_servers_counters_while_the_online_trainer_ran(tmp_path):
    """--server reads what the server's own `GET /metrics` (its Metrics collector, in Prometheus' text format) moved
    by between a scrape before the online trainer and one after; files without those counters are one line naming
    the fix."""
    from prometheus_client import generate_latest

    from eagle_extract.faces.routes import Metrics

    loop = SimpleNamespace(rows=0, tokens=0, redone=0, abandoned=0, steps=10, step_s=1.0, drain_s=0.5, worker_s=0.1,
                           starved_s=2.0, failed=None, waiting=lambda: 0)  # fmt: skip
    spool = SimpleNamespace(waiting_for_room=lambda: 0, used=lambda: 0, limit=1 << 30)
    metrics = Metrics(loop, spool, set(), None)
    before, after = tmp_path / "before.txt", tmp_path / "after.txt"
    before.write_bytes(generate_latest(metrics.registry))
    for seconds in (0.02, 0.03, 0.07):
        metrics.row_seconds.observe(seconds)
    loop.rows = 5  # its own counter, not the histogram's: the rows answered are the histogram's count
    loop.steps, loop.step_s, loop.drain_s, loop.starved_s = 16, 1.9, 1.25, 2.5
    after.write_bytes(generate_latest(metrics.registry))
    log = tmp_path / "trainer.log"  # two epochs of speculators' step records, the fields trainer_wait.py reads
    log.write_text(
        "".join(f"INFO train/loss=1.0, profile/fetch_ms=5.0, profile/step_ms=20.0, epoch={e}\n" for e in (0, 1))
    )
    got = run_script("trainer_wait.py", str(log), str(log), "--server", str(before), str(after),
                     "--json", str(tmp_path / "w.json"))  # fmt: skip
    assert got.returncode == 0, got.stderr
    moved = json.loads((tmp_path / "w.json").read_text())["server"]
    assert moved == pytest.approx({"rows": 3, "steps": 6, "rows_a_step": 0.5, "row_s_mean": 0.04,
                                   "engine_step_s": 0.9, "engine_wait_s": 0.75, "engine_starved_s": 0.5})  # fmt: skip
    assert (
        "the server meanwhile: 3 rows in 6 engine steps (0.5 a step), a row 40.0 ms from its request to its "
        "answer (mean); the engine 0.9 s in steps, 0.8 s in looks at its workers, 0.5 s starved"
    ) in got.stdout
    other = tmp_path / "other.txt"  # a second server (or a restarted one) whose counters only went forward
    loop.steps = 40
    other.write_bytes(generate_latest(Metrics(loop, spool, set(), None).registry))
    for pair in ([after, before], [before, other]):
        refused = run_script("trainer_wait.py", str(log), str(log), "--server", *map(str, pair))
        assert refused.returncode == 1 and "not one server's counters, before then after" in refused.stderr, refused
    cut = tmp_path / "cut.txt"
    cut.write_text(
        after.read_text().replace("eagle_extract_engine_steps_total 16.0", "eagle_extract_engine_steps_total 1e")
    )
    unreadable = run_script("trainer_wait.py", str(log), str(log), "--server", str(before), str(cut))
    assert unreadable.returncode == 1 and "not GET /metrics' text: save its whole answer" in unreadable.stderr
    bad = run_script("trainer_wait.py", str(log), str(log), "--server", str(log), str(after))
    assert bad.returncode == 1 and "no eagle_extract_row_seconds_count in them" in bad.stderr, bad.stderr
    assert "save eagle-extract serve's GET /metrics" in bad.stderr
