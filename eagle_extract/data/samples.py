"""Records in, (input_ids, loss_mask) out, for any chat template.

Assistant spans are found by rendering, never with template-specific patterns.  Where the
template marks them itself (`{% generation %}`), its own marks are used.  Otherwise, for each
assistant turn k: it starts where the rendering of `messages[:k]` plus the generation prompt
stops agreeing with the full rendering, and it ends where a marker appended to its content
appears in the full rendering, plus the end-of-turn text the template puts after a final
assistant turn (such as `<|im_end|>`).  Templates that rewrite earlier turns (Qwen3 drops the
thinking of turns before the last question) are handled: only the full rendering is trained on.
Tokens overlapping a span get loss_mask 1.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .formats import BadRow, DataError, Record, read_rows, to_record

_END = "\u2063EAGLE-EXTRACT-END\u2063"  # appended to one turn's content to find where it ends in the rendering
_GENERATION_MARK = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass
class Sample:
    row: int  # position of the row in the data source
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False


@dataclass
class LoadReport:
    rows: int = 0
    truncated: int = 0
    skipped_long: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)


def unparsed_template(tokenizer, exc) -> DataError:
    """A chat template jinja2 cannot compile: no row can pass it, so it is the run's error, naming where the
    template came from.  (jinja2's TemplateAssertionError, an unknown filter or tag, is one too: a template
    written for a newer transformers or jinja2.)"""
    said = " ".join(str(exc.message or "").split())[:200]
    return DataError(
        f"the chat template of {tokenizer.name_or_path} does not parse (line {exc.lineno}: {said}); fix "
        "chat_template in its tokenizer files (chat_template.jinja or tokenizer_config.json) or update "
        "transformers and jinja2 if it was written for newer ones, or use pre-tokenized rows"
    )


def check_template(tokenizer) -> None:
    """Compile the chat template once, before any row: `unparsed_template` if it cannot be.  Rendering one user
    message compiles it; what the template refuses about that message (roles, a system turn it wants) is left
    to the real rows."""
    from jinja2 import TemplateSyntaxError

    if not getattr(tokenizer, "chat_template", None):
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    except TemplateSyntaxError as exc:
        raise unparsed_template(tokenizer, exc) from None
    except Exception:
        pass


def _apply_template(tokenizer, messages: list[dict], **options):
    """The chat template's own errors (jinja2's, or what it raises for a row it refuses) are the row's,
    except a template that does not parse, which no row can pass."""
    from jinja2 import TemplateSyntaxError

    try:
        return tokenizer.apply_chat_template(messages, **options)
    except TemplateSyntaxError as exc:
        raise unparsed_template(tokenizer, exc) from None
    except Exception as exc:
        said = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "no message"
        raise BadRow(f"the chat template cannot render this row ({type(exc).__name__}: {said})") from None


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return _apply_template(tokenizer, messages, tokenize=False, add_generation_prompt=generation_prompt)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def assistant_char_spans(
    tokenizer, messages: list[dict], full: str | None = None, until: int | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character spans of its assistant turns, those starting before character
    `until` (where the kept tokens end): each span renders the turns before it, so a conversation's spans
    cost the square of its turns, and turns past the cut are never rendered alone."""
    full = _render(tokenizer, messages, False) if full is None else full
    until = len(full) if until is None else until
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], False).rstrip()
        if len(before) >= until:
            break
        start = _common_prefix(_render(tokenizer, messages[:k], True), full)
        if start < len(before):
            raise BadRow(f"chat template renders the turns before turn {k} differently once turn {k} follows")
        marked = {**message, "content": (message.get("content") or "") + _END}
        alone = _render(tokenizer, messages[:k] + [marked], False)
        for tail in (messages[k + 1 : k + 3], messages[k + 1 :]):  # the next turns, else all (a template may
            within = _render(tokenizer, messages[:k] + [marked] + tail, False)  # look at the last user turn)
            end = within.find(_END)
            if end >= 0 and within[:end] == full[:end]:
                break
        if _END not in within or _END not in alone:
            raise BadRow(f"chat template does not render the content of assistant turn {k}")
        if within[:end] != full[:end] or end < start:
            raise BadRow(f"chat template renders assistant turn {k} in a way its span cannot be found")
        glue = alone[alone.index(_END) + len(_END) :].rstrip()  # end-of-turn text, e.g. <|im_end|>
        if glue and full.startswith(glue, end):
            end += len(glue)
        spans.append((start, end))
    return full, spans


def _template_marks(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    out = _apply_template(
        tokenizer,
        messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        add_special_tokens=False,
    )
    return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]


def tokenize_conversation(tokenizer, messages: list[dict], keep: int | None = None) -> tuple[list[int], list[int]]:
    """The conversation's token ids and loss mask; past the first `keep` tokens the mask may be left 0."""
    if _GENERATION_MARK.search(tokenizer.chat_template or ""):
        return _template_marks(tokenizer, messages)
    if not getattr(tokenizer, "is_fast", True):
        raise DataError(
            "the model's tokenizer is a slow (Python) one, which cannot map tokens to text offsets, and its chat "
            "template has no {% generation %} marks: give the checkpoint a tokenizer.json, or use token rows"
        )
    text = _render(tokenizer, messages, False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    until = enc["offset_mapping"][keep - 1][1] if keep and len(enc["input_ids"]) > keep else len(text)
    _, spans = assistant_char_spans(tokenizer, messages, text, until)
    mask = [0] * len(enc["input_ids"])
    for i, (a, b) in enumerate(enc["offset_mapping"]):
        if any(a < end and b > start for start, end in spans):
            mask[i] = 1
    return list(enc["input_ids"]), mask


def tokenize_record(tokenizer, record: Record, keep: int | None = None) -> tuple[list[int], list[int]]:
    if record.input_ids is not None:
        if max(record.input_ids) >= len(tokenizer):
            raise BadRow(f"token id {max(record.input_ids)} is outside the model's vocabulary of {len(tokenizer)}")
        return record.input_ids, record.loss_mask
    if record.text is not None:
        ids = tokenizer(record.text)["input_ids"]
        return ids, [1] * len(ids)
    return tokenize_conversation(tokenizer, record.messages, keep)


def _tokenized(tokenizer, record: Record, keep: int) -> tuple[list[int], list[int]]:
    """tokenize_record, where what the tokenizer or the template refuses (a lone surrogate, content nested
    too deeply) is this row's problem, not the run's."""
    try:
        return tokenize_record(tokenizer, record, keep)
    except (BadRow, DataError):
        raise
    except (TypeError, ValueError, UnicodeError, RecursionError) as exc:
        said = (str(exc).splitlines() or [""])[0][:160]
        raise BadRow(f"the tokenizer cannot encode this row ({type(exc).__name__}: {said})") from None


def row_name(source, number: int) -> str:
    """How a user finds row `number` of `source`: a line for JSONL files, an index otherwise."""
    source = os.fspath(source)
    return f"{source} line {number + 1}" if source.endswith((".jsonl", ".jsonl.gz")) else f"{source} row {number}"


def read_records(path: Path, data_format: str = "auto", strict: bool = False, need_assistant: bool = True):
    """Yield (record or None, row number, reason): bad rows come back with a reason, or stop the
    run with their row number under `strict`."""
    for number, row in read_rows(path):
        try:
            try:
                record = to_record(number, row, data_format, need_assistant)
            except RecursionError:
                raise BadRow("the row nests its content too deeply to read") from None
            yield record, number, None
        except BadRow as exc:
            if strict:
                raise DataError(f"{row_name(path, number)}: {exc}; fix the row or run without --strict") from None
            yield None, number, str(exc)


@dataclass
class Skipped:
    row: int
    reason: str
    long: bool = False  # over --seq-length with --long-samples skip


def sample_from(record, number: int, reason: str | None, tokenizer, seq_length: int, options: dict) -> Sample | Skipped:
    """One (record or None, row number, reason) triple as a sample, or why it is skipped; `options` are
    long_samples, strict and source.  Under strict a bad row (not an over-long one) stops the run."""
    try:
        if record is None:
            raise BadRow(reason)
        if record.messages is not None and not getattr(tokenizer, "chat_template", None):
            raise DataError("the model's tokenizer has no chat template; use a chat model or pre-tokenized rows")
        ids, mask = _tokenized(tokenizer, record, seq_length)
        if len(ids) > seq_length and options.get("long_samples") == "skip":
            return Skipped(number, f"{len(ids)} tokens, longer than --seq-length {seq_length}", long=True)
        truncated = len(ids) > seq_length
        ids, mask = ids[:seq_length], mask[:seq_length]
        if not any(mask):
            raise BadRow(f"no trained (assistant) token within the first {seq_length} tokens")
    except BadRow as exc:
        if options.get("strict"):
            where = row_name(options.get("source", "--data"), number)
            raise DataError(f"{where}: {exc}; fix the row or run without --strict") from None
        return Skipped(number, str(exc))
    return Sample(number, ids, mask, truncated)


def no_usable_rows(report: LoadReport, source) -> DataError:
    reasons = "; ".join(f"row {n}: {why}" for n, why in report.skipped[:3])
    return DataError(f"no usable rows in {source} ({reasons or 'it is empty'}); see docs/data.md for the formats")


def make_samples(
    records,
    tokenizer,
    seq_length: int,
    max_samples: int | None = None,
    long_samples: str = "truncate",
    strict: bool = False,
    source: str = "--data",
) -> tuple[list[Sample], LoadReport]:
    """Tokenize (record, row number, reason) triples in memory, in one thread; bad and (with
    long_samples='skip') over-long rows are skipped and listed in the report with their reason.
    (A run streams the same through `stream.py`.)"""
    samples, report = [], LoadReport()
    options = {"long_samples": long_samples, "strict": strict, "source": source}
    for record, number, reason in records:
        if max_samples is not None and len(samples) >= max_samples:
            break
        report.rows += 1
        got = sample_from(record, number, reason, tokenizer, seq_length, options)
        if isinstance(got, Skipped):
            report.skipped.append((got.row, got.reason))
            report.skipped_long += got.long
            continue
        report.truncated += got.truncated
        samples.append(got)
    if not samples:
        raise no_usable_rows(report, source)
    return samples, report


def load_samples(path: Path, tokenizer, seq_length: int, max_samples: int | None = None, **options):
    """Read, check and tokenize a data source in one go (see make_samples for the options)."""
    strict = options.get("strict", False)
    records = read_records(path, options.pop("data_format", "auto"), strict)
    return make_samples(records, tokenizer, seq_length, max_samples, source=os.fspath(path), **options)
