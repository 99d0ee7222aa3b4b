"""Train an EAGLE-3 draft on an eagle-extract output with speculators' own trainer.

    python train/train_draft.py OUT --save-path DRAFT [--draft-vocab-size 8192] [--epochs 10]
        [--lr 1e-4] [--verifier PATH] [--gpus N] [--norm-output] [--dry-run] [-- further `speculators train` flags]

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

The draft folder it writes is what vLLM loads as an EAGLE-3 speculator:

    vllm serve VERIFIER --speculative-config '{"method": "eagle3", "model": "DRAFT", "num_speculative_tokens": 3}'
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import click

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
        "--speculator-type", "eagle3",
        "--target-layer-ids", *map(str, manifest["aux_layer_ids"]),
        "--hidden-states-dtype", "float32" if stored == "float32" else "bfloat16",
        "--total-seq-len", str(max(manifest["seq_length"], 2)),
        "--epochs", str(opts["epochs"]),
        "--lr", str(opts["lr"]),
        "--save-path", str(opts["save_path"]),
    ]  # fmt: skip
    if opts["draft_vocab_size"]:
        args += ["--draft-vocab-size", str(opts["draft_vocab_size"])]
    args.append("--norm-output" if opts["norm_output"] else "--no-norm-output")
    if opts["dry_run"]:
        args.append("--dry-run")
    return args + list(opts["extra"])


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
    cmd = command(trainer_args(opts["output"], manifest, opts), opts["gpus"])
    click.echo("$ " + shlex.join(cmd))
    rc = subprocess.run(cmd).returncode
    if rc == 0:
        verifier = opts["verifier"] or manifest["model"]
        draft = servable_draft(opts["save_path"])
        config = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
        click.echo(f"draft: {draft}\nserve: vllm serve {verifier} --speculative-config '{config}'")
    sys.exit(rc)


if __name__ == "__main__":
    main()
