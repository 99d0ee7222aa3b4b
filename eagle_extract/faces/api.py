"""The public Python API: `extract` and `verify` (with `merge` and `repair`); the CLI is a thin shell over it.

    from eagle_extract import extract, verify
    summary = extract(model="/models/Kimi-K2.5", data="chats.jsonl", output="out/", layers="2,30,58", tp=8)
    report = verify("out/")

Every failure a user can fix is raised as `ExtractError`, with the one line the CLI prints.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..config import ExtractConfig
from ..errors import ExtractError
from ..files.checks import find_problems
from ..files.manifest import MANIFEST, Manifest, read_manifest
from ..job import completion
from ..job.lock import holding
from ..job.run import run


@dataclass(frozen=True)
class Summary:
    """What a run produced: the whole output (`complete`), or one shard of it waiting for the others."""

    output: Path
    complete: bool
    model: str
    rows: int
    tokens: int
    bytes_written: int | None  # None for one shard: the files are counted when the output completes
    engine_start_s: float
    extract_s: float
    tokens_per_s: float
    aux_layer_ids: list[int]
    legacy_layer_ids: list[int] | None = None
    truncated: int | None = None  # these three are the whole dataset's, known once it is complete
    skipped: int | None = None
    skipped_long: int | None = None
    shard: str | None = None
    resumed_rows: int = 0  # rows an interrupted run had written, kept
    redone_rows: int = 0  # kept rows whose file was damaged (a power cut), written again
    waiting_for: tuple[int, ...] = ()  # shards still running, for an incomplete output
    manifest: dict | None = None

    @property
    def skipped_rows(self) -> Path | None:
        """The file listing each skipped row and why, when rows were skipped."""
        return self.output / completion.SKIPPED if self.skipped else None

    @classmethod
    def of(cls, result: dict, output: Path) -> Summary:
        """From a manifest, or from a shard's summary (which has "complete": False)."""
        if result.get("complete") is False:
            config = result["config"]
            return cls(
                output=Path(output),
                complete=False,
                model=config["model"],
                rows=result["rows"],
                tokens=result["tokens"],
                bytes_written=None,
                engine_start_s=result["engine_start_s"],
                extract_s=result["extract_s"],
                tokens_per_s=round(result["tokens"] / result["extract_s"], 1) if result["extract_s"] else 0.0,
                aux_layer_ids=result["identity"]["aux_layer_ids"],
                shard=result["shard"],
                resumed_rows=result["resumed_rows"],
                redone_rows=result["redone_rows"],
                waiting_for=tuple(result["waiting_for"]),
            )
        m = Manifest.of(result)  # an earlier release's too: a rerun of a complete output returns its manifest
        return cls(
            output=Path(output),
            complete=True,
            model=m.model,
            rows=m.num_samples,
            tokens=m.num_tokens,
            bytes_written=m.bytes_written,
            engine_start_s=m.timing["engine_start_s"],
            extract_s=m.timing["extract_s"],
            tokens_per_s=m.timing["tokens_per_s"],
            aux_layer_ids=m.aux_layer_ids,
            legacy_layer_ids=m.legacy_layer_ids,
            truncated=m.truncated,
            skipped=m.skipped,
            skipped_long=m.skipped_long,
            resumed_rows=m.resumed_rows,
            redone_rows=m.redone_rows,
            manifest=result,
        )


@dataclass(frozen=True)
class Report:
    """`verify`'s findings: (row or None for the output as a whole, what is wrong)."""

    output: Path
    problems: list[tuple[int | None, str]]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def rows(self) -> list[int]:
        return sorted({row for row, _ in self.problems if row is not None})


def _refuse_spawned_child(call: str) -> None:
    """vLLM starts its engine processes by spawning, and a spawned process runs the caller's script's top level
    again (as `__mp_main__`): a call there without the main guard would run once more, inside the engine's
    process, and fail in its log.  It ends that process with one line instead."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            where = frame.f_globals.get("__file__") or "your script"
            raise SystemExit(
                f"Error: eagle_extract.{call}() ran again in a process vLLM started, which imports {where} anew: put "
                f"the call under `if __name__ == \"__main__\":`"
            )
        frame = frame.f_back


def extract(*, log=print, **options) -> Summary:
    """Run an extraction; keyword arguments are the CLI's options (`seq_length=4096` for `--seq-length 4096`),
    with its defaults.  Rerunning the same call after an interruption resumes it."""
    _refuse_spawned_child("extract")
    cfg = ExtractConfig.from_options(**options).resolved()
    if cfg.dp > 1:
        from ..job.replicas import run_replicas

        return Summary.of(run_replicas(cfg, log=log), cfg.output)
    return Summary.of(run(cfg, log=log), cfg.output)


def _folder(output) -> Path:
    if not isinstance(output, (str, os.PathLike)):
        raise ExtractError(f"output={output!r}: give the output folder as a str or a Path")
    if not str(output).strip():
        raise ExtractError(f"output={output!r}: an empty path; name the output folder")
    return Path(output)


def _rows_of(output: Path, rows) -> list[int]:
    """`repair`'s rows: dataset row indices the complete output has."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise ExtractError(f"rows={rows!r}: give the row indices to repair as a list of integers (verify's report "
                           "names them)")  # fmt: skip
    rows = list(rows)
    if not rows or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
        raise ExtractError(f"rows={rows!r}: give the row indices to repair as a non-empty list of integers")
    count = read_manifest(output).get("num_samples")
    outside = sorted({r for r in rows if isinstance(count, int) and not 0 <= r < count})
    if outside:
        raise ExtractError(f"rows {outside[:5]}{' ...' if len(outside) > 5 else ''}: {output} has rows 0 to "
                           f"{count - 1}; nothing was changed")  # fmt: skip
    return sorted(set(rows))


def verify(output, progress: bool = False) -> Report:
    """Check an output file by file; returns the findings, raises nothing for a damaged output."""
    return Report(_folder(output), find_problems(_folder(output), progress=progress))


def merge(output, log=print) -> Summary:
    """Complete a sharded output once every shard has finished (an output already complete is returned as it
    is)."""
    return Summary.of(completion.merge(_folder(output), log), output)


def repair(output, rows: list[int], log=print) -> Summary:
    """Delete the given rows' files and rerun the recorded extraction, which rewrites just those;
    raises when `verify` still finds problems afterwards."""
    _refuse_spawned_child("repair")
    output = _folder(output)
    if not (output / MANIFEST).exists():
        raise ExtractError("no manifest to repair from: rerun the original extraction command to resume it")
    rows = _rows_of(output, rows)
    log(f"repairing {len(rows)} row(s)")
    with holding(output):  # before a file is deleted; the run inside holds it on
        summary = Summary.of(run(completion.recorded_config(output), log=log, repair=rows), output)
    remaining = find_problems(output, progress=False)
    if remaining:
        raise ExtractError(f"{len(remaining)} problem(s) remain after repair; first: {remaining[0][1]}")
    return summary
