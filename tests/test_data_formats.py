"""Every input format turns a small file into the expected input_ids / loss_mask rows."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from eagle_extract.data.formats import DataError
from eagle_extract.data.samples import load_samples, tokenize_conversation

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def expected(tokenizer):
    return tokenize_conversation(tokenizer, CONVERSATION)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_sample(path, tokenizer, **options):
    samples, report = load_samples(path, tokenizer, 512, **options)
    assert len(samples) == 1 and not report.skipped, report
    return samples[0].input_ids, samples[0].loss_mask


@pytest.mark.parametrize(
    "row",
    [
        {"messages": CONVERSATION},
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Capital of France?"},
                {"from": "gpt", "value": "Paris."},
            ]
        },
        {"conversations": CONVERSATION},  # speculators' own spelling: role/content turns under 'conversations'
        {"system": "Be brief.", "instruction": "Capital of France?", "output": "Paris."},
    ],
    ids=["messages", "sharegpt", "conversations-role-content", "alpaca"],
)
def test_conversation_formats_give_the_same_row(tmp_path, tokenizer, expected, row):
    assert one_sample(write_jsonl(tmp_path / "d.jsonl", [row]), tokenizer) == expected


def test_alpaca_input_joins_the_instruction(tmp_path, tokenizer):
    row = {"instruction": "Translate.", "input": "chat", "output": "cat"}
    want = tokenize_conversation(
        tokenizer, [{"role": "user", "content": "Translate.\n\nchat"}, {"role": "assistant", "content": "cat"}]
    )
    assert one_sample(write_jsonl(tmp_path / "a.jsonl", [row]), tokenizer) == want


def test_pretokenized_rows_pass_unchanged(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}])
    assert one_sample(path, tokenizer) == ([5, 6, 7, 8], [0, 0, 1, 1])
    path = write_jsonl(tmp_path / "t2.jsonl", [{"input_ids": [5, 6, 7]}])
    assert one_sample(path, tokenizer) == ([5, 6, 7], [1, 1, 1])
    path = write_jsonl(tmp_path / "t3.jsonl", [{"input_ids": [5, 10**7]}])
    samples_or_error = pytest.raises(DataError, match="outside the model's vocabulary")
    with samples_or_error:
        load_samples(path, tokenizer, 512)


def test_text_rows_train_on_every_token(tmp_path, tokenizer):
    ids, mask = one_sample(write_jsonl(tmp_path / "x.jsonl", [{"text": "Plain text, no template."}]), tokenizer)
    assert ids == tokenizer("Plain text, no template.")["input_ids"] and mask == [1] * len(ids)


def test_questions_need_regenerate(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "turns": ["Why?", "And then?"]}])
    with pytest.raises(DataError, match="no assistant turn; pass --regenerate"):
        load_samples(path, tokenizer, 512)


def test_forced_format_rejects_other_rows(tmp_path, tokenizer, expected):
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONVERSATION}, {"text": "hello"}])
    samples, report = load_samples(path, tokenizer, 512, data_format="messages")
    assert [s.input_ids for s in samples] == [expected[0]]
    assert report.skipped == [(1, "row has no 'messages' (--data-format messages; keys: text)")]


def test_saved_dataset_folder(tmp_path, tokenizer, expected):
    from datasets import Dataset, DatasetDict

    Dataset.from_list([{"messages": CONVERSATION}]).save_to_disk(str(tmp_path / "flat"))
    assert one_sample(tmp_path / "flat", tokenizer) == expected
    DatasetDict({"train": Dataset.from_list([{"text": "abc"}])}).save_to_disk(str(tmp_path / "split"))
    ids, mask = one_sample(tmp_path / "split", tokenizer)
    assert ids == tokenizer("abc")["input_ids"]


def test_speculators_prepare_data_folder_is_reused_unchanged(tmp_path, tokenizer, smollm2):
    """speculators' own prepare-data (pre-tokenized input needs no render server) writes the folder."""
    from speculators.cli.prepare_data import prepare_data

    rows = [
        {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [9, 8, 7], "loss_mask": [0, 1, 1]},
    ]
    src = write_jsonl(tmp_path / "pre.jsonl", rows)
    prepare_data(model=str(smollm2), data=[str(src)], output=str(tmp_path / "prepared"), num_preprocessing_workers=1)
    samples, report = load_samples(tmp_path / "prepared", tokenizer, 512)
    assert [(s.input_ids, s.loss_mask) for s in samples] == [(r["input_ids"], r["loss_mask"]) for r in rows]


def test_the_cli_offers_every_row_format_the_reader_knows():
    """config.FORMATS (the --data-format choices) is kept apart from the reader's table, which the base layer
    may not import: the two must name the same formats."""
    from eagle_extract.config import FORMATS
    from eagle_extract.data.formats import _KEYS

    assert FORMATS[0] == "auto" and set(FORMATS[1:]) == set(_KEYS)
