"""The output folder's life: whose it is, a rerun of a complete run, --overwrite's replacement folder and
its swap, resuming into it, and sweeping what a dead run left.  (Completing it: completion.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from ..atomic import read_record, write_record
from ..config import LEGACY
from ..data.store import STORE, store_name
from ..errors import ExtractError
from ..files import shards
from ..files.manifest import MANIFEST, Manifest, read_manifest, write_manifest
from ..files.rowfile import HIDDEN_DIR, completed_rows, hidden_state_path
from ..worker.stages import PARTS_DIR
from . import lock

RUN_FILE = ".eagle_extract_run.json"  # identity of an unfinished run, for resuming
LOG = "eagle_extract.log"  # the run's own log, the engine's output in it (a shard's: eagle_extract.I-of-N.log)


def log_name(shard: tuple[int, int] | None) -> str:
    return LOG if shard is None else f"eagle_extract.{shards.shard_name(shard)}.log"


def run_file(shard: tuple[int, int] | None) -> str:
    return RUN_FILE if shard is None else f".eagle_extract_run.{shards.shard_name(shard)}.json"


def _other_identities(output: Path, own: Path | None = None) -> list[dict]:
    """Identities recorded by the jobs (shards) writing into `output`, but for the run file `own`."""
    found = [_record(f) for f in output.glob(".eagle_extract_run*.json") if f != own]
    folder = output / shards.SHARDS_DIR
    if folder.is_dir():
        found += [_record(f).get("identity") for f in folder.glob("*-of-*.json")]
    return found


WARN_ONLY = ("versions",)  # identity keys a resumed run may change, told: other releases, equal to the last bits or not


def identity_changes(previous: dict, identity: dict) -> list[str]:
    """The identity keys (but WARN_ONLY) whose values differ.  A key the previous record lacks (an earlier
    eagle-extract's) is not compared, but for its `tokenizer`, which engine_args now holds (two earlier
    records, two shards' say, compare their tokenizers as they are).  The model's folder is compared only
    where a record lacks its digest (`model_sha256`)."""
    if "tokenizer" in previous and "engine_args" not in previous and "engine_args" in identity:
        args = {k: v for k, v in identity["engine_args"].items() if k != "tokenizer"}
        if previous["tokenizer"] is not None:
            args["tokenizer"] = previous["tokenizer"]
        previous = {**previous, "engine_args": args}
    moved = "model_sha256" in previous and "model_sha256" in identity  # the same files elsewhere are the same model
    return [
        k for k in identity
        if k not in WARN_ONLY and k in previous and previous[k] != identity[k] and not (moved and k == "model")
    ]  # fmt: skip


def other_releases(output: Path, identity: dict, shard: tuple[int, int] | None) -> str | None:
    """What differs between the releases the unfinished run in `output` wrote its rows with and these."""
    own = Path(output) / run_file(shard)
    old = _record(own).get("versions") if own.exists() else None
    new = identity["versions"]
    if not isinstance(old, dict) or old == new:
        return None
    changed = ", ".join(f"{k} {old.get(k)} -> {new[k]}" for k in new if old.get(k) != new[k])
    return (
        f"{output}'s rows so far were written with other releases ({changed}); their states may differ from "
        "this run's in the last bits: pass --overwrite to write every row with these"
    )


def different(key: str, old: dict, new: dict, word: str = "now") -> str:
    """How a message names one changed identity key: the model's digest by the two folders it was taken in."""
    if key == "model_sha256" and old.get("model") == new.get("model"):
        return f"a different model (the files in {old.get('model')} changed since: weights, or a JSON file there)"
    if key == "model_sha256":
        return f"a different model (the files in {old.get('model')} and in {new.get('model')} differ)"
    return f"a different {key} ({old.get(key)!r}, {word} {new.get(key)!r})"


def moved_model(output: Path, identity: dict, shard: tuple[int, int] | None) -> str | None:
    """The unfinished run in `output` read the model from another folder, and the files' digest is the same: the
    run goes on, told (the digest samples the weights, so a fine-tune that changed only unsampled bytes passes)."""
    own = Path(output) / run_file(shard)
    old = _record(own) if own.exists() else {}
    if old.get("model_sha256") != identity["model_sha256"] or old.get("model") in (None, identity["model"]):
        return None
    return (
        f"{output}'s rows so far were written with the model in {old['model']}, now {identity['model']}; its files "
        "sample the same, so the run goes on: pass --overwrite if it is not the same checkpoint"
    )


def _record(path: Path) -> dict:
    """A run file, or a shard's finished record: deleting it loses no row (the rerun keeps every whole file)."""
    if path.parent.name == shards.SHARDS_DIR:
        fix = f"delete it and rerun that shard's job (--shard {path.stem.replace('-of-', '/')}): its rows are kept"
    else:
        fix = "delete it and rerun the same command: every row already written is kept"
    return read_record(path, fix)


def _sweep(output: Path) -> None:
    """Delete the half-written files a dead run left, and --pp stages' part files (always rewritten)."""
    stale_files = list((output / HIDDEN_DIR).glob(".*.tmp")) + list(output.glob(".data_*.pt.tmp"))
    stale_files += (output / PARTS_DIR).glob(f"*/{HIDDEN_DIR}/*")
    for stale in stale_files:
        stale.unlink(missing_ok=True)


OURS = re.compile(  # every name eagle-extract writes in an output folder
    r"eagle_extract\.(json|log|\d+-of-\d+\.log)|\.eagle_extract.*|hidden_states|shards|\.pp_parts|\.completing"
    r"|token_freq\.pt|skipped_rows\.jsonl|regenerated\.jsonl|data-\d+-of-\d+\.arrow|dataset_info\.json|state\.json"
    r"|\.dataset-.*|\.?data_\d+\.pt(\.tmp)?|\.(token_freq\.pt|skipped_rows\.jsonl|regenerated\.jsonl)\.tmp"
)
REPLACEMENT = ".eagle_extract_replacement"  # --overwrite of a complete output writes here, then swaps it in
REPLACED = ".eagle_extract_replaced"  # the old output's files, during the swap


def _ours(entry: Path) -> bool:
    return bool(OURS.fullmatch(entry.name))


@contextmanager
def claimed(output: Path, shard: tuple[int, int] | None):
    """Hold the output for one run (yields the main lock's fd): refused when it holds someone else's
    files or another run is writing it.  Finishes a swap that an interrupted --overwrite left."""
    output = Path(output)
    if output.is_dir() and any(output.iterdir()):
        marks = [output / MANIFEST, output / LOG, *output.glob("eagle_extract.*.log"), *output.glob(".eagle_extract*")]
        marks += output.glob(f"{shards.SHARDS_DIR}/*-of-*")
        if not any(m.exists() for m in marks):
            raise ExtractError(
                f"--output {output} holds files that are not an eagle-extract output; choose an empty folder"
            )
        link = next((e for e in output.iterdir() if _ours(e) and e.is_symlink() and not e.exists()), None)
        if link is not None:  # a link the user made (hidden_states on another disk) is followed, if it leads anywhere
            raise ExtractError(
                f"--output {output}: {link.name} is a link to {os.readlink(link)}, which does not exist; create "
                "that, or move the link away, then rerun"
            )
    output.mkdir(parents=True, exist_ok=True)
    with lock.holding(output, shard) as main_fd:
        if (output / REPLACEMENT / MANIFEST).exists() or (output / REPLACED).exists():
            if shard is not None:  # shards share the folder: the swap needs it alone
                raise ExtractError(
                    f"--output {output}: an --overwrite run was cut while swapping its replacement in; rerun it "
                    "(any command without --shard finishes the swap), then start the shards"
                )
            replace_complete(output / REPLACEMENT, output)
        yield main_fd


def identical_complete(output: Path, identity: dict, overwrite: bool, states: str = "all") -> dict | None:
    """The manifest of a complete output this same run already wrote (a rerun has nothing to do), None
    when there is none or --overwrite asks to redo it; refused when the complete output is another run's."""
    path = Path(output) / MANIFEST
    if overwrite or not path.exists():
        return None
    try:
        manifest = json.loads(path.read_bytes())
        changed = identity_changes(manifest["identity"], identity)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        if (Path(output) / shards.SHARDS_DIR).is_dir():  # its rows are named by dataset row now: a rerun redoes them
            fix = "restore it from a copy (a rerun of the shards would extract every row again)"
        else:
            fix = (
                "delete it and rerun the command that wrote the output: every row already written is checked and "
                "kept, and the manifest is written again"
            )
        raise ExtractError(f"--output {output}: its manifest {path} is unreadable ({why}); {fix}") from None
    if changed:
        raise ExtractError(
            f"--output {output} already holds a complete extraction with "
            f"{different(changed[0], manifest['identity'], identity)}; pass --overwrite to replace it, or choose "
            "another --output"
        )
    recorded = Manifest.of(manifest)
    if recorded.states == "none" and states == "all":
        raise ExtractError(
            f"--output {output} is complete without hidden states (--states none); pass --overwrite to extract every "
            "row's states into it"
        )
    missing = _first_missing_row(Path(output), recorded)
    if missing is not None:
        raise ExtractError(
            f"--output {output} is complete but row {missing}'s file is gone; `eagle-extract verify --repair {output}` "
            "writes the missing rows again"
        )
    remove_leftovers(Path(output))  # a completion cut after its manifest left them
    return manifest


def _first_missing_row(output: Path, manifest: Manifest) -> int | None:
    """One stat per row: a complete output that lost a row file is not reported complete."""
    if manifest.states == "none" or not isinstance(manifest.num_samples, int):
        return None
    legacy = manifest.format == LEGACY
    return next((i for i in range(manifest.num_samples) if not hidden_state_path(output, i, legacy).exists()), None)


def already_complete(output: Path) -> str:
    """What a rerun of the command that completed `output` says."""
    said = f"{output} is already complete: this same extraction wrote it (check it with `eagle-extract verify`)"
    if (output / REPLACEMENT).exists():
        said += f"; {output / REPLACEMENT} holds an unfinished --overwrite: rerun it to finish, or delete it"
    return said


def writing_folder(output: Path, identity: dict, overwrite: bool) -> Path:
    """Where this run writes: `output`, or, when --overwrite replaces a complete output, a folder inside it
    that is swapped in once complete, so the old output stays whole until then.  An unfinished
    replacement that recorded these settings (its run file, or its --dp replicas') resumes; any
    other is started over."""
    output = Path(output)
    if not (overwrite and (output / MANIFEST).exists()):
        return output
    staged = output / REPLACEMENT
    if staged.exists():
        recorded = _other_identities(staged)  # every run file and shard summary in it
        if not recorded or any(not isinstance(r, dict) or identity_changes(r, identity) for r in recorded):
            shutil.rmtree(staged)
    return staged


def replace_complete(staged: Path, output: Path) -> dict:
    """Swap a complete replacement in: (1) the old output's files move aside, the manifest first, into a
    folder renamed once they all are; (2) the new ones move in, the manifest last (from then on the
    output is the new one); (3) what is left goes.  `claimed` finishes a swap cut at any point."""
    aside = output / REPLACED
    try:
        if (staged / MANIFEST).exists():  # (1) and (2) not done yet
            if not aside.exists():
                moving = Path(f"{aside}.tmp")
                moving.mkdir(exist_ok=True)
                old = [e for e in output.iterdir() if _ours(e) and e.name not in _KEPT and not e.name.endswith(".lock")]
                old.sort(key=lambda e: e.name != MANIFEST)
                for entry in old:
                    os.replace(entry, moving / entry.name)
                os.replace(moving, aside)
            new = [e for e in staged.iterdir() if e.name not in _KEPT and not e.name.endswith(".lock")]
            for entry in sorted(new, key=lambda e: e.name == MANIFEST):
                if entry.name == MANIFEST:
                    manifest = json.loads(entry.read_text())
                    manifest["config"]["output"] = os.path.abspath(output)
                    write_manifest(output, manifest)
                    entry.unlink()
                else:
                    os.replace(entry, output / entry.name)
    except OSError as exc:
        raise ExtractError(
            f"--output {output}: swapping the complete replacement in failed ({exc.strerror or exc}); "
            "fix the cause and rerun: the next run into the folder finishes the swap"
        ) from None
    try:  # (3) the output is complete now; a Ctrl-C here leaves the rest to the next run
        shutil.rmtree(aside, ignore_errors=True)
        shutil.rmtree(staged, ignore_errors=True)
    except KeyboardInterrupt:
        pass
    return read_manifest(output)


_KEPT = {REPLACEMENT, REPLACED, f"{REPLACED}.tmp", LOG}  # not part of either output


ROW_NAME = re.compile(r"\.?hs_\d+\.safetensors(\.tmp)?")
_WHOLE = {  # the folders --overwrite deletes whole, and the names eagle-extract writes in each (relative paths)
    HIDDEN_DIR: ROW_NAME,
    shards.SHARDS_DIR: re.compile(r"\.?\d+-of-\d+\.(json|log|progress)(\.tmp)?"),  # --dp: its jobs' logs too
    PARTS_DIR: re.compile(rf"layers_\d+-\d+/({HIDDEN_DIR}/{ROW_NAME.pattern}|\.?data_\d+\.pt(\.tmp)?)"),
    shards.ROWS_DIR: re.compile(rf"{HIDDEN_DIR}/{ROW_NAME.pattern}|\.?data_\d+\.pt(\.tmp)?"),
}


def refuse_foreign_files(output: Path, data: Path | None) -> None:
    """--overwrite deletes hidden_states/, shards/, .pp_parts/ and .eagle_extract_rows/ whole, and every file
    of an eagle-extract name: a file in those folders that is not eagle-extract's, or the run's own --data
    among what goes (a regenerated.jsonl fed back in), is refused first, never deleted with them."""
    output = Path(output)
    if data is not None:
        where, root = Path(os.path.realpath(data)), Path(os.path.realpath(output))
        unfinished = where == root and not (root / MANIFEST).exists()  # its dataset files go at once
        inside = where != root and where.is_relative_to(root)
        if unfinished or inside and _ours(root / where.relative_to(root).parts[0]):
            raise ExtractError(
                f"--overwrite: --data {data} is inside --output {output} and would be deleted with the old "
                f"output; copy it out of {output} first and pass the copy"
            )
    top = output.iterdir() if output.is_dir() else []
    link = next((e for e in top if _ours(e) and e.is_symlink() and e.name not in _WHOLE), None)
    if link is not None:  # --overwrite deletes or replaces what bears eagle-extract's names, and never through a link
        raise ExtractError(
            f"--overwrite: {link} is a link (to {os.readlink(link)}), and --overwrite deletes or replaces that name; "
            "move the link away, or rerun without --overwrite"
        )
    for name, ours in _WHOLE.items():
        folder = str(output / name)
        if os.path.islink(folder):
            raise ExtractError(
                f"--overwrite: {folder} is a link (to {os.readlink(folder)}), and --overwrite replaces that folder "
                "whole without following links; make it a plain folder, or rerun without --overwrite"
            )
        for top, dirs, files in os.walk(folder):  # a million rows: names only, in the order the folder has them
            below = "" if top == folder else os.path.relpath(top, folder).replace(os.sep, "/") + "/"
            link = next((d for d in dirs if os.path.islink(os.path.join(top, d))), None)  # walk does not enter it
            if link is not None:
                raise ExtractError(
                    f"--overwrite: {os.path.join(top, link)} is a link, not eagle-extract's, and --overwrite replaces "
                    f"{folder} whole; move it out of that folder first"
                )
            foreign = next((f for f in files if not ours.fullmatch(below + f)), None)
            if foreign is not None:
                raise ExtractError(
                    f"--overwrite: {os.path.join(top, foreign)} is not eagle-extract's, and --overwrite replaces "
                    f"{folder} whole; move it out of that folder first"
                )


def _clear(output: Path) -> None:
    """--overwrite of an unfinished run: its files go, nobody else's, and not the lock being held."""
    for entry in output.iterdir():
        if _ours(entry) and not entry.name.endswith(".lock") and entry.name != LOG:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def prepare_output(output: Path, identity: dict, overwrite: bool, shard: tuple[int, int] | None = None) -> set[int]:
    """Make `output` (claimed) ready; returns the rows an identical run (or another shard) already wrote.
    A token store that no run file vouches for (a run that failed before writing a row) is started over."""
    output.mkdir(parents=True, exist_ok=True)
    if overwrite:
        _clear(output)
    refuse_other_runs(output, identity, shard)
    if not (output / run_file(shard)).exists():
        shutil.rmtree(output / store_name(shard), ignore_errors=True)
    legacy = identity.get("format") == LEGACY
    done = completed_rows(shards.rows_folder(output, shard), legacy)
    if shard is None:  # a shard leaves the others' files in flight alone: it writes its own again anyway
        _sweep(output)
    write_record(output / run_file(shard), identity)
    return done


def refuse_other_runs(output: Path, identity: dict, shard: tuple[int, int] | None) -> None:
    """An unfinished run (or another shard) in `output` with other settings cannot be continued by this one,
    nor shards of another count share it (they would own the same rows)."""
    own = output / run_file(shard)
    if shard is not None and os.environ.get(lock.REPLICA_ENV) is None:  # a --dp parent cleared other counts
        names = [p.name for p in [*output.glob(".eagle_extract_run.*-of-*.json"), *output.glob("shards/*-of-*.json")]]
        counts = {int(m.group(1)) for m in (re.search(r"-of-(\d+)\.json$", n) for n in names) if m}
        if counts - {shard[1]}:
            raise shards.ShardError(
                f"--output {output} holds shards of {min(counts - {shard[1]})} jobs; --shard {shard[0]}/{shard[1]} "
                "would write rows they own: use their count"
            )
    recorded = ([_record(own)] if own.exists() else []) + _other_identities(output, own)
    for previous in (r for r in recorded if isinstance(r, dict)):
        changed = identity_changes(previous, identity)
        if changed:
            resume = "rerun with its settings to resume it (every row written is kept)"
            fix = "use the other shards' settings" if shard else f"{resume}, or pass --overwrite to start over"
            raise ExtractError(
                f"--output {output} holds an unfinished run with {different(changed[0], previous, identity)}; {fix}"
            )


def forget_other_counts(output: Path, count: int) -> None:
    """A --dp run resumed with another count: the earlier replicas' records and token stores go (their rows
    stay: they are named by source row, whoever wrote them); the parent holds the folder alone."""
    for path in [*output.glob(".eagle_extract_run.*-of-*.json"), *output.glob(f"{shards.SHARDS_DIR}/*-of-*.json")]:
        if not path.name.endswith(f"-of-{count}.json"):
            path.unlink()
    for folder in output.glob(f"{STORE}.*-of-*"):
        if not folder.name.endswith(f"-of-{count}"):
            shutil.rmtree(folder, ignore_errors=True)


def abandon_if_empty(output: Path, shard: tuple[int, int] | None) -> None:
    """A run that failed before writing anything leaves no record that would refuse a corrected command."""
    from .regenerate import JOURNAL, REGENERATED

    folders = (output, output / shards.ROWS_DIR)
    written = any(completed_rows(f) or completed_rows(f, legacy=True) for f in folders)
    answers = (output / REGENERATED).exists() or (output / JOURNAL).exists()
    if not written and not answers:
        (output / run_file(shard)).unlink(missing_ok=True)
        shutil.rmtree(output / store_name(shard), ignore_errors=True)  # tokenized again: the data may change


def finish_run(output: Path, shard: tuple[int, int] | None) -> None:
    """The run's own record goes: what is left is a complete output, or a finished shard's summary."""
    (output / run_file(shard)).unlink()


def remove_leftovers(output: Path) -> None:
    """What a complete output no longer needs: the token stores, the shards' emptied row folder, --pp parts.
    (After the manifest: until it is written they are what a cut completion is finished from.)"""
    for folder in [*output.glob(f"{STORE}*"), output / PARTS_DIR, output / shards.ROWS_DIR]:
        shutil.rmtree(folder, ignore_errors=True)
