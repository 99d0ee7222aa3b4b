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


def test_fp8_output_reads_through_speculators_fp8_reader(tiny_fp8_out, tiny_tp1_out):
    from hs_connectors.transfer import FP8Transfer
    from speculators.train.data import ArrowDataset

    from eagle_extract import verify

    assert verify(tiny_fp8_out).problems == []
    reader = FP8Transfer(tiny_fp8_out / "hidden_states", dequantize_dtype=torch.float32)
    rows = load_from_disk(str(tiny_fp8_out))
    worst, fp8_bytes, full_bytes = 0.0, 0, 0
    for i in range(len(rows)):
        raw = load_row(tiny_fp8_out, i)
        assert raw["hidden_states"].dtype == torch.float8_e4m3fn and raw["hidden_states_scales"].shape[1:] == (1, 1)
        decoded = reader.get_cached(i)["hidden_states"]
        exact = load_row(tiny_tp1_out, i)["hidden_states"]
        worst = max(worst, float((decoded - exact).norm() / exact.norm()))
        fp8_bytes += (tiny_fp8_out / "hidden_states" / f"hs_{i}.safetensors").stat().st_size
        full_bytes += (tiny_tp1_out / "hidden_states" / f"hs_{i}.safetensors").stat().st_size
    print(
        f"fp8 decoded vs float32 capture: worst sample relative error {worst:.2e}; bytes {fp8_bytes / full_bytes:.3f}x"
    )
    assert worst < 0.05  # e4m3 keeps 3 mantissa bits: at most 1/16 per element
    assert fp8_bytes < 0.3 * full_bytes  # 1 byte per value instead of 4 (float32 model), plus one scale per token
    item = ArrowDataset(max_len=4096, datapath=str(tiny_fp8_out), on_missing="raise", transfer=reader)[0]
    assert item["hidden_states"].dtype == torch.float32 and torch.equal(item["loss_mask"], rows[0]["loss_mask"])
