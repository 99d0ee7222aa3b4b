"""Have the verifier write its own user prompts, for more distinct training prompts than the data holds.

    python train/synthesize_prompts.py --model M --count N OUT.jsonl [--held-out FILE ...]

The chat template is rendered up to where a user's message begins, and the model continues it:
an instruct model then writes a plausible user request, since that is what follows in its
training conversations (the "pre-query" trick of Magpie, Xu et al. 2024).  Requests that hit
`--max-tokens`, are shorter than `--min-chars`, repeat an earlier one or equal a held-out
prompt (case and spacing ignored) are dropped; the first N others are written as
`{"messages": [{"role": "user", "content": ...}]}` lines that `build_prompts.py` reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import click

from eagle_extract.faces.cli import engine_arg_option

SENTINEL = "\x00USER\x00"


def pre_query_prefix(tokenizer) -> str:
    """The rendered chat template up to the first user message's text."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    if SENTINEL not in text:
        raise SystemExit("Error: the chat template drops the user message; use a model with a chat template")
    return text[: text.index(SENTINEL)]


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def held_out_texts(paths: list[Path]) -> set[str]:
    """Every user turn of the held-out files (vicuna `turns`, or `messages`), normalised."""
    seen = set()
    for path in paths:
        for line in path.open(encoding="utf-8"):
            if line.strip():
                row = json.loads(line)
                turns = row.get("turns") or [m["content"] for m in row.get("messages", []) if m["role"] == "user"]
                seen.update(normalise(t) for t in turns)
    return seen


def keep_distinct(candidates, count: int, min_chars: int, exclude: set[str]) -> tuple[list[str], dict]:
    """The first `count` usable candidates: (text, finish_reason) pairs, in order."""
    kept, seen = [], set(exclude)
    dropped = {"cut_at_max_tokens": 0, "too_short": 0, "repeated": 0, "held_out": 0}
    for text, finish in candidates:
        key = normalise(text)
        if finish != "stop":
            dropped["cut_at_max_tokens"] += 1
        elif len(key) < min_chars:
            dropped["too_short"] += 1
        elif key in exclude:
            dropped["held_out"] += 1
        elif key in seen:
            dropped["repeated"] += 1
        else:
            seen.add(key)
            kept.append(text.strip())
            if len(kept) == count:
                break
    return kept, dropped


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", required=True)
@click.option("--count", type=int, required=True, help="distinct prompts to write")
@click.option("--held-out", type=click.Path(exists=True, path_type=Path), multiple=True,
              help="prompt file no output may equal; repeatable")  # fmt: skip
@click.option("--oversample", type=float, default=1.5, show_default=True, help="candidates generated per prompt wanted")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-p", type=float, default=0.99, show_default=True)
@click.option("--max-tokens", type=int, default=160, show_default=True)
@click.option("--min-chars", type=int, default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@engine_arg_option("further vllm.LLM keyword argument; repeatable")
def main(**kw) -> None:
    from vllm import LLM, SamplingParams

    opts = SimpleNamespace(**kw)
    llm = LLM(model=opts.model, enforce_eager=True, seed=opts.seed, **opts.engine_args)
    prefix = pre_query_prefix(llm.get_tokenizer())
    wanted = max(1, int(opts.count * opts.oversample))
    params = [  # one seed per candidate, so the set does not depend on batching
        SamplingParams(temperature=opts.temperature, top_p=opts.top_p, max_tokens=opts.max_tokens, seed=opts.seed + i)
        for i in range(wanted)
    ]
    outputs = [out.outputs[0] for out in llm.generate([prefix] * wanted, params)]
    kept, dropped = keep_distinct(
        ((o.text, o.finish_reason) for o in outputs), opts.count, opts.min_chars, held_out_texts(list(opts.held_out))
    )
    with opts.out.open("w", encoding="utf-8") as f:
        for text in kept:
            f.write(json.dumps({"messages": [{"role": "user", "content": text}]}, ensure_ascii=False) + "\n")
    click.echo(f"{len(kept)} distinct prompts of {len(outputs)} generated -> {opts.out}; dropped {dropped}")
    if len(kept) < opts.count:
        click.echo(f"warning: fewer than --count {opts.count}; raise --oversample")


if __name__ == "__main__":
    main()
