"""The `eagle-extract` command line: a thin shell over the Python API (`api.py`)."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import Field, fields
from pathlib import Path
from typing import get_args

import click

from ..config import ExtractConfig, ServeOptions, StoreSettings, option_name, options_of
from ..drafts import train_flags
from ..errors import ExtractError
from ..files.checks import repairable
from ..files.manifest import MANIFEST
from ..interrupts import stop_on_signals
from . import api


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


class _NamedPath(click.Path):
    """A path that is not empty: an unset shell variable (`--output "$OUT"`) would otherwise mean the
    current folder."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty or blank path; name the file or folder (. for the current one)", param, ctx)
        return super().convert(value, param, ctx)


def click_option(f: Field, help: str | None = None, show_default: bool = True):
    """A declared option (config.option) as click's decorator: a flag for a bool, repeatable KEY=VALUE pairs
    for the engine_args dict, else a value of the annotation's type.  `help` in place of the declared one
    (`show_default=False` where it words the default itself)."""
    meta, name = f.metadata, option_name(f)
    help = help or meta["help"] + (f" [default: {meta['shown']}]" if meta["shown"] else "")
    kind = (get_args(f.type) or (f.type,))[0]
    if kind is bool:
        return click.option(name, f.name, is_flag=True, flag_value=not f.default, default=f.default, help=help)
    if kind is dict:
        return click.option(name, f.name, multiple=True, metavar=meta["metavar"],
                            callback=lambda ctx, param, pairs: parse_engine_args(pairs), help=help)  # fmt: skip
    given = click.Choice(meta["choices"]) if meta["choices"] else _NamedPath(path_type=Path) if kind is Path else kind
    shown = show_default and f.default is not None and not meta["shown"]  # else --help has the words already
    return click.option(name, f.name, type=given, default=f.default, show_default=shown, metavar=meta["metavar"],
                        help=help)  # fmt: skip


def engine_arg_option(help: str):
    """extract's --engine-arg with another help, for the train/ scripts."""
    return click_option(next(f for f in fields(ExtractConfig) if f.name == "engine_args"), help)


class _ExtractByDefault(click.Group):
    """`eagle-extract [OPTIONS]` runs `extract`; `eagle-extract verify DIR` runs a named command."""

    def parse_args(self, ctx, args):
        if not args or args[0] not in self.commands:
            args = ["extract", *args]
        return super().parse_args(ctx, args)

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        """A mistyped command line is one line too (click's own adds the usage and a blank line before it)."""
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else "eagle-extract"
            click.echo(f"Error: {exc.format_message()} (see `{where} --help`)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)


@click.group(cls=_ExtractByDefault, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """eagle-extract: EAGLE-3 training data from models running in vLLM."""


SERVE_HELP = {  # options whose meaning or default differ in `serve`
    "seq_length": "Longest prompt served, in tokens. [default: the model's context less one, at most 32767]",
}


def options(face: str):
    """The options command `face` takes (config.options_of) as its decorators, listed in its --help in that order."""

    def apply(command):
        for f in reversed(options_of(face)):
            own = SERVE_HELP.get(f.name) if face == "serve" else None
            command = click_option(f, own, show_default=own is None)(command)
        return command

    return apply


@main.command("extract", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@options("extract")
def extract_command(**options):
    """Capture EAGLE-3 training hidden states from a model running in vLLM.

    Writes speculators' offline layout: an Arrow dataset (input_ids, loss_mask, seq_len),
    token_freq.pt, hidden_states/hs_{i}.safetensors ([tokens, slots, hidden]) and a manifest.
    With no options it extracts the bundled SmolLM2 model over the bundled conversations.
    Rerunning an interrupted command resumes it. Check an output with `eagle-extract verify DIR`.
    """
    _summarise(_run_or_fail(api.extract, **options), options["draft_kind"])


@main.command("serve", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@options("serve")
def serve_command(**options):
    """Serve each prompt's hidden states over HTTP to speculators' online trainer.

    Answers speculators 0.9's loader (`speculators train --vllm-endpoint http://HOST:PORT/v1`) as vLLM's
    hidden-states connector does: each request's states are a safetensors file in the spool, named in
    the answer's kv_transfer_params; the trainer reads and deletes it. With --transfer mooncake each is an
    object in a Mooncake store instead, for a trainer on another node. SIGTERM or Ctrl-C finishes the
    requests in flight, removes the spool's files (and objects) and exits 0.
    """
    from .serve import serve

    own = {f.name for f in fields(ServeOptions)}
    opts = ServeOptions(**{name: options.pop(name) for name in [*options] if name in own})
    ctx = click.get_current_context()
    store = {f: options.pop(f.name) for f in fields(StoreSettings)}
    if opts.transfer == "mooncake":
        opts.mooncake = StoreSettings(**{f.name: v for f, v in store.items()})
    elif stray := [f for f in store if ctx.get_parameter_source(f.name) is not click.core.ParameterSource.DEFAULT]:
        raise click.ClickException(f"{option_name(stray[0])} is for --transfer mooncake; add that, or leave it out")
    given = ctx.get_parameter_source("seq_length") is not click.core.ParameterSource.DEFAULT
    opts.whole_context = not given  # a trainer's rows can be as long as the model takes

    def run(log):
        cfg = ExtractConfig.from_options(**options)
        opts.served_model_name = opts.served_model_name or cfg.model
        if opts.replicas > 1 or opts.ray_address:
            try:
                from .fleet import serve_replicas
            except ImportError as exc:
                raise ExtractError(f"--replicas and --ray-address run on Ray Serve, which is not installed ({exc}); "
                                   "install it: pip install 'eagle-extract[replicas]'") from None  # fmt: skip
            return serve_replicas(cfg.resolved(), opts, log=log)
        return serve(cfg.resolved(), opts, log=log)

    raise SystemExit(_run_or_fail(run, interrupted="interrupted before the server was ready; nothing was kept"))


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("output", type=click.Path(exists=True, file_okay=False, path_type=Path))
def merge(output):
    """Complete a sharded output once every shard (--shard I/N) has finished: write the Arrow
    dataset, token_freq.pt and the manifest. Names the shards still missing."""
    _summarise(_run_or_fail(lambda log: api.merge(output, log)))


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


def serve_args(manifest: dict) -> list[str]:
    """`eagle-extract serve` capturing the states an output of `manifest` would hold: its model, layers, dtypes,
    length, TP, step budget, decoder and engine arguments (serve has no --pp: an output made with it gets its
    TP alone, and the GPUs a server needs are the user's to give)."""
    config = manifest.get("config") or {}
    cmd = ["eagle-extract", "serve", "--model", str(manifest["model"]),
           "--layers", ",".join(map(str, manifest["aux_layer_ids"])), "--dtype", manifest["dtype"],
           "--seq-length", str(manifest["seq_length"])]  # fmt: skip
    if manifest.get("storage_dtype") == "float8_e4m3fn":
        cmd += ["--storage-dtype", "fp8"]
    if config.get("tp", 1) > 1:
        cmd += ["--tp", str(config["tp"])]
    if config.get("max_num_batched_tokens"):
        cmd += ["--max-num-batched-tokens", str(config["max_num_batched_tokens"])]
    if config.get("decoder_path"):
        cmd += ["--decoder-path", str(config["decoder_path"])]
    if config.get("trust_remote_code"):
        cmd.append("--trust-remote-code")
    for key, value in (config.get("engine_args") or {}).items():  # plain where parse_engine_args reads it back
        pair = f"{key}={value}"
        cmd += ["--engine-arg", pair if parse_engine_args((pair,)) == {key: value} else f"{key}={json.dumps(value)}"]
    return cmd


def _summarise(summary: api.Summary, draft_kind: str | None = None) -> None:
    """The run's closing lines, ending with the command that trains `draft_kind` (else the recorded kind) on it."""
    output = summary.output
    if not summary.complete:  # one shard of several
        waiting = ", ".join(f"{k}/{summary.shard.split('/')[1]}" for k in summary.waiting_for)
        click.echo(
            f"shard {summary.shard} done: {summary.rows} samples ({summary.tokens_per_s:,.0f} tokens/s; engine start "
            f"{summary.engine_start_s:.1f} s); the dataset is completed when shard(s) {waiting or '-'} "
            f"finish, or by `eagle-extract merge {output}`"
        )
        return
    stateless = (summary.manifest or {}).get("states") == "none"
    written = (
        "the dataset files only (--states none)"
        if stateless
        else f"{summary.bytes_written / 2**20:.1f} MiB in {summary.extract_s:.1f} s "
        f"({summary.tokens_per_s:,.0f} tokens/s; engine start {summary.engine_start_s:.1f} s)"
    )
    click.echo(
        f"done: {summary.rows} samples, {summary.tokens} tokens, {written}; "
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
    model = shlex.quote(str(summary.model))
    online = ""
    if stateless:  # every row's states come from the server, which must capture them as this output would
        serve = serve_args(summary.manifest)
        click.echo(f"serve the states: {shlex.join(serve)}")
        port = ServeOptions.__dataclass_fields__["port"].default
        fp8 = " --hidden-states-backend fp8" if "--storage-dtype" in serve else ""  # the trainer reads what it serves
        online = f" --vllm-endpoint http://127.0.0.1:{port}/v1{fp8}"
    kind = draft_kind or ((summary.manifest or {}).get("config") or {}).get("draft_kind") or "eagle3"
    click.echo(
        f"train on it: speculators train --verifier-name-or-path {model} --data-path {shlex.quote(str(output))} "
        f"{shlex.join(train_flags(kind, summary.aux_layer_ids))}{online}"
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
