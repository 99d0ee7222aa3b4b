"""Let the target model write every assistant turn itself before extraction.

EAGLE-3 recipes train the draft on the target's own answers: the draft then learns the
distribution it will be asked to predict.  Conversations are replayed turn by turn: after
each user turn the model answers, and its answer (not the dataset's) is what later turns
see.  All conversations advance together, one batched `generate` call per turn.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..atomic import write_atomically
from ..config import ExtractConfig
from ..data.formats import Record
from ..errors import ExtractError
from ..runlog import progress

REGENERATED = "regenerated.jsonl"  # the conversations as the model answered them, beside the output
JOURNAL = ".eagle_extract_answers.jsonl"  # the answers so far, while the regeneration runs


@dataclass
class RegenerateStats:
    conversations: int = 0
    answers: int = 0
    hit_max_new_tokens: int = 0
    cut_at_seq_length: int = 0  # conversations whose later turns no longer fit --seq-length
    kept_as_is: int = 0  # token, text and tool-using rows: nothing to regenerate
    kept_answers: int = 0  # answers an interrupted run had journaled, used again


def _prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answers(llm, cfg: ExtractConfig, tokenizer, records: list[Record], log, beat) -> tuple[list[Record], dict]:
    """The model's own answers: loaded when an interrupted run already made them all, else generated (after
    the answers an interrupted run journaled) and saved.  `beat` tells the engine watch the run moves."""
    output = Path(cfg.output)
    saved = load(output, records)
    journal = Journal(output / JOURNAL)
    if saved is not None:
        journal.path.unlink(missing_ok=True)  # a run that died right after saving them left it
        log(f"using the {REGENERATED} an interrupted run already wrote")
        return saved, {"reused": True}
    kept = journal.read()
    if kept:
        log(f"continuing the regeneration after the {sum(map(len, kept.values()))} answers an interrupted run kept")
    out, stats = regenerate(llm, tokenizer, records, cfg, kept, journal.append, beat)
    save(output, out)
    journal.path.unlink(missing_ok=True)
    log(
        f"regenerated {stats.answers} answers in {stats.conversations} conversations "
        f"({stats.kept_answers} of them kept from an interrupted run; {stats.hit_max_new_tokens} stopped at "
        f"--max-new-tokens, {stats.cut_at_seq_length} cut at --seq-length, {stats.kept_as_is} rows kept as they "
        f"were); saved to {output / REGENERATED}"
    )
    return out, asdict(stats)


class Journal:
    """Answers appended as each engine call finishes, fsynced: {"row", "turn", "text", "finish"} per line.
    A power cut can tear only the last line, which reading drops (and cuts off, so appends stay whole)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[int, dict[int, tuple[str, str | None]]]:
        """row -> turn -> (answer, finish reason)."""
        kept: dict[int, dict[int, tuple[str, str | None]]] = {}
        if not self.path.is_file():
            return kept
        good = 0
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    entry = json.loads(line) if line.endswith(b"\n") else None
                    kept.setdefault(int(entry["row"]), {})[int(entry["turn"])] = (str(entry["text"]), entry["finish"])
                except (ValueError, KeyError, TypeError):
                    break
                good += len(line)
        if good < self.path.stat().st_size:
            os.truncate(self.path, good)
        return kept

    def append(self, entries: list[dict]) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:  # a full disk, most likely: the answers before these are kept
            raise ExtractError(
                f"saving answers to {self.path}: {exc.strerror or exc}; free space and rerun the same command "
                "to continue the regeneration"
            ) from None


def regenerate(
    llm, tokenizer, records: list[Record], cfg: ExtractConfig, kept: dict | None = None, keep=None, beat=None
) -> tuple[list[Record], RegenerateStats]:
    """Records with every assistant turn written by the model, sampled as `cfg` says; other rows pass through.
    `kept` answers (row -> turn -> (text, finish reason)) are used instead of generating them again; each
    engine call's answers go to `keep`, as Journal entries."""
    from vllm import SamplingParams, TokensPrompt

    kept = kept or {}
    stats = RegenerateStats()
    todo = {}  # record index -> (turns still to replay, conversation so far)
    for i, rec in enumerate(records):
        if rec.messages is None or any(m["role"] == "tool" or m.get("tool_calls") for m in rec.messages):
            stats.kept_as_is += 1
            continue
        todo[i] = ([m for m in rec.messages if m["role"] != "assistant"], [])
    stats.conversations = len(todo)
    done: dict[int, list[dict]] = {}

    def answered(i: int, text: str, finish: str | None) -> None:
        stats.answers += 1
        stats.hit_max_new_tokens += finish == "length"
        todo[i][1].append({"role": "assistant", "content": text})

    total = sum(sum(m["role"] == "user" for m in turns) for turns, _ in todo.values())
    with progress(total, "regenerate", "answer") as bar:
        while todo:
            prompts, owners = [], []
            for i, (turns, convo) in list(todo.items()):
                while True:
                    while turns:  # replay up to and including the next user turn
                        convo.append(turns.pop(0))
                        if convo[-1]["role"] == "user":
                            break
                    if not convo or convo[-1]["role"] != "user":
                        done[i] = convo + turns
                        del todo[i]
                        break
                    ids = _prompt_ids(tokenizer, convo)
                    if beat:
                        beat()  # tokenizing a million conversations is progress too
                    room = min(cfg.max_new_tokens, cfg.seq_length - len(ids))
                    if room <= 0:  # this turn cannot fit: the conversation ends with the previous answer
                        stats.cut_at_seq_length += 1
                        bar.update(1 + sum(m["role"] == "user" for m in turns))
                        done[i] = convo[:-1]
                        del todo[i]
                        break
                    turn = sum(m["role"] == "assistant" for m in convo)
                    if turn not in kept.get(records[i].row, {}):
                        seed = cfg.seed + records[i].row
                        params = SamplingParams(
                            max_tokens=room, temperature=cfg.temperature, top_p=cfg.top_p, seed=seed
                        )
                        prompts.append((TokensPrompt(prompt_token_ids=ids), params, turn))
                        owners.append(i)
                        break
                    answered(i, *kept[records[i].row][turn])
                    stats.kept_answers += 1
                    bar.update(1)
            size = cfg.regenerate_batch_size
            for start in range(0, len(prompts), size):  # each engine call's answers are kept at once
                chunk, who = prompts[start : start + size], owners[start : start + size]
                outputs = llm.generate([p for p, _, _ in chunk], [s for _, s, _ in chunk], use_tqdm=False)
                entries = []
                for i, (_, _, turn), out in zip(who, chunk, outputs):
                    answer = out.outputs[0]
                    answered(i, answer.text, answer.finish_reason)
                    entries.append(
                        {"row": records[i].row, "turn": turn, "text": answer.text, "finish": answer.finish_reason}
                    )
                if keep:
                    keep(entries)
                if beat:
                    beat()
                bar.update(len(who))
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

    try:
        write_atomically(Path(output) / REGENERATED, write, durable=True)
    except OSError as exc:  # a full disk: the journal still holds every answer
        raise ExtractError(
            f"saving {REGENERATED} in {output}: {exc.strerror or exc}; free space and rerun the same command"
        ) from None


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
