"""Engine settings eagle-extract applies before vLLM starts (engine-free)."""

from __future__ import annotations

import os

from eagle_extract.engine import prepare_environment


def test_float32_asks_triton_for_ieee_float32_unless_set(monkeypatch):
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    prepare_environment(1, 1, "bfloat16")
    assert "TRITON_F32_DEFAULT" not in os.environ
    prepare_environment(1, 1, "float32")
    assert os.environ["TRITON_F32_DEFAULT"] == "ieee"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")
    prepare_environment(1, 1, "float32")
    assert os.environ["TRITON_F32_DEFAULT"] == "tf32"
