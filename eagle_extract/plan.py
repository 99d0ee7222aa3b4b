"""What one run will do, decided before anything is created.

The checked settings, the model's shape, the slots, the rows and their tokens, and the identity a
resumed run must match.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from . import preflight, shards
from .config import ExtractConfig
from .data import LoadReport, Sample, make_samples, read_records
from .layers import parse_layer_ids
from .preflight import ModelShape


@dataclass
class Plan:
    cfg: ExtractConfig
    shape: ModelShape
    aux_ids: list[int]
    tokenizer: object
    triples: list  # (record or None, source row, reason) from read_records
    identity: dict
    shard: tuple[int, int] | None

    @property
    def slot_ids(self) -> list[int]:
        return self.aux_ids + [self.shape.num_layers]

    @property
    def dtype(self) -> str:
        return self.identity["dtype"]

    def bytes_per_token(self) -> int:
        width = 1 if self.cfg.fp8 else (4 if self.dtype in ("float32", "float") else 2)
        return len(self.slot_ids) * self.shape.hidden_size * width + 12


def make_plan(cfg: ExtractConfig) -> Plan:
    """Every input check, in the order a user would fix them; `cfg` must be resolved()."""
    preflight.check_options(cfg)
    shard = shards.parse_shard(cfg.shard)
    shape = preflight.read_model_shape(cfg.model, cfg.trust_remote_code)
    aux_ids = parse_layer_ids(cfg.layers, shape.num_layers)
    preflight.check_layers(cfg, aux_ids)
    preflight.check_tp(cfg.tp, shape)
    preflight.check_pp(cfg.pp, shape)
    if cfg.regenerate:
        preflight.check_regenerate_room(cfg.seq_length, shape)
    preflight.check_weights(cfg)
    preflight.check_output_writable(cfg.output)
    tokenizer = preflight.load_tokenizer(cfg)
    triples = list(read_records(cfg.data, cfg.data_format, cfg.strict, need_assistant=not cfg.regenerate))
    return Plan(cfg, shape, aux_ids, tokenizer, triples, identity(cfg, shape, aux_ids), shard)


def identity(cfg: ExtractConfig, shape: ModelShape, aux_ids: list[int]) -> dict:
    """What a resumed run must share with the run it continues."""
    return {
        "model": str(Path(cfg.model).resolve()),
        "tokenizer": cfg.engine_args.get("tokenizer"),  # another tokenizer, other tokens
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


def plan_samples(plan: Plan, triples: list | None = None) -> tuple[list[Sample], LoadReport]:
    """The rows as samples (tokens and loss masks), from the plan's records or from `triples`."""
    cfg = plan.cfg
    options = dict(long_samples=cfg.long_samples, strict=cfg.strict, source=str(cfg.data))
    samples, report = make_samples(triples or plan.triples, plan.tokenizer, cfg.seq_length, cfg.max_samples, **options)
    preflight.check_context(max(len(s.input_ids) for s in samples), plan.shape)
    return samples, report
