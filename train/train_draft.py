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

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

MANIFEST = "eagle_extract.json"


class TrainSetupError(SystemExit):
    """One line naming the fix, exit status 1."""

    def __init__(self, message: str):
        super().__init__(f"Error: {message}")


def read_manifest(output: Path) -> dict:
    path = Path(output) / MANIFEST
    if not path.is_file():
        raise TrainSetupError(
            f"{output} is not a complete eagle-extract output (no {MANIFEST}); finish it or check it with "
            f"`eagle-extract verify {output}`"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != "speculators-offline":
        raise TrainSetupError(
            f"{output} is in the {manifest.get('format')} format; speculators' trainer reads the speculators "
            "layout: extract again without --format speculators-legacy"
        )
    return manifest


def trainer_args(output: Path, manifest: dict, opts: argparse.Namespace) -> list[str]:
    """The `speculators train` flags for this output."""
    stored = manifest["dtype"]  # fp8 files are decoded by speculators' own reader into this dtype
    args = [
        "--verifier-name-or-path", opts.verifier or manifest["model"],
        "--data-path", str(output),
        "--speculator-type", "eagle3",
        "--target-layer-ids", *map(str, manifest["aux_layer_ids"]),
        "--hidden-states-dtype", "float32" if stored == "float32" else "bfloat16",
        "--total-seq-len", str(max(manifest["seq_length"], 2)),
        "--epochs", str(opts.epochs),
        "--lr", str(opts.lr),
        "--save-path", str(opts.save_path),
    ]  # fmt: skip
    if opts.draft_vocab_size:
        args += ["--draft-vocab-size", str(opts.draft_vocab_size)]
    args.append("--norm-output" if opts.norm_output else "--no-norm-output")
    if opts.dry_run:
        args.append("--dry-run")
    return args + opts.extra


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


def parse(argv: list[str]) -> argparse.Namespace:
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", type=Path, help="an eagle-extract output folder")
    ap.add_argument("--save-path", type=Path, required=True, help="where the draft is written")
    ap.add_argument("--verifier", default=None, help="verifier checkpoint [default: the model in the manifest]")
    ap.add_argument("--draft-vocab-size", type=int, default=None, help="draft vocabulary, from token_freq.pt")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--gpus", type=int, default=1, help="GPUs to train on (torchrun when more than one)")
    ap.add_argument(
        "--norm-output",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="feed the normed hidden state to the next draft step (needs a vLLM that reads norm_output)",
    )
    ap.add_argument("--dry-run", action="store_true", help="build and save the untrained draft, then stop")
    opts = ap.parse_args(argv)
    opts.extra = extra
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    manifest = read_manifest(opts.output)
    cmd = command(trainer_args(opts.output, manifest, opts), opts.gpus)
    print("$ " + shlex.join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    if rc == 0:
        verifier = opts.verifier or manifest["model"]
        draft = servable_draft(opts.save_path)
        config = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
        print(f"draft: {draft}\nserve: vllm serve {verifier} --speculative-config '{config}'")
    return rc


if __name__ == "__main__":
    sys.exit(main())
