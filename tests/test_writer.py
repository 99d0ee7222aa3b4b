"""The file contract at its edges: atomic rename, full disk, background errors."""

from __future__ import annotations

import errno

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eagle_extract import writer
from eagle_extract.writer import (
    BackgroundWriter,
    hidden_state_path,
    write_hidden_states,
)


def test_file_round_trip(tmp_path):
    (tmp_path / "hidden_states").mkdir()
    hidden = torch.randn(5, 4, 8, dtype=torch.bfloat16)
    write_hidden_states(tmp_path, 3, hidden, [1, 2, 3, 4, 5])
    got = load_file(str(hidden_state_path(tmp_path, 3)))
    assert torch.equal(got["hidden_states"], hidden)
    assert got["token_ids"].dtype == torch.int64 and got["token_ids"].tolist() == [1, 2, 3, 4, 5]
    assert [p.name for p in (tmp_path / "hidden_states").iterdir()] == ["hs_3.safetensors"]


def _disk_full(tensors, filename, metadata=None):
    with open(filename, "wb") as f:
        f.write(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")


def _safetensors_disk_full(tensors, filename, metadata=None):
    with open(filename, "wb") as f:
        f.write(b"partial")
    # what safetensors 0.8 raises on a full disk (seen in the full-disk test): no errno, only text
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("failing_save", [_disk_full, _safetensors_disk_full])
def test_full_disk_leaves_no_file_and_names_the_fix(tmp_path, monkeypatch, failing_save):
    (tmp_path / "hidden_states").mkdir()
    monkeypatch.setattr(writer, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full .* free space and rerun") as err:
        write_hidden_states(tmp_path, 0, torch.zeros(2, 2, 2), [1, 2])
    assert "\n" not in str(err.value)
    assert list((tmp_path / "hidden_states").iterdir()) == []


def test_background_writer_reports_failures_and_stops_writing(tmp_path, monkeypatch):
    bg = BackgroundWriter(tmp_path, threads=1)
    bg.submit(0, torch.zeros(2, 2, 2), [1, 2])
    first = bg.drain()
    assert first["written"] == [0] and first["errors"] == []
    monkeypatch.setattr(writer, "save_file", _disk_full)
    bg.submit(1, torch.zeros(2, 2, 2), [1, 2])
    bg.submit(2, torch.zeros(2, 2, 2), [1, 2])
    report = bg.drain()
    bg.close()
    assert report["written"] == [] and len(report["errors"]) == 1 and "row 1: disk full" in report["errors"][0]
    assert sorted(p.name for p in (tmp_path / "hidden_states").iterdir()) == ["hs_0.safetensors"]
