"""Move a wheel folder to an air-gapped machine in pieces no larger than a transfer limit.

    python scripts/offline_wheels.py download gpu/requirements-gpu.lock WHEELS   # here (network)
    python scripts/offline_wheels.py split WHEELS PIECES                       # here, 57 MiB each
    ... carry PIECES/p1, PIECES/p2, ... one at a time ...
    python scripts/offline_wheels.py join PIECES WHEELS --lock gpu/requirements-gpu.lock   # there
    python3 -m pip install --no-index --no-deps --require-hashes --find-links WHEELS \\
        --target SITE -r gpu/requirements-gpu.lock                                        # there

`split` packs whole wheels into folders p1, p2, ... of at most --max-mib each and cuts wheels
larger than that into numbered pieces. `join` puts the wheels back together and checks each one
against the lock file's sha256 before pip checks them again, so a missing or damaged piece is
named in one line.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

PIECE = re.compile(r"^(?P<wheel>.+\.whl)\.(?P<n>\d{3})$")


def locked_hashes(lock: Path) -> dict[str, str]:
    """{wheel file name: sha256} from the lock file's trailing '# file' comments."""
    found = {}
    for line in lock.read_text().splitlines():
        m = re.search(r"--hash=sha256:([0-9a-f]{64})\s+#\s+(\S+\.whl)", line)
        if m:
            found[m.group(2)] = m.group(1)
    return found


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(lock: Path, wheels: Path) -> None:
    """Fetch the locked wheels for CPython 3.12 on x86-64 Linux.

    pip matches a manylinux_2_N tag only when N is named, so every N from 17 to 39 is: vLLM 0.20.2's
    GPU wheel is manylinux_2_35 and nvidia-nccl-cu13 2.30.7's manylinux_2_18. The lock's hashes pick
    the files, so the wide list fetches nothing else; pip on the GPU machine refuses a wheel whose
    glibc is newer than its own."""
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64"]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--require-hashes",
        "-d",
        str(wheels),
        "-r",
        str(lock),
    ]
    for p in platforms:
        cmd += ["--platform", p]
    subprocess.run(cmd, check=True)


def split(wheels: Path, out: Path, max_mib: float) -> list[Path]:
    """Pack the wheels into out/p1, out/p2, ... each holding at most max_mib MiB."""
    limit = int(max_mib * 2**20)
    items: list[tuple[str, Path, int, int]] = []  # (name in folder, source, offset, length)
    for wheel in sorted(wheels.glob("*.whl"), key=lambda p: -p.stat().st_size):
        size = wheel.stat().st_size
        if size <= limit:
            items.append((wheel.name, wheel, 0, size))
        else:
            for n, offset in enumerate(range(0, size, limit)):
                items.append((f"{wheel.name}.{n:03d}", wheel, offset, min(limit, size - offset)))
    folders: list[list] = []
    for item in items:  # first fit, largest first
        home = next((f for f in folders if sum(i[3] for i in f) + item[3] <= limit), None)
        if home is None:
            folders.append(home := [])
        home.append(item)
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for k, folder in enumerate(folders, start=1):
        target = out / f"p{k}"
        target.mkdir(exist_ok=True)
        for name, src, offset, length in folder:
            with open(src, "rb") as f, open(target / name, "wb") as g:
                f.seek(offset)
                g.write(f.read(length))
        made.append(target)
    return made


def join(pieces: Path, out: Path, lock: Path) -> list[Path]:
    """Reassemble the lock's wheels from pieces/p*/ into out/ and check them there; returns those.

    Pieces of wheels the lock does not name are left alone, so one carry can hold several sets."""
    out.mkdir(parents=True, exist_ok=True)
    expected = locked_hashes(lock)
    parts: dict[str, list[Path]] = {}
    for path in sorted(pieces.glob("p*/*")):
        m = PIECE.match(path.name)
        if m and m.group("wheel") in expected:
            parts.setdefault(m.group("wheel"), []).append(path)
        elif path.name in expected:
            shutil.copyfile(path, out / path.name)
    for wheel, chunks in parts.items():
        if (out / wheel).exists() and sha256(out / wheel) == expected[wheel]:
            continue  # carried whole too, or joined by an earlier call
        chunks.sort(key=lambda p: PIECE.match(p.name).group("n"))
        numbers = [int(PIECE.match(p.name).group("n")) for p in chunks]
        twice = next((p for p, n, m in zip(chunks[1:], numbers[1:], numbers) if n == m), None)
        if twice is not None:
            raise SystemExit(
                f"{wheel}: pieces of two splits ({twice.name} more than once); carry one split's p* folders"
            )
        if numbers != list(range(len(numbers))):
            missing = sorted(set(range(max(numbers) + 1)) - set(numbers))
            raise SystemExit(f"{wheel}: piece(s) {missing} missing; carry every p* folder, then join again")
        with open(out / wheel, "wb") as g:
            for chunk in chunks:
                g.write(chunk.read_bytes())
    absent = sorted(set(expected) - {p.name for p in out.glob("*.whl")})
    if absent:
        raise SystemExit(f"{len(absent)} locked wheel(s) missing, first {absent[0]}; carry every p* folder")
    for name, digest in expected.items():
        if sha256(out / name) != digest:
            raise SystemExit(f"{name}: sha256 differs from the lock (a damaged or incomplete piece); carry it again")
    return sorted(out / name for name in expected)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download")
    d.add_argument("lock", type=Path)
    d.add_argument("wheels", type=Path)
    s = sub.add_parser("split")
    s.add_argument("wheels", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--max-mib", type=float, default=57, help="57 MiB is under 60 MB")
    j = sub.add_parser("join")
    j.add_argument("pieces", type=Path)
    j.add_argument("out", type=Path)
    j.add_argument("--lock", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "download":
        download(args.lock, args.wheels)
    elif args.cmd == "split":
        for folder in split(args.wheels, args.out, args.max_mib):
            print(f"{folder}: {sum(p.stat().st_size for p in folder.iterdir()) / 2**20:.1f} MiB")
    else:
        print(f"{len(join(args.pieces, args.out, args.lock))} locked wheels joined and checked against {args.lock}")


if __name__ == "__main__":
    main()
