"""Train a draft on an eagle-extract output with speculators' own trainer: EAGLE-3, or any kind speculators 0.9
trains from the same states (--speculator-type: eagle3, peagle, dflash, dflash2, dspark, mtp).

    python train/train_draft.py OUT --save-path DRAFT [--speculator-type KIND] [--draft-vocab-size 8192]
        [--epochs 10] [--lr 1e-4] [--verifier PATH] [--gpus N] [--norm-output] [--dry-run]
        [-- further `speculators train` flags, such as a kind's own: --block-size 16, --num-layers 5]

Everything that must agree with the extraction is read from OUT/eagle_extract.json: the
verifier, the auxiliary layer ids (so --target-layer-ids can never name other layers than
the files hold) and the hidden-state dtype.  The trainer itself is speculators' (0.9):
`python -m speculators.train`, or torchrun over --gpus GPUs.  It needs a GPU; `--dry-run`
(speculators' own) builds and saves the untrained draft, which runs on a CPU.

The draft is trained with `--no-norm-output` unless --norm-output is given: speculators 0.9
defaults EAGLE-3 drafts to feeding the *normed* hidden state to the next draft step, but vLLM
releases before June 2026 (0.22 among them) drop that config field and feed the un-normed one,
so draft steps 2 and up run on inputs they were never trained on.  `check_draft.py` refuses a
draft whose config the serving vLLM does not honour.

The kind defaults to the one the output was extracted for (`--draft-kind`, in its manifest).  The draft folder it
writes is what vLLM loads as a speculator; the line it prints names vLLM's method for the kind:

    vllm serve VERIFIER --speculative-config '{"method": "eagle3", "model": "DRAFT", "num_speculative_tokens": 3}'

An mtp draft is built from the verifier's own MTP weights (`mtp.*`), so a verifier without them is refused; vLLM
serves it after `speculators stitch-mtp` puts it back into the verifier (method "mtp").
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import click

from eagle_extract.config import DRAFT_KINDS
from eagle_extract.drafts import missing_layers, speculative_config, train_flags
from eagle_extract.files.manifest import MANIFEST, read_manifest


def complete_manifest(output: Path) -> dict:
    """The manifest of a complete output in the layout speculators' trainer reads; else one line naming the fix."""
    if not (Path(output) / MANIFEST).is_file():
        raise click.ClickException(
            f"{output} is not a complete eagle-extract output (no {MANIFEST}); finish it or check it with "
            f"`eagle-extract verify {output}`"
        )
    manifest = read_manifest(output)
    if manifest.get("format") != "speculators-offline":
        raise click.ClickException(
            f"{output} is in the {manifest.get('format')} format; speculators' trainer reads the speculators "
            "layout: extract again without --format speculators-legacy"
        )
    return manifest


def trainer_args(output: Path, manifest: dict, opts: dict) -> list[str]:
    """The `speculators train` flags for this output."""
    stored = manifest["dtype"]  # fp8 files are decoded by speculators' own reader into this dtype
    args = [
        "--verifier-name-or-path", opts["verifier"] or manifest["model"],
        "--data-path", str(output),
        *train_flags(opts["speculator_type"], manifest["aux_layer_ids"]),
        "--hidden-states-dtype", "float32" if stored == "float32" else "bfloat16",
        "--total-seq-len", str(max(manifest["seq_length"], 2)),
        "--epochs", str(opts["epochs"]),
        "--lr", str(opts["lr"]),
        "--save-path", str(opts["save_path"]),
    ]  # fmt: skip
    if opts["draft_vocab_size"]:
        args += ["--draft-vocab-size", str(opts["draft_vocab_size"])]
    if opts["speculator_type"] in ("eagle3", "peagle"):  # the kinds whose drafts read norm_output
        args.append("--norm-output" if opts["norm_output"] else "--no-norm-output")
    if opts["dry_run"]:
        args.append("--dry-run")
    return args + list(opts["extra"])


def refuse_unheld_layers(kind: str, manifest: dict, extra: tuple[str, ...]) -> None:
    """--target-layer-ids among the further flags may name only layers the output holds."""
    asked, taking = [], False
    for arg in extra:  # `--target-layer-ids 2 15 27` or `--target-layer-ids=2`, up to the next flag
        name, eq, value = arg.partition("=")
        if name == "--target-layer-ids":
            taking = not eq
            asked += [int(value)] if eq and value.isdigit() else []
        elif arg.startswith("--"):
            taking = False
        elif taking and arg.isdigit():
            asked.append(int(arg))
    if not asked:
        return
    missing = missing_layers(kind, asked, manifest["aux_layer_ids"])
    if missing:
        raise click.ClickException(
            f"--target-layer-ids {' '.join(map(str, asked))}: the output holds layers "
            f"{' '.join(map(str, manifest['aux_layer_ids']))} (and the final slot), not {missing}; extract those "
            "layers (--layers), or leave --target-layer-ids out"
        )


def refuse_mtp_without_heads(verifier: str) -> None:
    """speculators builds an mtp draft from the verifier's own MTP weights; without them it fails after loading."""
    if not Path(verifier).is_dir():  # a hub name: speculators reads it itself
        return
    index = Path(verifier) / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text()).get("weight_map", {})
    else:
        from safetensors import safe_open

        names = [n for f in Path(verifier).glob("*.safetensors") for n in safe_open(str(f), "pt").keys()]
    if not any(n.startswith("mtp.") for n in names):  # as speculators looks for them
        raise click.ClickException(
            f"--speculator-type mtp builds the draft from the verifier's own MTP weights (mtp.*), and {verifier} "
            "has none; train another kind (eagle3, dflash, dspark, ...) on this output"
        )


def servable_draft(save_path: Path) -> Path:
    """The folder vLLM loads: speculators' best checkpoint, else its last epoch, else save_path
    itself (a --dry-run saves there)."""
    save_path = Path(save_path)
    if (save_path / "checkpoint_best" / "config.json").is_file():
        return save_path / "checkpoint_best"
    epochs = [d for d in save_path.glob("*") if d.name.isdigit() and (d / "config.json").is_file()]
    return max(epochs, key=lambda d: int(d.name)) if epochs else save_path


def command(args: list[str], gpus: int) -> list[str]:
    if gpus > 1:
        return ["torchrun", f"--nproc_per_node={gpus}", "-m", "speculators.train", *args]
    return [sys.executable, "-m", "speculators.train", *args]


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("output", type=click.Path(path_type=Path))
@click.option("--save-path", type=click.Path(path_type=Path), required=True, help="where the draft is written")
@click.option("--verifier", default=None, help="verifier checkpoint [default: the model in the manifest]")
@click.option("--draft-vocab-size", type=int, default=None, help="draft vocabulary, from token_freq.pt")
@click.option(
    "--speculator-type",
    type=click.Choice(DRAFT_KINDS),
    default=None,
    help="the draft kind [default: the output's --draft-kind, else eagle3]",
)
@click.option("--epochs", type=int, default=10, show_default=True)
@click.option("--lr", type=float, default=1e-4, show_default=True)
@click.option("--gpus", type=int, default=1, show_default=True, help="GPUs to train on (torchrun when more than one)")
@click.option(
    "--norm-output/--no-norm-output",
    default=False,
    show_default=True,
    help="feed the normed hidden state to the next draft step (needs a vLLM that reads norm_output)",
)
@click.option("--dry-run", is_flag=True, help="build and save the untrained draft, then stop")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def main(**opts) -> None:
    manifest = complete_manifest(opts["output"])
    recorded = (manifest.get("config") or {}).get("draft_kind", "eagle3")
    kind = opts["speculator_type"] = opts["speculator_type"] or recorded
    verifier = opts["verifier"] or manifest["model"]
    refuse_unheld_layers(kind, manifest, opts["extra"])
    if kind == "mtp":
        refuse_mtp_without_heads(verifier)
    cmd = command(trainer_args(opts["output"], manifest, opts), opts["gpus"])
    click.echo("$ " + shlex.join(cmd))
    rc = subprocess.run(cmd).returncode
    if rc == 0:
        draft = servable_draft(opts["save_path"])
        config = speculative_config(kind, str(draft), json.loads((draft / "config.json").read_text()))
        serving = (f"vllm serve {verifier} --speculative-config '{json.dumps(config)}'" if config else
                   "speculators stitch-mtp (puts the draft back into the verifier), then vllm serve it")  # fmt: skip
        if kind == "peagle":  # vLLM 0.34's speculators reader refuses P-EAGLE drafts
            serving += "  (vLLM 0.22 to 0.33; 0.34 serves no P-EAGLE draft)"
        click.echo(f"draft: {draft}\nserve: {serving}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
