"""The `eagle-extract` command line."""

from __future__ import annotations

import json
import signal
from importlib import resources
from pathlib import Path

import click

from .extract import ExtractConfig, ExtractError, run
from .formats import FORMATS, DataError
from .layers import LayerError

BUNDLED_MODEL = "smollm2"
BUNDLED_DATA = "sharegpt_dummy_conversations.json"


def _bundled_data() -> Path:
    return Path(str(resources.files("eagle_extract") / "sample_data" / BUNDLED_DATA))


def _parse_engine_args(pairs: tuple[str, ...]) -> dict:
    args = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"'{pair}' is not KEY=VALUE", param_hint="--engine-arg")
        try:
            args[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            args[key.replace("-", "_")] = value
    return args


class _ExtractByDefault(click.Group):
    """`eagle-extract [OPTIONS]` runs `extract`; `eagle-extract verify DIR` runs a named command."""

    def parse_args(self, ctx, args):
        if not args or args[0] not in self.commands:
            args = ["extract", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_ExtractByDefault, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """eagle-extract: EAGLE-3 training data from models running in vLLM."""


@main.command("extract", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--model",
    default=BUNDLED_MODEL,
    show_default=True,
    help="Checkpoint folder (config.json, weights, tokenizer). 'smollm2' builds and uses the bundled "
    "SmolLM2-135M-Instruct.",
)
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    default=None,
    help="JSON or JSONL file, or a dataset folder (datasets' save_to_disk, speculators' prepare-data): "
    "conversations, Alpaca, token or text rows (docs/data.md). "
    "[default: the bundled 500 ShareGPT sample conversations]",
)
@click.option(
    "--data-format",
    type=click.Choice(FORMATS),
    default="auto",
    show_default=True,
    help="Row format; 'auto' detects it per row.",
)
@click.option("--strict", is_flag=True, help="Stop at the first bad row, naming it, instead of skipping it.")
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    default=Path("eagle-extract-output"),
    show_default=True,
    help="Output folder, laid out for `speculators train --data-path`.",
)
@click.option(
    "--layers",
    default=None,
    help="Comma-separated auxiliary layer ids, vLLM EAGLE-3 convention (id L = residual stream "
    "entering layer L). The final slot (id = number of layers) is always added. "
    "[default: 2, n//2, n-3]",
)
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size (GPUs per engine).")
@click.option(
    "--pp",
    type=int,
    default=1,
    show_default=True,
    help="Pipeline-parallel stages (engine GPUs = --tp x --pp); each stage captures its own layers. GPU builds only.",
)
@click.option(
    "--dp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Engine replicas on this machine, each with --tp GPUs (or a share of the CPU cores) and a share of the rows.",
)
@click.option(
    "--shard",
    default=None,
    metavar="I/N",
    help="Process only part I of N of the rows (0 <= I < N), for N jobs sharing one --output; the last to finish "
    "(or `eagle-extract merge`) completes the dataset. docs/scaling.md",
)
@click.option("--max-samples", type=int, default=None, help="Use at most this many rows. [default: all]")
@click.option(
    "--seq-length",
    type=int,
    default=2048,
    show_default=True,
    help="Longest sample in tokens; see --long-samples.",
)
@click.option(
    "--long-samples",
    type=click.Choice(["truncate", "skip"]),
    default="truncate",
    show_default=True,
    help="What to do with samples longer than --seq-length; counts are reported.",
)
@click.option(
    "--regenerate",
    is_flag=True,
    help="Let the model write every assistant turn itself, turn by turn, before extraction "
    "(questions-only data becomes training data); saved as regenerated.jsonl in --output.",
)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="--regenerate sampling; 0 is greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="--regenerate sampling.")
@click.option(
    "--max-new-tokens", type=int, default=1024, show_default=True, help="--regenerate: longest answer in tokens."
)
@click.option("--seed", type=int, default=0, show_default=True, help="--regenerate sampling seed (plus row number).")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
    default="auto",
    show_default=True,
    help="Model dtype, and the dtype of the stored hidden states.",
)
@click.option(
    "--batch-size",
    type=int,
    default=256,
    show_default=True,
    help="Samples handed to vLLM per generate call (progress is reported per call).",
)
@click.option(
    "--max-num-batched-tokens",
    type=int,
    default=None,
    help="Token budget of one engine step; smaller values lower peak memory. [default: vLLM's]",
)
@click.option(
    "--engine-arg",
    "engine_args",
    multiple=True,
    metavar="KEY=VALUE",
    help="Further vllm.LLM keyword argument, VALUE parsed as JSON when it can be; repeatable "
    "(e.g. --engine-arg gpu_memory_utilization=0.85).",
)
@click.option(
    "--decoder-path",
    default=None,
    help="Dotted path of the module that owns the decoder `layers`, when the search cannot tell "
    "(e.g. language_model.model).",
)
@click.option("--trust-remote-code", is_flag=True, help="Allow the model's own Python code (config, tokenizer).")
@click.option("--overwrite", is_flag=True, help="Replace an existing extraction in --output.")
@click.option(
    "--storage-dtype",
    type=click.Choice(["model", "fp8"]),
    default="model",
    show_default=True,
    help="'model' stores the model dtype; 'fp8' stores speculators' FP8 layout (float8_e4m3fn values and a "
    "float32 scale per token), half the bytes of bf16.",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["speculators", "speculators-legacy"]),
    default="speculators",
    show_default=True,
    help="'speculators-legacy' writes speculators 0.3/0.4's data_{i}.pt files (layer ids translated to that "
    "version's numbering of layer outputs, recorded in the manifest).",
)
@click.option(
    "--writer-threads",
    type=click.IntRange(min=1),
    default=None,
    help="Threads writing hidden-state files on the writing rank. [default: one per two CPU cores, 2 to 8]",
)
@click.option(
    "--no-disk-check",
    is_flag=True,
    help="Start even when the estimated output is larger than the free disk space (e.g. space freed during the run).",
)
def extract_command(
    model,
    data,
    output,
    layers,
    tp,
    pp,
    max_samples,
    seq_length,
    dtype,
    batch_size,
    max_num_batched_tokens,
    engine_args,
    decoder_path,
    trust_remote_code,
    overwrite,
    storage_dtype,
    output_format,
    writer_threads,
    no_disk_check,
    data_format,
    strict,
    long_samples,
    dp,
    shard,
    regenerate,
    temperature,
    top_p,
    max_new_tokens,
    seed,
):
    """Capture EAGLE-3 training hidden states from a model running in vLLM.

    Writes speculators' offline layout: an Arrow dataset (input_ids, loss_mask, seq_len),
    token_freq.pt, hidden_states/hs_{i}.safetensors ([tokens, slots, hidden]) and a manifest.
    With no options it extracts the bundled SmolLM2 model over the bundled conversations.
    Rerunning an interrupted command resumes it. Check an output with `eagle-extract verify DIR`.
    """
    extra = _parse_engine_args(engine_args)
    if max_num_batched_tokens:
        extra["max_num_batched_tokens"] = max_num_batched_tokens
    if model == BUNDLED_MODEL:
        from .smollm2 import ensure_smollm2

        model = str(ensure_smollm2())
    cfg = ExtractConfig(
        model=model,
        data=data or _bundled_data(),
        output=output,
        layers=layers,
        tp=tp,
        pp=pp,
        dtype=dtype,
        seq_length=seq_length,
        max_samples=max_samples,
        batch_size=batch_size,
        trust_remote_code=trust_remote_code,
        overwrite=overwrite,
        check_disk=not no_disk_check,
        storage_dtype=storage_dtype,
        format=output_format,
        writer_threads=writer_threads,
        decoder_path=decoder_path,
        engine_args=extra,
        data_format=data_format,
        strict=strict,
        long_samples=long_samples,
        shard=shard,
        regenerate=regenerate,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )
    if dp > 1:
        from .replicas import run_replicas

        _summarise(_run_or_fail(lambda c, log: run_replicas(c, dp, log=log), cfg), model, output)
    else:
        _summarise(_run_or_fail(run, cfg), model, output)


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("output", type=click.Path(exists=True, file_okay=False, path_type=Path))
def merge(output):
    """Complete a sharded output once every shard (--shard I/N) has finished: write the Arrow
    dataset, token_freq.pt and the manifest. Names the shards still missing."""
    from .extract import merge as complete

    manifest = _run_or_fail(complete, output)
    _summarise(manifest, manifest["model"], output)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _run_or_fail(fn, *args) -> dict:
    """Run the job; user-facing failures and SIGINT/SIGTERM become one line and exit 1."""
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop: leave resumable, like Ctrl-C
    try:
        return fn(*args, log=click.echo)
    except (ExtractError, LayerError, DataError) as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        raise click.ClickException(
            "interrupted; every completed row is kept: rerun the same command to resume"
        ) from None


def _summarise(manifest: dict, model: str, output: Path) -> None:
    if manifest.get("complete") is False:  # one shard of several
        rate = manifest["tokens"] / manifest["extract_s"] if manifest["extract_s"] else 0
        waiting = ", ".join(f"{k}/{manifest['shard'].split('/')[1]}" for k in manifest["waiting_for"])
        click.echo(
            f"shard {manifest['shard']} done: {manifest['rows']} samples ({rate:,.0f} tokens/s; engine start "
            f"{manifest['engine_start_s']:.1f} s); the dataset is completed when shard(s) {waiting or '-'} "
            f"finish, or by `eagle-extract merge {output}`"
        )
        return
    t = manifest["timing"]
    click.echo(
        f"done: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens, "
        f"{manifest['bytes_written'] / 2**20:.1f} MiB in {t['extract_s']:.1f} s "
        f"({t['tokens_per_s']:,.0f} tokens/s; engine start {t['engine_start_s']:.1f} s); "
        f"truncated {manifest['truncated']}, skipped {manifest['skipped']} "
        f"({manifest['skipped_long']} over --seq-length)"
    )
    if manifest["skipped"]:
        click.echo(f"skipped rows and why: {Path(output) / 'skipped_rows.jsonl'}")
    click.echo(f"output: {Path(output).resolve()}")
    if manifest.get("legacy_layer_ids"):
        click.echo(f"legacy layer ids (outputs of layers): {manifest['legacy_layer_ids']}")
        return
    ids = " ".join(map(str, manifest["aux_layer_ids"]))  # speculators takes a space-separated list
    click.echo(
        f"train on it: speculators train --verifier-name-or-path {model} --data-path {output} "
        f"--speculator-type eagle3 --target-layer-ids {ids}"
    )


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("output", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--repair", is_flag=True, help="Delete the broken rows' files and rerun the recorded extraction for them."
)
def verify(output, repair):
    """Check an eagle-extract output: every row's file present and readable to the end, shapes
    and dtypes as the manifest says, token_ids equal to input_ids, no NaN or Inf, token_freq.pt
    consistent. Exits 1 and lists the problems when there are any."""
    from .extract import repair as rerun_rows
    from .verify import verify as find_problems

    problems = find_problems(output)
    for row, why in problems:
        click.echo(f"{'row ' + str(row) if row is not None else 'output'}: {why}", err=True)
    if not problems:
        click.echo(f"ok: {output} passes every check")
        return
    if not repair:
        raise click.ClickException(
            f"{len(problems)} problem(s) in {output}; `eagle-extract verify --repair {output}` fixes them"
        )
    if not (output / "eagle_extract.json").exists():
        raise click.ClickException("no manifest to repair from: rerun the original extraction command to resume it")
    rows = sorted({row for row, _ in problems if row is not None})
    click.echo(f"repairing {len(rows)} row(s)")
    manifest = _run_or_fail(lambda log: rerun_rows(output, rows, log=log))
    remaining = find_problems(output, progress=False)
    if remaining:
        raise click.ClickException(f"{len(remaining)} problem(s) remain after repair; first: {remaining[0][1]}")
    click.echo(f"repaired: {output} passes every check ({manifest['num_samples']} rows)")
