"""scripts/offline_wheels.py: wheels in pieces under a size limit, back together, checked against a lock."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "offline_wheels", Path(__file__).parents[1] / "scripts" / "offline_wheels.py"
)
offline_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(offline_wheels)


@pytest.fixture
def wheels(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    lock = []
    for name, size in [
        ("big-1.0-py3-none-any.whl", 2_600_000),
        ("mid-1.0-py3-none-any.whl", 700_000),
        ("small-1.0-py3-none-any.whl", 90_000),
    ]:
        data = os.urandom(size)
        (folder / name).write_bytes(data)
        lock.append(f"{name.split('-')[0]}==1.0 --hash=sha256:{hashlib.sha256(data).hexdigest()}  # {name}")
    (tmp_path / "lock").write_text("\n".join(lock) + "\n")
    return folder, tmp_path / "lock"


def test_split_respects_the_limit_and_join_restores_every_byte(tmp_path, wheels):
    folder, lock = wheels
    made = offline_wheels.split(folder, tmp_path / "pieces", max_mib=1)
    assert all(sum(p.stat().st_size for p in d.iterdir()) <= 2**20 for d in made)
    assert len(made) == 4  # the 2.6 MB wheel in 3 pieces; the small wheel fits beside its last piece
    joined = offline_wheels.join(tmp_path / "pieces", tmp_path / "joined", lock)
    for path in joined:
        assert path.read_bytes() == (folder / path.name).read_bytes()


def test_missing_or_damaged_piece_is_named(tmp_path, wheels):
    folder, lock = wheels
    made = offline_wheels.split(folder, tmp_path / "pieces", max_mib=1)
    piece = next(p for d in made for p in d.iterdir() if p.name.endswith(".001"))
    data = piece.read_bytes()
    piece.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(SystemExit, match="big-1.0-py3-none-any.whl: sha256 differs from the lock"):
        offline_wheels.join(tmp_path / "pieces", tmp_path / "j1", lock)
    piece.unlink()
    with pytest.raises(SystemExit, match=r"big-1.0-py3-none-any.whl: piece\(s\) \[1\] missing"):
        offline_wheels.join(tmp_path / "pieces", tmp_path / "j2", lock)


def test_join_takes_only_the_locked_wheels(tmp_path, wheels):
    """One carry can hold two sets: a cut wheel of the other set (here, piece 1 of 3 missing) must not stop
    this lock's join, and nothing of it is copied out."""
    folder, lock = wheels
    other = tmp_path / "other"
    other.mkdir()
    (other / "otherbig-2.0-py3-none-any.whl").write_bytes(os.urandom(2_600_000))
    offline_wheels.split(folder, tmp_path / "pieces", max_mib=1)
    extra = offline_wheels.split(other, tmp_path / "extra", max_mib=1)
    for k, d in enumerate(extra, start=1):
        for p in d.iterdir():
            if not p.name.endswith(".001"):
                (tmp_path / "pieces" / f"p{k + 10}").mkdir(exist_ok=True)
                p.rename(tmp_path / "pieces" / f"p{k + 10}" / p.name)
    joined = offline_wheels.join(tmp_path / "pieces", tmp_path / "joined", lock)
    assert sorted(p.name for p in (tmp_path / "joined").iterdir()) == sorted(p.name for p in joined)
    assert len(joined) == 3
    (tmp_path / "otherlock").write_text(f"otherbig==2.0 --hash=sha256:{'0' * 64}  # otherbig-2.0-py3-none-any.whl\n")
    with pytest.raises(SystemExit, match=r"otherbig-2.0-py3-none-any.whl: piece\(s\) \[1\] missing"):
        offline_wheels.join(tmp_path / "pieces", tmp_path / "j2", tmp_path / "otherlock")


def test_a_wheel_cut_by_two_splits_is_named_unless_it_is_already_whole(tmp_path, wheels):
    folder, lock = wheels
    offline_wheels.split(folder, tmp_path / "a", max_mib=1)
    offline_wheels.split(folder, tmp_path / "b", max_mib=1.5)
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    for k, d in enumerate([*sorted((tmp_path / "a").iterdir()), *sorted((tmp_path / "b").iterdir())], start=1):
        d.rename(pieces / f"p{k}")
    twice = r"big-1.0-py3-none-any.whl: pieces of two splits \(big-1.0-py3-none-any.whl.00"
    with pytest.raises(SystemExit, match=twice):
        offline_wheels.join(pieces, tmp_path / "j1", lock)
    (tmp_path / "j2").mkdir()
    (tmp_path / "j2" / "big-1.0-py3-none-any.whl").write_bytes((folder / "big-1.0-py3-none-any.whl").read_bytes())
    joined = offline_wheels.join(pieces, tmp_path / "j2", lock)  # an earlier join left it whole: nothing to cut
    assert all(path.read_bytes() == (folder / path.name).read_bytes() for path in joined)


def test_a_build_tagged_wheel_is_read_from_the_lock_cut_and_joined(tmp_path):
    """vLLM 0.21.0's GPU wheel carries a build tag (NAME-VERSION-BUILD-...): the lock's comment names it,
    and its pieces join back under that name."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    name = "vllm-0.21.0-1-cp38-abi3-manylinux_2_24_x86_64.whl"
    data = os.urandom(2_300_000)
    (folder / name).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    (tmp_path / "lock").write_text(f"vllm==0.21.0 --hash=sha256:{digest}  # {name}\n")
    assert offline_wheels.locked_hashes(tmp_path / "lock") == {name: digest}
    offline_wheels.split(folder, tmp_path / "pieces", max_mib=1)
    assert sorted(p.name for p in (tmp_path / "pieces").glob("p*/*")) == [f"{name}.{n:03d}" for n in range(3)]
    [joined] = offline_wheels.join(tmp_path / "pieces", tmp_path / "joined", tmp_path / "lock")
    assert joined.read_bytes() == data


def test_download_names_every_manylinux_level_a_locked_wheel_uses(monkeypatch, tmp_path):
    """pip matches manylinux_2_N only when N is named: vLLM 0.20.2's wheel is manylinux_2_35, NCCL 2.30.7's
    manylinux_2_18."""
    seen = {}
    monkeypatch.setattr(offline_wheels.subprocess, "run", lambda cmd, check: seen.setdefault("cmd", cmd))
    offline_wheels.download(tmp_path / "lock", tmp_path / "wheels")
    platforms = {seen["cmd"][i + 1] for i, arg in enumerate(seen["cmd"]) if arg == "--platform"}
    wanted = {"manylinux_2_18_x86_64", "manylinux_2_24_x86_64", "manylinux_2_35_x86_64", "manylinux2014_x86_64"}
    assert wanted <= platforms
