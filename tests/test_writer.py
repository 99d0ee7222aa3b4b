"""The file contract at its edges: atomic rename, full disk, background errors."""

from __future__ import annotations

import errno
import json
import re
import weakref

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from eagle_extract.files import safetensors_stream, writer
from eagle_extract.files.rowfile import changed_since_written, checksum, hidden_state_path, legacy_tensors, read_row
from eagle_extract.files.writer import BackgroundWriter, write_hidden_states


def test_file_round_trip(tmp_path):
    (tmp_path / "hidden_states").mkdir()
    hidden = torch.randn(5, 4, 8, dtype=torch.bfloat16)
    write_hidden_states(tmp_path, 3, hidden, [1, 2, 3, 4, 5])
    got = load_file(str(hidden_state_path(tmp_path, 3)))
    assert torch.equal(got["hidden_states"], hidden)
    assert got["token_ids"].dtype == torch.int64 and got["token_ids"].tolist() == [1, 2, 3, 4, 5]
    assert [p.name for p in (tmp_path / "hidden_states").iterdir()] == ["hs_3.safetensors"]


ROW_TENSORS = {
    "bf16 row": {"hidden_states": torch.randn(5, 3, 7).to(torch.bfloat16), "token_ids": torch.arange(5)},
    "fp8 row": {
        "hidden_states": torch.randn(5, 3, 7).to(torch.float8_e4m3fn),
        "hidden_states_scales": torch.rand(5, 1, 1),
        "token_ids": torch.arange(5),
    },
    "no tokens": {"hidden_states": torch.zeros(0, 3, 7), "token_ids": torch.arange(0)},
    "every dtype": {
        name: torch.arange(3).to(dtype) for name, dtype in zip("abcdefghi", safetensors_stream.DTYPES)
    },
    "a scalar": {"x": torch.tensor(3.0)},
    "names against dtypes": {  # safetensors' order y, z, b, m, a: neither the names' order nor its reverse
        "z": torch.arange(3),
        "a": torch.tensor([True]),
        "m": torch.ones(2).half(),
        "b": torch.ones(3).bfloat16(),
        "y": torch.arange(2),
    },
}


@pytest.mark.parametrize("metadata", [None, {}, {"checksum": "xxh3_128:" + "0" * 32, "slot_layer_ids": "2,15,27,30"}])
@pytest.mark.parametrize("chunk", [5, 8 << 20])
@pytest.mark.parametrize("name", list(ROW_TENSORS))
def test_a_streamed_file_holds_what_safetensors_own_writer_writes(tmp_path, monkeypatch, name, chunk, metadata):
    """The same header (length, JSON) and data bytes as safetensors' save_file, in 5-byte chunks too; only
    the metadata's key order may differ, since safetensors' own order is not fixed.  (One metadata key, or
    none: then the files are equal byte for byte.)"""
    from safetensors import safe_open
    from safetensors.torch import save_file

    monkeypatch.setattr(safetensors_stream, "CHUNK", chunk)
    tensors = ROW_TENSORS[name]
    save_file(tensors, str(tmp_path / "theirs"), metadata=metadata)
    safetensors_stream.save(tmp_path / "ours", tensors, metadata, durable=True)
    theirs, ours = (tmp_path / "theirs").read_bytes(), (tmp_path / "ours").read_bytes()
    n = int.from_bytes(theirs[:8], "little")
    assert ours[:8] == theirs[:8] and json.loads(ours[8 : 8 + n]) == json.loads(theirs[8 : 8 + n])
    assert ours[8 + n :] == theirs[8 + n :]
    if len(metadata or {}) < 2:
        assert ours == theirs
    with safe_open(str(tmp_path / "ours"), "pt") as f:
        assert f.metadata() == metadata and sorted(f.keys()) == sorted(tensors)
        for key in tensors:
            got, put = (t.reshape(-1).view(torch.uint8) for t in (f.get_tensor(key), tensors[key]))
            assert f.get_slice(key).get_shape() == list(tensors[key].shape) and torch.equal(got, put)


def test_the_disk_is_started_on_whole_chunks_only_and_the_file_fsynced(tmp_path, monkeypatch):
    """Durable: every whole CHUNK of the file is handed to the disk once, in order, after it is written (a page
    still to be written never is), then the file is fsynced; not durable (the server's spool): neither."""
    import os

    real_range = safetensors_stream._sync_range
    if real_range is not None:  # the C library's call as declared: 0 on a real file
        with open(tmp_path / "probe", "wb") as f:
            f.write(b"x" * 8192)
            assert real_range(f.fileno(), 0, 8192, safetensors_stream.SYNC_FILE_RANGE_WRITE) == 0
    started, synced = [], []
    monkeypatch.setattr(safetensors_stream, "CHUNK", 64)

    def sync_range(fd, at, n, flags):  # only bytes already written: the file is at least this long
        assert at + n <= os.fstat(fd).st_size
        started.append((at, n, flags))

    monkeypatch.setattr(safetensors_stream, "_sync_range", sync_range)
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    tensors = {"hidden_states": torch.randn(7, 3, 5), "token_ids": torch.arange(7)}  # 420 + 56 bytes of data
    safetensors_stream.save(tmp_path / "row", tensors, {"k": "v"}, durable=True)
    size = (tmp_path / "row").stat().st_size
    assert [at for at, _, _ in started] == list(range(0, size // 64 * 64, 64)) and started
    assert {n for _, n, _ in started} == {64} and {f for _, _, f in started} == {2}
    assert len(synced) == 1
    started.clear(), synced.clear()
    (tmp_path / "hidden_states").mkdir()
    write_hidden_states(tmp_path, 0, torch.randn(7, 3, 5), list(range(7)), durable=False)
    assert started == [] and synced == []
    write_hidden_states(tmp_path, 1, torch.randn(7, 3, 5), list(range(7)))  # a dataset's row: one fsync, in save
    assert started and len(synced) == 1


@pytest.mark.parametrize(
    "tensor, said",
    [
        (torch.zeros(2, 2, dtype=torch.complex64), "states: dtype torch.complex64 has no safetensors name here"),
        (torch.zeros(4, 3).t(), "states: a contiguous host tensor is needed"),
    ],
)
def test_a_tensor_the_format_cannot_hold_is_named(tmp_path, tensor, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        safetensors_stream.save(tmp_path / "x", {"states": tensor}, None, durable=False)
    assert not (tmp_path / "x").exists()


def test_metadata_the_format_cannot_hold_is_refused_before_the_file_is_made(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="metadata values must be strings"):
        safetensors_stream.save(tmp_path / "x", {"s": torch.zeros(1)}, {"n": 3}, durable=False)
    monkeypatch.setattr(safetensors_stream, "MAX_HEADER", 64)
    with pytest.raises(ValueError, match="longer than its readers take"):
        safetensors_stream.save(tmp_path / "x", {"s": torch.zeros(1)}, {"k": "v" * 64}, durable=False)
    assert not (tmp_path / "x").exists()


def test_every_changed_data_byte_breaks_the_checksum(tmp_path):
    (tmp_path / "hidden_states").mkdir()
    write_hidden_states(tmp_path, 0, torch.randn(3, 2, 4).to(torch.bfloat16), [1, 2, 3], layer_ids=[2, 6])
    path = hidden_state_path(tmp_path, 0)
    tensors, meta = read_row(path)
    assert meta == {"slot_layer_ids": "2,6", "checksum": checksum(tensors, "2,6")}
    assert changed_since_written(tensors, meta) is None
    raw = path.read_bytes()
    data = 8 + int.from_bytes(raw[:8], "little")
    assert len(raw) - data == 3 * 2 * 4 * 2 + 3 * 8  # the data section: token_ids, then hidden_states
    for at in range(data, len(raw)):
        path.write_bytes(raw[:at] + bytes([raw[at] ^ 0x80]) + raw[at + 1 :])
        assert changed_since_written(*read_row(path)), at


def test_background_writer_records_the_layer_ids_in_both_formats(tmp_path):
    states = torch.randn(3, 3, 4).to(torch.bfloat16)
    bg = BackgroundWriter(tmp_path / "a", threads=2, layer_ids=[2, 5, 8])
    bg.submit(0, _rows(states), [1, 2, 3])
    assert bg.drain()["written"] == [0]
    bg.close()
    tensors, meta = read_row(hidden_state_path(tmp_path / "a", 0))
    assert meta["slot_layer_ids"] == "2,5,8" and changed_since_written(tensors, meta) is None
    bg = BackgroundWriter(tmp_path / "b", legacy=True, threads=1, layer_ids=[2, 5, 8])
    bg.expect_loss_masks([(0, [0, 1, 1])])
    bg.submit(0, _rows(states), [1, 2, 3])
    assert bg.drain()["written"] == [0]
    bg.close()
    sample = torch.load(hidden_state_path(tmp_path / "b", 0, legacy=True), weights_only=True)
    record = sample["eagle_extract"]  # speculators 0.3/0.4 take only input_ids, hidden_states and loss_mask
    assert record["slot_layer_ids"] == "2,5,8" and changed_since_written(legacy_tensors(sample), record) is None
    assert all(torch.equal(sample["hidden_states"][k], states[:, k]) for k in range(3))


def _disk_full(path, tensors, metadata, durable):
    with open(path, "wb") as f:
        f.write(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_leaves_no_file_and_names_the_fix(tmp_path, monkeypatch):
    (tmp_path / "hidden_states").mkdir()
    monkeypatch.setattr(safetensors_stream, "save", _disk_full)
    with pytest.raises(OSError, match="disk full .* free space and rerun") as err:
        write_hidden_states(tmp_path, 0, torch.zeros(2, 2, 2), [1, 2])
    assert "\n" not in str(err.value)
    assert list((tmp_path / "hidden_states").iterdir()) == []


def test_a_full_disk_under_torch_save_is_one_line_too(small_disk):
    """The legacy rows and token_freq.pt go through torch.save, which given a path reports a full disk as
    its own "unexpected pos"; a real full filesystem, no mock."""
    (small_disk / "hidden_states").mkdir()
    states = torch.zeros(300, 3, 4096)  # 14 MiB, twice: the second row does not fit in 16 MiB
    writer.write_legacy(small_disk, 0, states, list(range(300)), [1] * 300)
    with pytest.raises(OSError, match="disk full .* free space and rerun") as err:
        writer.write_legacy(small_disk, 1, states, list(range(300)), [1] * 300)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in small_disk.rglob("*")) == ["data_0.pt", "hidden_states"]  # nothing half-written
    with pytest.raises(OSError, match="disk full .* free space and rerun"):
        writer.write_dataset(small_disk, Dataset.from_dict({"input_ids": [[1]]}), {i: 1 for i in range(10**6)})
    assert not list(small_disk.glob("*token_freq*"))
    (small_disk / "data_0.pt").unlink()  # the dataset's own files do not fit either: datasets' own OSError
    before = sorted(small_disk.iterdir())
    with pytest.raises(OSError) as err:
        writer.write_dataset(small_disk, Dataset.from_dict({"input_ids": [list(range(1000))] * 6000}), {})
    assert err.value.errno == errno.ENOSPC and sorted(small_disk.iterdir()) == before  # its staging folder removed


def _rows(states):
    """A row as the capture hands it to the writer."""
    from eagle_extract.worker.hostmem import ByteBudget, Held, Rows

    return Rows(Held(ByteBudget(2**20), states.nbytes, states, None), 0, len(states))


def test_background_writer_reports_failures_and_stops_writing(tmp_path, monkeypatch):
    bg = BackgroundWriter(tmp_path, threads=1)
    bg.submit(0, _rows(torch.zeros(2, 2, 2)), [1, 2])
    first = bg.drain()
    assert first["written"] == [0] and first["errors"] == []
    monkeypatch.setattr(safetensors_stream, "save", _disk_full)
    bg.submit(1, _rows(torch.zeros(2, 2, 2)), [1, 2])
    bg.submit(2, _rows(torch.zeros(2, 2, 2)), [1, 2])
    report = bg.drain()
    bg.close()
    assert report["written"] == [] and len(report["errors"]) == 1 and "row 1: disk full" in report["errors"][0]
    assert sorted(p.name for p in (tmp_path / "hidden_states").iterdir()) == ["hs_0.safetensors"]


def test_an_output_folder_removed_mid_run_is_named_not_an_io_error(tmp_path):
    import shutil

    out = tmp_path / "out"
    bg = BackgroundWriter(out, threads=1)
    bg.submit(0, _rows(torch.zeros(2, 2, 2)), [1, 2])
    assert bg.drain()["written"] == [0]
    shutil.rmtree(out)
    bg.submit(1, _rows(torch.zeros(2, 2, 2)), [1, 2])
    report = bg.drain()
    bg.close()
    assert report["written"] == [] and len(report["errors"]) == 1
    assert report["errors"][0].startswith(f"{out / 'hidden_states'} disappeared while rows were being written")
    assert not out.exists()  # nothing made it again


def test_host_memory_is_bounded_in_bytes_and_given_back_when_rows_are_written(tmp_path, monkeypatch):
    """Steps take their bytes from the budget; the capture waits for room while rows are in flight,
    and every byte comes back once the writer has written (and dropped) the rows."""
    import threading

    from eagle_extract.worker.hostmem import ByteBudget, Held, Rows

    budget = ByteBudget(3000)
    gate = threading.Event()
    real = safetensors_stream.save
    monkeypatch.setattr(safetensors_stream, "save", lambda *a: (gate.wait(), real(*a)))  # a slow disk
    bg = BackgroundWriter(tmp_path, threads=1)
    for i in range(2):  # two "steps" of 1,000 bytes, one row each, handed to the writer
        budget.take(1000)
        step = Held(budget, 1000, torch.zeros(250, 1, 1), None)
        row = Rows(step, 0, 250)
        budget.count("rows", 1)
        weakref.finalize(row, budget.count, "rows", -1)
        bg.submit(i, row, list(range(250)))
        del step, row
    assert budget.used == 2000 and budget.rows == 2
    took = threading.Thread(target=budget.take, args=(1500,))  # a third step does not fit: it waits ...
    took.start()
    took.join(0.3)
    assert took.is_alive() and budget.waits == 1
    gate.set()  # ... until the disk has taken the rows
    took.join(5)
    assert not took.is_alive() and sorted(bg.drain()["written"]) == [0, 1]
    assert budget.used == 1500 and budget.rows == 0 and 2000 <= budget.peak <= budget.limit
    budget.give(1500)
    budget.take(10_000)  # nothing in flight frees room: a step larger than the budget is let through
    assert budget.used == 10_000 and budget.peak == 10_000


def test_a_drain_with_patience_returns_with_the_first_row_written_not_after_its_patience(tmp_path):
    """The server's look at an empty engine: `drain(False, patience)` waits for a row, and no longer than that."""
    import threading
    import time

    bg = BackgroundWriter(tmp_path, threads=1)
    t0 = time.monotonic()
    assert bg.drain(False, 0.2)["written"] == [] and 0.19 < time.monotonic() - t0 < 5  # nothing came: its patience
    threading.Timer(0.3, bg.submit, (0, _rows(torch.zeros(2, 2, 2)), [1, 2])).start()
    t0 = time.monotonic()
    assert bg.drain(False, 30.0)["written"] == [0] and time.monotonic() - t0 < 10  # the row, long before 30 s
    assert bg.drain(False, 0.0)["written"] == []  # no patience: no wait
    bg.close()
