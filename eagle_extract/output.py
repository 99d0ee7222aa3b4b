"""The output folder's life, from preparing it to completing it.

Whose it is, resuming into it, sweeping what a dead run left, completing it (the Arrow rows,
token_freq.pt and, last, the manifest), merging shards and reopening it for a repair.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from . import shards
from .atomic import write_atomically, write_json
from .config import LEGACY, ExtractConfig
from .data import LoadReport, Sample
from .errors import ExtractError
from .layers import CONVENTION, legacy_layer_ids
from .plan import Plan, make_plan, plan_samples
from .stages import PARTS_DIR
from .version import __version__
from .writer import (
    HIDDEN_DIR,
    MANIFEST,
    completed_rows,
    hidden_state_path,
    read_manifest,
    write_dataset,
    write_manifest,
)

RUN_FILE = ".eagle_extract_run.json"  # identity of an unfinished run, for resuming
SKIPPED = "skipped_rows.jsonl"


def run_file(shard: tuple[int, int] | None) -> str:
    return RUN_FILE if shard is None else f".eagle_extract_run.{shards.shard_name(shard)}.json"


def _other_identities(output: Path, own: Path) -> list[dict]:
    """Identities recorded by the other jobs (shards) writing into `output`."""
    found = [json.loads(f.read_text()) for f in output.glob(".eagle_extract_run*.json") if f != own]
    folder = output / shards.SHARDS_DIR
    if folder.is_dir():
        found += [json.loads(f.read_text())["identity"] for f in folder.glob("*-of-*.json")]
    return found


def _sweep(output: Path, rows: set[int] | None) -> None:
    """Delete the half-written files of `rows` (all rows when None) that a dead run left; other shards'
    files in flight stay.  --pp stages' part files are always rewritten."""
    stale_files = list((output / HIDDEN_DIR).glob(".*.tmp")) + list(output.glob(".data_*.pt.tmp"))
    stale_files += (output / PARTS_DIR).glob(f"*/{HIDDEN_DIR}/*")
    for stale in stale_files:
        index = re.fullmatch(r"\.?(?:hs_|data_)(\d+)\.(?:safetensors|pt)(?:\.tmp)?", stale.name)
        if rows is None or (index and int(index.group(1)) in rows):
            stale.unlink(missing_ok=True)


def prepare_output(
    output: Path, identity: dict, overwrite: bool, shard: tuple[int, int] | None = None, rows: set[int] | None = None
) -> set[int]:
    """Make `output` ready; returns the rows (of `rows`, default all) an identical run already wrote."""
    own = output / run_file(shard)
    if output.is_dir() and any(output.iterdir()):
        ours = (output / MANIFEST).exists() or any(output.glob(".eagle_extract_run*.json"))
        if not ours and not (output / shards.SHARDS_DIR).is_dir():
            raise ExtractError(
                f"--output {output} holds files that are not an eagle-extract output; choose an empty folder"
            )
        if overwrite:
            shutil.rmtree(output)
        elif (output / MANIFEST).exists():
            raise ExtractError(f"--output {output} already holds a complete extraction; pass --overwrite to replace it")
        else:
            recorded = ([json.loads(own.read_text())] if own.exists() else []) + _other_identities(output, own)
            for previous in recorded:
                changed = [k for k in identity if previous.get(k) != identity[k]]
                if changed:
                    k = changed[0]
                    fix = "use the other shards' settings" if shard else "pass --overwrite to start over"
                    raise ExtractError(
                        f"--output {output} holds an unfinished run with a different {k} "
                        f"({previous.get(k)!r}, now {identity[k]!r}); {fix}"
                    )
            legacy = identity.get("format") == LEGACY
            done = completed_rows(output, legacy) if rows is None else completed_rows(output, legacy) & rows
            _sweep(output, rows)
            write_json(own, identity)
            return done
    output.mkdir(parents=True, exist_ok=True)
    write_json(own, identity)
    return set()


def finish_run(output: Path, shard: tuple[int, int] | None) -> None:
    """The run's own record goes: what is left is a complete output, or a finished shard's summary."""
    (output / run_file(shard)).unlink()


def _versions() -> dict:
    import torch
    import transformers
    import vllm

    return {
        "eagle_extract": __version__,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def complete(plan: Plan, samples: list[Sample], report: LoadReport, runs: list[dict], regenerated) -> dict:
    """Write the dataset files and, last, the manifest: the output now looks complete."""
    cfg, shape, output = plan.cfg, plan.shape, Path(plan.cfg.output)
    missing = sorted(set(range(len(samples))) - completed_rows(output, cfg.legacy))
    if missing:
        raise ExtractError(f"{len(missing)} rows have no hidden-state file (first: row {missing[0]}); rerun to finish")
    try:
        write_dataset(output, [s.input_ids for s in samples], [s.loss_mask for s in samples])
    except OSError as exc:
        raise ExtractError(f"writing the dataset files in {output}: {exc.strerror or exc}; rerun to finish") from None
    extract_s = max(r["extract_s"] for r in runs)
    manifest = {
        "format": LEGACY if cfg.legacy else "speculators-offline",
        "identity": plan.identity,
        "config": cfg.record(),
        "model": str(cfg.model),
        "aux_layer_ids": plan.aux_ids,
        "final_layer_id": shape.num_layers,
        "slot_layer_ids": plan.slot_ids,
        "layer_convention": CONVENTION,
        "legacy_layer_ids": legacy_layer_ids(plan.slot_ids) if cfg.legacy else None,
        "dtype": plan.dtype,
        "storage_dtype": "float8_e4m3fn" if cfg.fp8 else plan.dtype,
        "hidden_size": shape.hidden_size,
        "num_samples": len(samples),
        "num_tokens": sum(len(s.input_ids) for s in samples),
        "num_loss_tokens": sum(sum(s.loss_mask) for s in samples),
        "seq_length": cfg.seq_length,
        "truncated": report.truncated,
        "skipped": len(report.skipped),
        "skipped_long": report.skipped_long,
        "regenerated": regenerated,
        "source_rows": [s.row for s in samples],
        "data": {"path": str(cfg.data), "sha256": plan.identity["data_sha256"], "format": cfg.data_format},
        "tensor_parallel_size": cfg.tp,
        "pipeline_parallel_size": cfg.pp,
        "engine_args": cfg.engine_kwargs(),
        "shards": len(runs) if plan.shard else None,
        "resumed_rows": sum(r["resumed_rows"] for r in runs),
        "capture": runs[0]["capture"] if len(runs) == 1 else [r["capture"] for r in runs],
        "timing": {
            "engine_start_s": max(r["engine_start_s"] for r in runs),
            "extract_s": extract_s,
            "tokens_per_s": round(sum(r["tokens"] for r in runs) / extract_s, 1) if extract_s else 0.0,
        },
        "bytes_written": sum(hidden_state_path(output, i, cfg.legacy).stat().st_size for i in range(len(samples))),
        "versions": _versions(),
    }
    try:
        _write_skip_report(output, report)
        write_manifest(output, manifest)
    except OSError as exc:
        raise ExtractError(f"writing the manifest in {output}: {exc.strerror or exc}; rerun to finish") from None
    (output / shards.COMPLETING).unlink(missing_ok=True)
    return manifest


def _write_skip_report(output: Path, report: LoadReport) -> None:
    def save(tmp: Path) -> None:
        with open(tmp, "w") as f:
            for row, why in report.skipped:
                f.write(json.dumps({"row": row, "reason": why}) + "\n")

    if report.skipped:
        write_atomically(output / SKIPPED, save)


def complete_shard(plan: Plan, samples, report, summary: dict, log) -> dict:
    """Record a finished shard, and complete the dataset when every shard has finished and no other job
    is doing it; returns the manifest, or the shard's summary with "complete": False."""
    output, num = Path(plan.cfg.output), plan.shard[1]
    shards.record_finished(output, plan.shard, summary)
    finish_run(output, plan.shard)
    runs = shards.finished(output, num)
    if len(runs) < num or not shards.claim_completion(output):
        waiting = sorted(set(range(num)) - set(runs))
        log(f"shard {plan.cfg.shard} done; waiting for shard(s) {', '.join(f'{k}/{num}' for k in waiting) or 'none'}")
        return {**summary, "complete": False, "waiting_for": waiting}
    return complete(plan, samples, report, [runs[k] for k in range(num)], None)


def merge(output: Path) -> dict:
    """Complete a sharded output once every shard has finished (`eagle-extract merge`)."""
    output = Path(output)
    if (output / MANIFEST).exists():
        raise ExtractError(f"{output} is already complete; check it with `eagle-extract verify {output}`")
    summary = shards.any_summary(output)
    if summary is None:
        raise ExtractError(f"{output} holds no finished shard; run the shards (--shard I/N) first")
    num = shards.parse_shard(summary["shard"])[1]
    runs = shards.finished(output, num)
    missing = sorted(set(range(num)) - set(runs))
    if missing:
        names = ", ".join(f"{k}/{num}" for k in missing)
        raise ExtractError(
            f"shard(s) {names} of {output} have not finished; run them (--shard {missing[0]}/{num}), then merge again"
        )
    plan = make_plan(ExtractConfig.from_options(**{**summary["config"], "output": output}))
    samples, report = plan_samples(plan)
    (output / shards.COMPLETING).unlink(missing_ok=True)  # an earlier completer that died left its lock
    shards.claim_completion(output)
    return complete(plan, samples, report, [runs[k] for k in range(num)], None)


def reopen(output: Path, rows: list[int]) -> ExtractConfig:
    """Delete the given rows' files and make the output an unfinished run again; returns the recorded
    config, whose rerun rewrites just those rows."""
    output = Path(output)
    manifest = read_manifest(output)
    for i in rows:
        hidden_state_path(output, i, manifest["format"] == LEGACY).unlink(missing_ok=True)
    write_json(output / RUN_FILE, manifest["identity"])  # the output is an unfinished run again ...
    (output / MANIFEST).unlink()  # ... and no longer looks complete
    return ExtractConfig.from_options(**{**manifest["config"], "output": output, "shard": None})
