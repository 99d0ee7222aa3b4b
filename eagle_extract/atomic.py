"""Writing a file so that its final name only ever holds a whole one."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from .errors import ExtractError


def temporary_name(path: Path) -> Path:
    """Where `path` is written before the rename: a dot-name beside it (a resumed run sweeps the rows')."""
    return path.with_name(f".{path.name}.tmp")


def write_atomically(path: Path, save: Callable[[Path], None], nbytes: int = 0, durable: bool = False) -> None:
    """save(tmp) then rename over `path`; a failed save leaves nothing, and ENOSPC becomes one line.
    `durable` files are fsynced before the rename: their bytes are on the disk before their name is
    final, and the disk is kept writing while the run goes on instead of when the page cache fills."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        save(tmp)
        if durable:
            fsync(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, disk_full_message(path, nbytes)) from None
        raise


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data, durable: bool = False) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n"), durable=durable)


def write_record(path: Path, data) -> None:
    """A record a rerun or `merge` reads (the run file, a shard's finished record, the manifest): its bytes,
    then its name, on the disk before the run goes on, so a power cut leaves the old record or the new one."""
    write_json(path, data, durable=True)
    fsync(Path(path).parent)


def read_record(path: Path, fix: str) -> dict:
    """A record written by write_record, as a JSON object; an unreadable one (emptied by a filesystem that
    lost it, edited by hand) raises RecordError: one line naming `path`, then `fix`."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise RecordError(f"{path} is unreadable ({why}); {fix}") from None
    if not isinstance(record, dict):
        raise RecordError(f"{path} is unreadable (not a JSON object); {fix}")
    return record


class RecordError(ExtractError, ValueError):
    """An unreadable record: the line names the file and what to do."""


def disk_full_message(path: Path, nbytes: int) -> str:
    free = shutil.disk_usage(path.parent).free
    needed = f"{nbytes / 2**20:.1f} MiB needed, " if nbytes else ""
    return (
        f"disk full writing {path.name} ({needed}{free / 2**20:.1f} MiB free): "
        "free space and rerun the same command to resume"
    )
