"""The real consumer reads our output: speculators 0.9's own dataset loader and vocabulary builder."""

from __future__ import annotations

import torch
from datasets import load_from_disk

from .common import load_row


def test_speculators_arrow_dataset_reads_every_sample(smollm2_fp32_out):
    from speculators.train.data import ArrowDataset

    dataset = ArrowDataset(max_len=4096, datapath=str(smollm2_fp32_out), on_missing="raise")
    rows = load_from_disk(str(smollm2_fp32_out))
    assert len(dataset) == len(rows)
    for i in range(len(dataset)):
        item = dataset[i]
        ours = load_row(smollm2_fp32_out, i)["hidden_states"]
        assert torch.equal(item["hidden_states"], ours[:, :-1].flatten(1))  # auxiliary slots, [T, K-1 * H]
        assert torch.equal(item["verifier_last_hidden_states"], ours[:, -1])  # final slot, before the norm
        assert torch.equal(item["input_ids"], rows[i]["input_ids"])
        assert torch.equal(item["loss_mask"], rows[i]["loss_mask"])


def test_speculators_builds_its_draft_vocabulary_from_token_freq(smollm2_fp32_out):
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    freq = torch.load(smollm2_fp32_out / "token_freq.pt", weights_only=True)  # the trainer's own load
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size=64, target_vocab_size=49152)
    assert d2t.shape == (64,) and t2d.shape == (49152,) and int(t2d.sum()) == 64
    most_common = sorted(freq, key=lambda t: -freq[t])[:10]
    assert all(t2d[t] for t in most_common)  # the draft vocabulary keeps the assistant's frequent tokens
