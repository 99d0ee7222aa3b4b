"""Let the target model write every assistant turn itself before extraction.

EAGLE-3 recipes train the draft on the target's own answers: the draft then learns the
distribution it will be asked to predict.  Conversations are replayed turn by turn: after
each user turn the model answers, and its answer (not the dataset's) is what later turns
see.  All conversations advance together, one batched `generate` call per turn.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .atomic import write_atomically
from .config import ExtractConfig
from .formats import Record
from .runlog import progress

REGENERATED = "regenerated.jsonl"  # the conversations as the model answered them, beside the output


@dataclass
class RegenerateStats:
    conversations: int = 0
    answers: int = 0
    hit_max_new_tokens: int = 0
    cut_at_seq_length: int = 0  # conversations whose later turns no longer fit --seq-length
    kept_as_is: int = 0  # token, text and tool-using rows: nothing to regenerate


def _prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answers(llm, cfg: ExtractConfig, tokenizer, records: list[Record], log) -> tuple[list[Record], dict]:
    """The model's own answers: loaded when an interrupted run already made them, else generated and saved."""
    output = Path(cfg.output)
    saved = load(output, records)
    if saved is not None:
        log(f"using the {REGENERATED} an interrupted run already wrote")
        return saved, {"reused": True}
    out, stats = regenerate(llm, tokenizer, records, cfg)
    save(output, out)
    log(
        f"regenerated {stats.answers} answers in {stats.conversations} conversations "
        f"({stats.hit_max_new_tokens} stopped at --max-new-tokens, {stats.cut_at_seq_length} cut at --seq-length, "
        f"{stats.kept_as_is} rows kept as they were); saved to {output / REGENERATED}"
    )
    return out, asdict(stats)


def regenerate(llm, tokenizer, records: list[Record], cfg: ExtractConfig) -> tuple[list[Record], RegenerateStats]:
    """Records with every assistant turn written by the model, sampled as `cfg` says; other rows pass through."""
    from vllm import SamplingParams, TokensPrompt

    stats = RegenerateStats()
    todo = {}  # record index -> (turns still to replay, conversation so far)
    for i, rec in enumerate(records):
        if rec.messages is None or any(m["role"] == "tool" or m.get("tool_calls") for m in rec.messages):
            stats.kept_as_is += 1
            continue
        todo[i] = ([m for m in rec.messages if m["role"] != "assistant"], [])
    stats.conversations = len(todo)
    done: dict[int, list[dict]] = {}
    total = sum(sum(m["role"] == "user" for m in turns) for turns, _ in todo.values())
    with progress(total, "regenerate", "answer") as bar:
        while todo:
            prompts, owners = [], []
            for i, (turns, convo) in list(todo.items()):
                while turns:  # replay up to and including the next user turn
                    convo.append(turns.pop(0))
                    if convo[-1]["role"] == "user":
                        break
                if not convo or convo[-1]["role"] != "user":
                    done[i] = convo + turns
                    del todo[i]
                    continue
                ids = _prompt_ids(tokenizer, convo)
                room = min(cfg.max_new_tokens, cfg.seq_length - len(ids))
                if room <= 0:  # this turn cannot fit: the conversation ends with the previous answer
                    stats.cut_at_seq_length += 1
                    bar.update(1 + sum(m["role"] == "user" for m in turns))
                    done[i] = convo[:-1]
                    del todo[i]
                    continue
                seed = cfg.seed + records[i].row
                params = SamplingParams(max_tokens=room, temperature=cfg.temperature, top_p=cfg.top_p, seed=seed)
                prompts.append((TokensPrompt(prompt_token_ids=ids), params))
                owners.append(i)
            if not prompts:
                break
            outputs = llm.generate([p for p, _ in prompts], [s for _, s in prompts], use_tqdm=False)
            for i, out in zip(owners, outputs):
                answer = out.outputs[0]
                stats.answers += 1
                stats.hit_max_new_tokens += answer.finish_reason == "length"
                todo[i][1].append({"role": "assistant", "content": answer.text})
            bar.update(len(owners))
    result = list(records)
    for i, convo in done.items():  # one with no answer that fits is later skipped: no trained token
        result[i] = replace(records[i], messages=convo)
    return result, stats


def save(output: Path, records: list[Record]) -> None:
    """Write the regenerated conversations atomically, one {"row", "messages"} object per line."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                if rec.messages is not None:
                    f.write(json.dumps({"row": rec.row, "messages": rec.messages}, ensure_ascii=False) + "\n")

    write_atomically(Path(output) / REGENERATED, write)


def load(output: Path, records: list[Record]) -> list[Record] | None:
    """The conversations an interrupted run already regenerated, if it got that far."""
    path = Path(output) / REGENERATED
    if not path.is_file():
        return None
    saved = {}
    for line in path.open(encoding="utf-8"):
        row = json.loads(line)
        saved[row["row"]] = row["messages"]
    return [replace(r, messages=saved.get(r.row)) if r.messages is not None else r for r in records]
