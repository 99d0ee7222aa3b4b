"""eagle-extract's rows against vLLM's own `extract_hidden_states` with `ExampleHiddenStatesConnector`."""

from __future__ import annotations

import sys

import pytest
import torch

from ..common import load_row, rel_err
from .runs import REPO, extracted, manifest

pytestmark = pytest.mark.gpu


def test_bf16_rows_equal_vllms_extract_hidden_states(smollm2, mixed_conversations, work, record):
    """SmolLM2 bf16, one request per generate call on both sides (a fixed batch, so fixed rounding), on the
    same token ids: bitwise equal, or the hooks read other states than vLLM's own path."""
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams, TokensPrompt

    sys.path.insert(0, str(REPO / "benchmarks"))
    from throughput import wait_for_files

    # each prompt in one step, as the connector (which refuses chunked prefill) runs it: a prompt split over
    # steps attends to its earlier chunks through the cache, which rounds differently in bf16
    ours = extracted(smollm2, mixed_conversations, work / "bf16-own", "--dtype", "bfloat16", "--batch-size", "1",
                     "--max-num-batched-tokens", "4096")  # fmt: skip
    info = manifest(ours)
    store = work / "builtin-store"
    store.mkdir(exist_ok=True)
    llm = LLM(
        model=str(smollm2),
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,  # the connector refuses chunked prefill
        max_model_len=info["seq_length"] + 1,
        gpu_memory_utilization=0.5,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": info["slot_layer_ids"]}},
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        },
    )
    equal, shapes, differ = 0, set(), []
    n = info["num_samples"]
    try:  # a failure must not leave the engine, held by its traceback, on the GPU for the next tests
        for i in range(n):
            row = load_row(ours, i)
            out = llm.generate([TokensPrompt(prompt_token_ids=row["token_ids"].tolist())],
                               SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)  # fmt: skip
            wait_for_files(out)
            theirs = load_file(out[0].kv_transfer_params["hidden_states_path"])
            got, want = row["hidden_states"], theirs["hidden_states"][: len(row["token_ids"])]
            shapes.add((tuple(got.shape), tuple(theirs["hidden_states"].shape)))
            same = got.shape == want.shape and torch.equal(got, want.to(got.dtype))
            equal += same
            if not same and got.shape == want.shape:
                differ.append(f"row {i} ({len(row['token_ids'])} tokens): rel err {rel_err(got, want):.1e}")
    finally:
        del llm
    record("rows", n)
    record("bitwise_equal", equal)
    record("shapes_ours_theirs", sorted(shapes)[:2])
    record("differ", differ)
    assert equal == n, f"{equal} of {n} rows bitwise equal; {'; '.join(differ)}"
