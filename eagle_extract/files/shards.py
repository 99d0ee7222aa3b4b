"""Several jobs writing one output folder: machines, scheduler array tasks, or `--dp` replicas.

Shard k of N takes the rows whose source row number is k modulo N, and tokenizes only those (the
source is still read past the others; with --max-samples, every row up to the cut is tokenized, to
count them).  Since a row's dataset index
depends on how many rows before it are usable, which no shard knows, a shard names each row's file
by its source row, in `.eagle_extract_rows/`; at completion every file is renamed to its dataset
index, so N shards equal one run file for file.  A finished shard leaves `shards/{k}-of-{N}.json`;
whoever finds all N there first completes the dataset, under a lock file so that only one does.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..atomic import read_record, write_record
from ..errors import ExtractError

SHARDS_DIR = "shards"
ROWS_DIR = ".eagle_extract_rows"  # the shards' row files, each named by its source row until completion
COMPLETING = ".completing"  # lock: one job writes the dataset files
_SPEC = re.compile(r"^(\d+)/(\d+)$")


class ShardError(ExtractError, ValueError):
    """A bad --shard value or an output whose shards do not fit together; one line."""


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'I/N' -> (I, N), 0 <= I < N."""
    if text is None:
        return None
    m = _SPEC.match(text.strip())
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise ShardError(f"--shard {text}: expected I/N with 0 <= I < N, e.g. --shard 0/4 ... --shard 3/4")
    return int(m.group(1)), int(m.group(2))


def shard_name(shard: tuple[int, int]) -> str:
    return f"{shard[0]}-of-{shard[1]}"


def rows_folder(output: Path, shard: tuple[int, int] | None) -> Path:
    """Where a job writes its row files (`hidden_states/`, or legacy `data_*.pt`): the output itself unless
    sharded."""
    return Path(output) if shard is None else Path(output) / ROWS_DIR


def owns(shard: tuple[int, int] | None, source_row: int) -> bool:
    return shard is None or source_row % shard[1] == shard[0]


def record_finished(output: Path, shard: tuple[int, int], summary: dict) -> None:
    folder = Path(output) / SHARDS_DIR
    folder.mkdir(exist_ok=True)
    write_record(folder / f"{shard_name(shard)}.json", summary)


def finished(output: Path, num_shards: int) -> dict[int, dict]:
    folder = Path(output) / SHARDS_DIR
    found = {}
    for k in range(num_shards):
        path = folder / f"{shard_name((k, num_shards))}.json"
        if path.is_file():
            found[k] = read_record(path, _rerun_shard(k, num_shards))
    return found


def _rerun_shard(k: int, num_shards: int) -> str:
    return f"delete it and rerun that shard's job (--shard {k}/{num_shards}): its rows are kept"


def any_summary(output: Path) -> dict | None:
    folder = Path(output) / SHARDS_DIR
    paths = sorted(folder.glob("*-of-*.json")) if folder.is_dir() else []
    named = [(p, m) for p in paths if (m := re.fullmatch(r"(\d+)-of-(\d+)", p.stem))]
    if not named:
        return None
    path, m = named[0]
    return read_record(path, _rerun_shard(int(m.group(1)), int(m.group(2))))


def claim_completion(output: Path) -> bool:
    """True for exactly one caller: the one that creates the lock file."""
    try:
        os.close(os.open(Path(output) / COMPLETING, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def release_completion(output: Path) -> None:
    (Path(output) / COMPLETING).unlink(missing_ok=True)
