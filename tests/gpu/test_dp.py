"""--dp 2 (one replica per GPU) against one engine, float32."""

from __future__ import annotations

import pytest
import torch

from ..common import load_row, rel_err
from ..conftest import BUDGET
from .runs import TWO_GPUS, extracted, manifest

pytestmark = [pytest.mark.gpu, TWO_GPUS]


def test_dp2_equals_one_engine(smollm2, mixed_conversations, work, record):
    """Two replicas, one on each GPU (their shard logs say which), give the one engine's rows within 1e-5
    and the same token ids: splitting the data changes nothing but the batches."""
    args = ("--dtype", "float32", *BUDGET)
    one = extracted(smollm2, mixed_conversations, work / "dp1", *args, gpus="0,1")
    two = extracted(smollm2, mixed_conversations, work / "dp2", *args, "--dp", "2", gpus="0,1")
    record("timing_one_engine", manifest(one)["timing"])
    record("timing_dp2", manifest(two)["timing"])
    logs = " | ".join((two / "shards" / f"{k}-of-2.log").read_text().splitlines()[0] for k in range(2))
    pairs = [(load_row(two, i), load_row(one, i)) for i in range(manifest(one)["num_samples"])]
    worst = max(rel_err(a["hidden_states"], b["hidden_states"]) for a, b in pairs)
    ids = all(torch.equal(a["token_ids"], b["token_ids"]) for a, b in pairs)
    record("worst_sample", worst)
    record("token_files_equal", ids)
    record("shard_logs", logs)
    assert worst < 1e-5 and ids and "GPUs 0" in logs and "GPUs 1" in logs, (
        f"worst sample rel err {worst:.1e}; token files equal {ids}; {logs}"
    )
