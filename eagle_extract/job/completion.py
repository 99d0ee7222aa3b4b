"""Completing an output: the dataset files, token_freq.pt and, last, the manifest; the shards' row files
renamed to their dataset indices; a finished shard recorded, and the shards merged by whoever finishes
last (or `merge`); and, for a repair, a complete output reopened as an unfinished run.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from ..atomic import fsync, write_atomically, write_record
from ..config import LEGACY, ExtractConfig
from ..data.store import DatasetRows, TokenStore, store_name
from ..errors import ExtractError
from ..files import shards
from ..files.manifest import MANIFEST, OFFLINE, Manifest, read_manifest
from ..files.rowfile import HIDDEN_DIR, completed_rows, hidden_state_path
from ..files.writer import write_dataset
from ..layers import CONVENTION, legacy_layer_ids
from ..version import __version__
from . import lock
from .output import RUN_FILE, different, finish_run, identity_changes, remove_leftovers
from .plan import Plan, make_plan

SKIPPED = "skipped_rows.jsonl"


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


def complete(plan: Plan, stores: list[TokenStore], runs: list[dict], regenerated) -> dict:
    """Write the dataset files (from the token stores: the run's, or every shard's) and, last, the manifest:
    the output now looks complete.  A sharded completion that fails lets the next one (`merge`) try."""
    try:
        return _complete(plan, stores, runs, regenerated)
    except BaseException:
        if plan.shard:
            shards.release_completion(plan.cfg.output)
        raise


def _complete(plan: Plan, stores: list[TokenStore], runs: list[dict], regenerated) -> dict:
    cfg, shape, output = plan.cfg, plan.shape, Path(plan.cfg.output)
    finish = f"run `eagle-extract merge {output}` to finish" if plan.shard else "rerun to finish"
    rows = DatasetRows(stores)
    counts = rows.counts
    if not counts["samples"]:  # only shards get here with none: each of them saw its own rows only
        row, why = next(rows.skipped(), (None, "the source is empty"))
        raise ExtractError(
            f"no usable rows in {cfg.data}: every shard skipped all of its rows (first: row {row}, {why}); "
            f"fix the data, empty {output} and run the shards again"
        )
    engines = {r["capture"].get("dtype") for r in runs if isinstance(r.get("capture"), dict)} - {None}
    if len(engines) > 1:
        raise ExtractError(
            f"the shards' engines ran in different dtypes ({', '.join(sorted(engines))}, --dtype {cfg.dtype}), so "
            "their rows differ in dtype; rerun every shard into a new output with --dtype set to one of them"
        )
    dtype = engines.pop() if engines else plan.dtype  # the engine's: --dtype auto may not be config.json's
    _name_by_index(output, rows, cfg.legacy, len(runs) if plan.shard else None, finish, cfg.states == "all")
    try:
        write_dataset(output, rows.dataset(), rows.token_freq())
    except OSError as exc:
        # a full disk reads the same whichever file it hit (token_freq.pt's own text names another fix)
        why = os.strerror(exc.errno) if exc.errno == errno.ENOSPC else exc.strerror or exc
        raise ExtractError(f"writing the dataset files in {output}: {why}; {finish}") from None
    extract_s = max(r["extract_s"] for r in runs)
    record = cfg.record()  # the paths made absolute: the trainer and a repair may run from another folder
    manifest = Manifest(
        format=LEGACY if cfg.legacy else OFFLINE,
        states=cfg.states,
        row_checksums=True,
        identity=plan.identity,
        config=record,
        model=record["model"],
        aux_layer_ids=plan.aux_ids,
        final_layer_id=shape.num_layers,
        slot_layer_ids=plan.slot_ids,
        layer_convention=CONVENTION,
        legacy_layer_ids=legacy_layer_ids(plan.slot_ids) if cfg.legacy else None,
        dtype=dtype,
        storage_dtype="float8_e4m3fn" if cfg.fp8 else dtype,
        hidden_size=shape.hidden_size,
        num_samples=counts["samples"],
        num_tokens=counts["tokens"],
        num_loss_tokens=counts["loss_tokens"],
        seq_length=cfg.seq_length,
        truncated=counts["truncated"],
        skipped=counts["skipped"],
        skipped_long=counts["skipped_long"],
        regenerated=regenerated,
        source_row_ranges=rows.source_row_ranges(),
        data={"path": record["data"], "sha256": plan.identity["data_sha256"], "format": cfg.data_format},
        tensor_parallel_size=cfg.tp,
        pipeline_parallel_size=cfg.pp,
        engine_args=cfg.engine_kwargs(),
        shards=len(runs) if plan.shard else None,
        resumed_rows=sum(r["resumed_rows"] for r in runs),
        redone_rows=sum(r.get("redone_rows", 0) for r in runs),
        tokenized_rows=sum(r.get("tokenized_rows", 0) for r in runs),
        waited_for_tokens_s=max(r.get("waited_for_tokens_s", 0.0) for r in runs),
        capture=runs[0]["capture"] if len(runs) == 1 else [r["capture"] for r in runs],
        timing={
            "engine_start_s": max(r["engine_start_s"] for r in runs),
            "extract_s": extract_s,
            "tokens_per_s": round(sum(r["tokens"] for r in runs) / extract_s, 1) if extract_s else 0.0,
        },
        bytes_written=_bytes_written(output, counts["samples"], cfg.legacy, cfg.states == "all"),
        versions=_versions(),
    )
    try:
        _write_skip_report(output, rows, counts["skipped"])
        manifest.write(output)
    except OSError as exc:
        raise ExtractError(f"writing the manifest in {output}: {exc.strerror or exc}; {finish}") from None
    remove_leftovers(output)
    shards.release_completion(output)
    return manifest.record()


RENAMERS = 16  # threads: a rename on a network filesystem is a round trip to its server, which they overlap


def _bytes_written(output: Path, samples: int, legacy: bool, every_row: bool) -> int:
    """Of the rows' files; with --states none (not `every_row`) rows may have none."""
    total = 0
    for i in range(samples):
        try:
            total += hidden_state_path(output, i, legacy).stat().st_size
        except FileNotFoundError:
            if every_row:
                raise
    return total


def _name_by_index(
    output: Path, rows: DatasetRows, legacy: bool, num_shards: int | None, finish: str, every_row: bool = True
) -> None:
    """Every row's file under its dataset index: the shards' files, named by source row, are renamed (in
    threads: on a network filesystem a rename is a round trip).  A completion cut midway is redone: a file
    already renamed is found under its index.  Unless `every_row` (--states none), rows may have none."""
    from concurrent.futures import ThreadPoolExecutor

    folder = output / shards.ROWS_DIR
    by_row, by_index = completed_rows(folder, legacy) if num_shards else set(), completed_rows(output, legacy)
    source = rows.source_rows.tolist()
    missing = [i for i, r in enumerate(source) if r not in by_row and i not in by_index]
    if missing and every_row:
        row = source[missing[0]]
        shard = f"{row % num_shards}/{num_shards}" if num_shards else None
        fix = f"rerun the --shard {shard} job (or the --dp {num_shards} command)" if shard else finish
        raise ExtractError(
            f"{len(missing)} rows have no hidden-state file (first: row {missing[0]}, source row {row}); {fix}"
        )
    moves = [(r, i) for i, r in enumerate(source) if r in by_row]

    def move(part: list[tuple[int, int]]) -> None:
        for row, index in part:
            os.replace(hidden_state_path(folder, row, legacy), hidden_state_path(output, index, legacy))

    names = output if legacy else output / HIDDEN_DIR
    try:
        if moves:
            (output / HIDDEN_DIR).mkdir(exist_ok=True)
            with ThreadPoolExecutor(RENAMERS) as pool:  # a slice each: a future per file costs more than a rename
                list(pool.map(move, [moves[k::RENAMERS] for k in range(RENAMERS)]))
        if names.is_dir():  # the rows' names (renamed here, or by the writers as they went) on the disk first
            fsync(names)
    except OSError as exc:
        raise ExtractError(f"naming the row files in {output}: {exc.strerror or exc}; {finish}") from None


def _write_skip_report(output: Path, rows: DatasetRows, skipped: int) -> None:
    def save(tmp: Path) -> None:
        with open(tmp, "w") as f:
            for row, why in rows.skipped():
                f.write(json.dumps({"row": row, "reason": why}) + "\n")

    if skipped:
        write_atomically(output / SKIPPED, save, durable=True)
        fsync(output)


def complete_shard(plan: Plan, store: TokenStore, summary: dict, log) -> dict:
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
    log(f"shard {plan.cfg.shard} done, and the last: completing the dataset")
    try:
        same_settings(output, [runs[k] for k in range(num)])
    except ExtractError:
        shards.release_completion(output)
        raise
    return complete(plan, _shard_stores(output, num), [runs[k] for k in range(num)], None)


def _shard_stores(output: Path, num: int) -> list[TokenStore]:
    """Every shard's token store, each holding its rows to the end (they make the dataset together)."""
    stores = [TokenStore(output / store_name((k, num)), change=False) for k in range(num)]
    cut = [k for k, store in enumerate(stores) if not store.ended]
    if cut:
        shards.release_completion(output)
        raise ExtractError(
            f"{output}: shard {cut[0]}/{num}'s token store is not whole, so the dataset files cannot be written; "
            f"rerun that shard's command (--shard {cut[0]}/{num}): it finds its rows written and completes the output"
        )
    return stores


def same_settings(output: Path, runs: list[dict]) -> None:
    """Shards run elsewhere and copied into one folder were never compared: rows of other layers, another
    model or other data cannot make one dataset."""
    first = runs[0].get("identity")
    for run in runs[1:]:
        other = run.get("identity")
        if not (isinstance(first, dict) and isinstance(other, dict)):
            continue
        changed = identity_changes(first, other)
        if changed:
            raise ExtractError(
                f"shards {runs[0].get('shard')} and {run.get('shard')} in {output} ran with "
                f"{different(changed[0], first, other, 'then')}, so their rows cannot make one dataset; run every "
                "shard with the same options (into an empty folder), then merge"
            )


def merge(output: Path, log=print) -> dict:
    """Complete a sharded output once every shard has finished (`eagle-extract merge`); refused while
    a shard still runs.  An output already complete (its last shard merged it) is a success that says so."""
    output = Path(output)
    with lock.holding(output):
        if (output / MANIFEST).exists():
            log(f"{output} is already complete (check it with `eagle-extract verify {output}`)")
            return read_manifest(output)
        return _merge(output)


def _merge(output: Path) -> dict:
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
    same_settings(output, [runs[k] for k in range(num)])
    # the shards may have read the model (and data) from other folders, on other nodes: take a shard's found here
    def found(run: dict) -> int:
        config = run.get("config") if isinstance(run.get("config"), dict) else {}
        return Path(str(config.get("model"))).is_dir() + Path(str(config.get("data"))).exists()

    summary = max(runs.values(), key=found, default=summary)
    config = ExtractConfig.from_options(**{**summary["config"], "output": output})
    if config.data is not None and not Path(config.data).exists():
        raise ExtractError(
            f"merging {output} reads the shards' data file {config.data} again, and it is gone; put the same "
            "file back at that path and merge again"
        )
    try:
        plan = make_plan(config, engine=False)  # merging starts no engine: the shards checked its arguments
    except ExtractError as exc:  # its words name the extraction's options, which merge does not take
        raise ExtractError(
            f"merging {output} reads the shards' recorded model and data again, and cannot: {exc}"
        ) from None
    recorded = summary.get("identity")
    changed = identity_changes(recorded, plan.identity) if isinstance(recorded, dict) else []
    if changed:
        raise ExtractError(
            f"merging {output}: the {changed[0]} is not what the shards ran with (the data file or the model "
            "changed since); put back what they ran with and merge again"
        )
    shards.release_completion(output)  # an earlier completer that died left its lock
    stores = _shard_stores(output, num)
    shards.claim_completion(output)
    return complete(plan, stores, [runs[k] for k in range(num)], None)


def recorded_config(output: Path) -> ExtractConfig:
    """The extraction that completed `output`, for a repair to run again; nothing is changed."""
    manifest = Manifest.read(output)
    if not isinstance(manifest.identity, dict) or not isinstance(manifest.config, dict):
        raise ExtractError(
            f"{output}'s manifest, from an earlier eagle-extract, records no run to repeat; rerun the "
            "extraction with --overwrite"
        )
    return ExtractConfig.from_options(**{**manifest.config, "output": output, "shard": None})


def reopen(output: Path, rows: list[int], identity: dict) -> None:
    """Delete the given rows' files and make the output an unfinished run again.  `run(repair=rows)` calls it
    once it holds the output and the recorded extraction has passed every check, with that run's `identity`,
    which must be the recorded one: a repair that cannot run changes nothing."""
    manifest = Manifest.read(output)
    changed = identity_changes(manifest.identity, identity)
    if changed:
        why = "; ".join(different(k, manifest.identity, identity) for k in changed)
        raise ExtractError(
            f"cannot repair {output}: its recorded extraction would now run with {why}; restore what changed, or "
            "extract again into a new --output (nothing was changed)"
        )
    paths = [hidden_state_path(output, i, manifest.format == LEGACY) for i in rows]
    folder = next((p for p in paths if p.is_dir()), None)
    if folder is not None:
        raise ExtractError(f"{folder} is a folder, not a row file; move it away, then run the repair again")
    for path in paths:
        path.unlink(missing_ok=True)
    write_record(output / RUN_FILE, manifest.identity)  # the output is an unfinished run again ...
    (output / MANIFEST).unlink()  # ... and no longer looks complete
