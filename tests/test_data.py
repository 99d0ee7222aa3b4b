"""Rows to (input_ids, loss_mask) with the real SmolLM2 tokenizer and chat template (ChatML)."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from eagle_extract.data.formats import BadRow, DataError, to_record
from eagle_extract.data.samples import load_samples, tokenize_conversation

from .common import assert_documented


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return AutoTokenizer.from_pretrained(smollm2)


def test_loss_mask_hand_computed(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you."},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages)
    pieces = [(tokenizer.decode([t]), m) for t, m in zip(ids, mask)]
    # Written out by hand from SmolLM2's ChatML template: the default system turn, then the
    # conversation; 1 exactly on what the assistant wrote and its <|im_end|>.
    tail = [
        ("<|im_start|>", 0),
        ("user", 0),
        ("\n", 0),
        ("Hi", 0),
        ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("ass", 0),
        ("istant", 0),
        ("\n", 0),
        ("Hello", 1),
        (" there", 1),
        ("!", 1),
        ("<|im_end|>", 1),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("user", 0),
        ("\n", 0),
        ("By", 0),
        ("e", 0),
        ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0),
        ("ass", 0),
        ("istant", 0),
        ("\n", 0),
        ("See", 1),
        (" you", 1),
        (".", 1),
        ("<|im_end|>", 1),
        ("\n", 0),
    ]
    assert pieces[-len(tail) :] == tail
    assert sum(m for _, m in pieces[: -len(tail)]) == 0  # the system prompt is never trained on
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_sharegpt_and_messages_agree(tokenizer):
    share = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4"},
        ]
    }
    openai = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    }
    assert tokenize_conversation(tokenizer, to_record(0, share).messages) == tokenize_conversation(
        tokenizer, to_record(0, openai).messages
    )


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown role"),
        ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "x"}]}, "empty user message"),
        ({"conversations": [{"from": "alien", "value": "hi"}]}, "unknown ShareGPT speaker"),
        ({"prompt": "hello"}, "matches no known format"),
        ([1, 2], "expected an object"),
        ({"input_ids": [1, -2]}, "non-negative integers"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "2 zeros and ones"),
        ({"text": "  "}, "empty 'text'"),
        ({"turns": "what?"}, "not a non-empty list"),
        ({"messages": [{"role": ["user"], "content": "hi"}]}, "a role is a list, expected one of"),
        ({"messages": [{"role": None, "content": "hi"}]}, "a role is a NoneType, expected one of"),
        ({"input_ids": 5}, "'input_ids' is not a non-empty list"),
        ({"input_ids": [True, 2]}, "non-negative integers"),
        (
            {"messages": [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Hello"}]},
            "starts with an assistant turn",
        ),
    ],
)
def test_bad_rows_name_the_problem(row, reason):
    with pytest.raises(BadRow, match=reason):
        to_record(0, row)


def test_bad_rows_are_skipped_and_counted(tmp_path, tokenizer):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "?"}]}),
        json.dumps(good),
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    samples, report = load_samples(path, tokenizer, seq_length=512)
    assert [s.row for s in samples] == [0, 3]
    assert [(n, why.split(" (")[0].split(";")[0]) for n, why in report.skipped] == [
        (1, "malformed JSON line"),
        (2, "no assistant turn"),
    ]
    with pytest.raises(DataError, match=r"rows.jsonl line 2: malformed JSON line .*run without --strict$"):
        load_samples(path, tokenizer, seq_length=512, strict=True)


def test_rows_the_tokenizer_or_the_json_parser_refuse_are_bad_rows(tmp_path, tokenizer):
    """A lone surrogate the tokenizer refuses, a line nested past Python's recursion limit or holding a
    number of over 4,300 digits, a whole JSON list so: the rows are skipped and named (a whole file is one
    line), not the run's failure."""
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    lone = {"messages": [{"role": "user", "content": "a\ud800b"}, {"role": "assistant", "content": "Hello"}]}
    path = tmp_path / "rows.jsonl"
    huge = '{"input_ids": [' + "9" * 5000 + "]}"  # past Python's 4,300-digit limit on reading integers
    path.write_text("\n".join([json.dumps(good), json.dumps(lone), "[" * 50000 + "]" * 50000, huge, json.dumps(good)]))
    samples, report = load_samples(path, tokenizer, seq_length=512)
    assert [s.row for s in samples] == [0, 4]
    assert [(n, why.split(" (")[0]) for n, why in report.skipped] == [
        (1, "the tokenizer cannot encode this row"),
        (2, "JSON nested too deeply to read"),
        (3, "a number too long to read"),
    ]
    whole = tmp_path / "rows.json"
    whole.write_text("[" * 50000 + "]" * 50000)
    with pytest.raises(DataError, match="nests JSON too deeply to read"):
        load_samples(whole, tokenizer, seq_length=512)
    whole.write_text("[" + huge + "]")
    with pytest.raises(DataError, match=r"rows.json cannot be read as JSON \(.*4300.*\); fix the file"):
        load_samples(whole, tokenizer, seq_length=512)


def test_truncation_keeps_prefix_and_counts(tmp_path, tokenizer):
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "word " * 200}]}
    path = tmp_path / "long.json"
    path.write_text(json.dumps([row]))
    full_ids, full_mask = tokenize_conversation(tokenizer, to_record(0, row).messages)
    samples, report = load_samples(path, tokenizer, seq_length=64)
    assert report.truncated == 1 and samples[0].truncated
    assert samples[0].input_ids == full_ids[:64] and samples[0].loss_mask == full_mask[:64]
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    path.write_text(json.dumps([row, short]))
    samples, report = load_samples(path, tokenizer, seq_length=64, long_samples="skip")
    assert [s.row for s in samples] == [1] and report.truncated == 0 and report.skipped_long == 1
    assert report.skipped[0][0] == 0 and "longer than --seq-length 64" in report.skipped[0][1]


def test_unusable_file_is_one_clear_error(tmp_path, tokenizer):
    with pytest.raises(DataError, match="data file not found"):
        load_samples(tmp_path / "missing.jsonl", tokenizer, 512)
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(DataError, match="not valid JSON"):
        load_samples(bad, tokenizer, 512)
    with pytest.raises(DataError, match="not a saved dataset"):
        load_samples(tmp_path, tokenizer, 512)


GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


def _rows(path, tokenizer, **options):
    samples, report = load_samples(path, tokenizer, 4096, **options)
    return [(s.row, s.input_ids) for s in samples], report.skipped


def test_a_utf8_bom_loses_no_row(tmp_path, tokenizer):
    plain, bom = tmp_path / "plain.jsonl", tmp_path / "bom.jsonl"
    plain.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert _rows(bom, tokenizer) == _rows(plain, tokenizer) and len(_rows(bom, tokenizer)[0]) == 2
    array = tmp_path / "bom.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps([GOOD, GOOD]).encode())
    assert _rows(array, tokenizer)[0] == _rows(plain, tokenizer)[0]


def test_utf8_is_checked_whole_not_by_its_first_mib(tmp_path, tokenizer):
    """A character cut by the 1 MiB mark is fine; a bad byte after it is that line's problem, not replaced."""
    path = tmp_path / "big.jsonl"
    first = json.dumps({**GOOD, "pad": "x"}).encode()
    pad = (1 << 20) - len(first) + len(b'"x"') - 2  # puts the 3-byte character across byte 1,048,576
    line0 = json.dumps({**GOOD, "pad": "x" * pad + "\u20ac"}, ensure_ascii=False).encode()
    assert line0.index("\u20ac".encode()) < (1 << 20) < line0.index("\u20ac".encode()) + 3
    bad = json.dumps(GOOD).encode().replace(b"Hello", b"Hel\xfflo")
    good = json.dumps(GOOD).encode()
    path.write_bytes(b"\n".join([good, bad, line0, bad, good]) + b"\n")  # bad lines inside the first MiB and after
    rows, skipped = _rows(path, tokenizer)
    assert [r for r, _ in rows] == [0, 2, 4]
    at = bad.index(b"\xff")
    why = f"line is not UTF-8 text (byte {at} of the line)"
    assert skipped == [(1, why), (3, why)]


def test_gzip_and_parquet_read_as_their_plain_source(tmp_path, tokenizer):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [GOOD, {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}]
    plain = tmp_path / "rows.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    (tmp_path / "rows.json.gz").write_bytes(gzip.compress(json.dumps(rows).encode()))
    pq.write_table(pa.Table.from_pylist([GOOD, GOOD]), tmp_path / "rows.parquet")
    want = _rows(plain, tokenizer)
    assert len(want[0]) == 2
    assert _rows(tmp_path / "rows.jsonl.gz", tokenizer) == want == _rows(tmp_path / "rows.json.gz", tokenizer)
    assert _rows(tmp_path / "rows.parquet", tokenizer)[0] == [(0, want[0][0][1]), (1, want[0][0][1])]


def test_files_of_other_formats_are_named(tmp_path, tokenizer):
    import gzip

    zstd = tmp_path / "rows.jsonl.zst"
    zstd.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(64))
    with pytest.raises(DataError, match=r"rows.jsonl.zst is zstd-compressed; --data takes JSON or JSONL .*Parquet"):
        load_samples(zstd, tokenizer, 512)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress((json.dumps(GOOD) + "\n").encode() * 2000)[:300])
    with pytest.raises(DataError, match="cut.jsonl.gz is a damaged gzip file"):
        load_samples(cut, tokenizer, 512)
    fake = tmp_path / "fake.parquet"
    fake.write_bytes(b"PAR1" + bytes(16))
    with pytest.raises(DataError, match="fake.parquet is not a readable Parquet file"):
        load_samples(fake, tokenizer, 512)


def test_a_template_that_raises_skips_its_row(tmp_path, tokenizer):
    picky = copy.deepcopy(tokenizer)
    picky.chat_template = (
        "{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    boom = {"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(boom) + "\n")
    rows, skipped = _rows(path, picky)
    assert [r for r, _ in rows] == [0]
    assert skipped == [(1, "the chat template cannot render this row (TemplateError: no boom here)")]


def test_a_slow_tokenizer_without_generation_marks_is_one_line(tmp_path, tokenizer):
    """transformers 5 builds no slow tokenizer for SmolLM2, so this is SmolLM2's own with the flag a
    Python tokenizer has (whose call cannot return offsets)."""
    slow = copy.copy(tokenizer)
    slow.__class__ = type("SlowTokenizer", (type(tokenizer),), {"is_fast": False})
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(DataError) as err:
        load_samples(path, slow, 512)
    assert_documented(
        "Before the engine starts",
        "a slow (Python) tokenizer and a chat template without `{% generation %}` marks",
        f"Error: {err.value}",
    )


def test_a_long_conversation_renders_only_the_turns_it_keeps(tokenizer, monkeypatch):
    """Each assistant turn's span renders the turns before it, so a 4,000-message conversation cost the square
    of its turns (4 renders of up to all 4,000 messages per turn) though only its first tokens are kept."""
    from .test_chat_templates import trained_runs

    messages = []
    for i in range(2000):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i} ok"}]
    rendered = []
    real = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda m, **kw: rendered.append(len(m)) or real(m, **kw))
    ids, mask = tokenize_conversation(tokenizer, messages, keep=96)
    runs = trained_runs(tokenizer, ids[:96], mask[:96])
    assert 3 <= len(runs) and runs[:-1] == [f"a{i} ok<|im_end|>" for i in range(len(runs) - 1)], runs
    assert f"a{len(runs) - 1} ok<|im_end|>".startswith(runs[-1])  # the last may be cut at the 96th token
    # the whole conversation once (its tokens are all counted, for --long-samples), then a few short renders
    # per kept turn; before, every turn's span rendered all 4,000 messages again
    assert len(rendered) < 8 * len(runs) and sum(rendered) < 2 * len(messages), (len(rendered), sum(rendered))
