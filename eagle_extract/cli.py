"""The `eagle-extract` command line: a thin shell over the Python API (`api.py`)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from . import api
from .checks import repairable
from .config import CHOICES, ExtractConfig
from .errors import ExtractError
from .interrupts import stop_on_signals
from .mooncake import StoreSettings
from .writer import MANIFEST

D = ExtractConfig()  # the defaults, shared with the API
M = StoreSettings()  # the Mooncake defaults, speculators' launcher's


def parse_engine_args(pairs: tuple[str, ...]) -> dict:
    """KEY=VALUE pairs as engine keyword arguments, each VALUE parsed as JSON when it can be."""
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


def engine_arg_option(help: str):
    """--engine-arg KEY=VALUE, repeatable, VALUE parsed as JSON when it can be; gathered as the engine_args dict."""
    return click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
                        callback=lambda ctx, param, pairs: parse_engine_args(pairs), help=help)  # fmt: skip


class _ExtractByDefault(click.Group):
    """`eagle-extract [OPTIONS]` runs `extract`; `eagle-extract verify DIR` runs a named command."""

    def parse_args(self, ctx, args):
        if not args or args[0] not in self.commands:
            args = ["extract", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_ExtractByDefault, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """eagle-extract: EAGLE-3 training data from models running in vLLM."""


OPTION = {  # every option of the commands that run a model, declared once; each command takes its own list
    "model": click.option(
        "--model",
        default=D.model,
        show_default=True,
        help="Checkpoint folder (config.json, weights, tokenizer). 'smollm2' builds and uses the bundled "
        "SmolLM2-135M-Instruct.",
    ),
    "data": click.option(
        "--data",
        type=click.Path(path_type=Path),
        default=None,
        help="JSON or JSONL file, or a dataset folder (datasets' save_to_disk, speculators' prepare-data): "
        "conversations, Alpaca, token or text rows (docs/data.md). "
        "[default: the bundled 500 ShareGPT sample conversations]",
    ),
    "data_format": click.option(
        "--data-format",
        type=click.Choice(CHOICES["data_format"]),
        default=D.data_format,
        show_default=True,
        help="Row format; 'auto' detects it per row.",
    ),
    "strict": click.option(
        "--strict", is_flag=True, help="Stop at the first bad row, naming it, instead of skipping it."
    ),
    "output": click.option(
        "--output",
        type=click.Path(path_type=Path),
        default=D.output,
        show_default=True,
        help="Output folder, laid out for `speculators train --data-path`.",
    ),
    "layers": click.option(
        "--layers",
        default=None,
        help="Comma-separated auxiliary layer ids, vLLM EAGLE-3 convention (id L = residual stream "
        "entering layer L). The final slot (id = number of layers) is always added. "
        "[default: 2, n//2, n-3]",
    ),
    "tp": click.option(
        "--tp", type=int, default=D.tp, show_default=True, help="Tensor-parallel size (GPUs per engine)."
    ),
    "pp": click.option(
        "--pp",
        type=int,
        default=D.pp,
        show_default=True,
        help="Pipeline-parallel stages (engine GPUs = --tp x --pp); each stage captures its own layers. "
        "GPU builds only.",
    ),
    "dp": click.option(
        "--dp",
        type=click.IntRange(min=1),
        default=D.dp,
        show_default=True,
        help="Engine replicas on this machine, each with --tp GPUs (or a share of the CPU cores) and a share of "
        "the rows.",
    ),
    "shard": click.option(
        "--shard",
        default=None,
        metavar="I/N",
        help="Process only part I of N of the rows (0 <= I < N), for N jobs sharing one --output; the last to finish "
        "(or `eagle-extract merge`) completes the dataset. docs/scaling.md",
    ),
    "max_samples": click.option(
        "--max-samples", type=int, default=None, help="Use at most this many rows. [default: all]"
    ),
    "seq_length": click.option(
        "--seq-length",
        type=int,
        default=D.seq_length,
        show_default=True,
        help="Longest sample in tokens; see --long-samples.",
    ),
    "long_samples": click.option(
        "--long-samples",
        type=click.Choice(CHOICES["long_samples"]),
        default=D.long_samples,
        show_default=True,
        help="What to do with samples longer than --seq-length; counts are reported.",
    ),
    "regenerate": click.option(
        "--regenerate",
        is_flag=True,
        help="Let the model write every assistant turn itself, turn by turn, before extraction "
        "(questions-only data becomes training data); saved as regenerated.jsonl in --output.",
    ),
    "temperature": click.option(
        "--temperature",
        type=float,
        default=D.temperature,
        show_default=True,
        help="--regenerate sampling; 0 is greedy.",
    ),
    "top_p": click.option("--top-p", type=float, default=D.top_p, show_default=True, help="--regenerate sampling."),
    "max_new_tokens": click.option(
        "--max-new-tokens",
        type=int,
        default=D.max_new_tokens,
        show_default=True,
        help="--regenerate: longest answer in tokens.",
    ),
    "seed": click.option(
        "--seed", type=int, default=D.seed, show_default=True, help="--regenerate sampling seed (plus row number)."
    ),
    "regenerate_batch_size": click.option(
        "--regenerate-batch-size",
        type=int,
        default=D.regenerate_batch_size,
        show_default=True,
        help="--regenerate: prompts per generate call, whose answers are saved together as the call returns (a rerun "
        "continues after them); more keeps the engine fuller at the end of each call.",
    ),
    "dtype": click.option(
        "--dtype",
        type=click.Choice(CHOICES["dtype"]),
        default=D.dtype,
        show_default=True,
        help="Model dtype, and the dtype of the stored hidden states.",
    ),
    "batch_size": click.option(
        "--batch-size",
        type=int,
        default=D.batch_size,
        show_default=True,
        help="Samples handed to vLLM per generate call (progress is reported per call).",
    ),
    "max_num_batched_tokens": click.option(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="Token budget of one engine step; smaller values lower peak memory. [default: vLLM's]",
    ),
    "engine_args": engine_arg_option(
        "Further vllm.LLM keyword argument, VALUE parsed as JSON when it can be; repeatable "
        "(e.g. --engine-arg gpu_memory_utilization=0.85)."
    ),
    "decoder_path": click.option(
        "--decoder-path",
        default=None,
        help="Dotted path of the module that owns the decoder `layers`, when the search cannot tell "
        "(e.g. language_model.model).",
    ),
    "trust_remote_code": click.option(
        "--trust-remote-code", is_flag=True, help="Allow the model's own Python code (config, tokenizer)."
    ),
    "overwrite": click.option("--overwrite", is_flag=True, help="Replace an existing extraction in --output."),
    "storage_dtype": click.option(
        "--storage-dtype",
        type=click.Choice(CHOICES["storage_dtype"]),
        default=D.storage_dtype,
        show_default=True,
        help="'model' stores the model dtype; 'fp8' stores speculators' FP8 layout (float8_e4m3fn values and a "
        "float32 scale per token), half the bytes of bf16.",
    ),
    "format": click.option(
        "--format",
        type=click.Choice(CHOICES["format"]),
        default=D.format,
        show_default=True,
        help="'speculators-legacy' writes speculators 0.3/0.4's data_{i}.pt files (layer ids translated to that "
        "version's numbering of layer outputs, recorded in the manifest).",
    ),
    "writer_threads": click.option(
        "--writer-threads",
        type=click.IntRange(min=1),
        default=None,
        help="Threads writing hidden-state files on the writing rank. [default: one per two CPU cores, 2 to 8]",
    ),
    "tokenize_processes": click.option(
        "--tokenize-processes",
        type=click.IntRange(min=0),
        default=None,
        help="Worker processes tokenizing the data ahead of the engine; 0 tokenizes in a thread of the driver. "
        "[default: 0 for a data source under 32 MiB, else one per four CPU cores, 1 to 8]",
    ),
    "host_memory": click.option(
        "--host-memory",
        type=float,
        default=D.host_memory,
        metavar="GIB",
        help="Host memory the captured states may hold at once (step buffers, open prompts, rows waiting for the "
        "disk); when it is spent the forward pass waits for the writer, and an open prompt that does not fit is "
        "run again alone. [default: an eighth of RAM, 2 to 32 GiB]",
    ),
    "stall_timeout": click.option(
        "--stall-timeout",
        type=float,
        default=D.stall_timeout,
        show_default=True,
        metavar="SECONDS",
        help="Stop with one line (and stop the engine) when the run makes no progress for this long: a stalled "
        "collective, a hung GPU, a disk that blocks the writer. 0: never.",
    ),
    "check_disk": click.option(
        "--no-disk-check",
        "check_disk",
        is_flag=True,
        flag_value=False,
        default=D.check_disk,
        help="Start even when the estimated output is larger than the free disk space (e.g. space freed during "
        "the run).",
    ),
    "states": click.option(
        "--states",
        type=click.Choice(CHOICES["states"]),
        default=D.states,
        show_default=True,
        help="'none' writes the dataset files without hidden states (no engine): speculators' online trainer "
        "reads the rows already in hidden_states/ and asks `eagle-extract serve` for the rest.",
    ),
    "host": click.option("--host", default="127.0.0.1", show_default=True, help="Address the server listens on."),
    "port": click.option("--port", type=int, default=8000, show_default=True, help="TCP port the server listens on."),
    "spool": click.option(
        "--spool",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Folder the state files are written into, in a fresh subfolder; the trainer must see it at the same "
        "path (one machine, or a shared filesystem). [default: the system's temporary folder]",
    ),
    "spool_bytes": click.option(
        "--spool-bytes",
        type=float,
        default=None,
        help="Bytes of state files the spool may hold; a request waits for room while the trainer catches up. "
        "[default: half the spool filesystem's free space]",
    ),
    "spool_ttl": click.option(
        "--spool-ttl",
        type=float,
        default=600.0,
        show_default=True,
        metavar="SECONDS",
        help="A state file (or Mooncake object) no trainer collected in this long (a killed trainer) is removed.",
    ),
    "api_key": click.option(
        "--api-key", default=None, help="Bearer token every request must send (for a server not on loopback)."
    ),
    "served_model_name": click.option(
        "--served-model-name",
        default=None,
        help="Model name /v1/models gives; speculators' trainer requires its --verifier-name-or-path. "
        "[default: --model as given]",
    ),
    "transfer": click.option(
        "--transfer",
        type=click.Choice(["file", "mooncake"]),
        default="file",
        show_default=True,
        help="How the trainer gets each row's states: 'file', a file in --spool (one machine, or a shared folder); "
        "'mooncake', an object in a Mooncake store (speculators' `--hidden-states-backend mooncake`: the trainer "
        "may run on another node). The --mooncake-* options are those of speculators' launcher.",
    ),
}


def _mooncake_options(command):
    """The Mooncake options of speculators' launcher (hs-connectors' MooncakeBackend): its names and defaults."""
    for option in reversed([
        click.option("--mooncake-master", default=M.master, show_default=True, help="The Mooncake master's HOST:PORT."),
        click.option("--mooncake-metadata-server", default=M.metadata_server, show_default=True,
                     help="Mooncake's metadata server, or P2PHANDSHAKE."),
        click.option("--mooncake-protocol", type=click.Choice(["tcp", "rdma"]), default=M.protocol, show_default=True,
                     help="How the store moves the rows between nodes."),
        click.option("--mooncake-device", default=M.device, help="RDMA device(s), e.g. mlx5_0,mlx5_1 [default: "
                     "Mooncake's choice]"),
        click.option("--mooncake-global-segment-gib", type=float, default=M.global_segment_gib, show_default=True,
                     help="Memory this server lends the store, where rows wait for the trainer (filled to 80% at "
                     "most, then requests wait)."),
        click.option("--mooncake-local-buffer-gib", type=float, default=M.local_buffer_gib, show_default=True,
                     help="The Mooncake client's own staging buffer (rows are put from buffers of the server's)."),
        click.option("--mooncake-writer-threads", type=int, default=M.writer_threads, show_default=True,
                     help="Rows put into the store at once."),
    ]):  # fmt: skip
        command = option(command)
    return command


OPTION["mooncake"] = _mooncake_options


def options(*names: str):
    """The named OPTIONs as the decorators of one command, listed in its --help in this order."""

    def apply(command):
        for name in reversed(names):
            command = OPTION[name](command)
        return command

    return apply


EXTRACT_OPTIONS = (
    "model",
    "data",
    "data_format",
    "strict",
    "output",
    "layers",
    "tp",
    "pp",
    "dp",
    "shard",
    "max_samples",
    "seq_length",
    "long_samples",
    "regenerate",
    "temperature",
    "top_p",
    "max_new_tokens",
    "seed",
    "regenerate_batch_size",
    "dtype",
    "batch_size",
    "max_num_batched_tokens",
    "engine_args",
    "decoder_path",
    "trust_remote_code",
    "overwrite",
    "storage_dtype",
    "format",
    "writer_threads",
    "tokenize_processes",
    "host_memory",
    "stall_timeout",
    "check_disk",
    "states",
)


@main.command("extract", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@options(*EXTRACT_OPTIONS)
def extract_command(**options):
    """Capture EAGLE-3 training hidden states from a model running in vLLM.

    Writes speculators' offline layout: an Arrow dataset (input_ids, loss_mask, seq_len),
    token_freq.pt, hidden_states/hs_{i}.safetensors ([tokens, slots, hidden]) and a manifest.
    With no options it extracts the bundled SmolLM2 model over the bundled conversations.
    Rerunning an interrupted command resumes it. Check an output with `eagle-extract verify DIR`.
    """
    _summarise(_run_or_fail(api.extract, **options))


SERVE_OPTIONS = (
    "model", "layers", "tp", "seq_length", "dtype", "storage_dtype", "batch_size", "max_num_batched_tokens",
    "engine_args", "decoder_path", "trust_remote_code", "writer_threads", "host_memory", "stall_timeout",
    "host", "port", "spool", "spool_bytes", "spool_ttl", "api_key", "served_model_name", "transfer", "mooncake",
)  # fmt: skip


@main.command("serve", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@options(*SERVE_OPTIONS)
def serve_command(host, port, spool, spool_bytes, spool_ttl, api_key, served_model_name, transfer, **options):
    """Serve each prompt's hidden states over HTTP to speculators' online trainer.

    Answers speculators 0.9's loader (`speculators train --vllm-endpoint http://HOST:PORT/v1`) as vLLM's
    hidden-states connector does: each request's states are a safetensors file in the spool, named in
    the answer's kv_transfer_params; the trainer reads and deletes it. With --transfer mooncake each is an
    object in a Mooncake store instead, for a trainer on another node. SIGTERM or Ctrl-C finishes the
    requests in flight, removes the spool's files (and objects) and exits 0.
    """
    from .serve import ServeOptions, serve

    opts = ServeOptions(host, port, spool, spool_bytes, spool_ttl, api_key, served_model_name)
    ctx = click.get_current_context()
    store = {k: options.pop(k) for k in [k for k in options if k.startswith("mooncake_")]}
    if transfer == "mooncake":
        opts.mooncake = StoreSettings(**{k.removeprefix("mooncake_"): v for k, v in store.items()})
    elif stray := [k for k in store if ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT]:
        option = "--" + stray[0].replace("_", "-")
        raise click.ClickException(f"{option} is for --transfer mooncake; add that, or leave it out")
    given = ctx.get_parameter_source("seq_length") is not click.core.ParameterSource.DEFAULT
    opts.whole_context = not given  # a trainer's rows can be as long as the model takes

    def run(log):
        cfg = ExtractConfig.from_options(**options)
        opts.served_model_name = opts.served_model_name or cfg.model
        return serve(cfg.resolved(), opts, log=log)

    raise SystemExit(_run_or_fail(run, interrupted="interrupted before the server was ready; nothing was kept"))


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("output", type=click.Path(exists=True, file_okay=False, path_type=Path))
def merge(output):
    """Complete a sharded output once every shard (--shard I/N) has finished: write the Arrow
    dataset, token_freq.pt and the manifest. Names the shards still missing."""
    _summarise(_run_or_fail(lambda log: api.merge(output)))


def _run_or_fail(fn, *args, interrupted="interrupted; every completed row is kept: rerun the same command to resume",
                 **kwargs):  # fmt: skip
    """Run the job; user-facing failures and SIGINT/SIGTERM become one line and exit 1."""
    stop_on_signals()  # a scheduler's stop: leave resumable, like Ctrl-C
    try:
        return fn(*args, log=click.echo, **kwargs)
    except ExtractError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        raise click.ClickException(interrupted) from None


def _summarise(summary: api.Summary) -> None:
    output = summary.output
    if not summary.complete:  # one shard of several
        waiting = ", ".join(f"{k}/{summary.shard.split('/')[1]}" for k in summary.waiting_for)
        click.echo(
            f"shard {summary.shard} done: {summary.rows} samples ({summary.tokens_per_s:,.0f} tokens/s; engine start "
            f"{summary.engine_start_s:.1f} s); the dataset is completed when shard(s) {waiting or '-'} "
            f"finish, or by `eagle-extract merge {output}`"
        )
        return
    click.echo(
        f"done: {summary.rows} samples, {summary.tokens} tokens, "
        f"{summary.bytes_written / 2**20:.1f} MiB in {summary.extract_s:.1f} s "
        f"({summary.tokens_per_s:,.0f} tokens/s; engine start {summary.engine_start_s:.1f} s); "
        f"truncated {summary.truncated}, skipped {summary.skipped} "
        f"({summary.skipped_long} over --seq-length)"
        + (f"; resumed: {summary.resumed_rows} rows kept" if summary.resumed_rows else "")
        + (f", {summary.redone_rows} damaged files written again" if summary.redone_rows else "")
    )
    if summary.skipped_rows:
        click.echo(f"skipped rows and why: {summary.skipped_rows}")
    click.echo(f"output: {Path(output).resolve()}")
    if summary.legacy_layer_ids:
        click.echo(f"legacy layer ids (outputs of layers): {summary.legacy_layer_ids}")
        return
    ids = " ".join(map(str, summary.aux_layer_ids))  # speculators takes a space-separated list
    click.echo(
        f"train on it: speculators train --verifier-name-or-path {shlex.quote(str(summary.model))} "
        f"--data-path {shlex.quote(str(output))} "
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
    report = api.verify(output, progress=True)
    if report.ok:
        click.echo(f"ok: {output} passes every check")
        return
    blocking = [why for row, why in report.problems if not repairable(row, why)]
    fix = "restore the manifest from a copy, or rerun the extraction with --overwrite"
    if not (output / MANIFEST).exists():  # nothing to repair from: the one problem says what to do
        raise click.ClickException(blocking[0])
    if blocking and len(report.problems) == 1:
        raise click.ClickException(blocking[0] if "--overwrite" in blocking[0] else f"{blocking[0]}; {fix}")
    for row, why in report.problems:
        click.echo(f"{'row ' + str(row) if row is not None else 'output'}: {why}", err=True)
    if blocking:  # a repair reruns rows from the manifest: it cannot vouch for the manifest itself
        raise click.ClickException(f"{len(report.problems)} problem(s) in {output}, some in its manifest; {fix}")
    if not repair:
        raise click.ClickException(
            f"{len(report.problems)} problem(s) in {output}; `eagle-extract verify --repair {output}` fixes them"
        )
    summary = _run_or_fail(api.repair, output, report.rows)
    click.echo(f"repaired: {output} passes every check ({summary.rows} rows)")
