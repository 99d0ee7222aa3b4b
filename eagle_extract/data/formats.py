"""Dataset rows in, one of three record kinds out: a conversation, token ids, or plain text.

Sources: a JSON list or JSONL file (either may be gzip-compressed), a Parquet file, or a folder
written by `datasets.save_to_disk` (which is also what speculators' `prepare-data` writes).
Row formats, detected per row unless forced:

    messages   {"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?}, ...]}
    sharegpt   {"conversations": [{"from", "value"}, ...]}  (role/content turns accepted too)
    alpaca     {"instruction", "input"?, "output", "system"?}
    tokens     {"input_ids": [...], "loss_mask"?: [...]}    (loss on every token if no mask)
    text       {"text": "..."}                               (loss on every token)
    questions  {"turns": ["question", ...]}                  (user turns only: needs --regenerate)
"""

from __future__ import annotations

import codecs
import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import ExtractError

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "tool": "tool",
}
ROLES = {"system", "user", "assistant", "tool"}
_KEYS = {  # the key that marks each format, in detection order
    "messages": "messages",
    "sharegpt": "conversations",
    "alpaca": "instruction",
    "tokens": "input_ids",
    "text": "text",
    "questions": "turns",
}


class BadRow(ValueError):
    """A row that cannot become a training sample; the message says why."""


class DataError(ExtractError, ValueError):
    """The data source as a whole is unusable."""


@dataclass
class Record:
    """One usable row: exactly one of messages, input_ids or text is set."""

    row: int
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    text: str | None = None


def is_dataset_folder(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def load_saved(path: Path):
    """datasets' load_from_disk, with a folder it cannot read (an Arrow file missing, a damaged state file) as
    one line."""
    from datasets import load_from_disk

    try:
        return load_from_disk(str(path))
    except (OSError, ValueError, KeyError) as exc:
        said = (str(exc).splitlines() or [""])[0][:200]
        raise DataError(
            f"--data {path}: the saved dataset cannot be read ({type(exc).__name__}: {said}); save it again"
        ) from None


def _dataset_rows(path: Path) -> Iterator[tuple[int, object]]:
    from datasets import DatasetDict

    ds = load_saved(path)
    if isinstance(ds, DatasetDict):
        if "train" not in ds and len(ds) != 1:
            raise DataError(f"{path} holds splits {', '.join(ds)}; pass the folder of one split to --data")
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    ds = ds.with_format(None)  # prepare-data saves torch-formatted columns; rows here are plain lists
    for i in range(len(ds)):
        yield i, ds[i]


_BOM = b"\xef\xbb\xbf"
_OTHER_FORMATS = {  # leading bytes of files people pass that --data cannot read, and what they are
    b"\x28\xb5\x2f\xfd": "zstd-compressed",
    b"BZh": "bzip2-compressed",
    b"\xfd7zXZ\x00": "xz-compressed",
    b"PK\x03\x04": "a zip archive",
    b"ARROW1": "an Arrow IPC file",
    b"\x89HDF": "an HDF5 file",
}
_TAKES = "--data takes JSON or JSONL (either may be gzip-compressed), Parquet, or a saved dataset folder"


def _parquet_rows(path: Path) -> Iterator[tuple[int, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        number = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield number, row
                number += 1
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path} is not a readable Parquet file ({str(exc).splitlines()[0]}); {_TAKES}") from None


def _open(path: Path, gzipped: bool):
    return gzip.open(path, "rb") if gzipped else path.open("rb")


def _utf8(data: bytes) -> bool:
    try:  # incremental: a character cut at the end (by the 1 MiB boundary) is not an error
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
        return True
    except UnicodeDecodeError:
        return False


def _mostly_utf8(head: bytes) -> bool:
    """Whether most lines of the file's first MiB are UTF-8 (the last may be cut by the MiB)."""
    lines = head.split(b"\n")
    return sum(map(_utf8, lines)) * 2 >= len(lines)


def _text_rows(path: Path, gzipped: bool) -> Iterator[tuple[int, object]]:
    """JSON list or JSONL rows, UTF-8 with or without a BOM; a JSONL line that is not UTF-8 is a bad row."""
    with _open(path, gzipped) as f:
        head = f.read(1 << 20).removeprefix(_BOM)
    if b"\0" in head or not _mostly_utf8(head):  # a binary file, not text with a few bad lines
        raise DataError(f"{path} is not UTF-8 text; {_TAKES}")
    if head.lstrip()[:1] == b"[":
        with _open(path, gzipped) as f:
            raw = f.read().removeprefix(_BOM)
        try:
            rows = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text at byte {exc.start}; convert the file to UTF-8") from None
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} is not valid JSON ({exc}); fix the file or convert it to JSONL") from None
        except RecursionError:
            raise DataError(f"{path} nests JSON too deeply to read; fix the file or convert it to JSONL") from None
        except ValueError as exc:  # a number of over 4,300 digits (Python's limit)
            raise DataError(f"{path} cannot be read as JSON ({exc}); fix the file or convert it to JSONL") from None
        yield from enumerate(rows)
        return
    with _open(path, gzipped) as f:
        for number, line in enumerate(f):
            if number == 0:
                line = line.removeprefix(_BOM)
            if not line.strip():
                continue
            try:
                yield number, json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as exc:
                yield number, BadRow(f"line is not UTF-8 text (byte {exc.start} of the line)")
            except json.JSONDecodeError as exc:
                yield number, BadRow(f"malformed JSON line ({exc.msg}: column {exc.colno})")
            except RecursionError:
                yield number, BadRow("JSON nested too deeply to read")
            except ValueError:  # Python reads no integer of over 4,300 digits
                yield number, BadRow("a number too long to read (over 4,300 digits)")


def _file_rows(path: Path) -> Iterator[tuple[int, object]]:
    with path.open("rb") as f:
        magic = f.read(8)
    if magic.startswith(b"PAR1"):
        return _parquet_rows(path)
    what = next((name for start, name in _OTHER_FORMATS.items() if magic.startswith(start)), None)
    if what:
        raise DataError(f"{path} is {what}; {_TAKES}")
    return _guard_gzip(path, _text_rows(path, gzipped=magic.startswith(b"\x1f\x8b")))


def _guard_gzip(path: Path, rows: Iterator) -> Iterator[tuple[int, object]]:
    """A cut or damaged .gz file is one line, wherever the damage is."""
    try:
        yield from rows
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DataError(f"{path} is a damaged gzip file ({exc}); download or compress it again") from None


def read_rows(path: Path) -> Iterator[tuple[int, object]]:
    """Yield (row number, parsed row); for JSONL the number is the 0-based line number.
    A line that is not JSON yields a BadRow in place of the row."""
    path = Path(path)
    if is_dataset_folder(path):
        return _dataset_rows(path)
    if path.is_dir():
        raise DataError(
            f"--data {path} is a folder but not a saved dataset (no dataset_info.json); "
            "pass a .json/.jsonl file or a folder written by datasets' save_to_disk"
        )
    if path.exists() and not path.is_file():
        raise DataError(
            f"--data {path} is not a regular file (a pipe or a device); save the rows to a file and pass that"
        )
    if not path.is_file():
        raise DataError(f"data file not found: {path}; pass an existing JSON, JSONL or Parquet file to --data")
    return _file_rows(path)


def count_rows(path: Path) -> int:
    """About how many rows `read_rows` yields, without parsing them (lines, for JSONL): for the disk estimate."""
    path = Path(path)
    if is_dataset_folder(path):
        from datasets import DatasetDict

        ds = load_saved(path)
        if isinstance(ds, DatasetDict):  # the split _dataset_rows reads
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return len(ds)
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == b"PAR1":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    try:
        with _open(path, magic.startswith(b"\x1f\x8b")) as f:
            if f.read(1 << 20).removeprefix(_BOM).lstrip()[:1] == b"[":
                return sum(1 for _ in read_rows(path))  # a JSON list is parsed whole anyway
            f.seek(0)
            lines, last = 0, b"\n"
            for block in iter(lambda: f.read(16 << 20), b""):
                lines, last = lines + block.count(b"\n"), block[-1:]
            return lines + (last != b"\n")
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DataError(f"{path} is a damaged gzip file ({exc}); download or compress it again") from None


def row_format(row: object, forced: str = "auto") -> str:
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"row is a {type(row).__name__}, expected an object")
    if forced != "auto":
        if _KEYS[forced] not in row:
            raise BadRow(f"row has no '{_KEYS[forced]}' (--data-format {forced}; keys: {', '.join(sorted(row))})")
        return forced
    for fmt, key in _KEYS.items():
        if row.get(key) is not None:
            return fmt
    raise BadRow(
        f"row matches no known format (keys: {', '.join(sorted(row))}); expected one of "
        "messages, conversations, instruction/output, input_ids, text, turns"
    )


def _check_messages(messages: list[dict], need_assistant: bool) -> list[dict]:
    for m in messages:
        if not isinstance(m["role"], str):
            raise BadRow(f"a role is a {type(m['role']).__name__}, expected one of {', '.join(sorted(ROLES))}")
        if m["role"] not in ROLES:
            raise BadRow(f"unknown role '{m['role']}'")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise BadRow(f"{m['role']} message content is a {type(content).__name__}, expected text")
        if not (content or "").strip() and not m.get("tool_calls") and not m.get("reasoning_content"):
            raise BadRow(f"empty {m['role']} message")
    if messages[0]["role"] == "assistant":  # a chat template cannot render the turns before it: there are none
        raise BadRow("the conversation starts with an assistant turn; drop it or put the user's turn first")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn; pass --regenerate to have the model write the answers")
    if not any(m["role"] == "user" for m in messages):
        raise BadRow("no user turn")
    return messages


def _turn_list(row: dict, key: str) -> list:
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"'{key}' is not a non-empty list")
    return turns


def conversation(row: dict, fmt: str, need_assistant: bool = True) -> list[dict]:
    """The row as [{"role", "content", ...}, ...] for the chat template."""
    if fmt == "messages" or fmt == "sharegpt":
        messages = []
        for turn in _turn_list(row, _KEYS[fmt]):
            if isinstance(turn, dict) and "role" in turn:
                messages.append({k: v for k, v in turn.items() if v is not None or k == "role"})
            elif isinstance(turn, dict) and "from" in turn and "value" in turn:
                role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
                if role is None:
                    raise BadRow(f"unknown ShareGPT speaker '{turn['from']}'")
                messages.append({"role": role, "content": turn["value"]})
            else:
                raise BadRow("a turn has neither 'role' nor 'from'/'value'")
    elif fmt == "alpaca":
        prompt = str(row.get("instruction") or "")
        if row.get("input"):
            prompt += "\n\n" + str(row["input"])
        messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        messages.append({"role": "user", "content": prompt})
        if row.get("output") is not None:
            messages.append({"role": "assistant", "content": row["output"]})
    elif fmt == "questions":
        messages = [{"role": "user", "content": q} for q in _turn_list(row, "turns")]
    else:
        raise BadRow(f"a {fmt} row is not a conversation")
    return _check_messages(messages, need_assistant)


def _int_list(value, name: str) -> list[int]:
    if isinstance(value, tuple):
        value = list(value)
    ints = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    if not ints or not value:
        raise BadRow(f"'{name}' is not a non-empty list of non-negative integers")
    return value


def to_record(number: int, row: object, forced: str = "auto", need_assistant: bool = True) -> Record:
    fmt = row_format(row, forced)
    if fmt == "tokens":
        ids = _int_list(row["input_ids"], "input_ids")
        mask = row.get("loss_mask")
        mask = [1] * len(ids) if mask is None else _int_list(mask, "loss_mask")
        if len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
            raise BadRow(f"'loss_mask' must be {len(ids)} zeros and ones, one per input id")
        return Record(number, input_ids=ids, loss_mask=mask)
    if fmt == "text":
        if not isinstance(row["text"], str) or not row["text"].strip():
            raise BadRow("empty 'text'")
        return Record(number, text=row["text"])
    return Record(number, messages=conversation(row, fmt, need_assistant))
