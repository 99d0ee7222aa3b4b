"""Conversation rows in, (input_ids, loss_mask) out, for any chat template.

Assistant spans are found by rendering the conversation turn by turn and comparing
the rendered prefixes, never with template-specific patterns: the characters that
rendering `messages[:k+1]` adds after `messages[:k]` plus the generation prompt are the
assistant's turn.  Tokens overlapping those characters get loss_mask 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
ROLES = {"system", "user", "assistant", "tool"}


class BadRow(ValueError):
    """A row that cannot become a training sample; the message says why."""


class DataError(ValueError):
    """The data file as a whole is unusable."""


@dataclass
class Sample:
    row: int  # position of the row in the data file
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False


@dataclass
class LoadReport:
    rows: int = 0
    truncated: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)


def read_rows(path: Path) -> Iterator[tuple[int, object]]:
    """Yield (row number, parsed row) from a JSON list or a JSONL file; bad JSON lines yield BadRow."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}; pass an existing .json or .jsonl file to --data")
    try:
        with path.open("rb") as f:
            f.read(1 << 20).decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text; --data takes JSON or JSONL conversations") from None
    with path.open("r", encoding="utf-8", errors="replace") as f:
        head = f.read(1)
        while head and head.isspace():
            head = f.read(1)
        f.seek(0)
        if head == "[":
            try:
                rows = json.load(f)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} is not valid JSON ({exc}); fix the file or convert it to JSONL") from None
            yield from enumerate(rows)
            return
        for number, line in enumerate(f):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, BadRow(f"malformed JSON line ({exc.msg} at column {exc.colno})")


def to_messages(row: object) -> list[dict]:
    """OpenAI `messages` or ShareGPT `conversations` → [{"role", "content"}, ...]."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"row is a {type(row).__name__}, expected an object with 'messages' or 'conversations'")
    if "messages" in row:
        turns = row["messages"]
        messages = []
        for turn in turns if isinstance(turns, list) else []:
            if not isinstance(turn, dict) or "role" not in turn:
                raise BadRow("a message lacks 'role'")
            messages.append({k: v for k, v in turn.items() if v is not None})
    elif "conversations" in row:
        turns = row["conversations"]
        messages = []
        for turn in turns if isinstance(turns, list) else []:
            if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
                raise BadRow("a ShareGPT turn lacks 'from' or 'value'")
            role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
            if role is None:
                raise BadRow(f"unknown ShareGPT speaker '{turn['from']}'")
            messages.append({"role": role, "content": turn["value"]})
    else:
        raise BadRow(f"row has neither 'messages' nor 'conversations' (keys: {', '.join(sorted(row))})")
    for m in messages:
        if m["role"] not in ROLES:
            raise BadRow(f"unknown role '{m['role']}'")
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            if not m.get("tool_calls"):
                raise BadRow(f"empty {m['role']} message")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn")
    return messages


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character spans of every assistant turn in it."""
    full = _render(tokenizer, messages, False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], True)
        after = _render(tokenizer, messages[: k + 1], False)
        if not (after.startswith(before) and full.startswith(after)):
            raise BadRow(
                f"chat template does not render turn {k} as a prefix of the conversation; "
                "this template rewrites earlier turns"
            )
        end = len(before) + len(after[len(before) :].rstrip())  # template glue after end-of-turn stays 0
        spans.append((len(before), end))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    text, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [0] * len(enc["input_ids"])
    for i, (a, b) in enumerate(enc["offset_mapping"]):
        if any(a < end and b > start for start, end in spans):
            mask[i] = 1
    return list(enc["input_ids"]), mask


def load_samples(
    path: Path, tokenizer, seq_length: int, max_samples: int | None = None
) -> tuple[list[Sample], LoadReport]:
    """Tokenize every usable row; bad rows are skipped and listed in the report."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the model's tokenizer has no chat template; use a chat model or add a template")
    samples, report = [], LoadReport()
    for number, row in read_rows(path):
        if max_samples is not None and len(samples) >= max_samples:
            break
        report.rows += 1
        try:
            ids, mask = tokenize_conversation(tokenizer, to_messages(row))
        except BadRow as exc:
            report.skipped.append((number, str(exc)))
            continue
        truncated = len(ids) > seq_length
        ids, mask = ids[:seq_length], mask[:seq_length]
        if not any(mask):
            report.skipped.append((number, f"no assistant token within the first {seq_length} tokens"))
            continue
        report.truncated += truncated
        samples.append(Sample(number, ids, mask, truncated))
    if not samples:
        reasons = "; ".join(f"row {n}: {why}" for n, why in report.skipped[:3])
        raise DataError(
            f"no usable rows in {path} ({reasons or 'file is empty'}); "
            "--data needs rows with OpenAI 'messages' or ShareGPT 'conversations'"
        )
    return samples, report
