"""Measure a trained EAGLE-3 draft in vLLM: acceptance length and decode speed-up.

    python train/check_draft.py --verifier V --draft D --prompts prompts.jsonl [--num-spec 3]
        [--max-tokens 256] [--temperature 0] [--batch N] [--modes plain,eagle3,ngram] [--json OUT.json]
        [--engine-arg KEY=VALUE ...]

Runs the same held-out prompts (JSONL rows with "turns" or "messages"; the first user turn is
asked) through vLLM once per mode: `plain` (no speculation), `eagle3` (the draft) and `ngram`
(prompt-lookup speculation over n-grams of --ngram-min to max(4, --ngram-min) tokens), each
engine started with the same arguments; greedy unless --temperature is above 0 (then sampled,
and texts are not compared).  Prints one table: output tokens/s, speed-up over plain, vLLM's
mean acceptance length, tokens per verifier step, the acceptance rate at each draft position,
and whether the text equals plain decoding's.

The two lengths differ when a method does not propose at every step.  vLLM's mean acceptance
length (1 + accepted draft tokens per step that had a draft) leaves out the steps without a
proposal; n-gram proposes only where its n-gram occurred earlier in the text, an EAGLE-3 draft
at every step.  Tokens per verifier step counts all steps: each step emits 1 + its accepted
tokens, so output - accepted steps emitted the output, and tokens per step is
output / (output - accepted): exact but for the accepted tokens vLLM counts past a request's
end (at most --num-spec per request; about one per request, 1 %, in the H200 runs), so a slight
overestimate.  It is the figure that sets the speed-up when a verifier step costs far more than
proposing.

A draft whose config this vLLM would not honour (a field such as `norm_output` that older
releases drop) is refused before anything is measured.
Engines are eager unless `--engine-arg enforce_eager=false` (CUDA graphs, on a GPU).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from types import SimpleNamespace

import click

from eagle_extract.faces.cli import engine_arg_option
from eagle_extract.job.engine import prepare_environment


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


def speculative_config(mode: str, draft: str | None, num_spec: int, ngram_min: int = 4) -> dict | None:
    if mode == "plain":
        return None
    if mode == "eagle3":
        return {"method": "eagle3", "model": draft, "num_speculative_tokens": num_spec}
    if mode == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": num_spec,
            "prompt_lookup_min": ngram_min,
            "prompt_lookup_max": max(4, ngram_min),
        }
    raise SystemExit(f"Error: unknown mode {mode}; use plain, eagle3 or ngram")


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


def run_mode(mode: str, opts, chats) -> dict:
    from vllm import LLM, SamplingParams

    settings = {"enforce_eager": True, "max_model_len": opts.max_model_len, **opts.engine_args}
    llm = LLM(
        model=opts.verifier,
        disable_log_stats=False,
        speculative_config=speculative_config(mode, opts.draft, opts.num_spec, opts.ngram_min),
        **settings,
    )
    if mode == "eagle3":
        check_served_draft(llm, opts.draft)
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
@click.option("--draft", default=None)
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@click.option("--limit", type=int, default=None, help="use the first N prompts")
@click.option("--batch", type=int, default=None, help="prompts decoded together [default: all]")
@click.option("--num-spec", type=int, default=3, show_default=True)
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 decodes greedily")
@click.option("--ngram-min", type=int, default=4, show_default=True,
              help="shortest n-gram the ngram mode matches (longest: max(4, this))")  # fmt: skip
@click.option("--max-model-len", type=int, default=4096, show_default=True)
@click.option("--modes", default="plain,eagle3,ngram", show_default=True)
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
    results = [run_mode(mode, opts, chats) for mode in opts.modes.split(",")]
    plain = next((r for r in results if r["mode"] == "plain"), None)
    click.echo(
        "| mode | output tok/s | speed-up | mean acceptance length (steps with a draft) | tokens per verifier step "
        "| acceptance per position | same text as plain |"
    )
    click.echo("|---|---|---|---|---|---|---|")
    for r in results:
        r["speedup"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3) if plain else None
        r["same_text_as_plain"] = r["texts"] == plain["texts"] if plain and not opts.temperature else None
        click.echo(
            f"| {r['mode']} | {r['tokens_per_s']:,.1f} | {r['speedup']} | {r['mean_acceptance_length']} | "
            f"{r['tokens_per_step']} | {r['acceptance_rate_per_position']} | {r['same_text_as_plain']} |"
        )
    if opts.json_path:
        args = {**kw, "prompts": str(opts.prompts), "json": None}
        del args["json_path"]
        opts.json_path.write_text(json.dumps({"args": args, "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
