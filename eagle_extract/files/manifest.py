"""The manifest, OUT/eagle_extract.json: what a complete output holds and how it was made.

It is written last, so its presence marks the output complete.  Each field is declared once, in
`Manifest`, in the order written: what `verify` requires of its value, whether every release wrote it
(verify says so when it is missing), and what a manifest of an earlier release that lacks it is read
with, so that earlier outputs still read and verify.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..atomic import write_record
from ..config import LEGACY
from ..errors import ExtractError

MANIFEST = "eagle_extract.json"
OFFLINE = "speculators-offline"
FORMATS = (OFFLINE, LEGACY)
MODEL_DTYPES = ("bfloat16", "float16", "float32")


class ManifestError(ExtractError, ValueError):
    pass


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no count


def _count(low: int):
    return lambda v: _int(v) and v >= low


def _ids(value) -> bool:
    return isinstance(value, list) and all(map(_int, value))


def _field(test=None, what: str = "", always: bool = False, default=None):
    """`test`: what `verify` requires of the value (said as `what`); `always`: every release wrote the
    field; `default`: what a manifest that lacks it is read with."""
    return field(default=default, metadata={"test": test, "what": what, "always": always})


POSITIVE, NON_NEGATIVE, IDS, OBJECT = "a positive integer", "a non-negative integer", "a list of integers", "an object"


@dataclass(kw_only=True)
class Manifest:
    """Every field of the manifest, in the order written; the comments say what the less plain ones hold."""

    format: str = _field(lambda v: v in FORMATS, " or ".join(map(json.dumps, FORMATS)), default=OFFLINE)
    states: str = _field(default="all")  # "none": rows without a file get their states from `eagle-extract serve`
    row_checksums: bool = _field(default=False)  # every row's header carries one: verify refuses a row without
    identity: dict | None = _field(lambda v: isinstance(v, dict), OBJECT)  # what a resumed or repaired run matches
    config: dict | None = _field(lambda v: isinstance(v, dict), OBJECT)  # the options, which a repair reruns
    model: str | None = _field(lambda v: isinstance(v, str), "a string", always=True)
    aux_layer_ids: list[int] | None = _field(_ids, IDS, always=True)
    final_layer_id: int | None = _field(_count(1), POSITIVE, always=True)
    slot_layer_ids: list[int] | None = _field(_ids, IDS, always=True)
    layer_convention: str | None = _field()
    legacy_layer_ids: list[int] | None = _field(lambda v: v is None or _ids(v), "a list of integers or null")
    dtype: str | None = _field(lambda v: v in MODEL_DTYPES, '"bfloat16", "float16" or "float32"', always=True)
    storage_dtype: str | None = _field(  # read as dtype when missing: earlier releases stored rows in it
        lambda v: v in (*MODEL_DTYPES, "float8_e4m3fn"), 'the dtype or "float8_e4m3fn"'
    )
    hidden_size: int | None = _field(_count(1), POSITIVE, always=True)
    num_samples: int | None = _field(_count(0), NON_NEGATIVE, always=True)
    num_tokens: int | None = _field(_count(0), NON_NEGATIVE, always=True)
    num_loss_tokens: int | None = _field(_count(0), NON_NEGATIVE)
    seq_length: int | None = _field(_count(1), POSITIVE)
    truncated: int | None = _field()
    skipped: int | None = _field()
    skipped_long: int | None = _field()
    regenerated: dict | None = _field()
    source_row_ranges: list | None = _field()  # dataset row i is the i-th source row these cover
    data: dict | None = _field()
    tensor_parallel_size: int | None = _field()
    pipeline_parallel_size: int | None = _field()
    engine_args: dict | None = _field()
    shards: int | None = _field()
    resumed_rows: int = _field(default=0)
    redone_rows: int = _field(default=0)  # kept files found damaged on resume
    tokenized_rows: int = _field(default=0)  # by the last run of each job
    waited_for_tokens_s: float = _field(default=0.0)
    capture: dict | list | None = _field()  # one run's capture statistics, or each shard's
    timing: dict | None = _field()  # engine_start_s, extract_s, tokens_per_s
    bytes_written: int | None = _field()  # of the rows' files
    versions: dict | None = _field()

    @classmethod
    def of(cls, record: dict) -> Manifest:
        """From a manifest's JSON object, an earlier release's too (the fields it lacks read as their
        defaults); fields this release does not know are left out."""
        known = {f.name for f in fields(cls)}
        return cls(**{"storage_dtype": record.get("dtype"), **{k: v for k, v in record.items() if k in known}})

    @classmethod
    def read(cls, output: Path) -> Manifest:
        return cls.of(read_manifest(output))

    def record(self) -> dict:
        """The JSON object written, its keys in the fields' order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def write(self, output: Path) -> None:
        write_manifest(output, self.record())


def write_manifest(output: Path, record: dict) -> None:
    write_record(Path(output) / MANIFEST, record)


def read_manifest(output: Path) -> dict:
    """The manifest as a JSON object; a damaged or hand-broken one raises ManifestError (one line)."""
    path = Path(output) / MANIFEST
    fix = "restore it from a copy, or rerun the extraction with --overwrite"
    if path.exists() and not path.is_file():  # a folder; a pipe would block its reader for ever
        raise ManifestError(f"{path} is not a regular file: {fix}")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ManifestError(f"{path} cannot be read ({exc.strerror or exc}): {fix}") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno} col {exc.colno}): {fix}") from None
    except UnicodeDecodeError:
        raise ManifestError(f"{path} is not text: {fix}") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path} is JSON but not an object: {fix}")
    return manifest
