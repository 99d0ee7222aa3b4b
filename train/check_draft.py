"""Measure trained drafts in vLLM beside n-gram and plain decoding: acceptance length and decode speed-up.

    python train/check_draft.py --verifier V --draft D [--draft D2 ...] --prompts prompts.jsonl [--num-spec N]
        [--max-tokens 256] [--temperature 0] [--batch N] [--modes plain,eagle3,ngram] [--json OUT.json]
        [--engine-arg KEY=VALUE ...]

Runs the same held-out prompts (JSONL rows with "turns" or "messages"; the first user turn is
asked) through vLLM once per mode: `plain` (no speculation), `ngram` (prompt-lookup speculation
over n-grams of --ngram-min to max(4, --ngram-min) tokens), and a mode per draft kind: `eagle3`,
`peagle`, `dflash`, `dflash2`, `dspark` and `xpress` measure the --draft whose config.json names
that kind (speculators' `speculators_model_type`; a draft whose config names none, not saved by
speculators, is measured when it is the only --draft and there is one draft mode), served as vLLM
serves the folder itself (its speculators reader gives the method, the options and the tokens a
step: peagle is eagle3 with parallel drafting on 0.22-0.33, dflash2 is dflash); `mtp` measures the
verifier's own MTP layers and takes no --draft (a speculators mtp draft is served after `speculators
stitch-mtp` puts it back into a verifier, passed as --verifier).  Each method proposes --num-spec
tokens a step when it is given, else its own count: a draft's `speculative_tokens` from its config
(speculators writes it from the training settings: 3 for EAGLE-3 by default), n-gram 3, mtp the
verifier's MTP layers.  Each engine is
started with the same arguments; greedy unless --temperature is above 0 (then sampled, and texts are
not compared).  Prints one table: the tokens proposed a step, output tokens/s, speed-up over plain,
vLLM's mean acceptance length, tokens per verifier step, the acceptance rate at each draft
position, and whether the text equals plain decoding's.

The two lengths differ when a method does not propose at every step.  vLLM's mean acceptance
length (1 + accepted draft tokens per step that had a draft) leaves out the steps without a
proposal; n-gram proposes only where its n-gram occurred earlier in the text, a draft at every
step.  Tokens per verifier step counts all steps: each step emits 1 + its accepted tokens, so
output - accepted steps emitted the output, and tokens per step is output / (output - accepted):
exact but for the accepted tokens vLLM counts past a request's end (at most the tokens proposed a
step, per request; about one per request, 1 %, in the H200 runs), so a slight overestimate.  It is the
figure that sets the speed-up when a verifier step costs far more than proposing.

Refused in one line before any engine starts: a draft kind this vLLM does not serve (naming the
releases that do), a draft mode without a --draft of its kind or with two, a draft whose config
names no kind for more than one draft mode, a draft config vLLM's reader cannot take, an mtp draft
given as --draft, and for `mtp` a verifier whose config vLLM cannot read or holds no MTP layers, or
a --num-spec its MTP layers cannot propose.  An EAGLE-3 or P-EAGLE draft whose layout fields this vLLM would not honour
(such as `norm_output`, which older releases drop) is refused before anything is measured with it;
DFlash and DSpark drafts' attention layout is not checked against what vLLM builds.
Engines are eager unless `--engine-arg enforce_eager=false` (CUDA graphs, on a GPU).
"""

from __future__ import annotations

import gc
import json
import time
import typing
from pathlib import Path
from types import SimpleNamespace

import click

from eagle_extract.config import DRAFT_KINDS
from eagle_extract.faces.cli import engine_arg_option
from eagle_extract.job.engine import prepare_environment

# speculators 0.9 also trains xpress drafts, whose folders no vLLM release to 0.34 reads: asking gets the refusal below.
DRAFT_MODES = (*DRAFT_KINDS, "xpress")
MODES = ("plain", "ngram", *DRAFT_MODES)
# The first release that serves each kind: the strings of SpeculativeMethod (vllm/config/speculative.py) and the
# kinds vllm/transformers_utils/configs/speculators/algos.py reads, in the wheels of the releases either side of it
# (0.19.1 and 0.20.0, 0.21.0 and 0.22.0, 0.24.0 and 0.25.0, 0.28.0 and 0.29.0); 0.16.0 serves eagle3 and mtp already.
FIRST_SERVED = {"dflash": "0.20.0", "peagle": "0.22.0", "dspark": "0.25.0", "dflash2": "0.29.0"}
# The last release that serves a kind it then dropped: 0.34.0's speculators reader refuses P-EAGLE drafts.
LAST_SERVED = {"peagle": "0.33.0"}
NEWEST_READ = "0.34.0"  # the newest release whose wheel the two tables were read from


def first_questions(path: Path, limit: int | None) -> list[list[dict]]:
    chats = []
    for line in Path(path).open(encoding="utf-8"):
        if not line.strip():
            continue
        row = json.loads(line)
        if "turns" in row:
            question = row["turns"][0]
        else:
            question = next(m["content"] for m in row["messages"] if m["role"] == "user")
        chats.append([{"role": "user", "content": question}])
    return chats[:limit]


def literal_strings(kind) -> set[str]:
    """The strings a typing.Literal admits, through the Literals and unions nested in it."""
    strings = set()
    for arg in typing.get_args(kind):
        strings |= {arg} if isinstance(arg, str) else literal_strings(arg)
    return strings


def served_methods() -> set[str]:
    from vllm.config.speculative import SpeculativeMethod

    return literal_strings(SpeculativeMethod)


def vllm_options(kind: str) -> dict | None:
    """The speculative method and options this vLLM serves a draft of `kind` with (its own reading of a speculators
    draft folder, as `vllm serve DRAFT` does), or None where it serves no such draft."""
    if kind == "mtp":
        return {"method": "mtp"} if "mtp" in served_methods() else None
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    if kind not in SUPPORTED_SPECULATORS_TYPES:
        return None
    stand_in = {"speculators_model_type": kind, "speculators_config": {"proposal_methods": [{"speculative_tokens": 1}]}}
    try:
        options = SpeculatorsConfig.build_vllm_speculative_config(stand_in)
    except ValueError:  # a reader that refuses the kind (0.34 and P-EAGLE)
        return None
    del options["num_speculative_tokens"]
    return options if options["method"] in served_methods() else None


def draft_options(mode: str, draft: str) -> dict:
    """vLLM's reading of a --draft folder for `mode`: its own config when speculators saved it as that kind (the
    tokens a step among the options), else the kind's options alone."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    config = json.loads((Path(draft) / "config.json").read_text())
    if config.get("speculators_model_type") != mode:  # a draft speculators did not save, measured as asked
        return vllm_options(mode)
    try:
        return SpeculatorsConfig.build_vllm_speculative_config(config)
    except Exception as exc:  # whatever vLLM's reader raises on a config it cannot take
        said = (str(exc).strip().splitlines() or [""])[0][:300]
        refuse(f"--draft {draft}: this vLLM cannot read its config.json as a {mode} draft ({type(exc).__name__}: "
               f"{said}); pass the draft folder train_draft.py prints")  # fmt: skip


def speculative_config(mode: str, draft: str | None, num_spec: int | None, ngram_min: int = 4) -> dict | None:
    """vLLM's speculative_config for a mode: `num_spec` tokens a step, else the draft's own (3 for n-gram and for a
    draft whose config gives none)."""
    if mode == "plain":
        return None
    if mode == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": num_spec or 3,
            "prompt_lookup_min": ngram_min,
            "prompt_lookup_max": max(4, ngram_min),
        }
    if mode == "mtp":  # its layers are the verifier's own
        return {"method": "mtp", **({"num_speculative_tokens": num_spec} if num_spec else {})}
    options = draft_options(mode, draft)  # a dict of its own: its count is taken out below
    own = options.pop("num_speculative_tokens", None)
    return {**options, "model": draft, "num_speculative_tokens": num_spec or own or 3}


def refuse(line: str) -> typing.NoReturn:
    raise SystemExit(f"Error: {line}")


def serving_releases(kind: str) -> str:
    first, last = FIRST_SERVED.get(kind), LAST_SERVED.get(kind)
    if first and last:
        return f"vLLM {first} to {last} do"
    if first:
        return f"vLLM {first} and later do"
    return f"no release to {NEWEST_READ} reads speculators' {kind} folders; measure a draft of another kind"


def refuse_unserved(mode: str) -> None:
    import vllm

    if vllm_options(mode) is None:
        refuse(f"--modes {mode}: this vLLM ({vllm.__version__}) does not serve {mode} drafts; {serving_releases(mode)}")


def draft_kinds(drafts: tuple[str, ...]) -> dict[str, str | None]:
    """Each --draft's kind, as its config.json names it (None for a draft speculators did not save)."""
    kinds = {}
    for draft in drafts:
        config = Path(draft) / "config.json"
        if not config.is_file():
            refuse(f"--draft {draft}: no config.json there; pass the draft folder train_draft.py prints")
        kinds[draft] = json.loads(config.read_text()).get("speculators_model_type")
        if kinds[draft] == "mtp":
            refuse(f"--draft {draft} is an mtp draft, which vLLM serves inside its verifier: `speculators stitch-mtp "
                   f"{draft} VERIFIER` writes VERIFIER-stitched; measure that as --verifier with --modes mtp and no "
                   "--draft")  # fmt: skip
    return kinds


def draft_for(mode: str, kinds: dict[str, str | None], draft_modes: list[str]) -> str:
    """The --draft a draft mode measures: the one of its kind, or the only --draft when its config names no kind
    and this is the only draft mode."""
    same = [draft for draft, kind in kinds.items() if kind == mode]
    if len(same) > 1:
        listed = ", ".join(same)
        refuse(f"--modes {mode}: {len(same)} --draft folders are of kind {mode} ({listed}); measure one per run")
    if same:
        return same[0]
    if len(kinds) == 1 and None in kinds.values():
        draft = next(iter(kinds))
        if len(draft_modes) > 1:
            refuse(f"--draft {draft}: its config.json names no kind (speculators_model_type), so it is measured with "
                   f"one draft mode, and --modes asks for {len(draft_modes)} ({', '.join(draft_modes)})")  # fmt: skip
        return draft
    if not kinds:
        refuse(f"--modes {mode} measures a draft: pass --draft, a draft folder of kind {mode}")
    held = ", ".join(f"{draft}: {kind or 'none named'}" for draft, kind in kinds.items())
    refuse(
        f"--modes {mode} measures a draft of kind {mode}, and no --draft is one ({held}, by config.json's "
        f"speculators_model_type); pass a draft folder of kind {mode}, or measure each draft with the mode of its kind"
    )


def mtp_layers(verifier: str, trust_remote_code: bool) -> tuple[str, int]:
    """The verifier's model type and the MTP layers vLLM finds in its config: the config read as vLLM reads an
    mtp draft's (hf_config_override), none when that is not one of its MTP model types."""
    from vllm.config.speculative import MTPModelTypes, SpeculativeConfig
    from vllm.transformers_utils.config import get_config

    try:
        config = get_config(verifier, trust_remote_code)
    except Exception as exc:  # a missing folder, an unreadable config: whatever vLLM's reader raises
        said = (str(exc).strip().splitlines() or [""])[0][:300]
        refuse(f"--modes mtp: vLLM cannot read the config of --verifier {verifier} ({type(exc).__name__}: {said})")
    model_type = config.model_type
    draft = SpeculativeConfig.hf_config_override(config)
    if draft.model_type not in literal_strings(MTPModelTypes):
        return model_type, 0
    return model_type, getattr(draft, "n_predict", None) or 0


def plan(opts) -> list[tuple[str, str | None]]:
    """Each mode with the --draft it measures, every refusal made before any engine starts."""
    modes = opts.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        refuse(f"unknown mode {unknown[0]}; use {', '.join(MODES[:-1])} or {MODES[-1]}")
    for mode in modes:
        if mode in DRAFT_MODES:
            refuse_unserved(mode)
    kinds = draft_kinds(opts.draft)
    if "mtp" in modes:
        model_type, layers = mtp_layers(opts.verifier, bool(opts.engine_args.get("trust_remote_code")))
        if not layers:
            refuse(
                f"--modes mtp measures the verifier's own MTP layers, and vLLM finds none in {opts.verifier} "
                f"(model_type {model_type}); measure a verifier with MTP weights, or a draft of another kind"
            )
        if opts.num_spec and opts.num_spec > layers and opts.num_spec % layers:  # vLLM refuses it at the start
            refuse(f"--num-spec {opts.num_spec}: the verifier's {layers} MTP layers propose a multiple of "
                   f"{layers} tokens a step (or fewer); pass such a --num-spec, or none for their own")  # fmt: skip
    draft_modes = [mode for mode in modes if mode in DRAFT_MODES and mode != "mtp"]
    planned = [(mode, draft_for(mode, kinds, draft_modes) if mode in draft_modes else None) for mode in modes]
    for mode, draft in planned:
        if draft:
            draft_options(mode, draft)  # a config vLLM cannot read is refused now, not after earlier modes ran
    return planned


# Draft config fields that change the draft's computation; vLLM reads each as False when absent.
DRAFT_LAYOUT_FIELDS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def unhonoured_fields(draft_config: dict, served_config) -> list[str]:
    """The draft's layout fields that the engine's draft config does not carry with the same value."""
    return [
        f"{name}={draft_config[name]}"
        for name in DRAFT_LAYOUT_FIELDS
        if name in draft_config and bool(getattr(served_config, name, False)) != bool(draft_config[name])
    ]


def check_served_draft(llm, draft: str) -> None:
    served = llm.llm_engine.vllm_config.speculative_config.draft_model_config.hf_config
    ignored = unhonoured_fields(json.loads((Path(draft) / "config.json").read_text()), served)
    if ignored:
        raise SystemExit(
            f"Error: this vLLM serves the draft without its {', '.join(ignored)} (an older release drops these "
            "fields), so its later draft steps would not run as trained; retrain with train_draft.py's default "
            "--no-norm-output, or serve it with a vLLM that reads them"
        )


def _spec_counts(metrics) -> tuple[float, float, list[int]]:
    """vLLM's speculative-decoding counters so far: drafts, accepted tokens, accepted tokens per position."""

    def total(name: str) -> float:
        return sum(getattr(m, "value", 0) or 0 for m in metrics if m.name == name)

    vectors = [m.values for m in metrics if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos"]
    per_position = [sum(column) for column in zip(*vectors)]
    return total("vllm:spec_decode_num_drafts"), total("vllm:spec_decode_num_accepted_tokens"), per_position


def run_mode(mode: str, draft: str | None, opts, chats) -> dict:
    from vllm import LLM, SamplingParams

    settings = {"enforce_eager": True, "max_model_len": opts.max_model_len, **opts.engine_args}
    llm = LLM(
        model=opts.verifier,
        disable_log_stats=False,
        speculative_config=speculative_config(mode, draft, opts.num_spec, opts.ngram_min),
        **settings,
    )
    if draft:
        check_served_draft(llm, draft)
    served = llm.llm_engine.vllm_config.speculative_config
    proposed = served.num_speculative_tokens if served else 0
    params = SamplingParams(temperature=opts.temperature, max_tokens=opts.max_tokens)
    llm.chat(chats[:2], params, use_tqdm=False)  # warm-up
    before = llm.get_metrics()
    t0 = time.perf_counter()
    outs = []
    for start in range(0, len(chats), opts.batch or len(chats)):
        outs += llm.chat(chats[start : start + (opts.batch or len(chats))], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.get_metrics()
    (drafts_0, accepted_0, per_position_0), (drafts_1, accepted_1, per_position_1) = map(_spec_counts, (before, after))
    drafts, accepted = drafts_1 - drafts_0, accepted_1 - accepted_0
    per_position = [b - a for a, b in zip(per_position_0 or [0] * len(per_position_1), per_position_1)]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = tokens - accepted  # each verifier step emits 1 + its accepted tokens
    del llm
    gc.collect()
    return {
        "mode": mode,
        "draft": draft,
        "proposed_tokens": proposed,
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "drafts": int(drafts),
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "verifier_steps": int(steps),
        "tokens_per_step": round(tokens / steps, 3),
        "acceptance_rate_per_position": [round(n / drafts, 3) for n in per_position] if drafts else None,
        "texts": [o.outputs[0].text for o in outs],
    }


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--verifier", required=True)
@click.option("--draft", multiple=True, help="a draft folder; repeatable, one per draft mode (the mode of its kind)")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@click.option("--limit", type=int, default=None, help="use the first N prompts")
@click.option("--batch", type=int, default=None, help="prompts decoded together [default: all]")
@click.option("--num-spec", type=click.IntRange(min=1), default=None,
              help="tokens every method proposes a step [default: each draft's own, as vLLM serves its folder; "
              "n-gram 3; mtp the verifier's MTP layers]")  # fmt: skip
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 decodes greedily")
@click.option("--ngram-min", type=int, default=4, show_default=True,
              help="shortest n-gram the ngram mode matches (longest: max(4, this))")  # fmt: skip
@click.option("--max-model-len", type=int, default=4096, show_default=True)
@click.option("--modes", default="plain,eagle3,ngram", show_default=True,
              help=f"comma-separated, from {', '.join(MODES)}")  # fmt: skip
@engine_arg_option("further vllm.LLM keyword argument; repeatable")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(**kw) -> None:
    opts = SimpleNamespace(**kw)
    chats = first_questions(opts.prompts, opts.limit)
    # the engine settings extraction applies (spawned workers; on the CPU a 2 GiB KV cache, where vLLM's own
    # default asks for 90 % of the machine's memory and fails beside other processes)
    engine = opts.engine_args
    prepare_environment(engine.get("tensor_parallel_size", 1), engine.get("pipeline_parallel_size", 1),
                        engine.get("dtype", "auto"))  # fmt: skip
    results = [run_mode(mode, draft, opts, chats) for mode, draft in plan(opts)]
    plain = next((r for r in results if r["mode"] == "plain"), None)
    click.echo(
        "| mode | proposed a step | output tok/s | speed-up | mean acceptance length (steps with a draft) "
        "| tokens per verifier step | acceptance per position | same text as plain |"
    )
    click.echo("|---|---|---|---|---|---|---|---|")
    for r in results:
        r["speedup"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3) if plain else None
        r["same_text_as_plain"] = r["texts"] == plain["texts"] if plain and not opts.temperature else None
        cells = [r["mode"], r["proposed_tokens"], f"{r['tokens_per_s']:,.1f}", r["speedup"],
                 r["mean_acceptance_length"], r["tokens_per_step"], r["acceptance_rate_per_position"],
                 r["same_text_as_plain"]]  # fmt: skip
        click.echo("| " + " | ".join(map(str, cells)) + " |")
    if opts.json_path:
        args = {**kw, "prompts": str(opts.prompts), "json": None}
        del args["json_path"]
        opts.json_path.write_text(json.dumps({"args": args, "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
