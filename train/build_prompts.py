"""Build the training prompts of the end-to-end run: each conversation's user turns, N copies.

    python train/build_prompts.py OUT.jsonl --copies 4 FILE [FILE ...]

Reads ShareGPT JSON lists, OpenAI-messages JSONL and alpaca seed tasks (`instruction` plus the
first instance's `input`), keeps the user and system turns only (`eagle-extract --regenerate`
lets the model write every answer) and writes each conversation `--copies` times as
`{"messages": [...]}` lines.  Copies sit on different rows, and regeneration seeds each row
with `--seed` plus its row number, so at a temperature above 0 every copy gets its own answer.

Conversations whose kept turns repeat an earlier one are dropped (the bundled ShareGPT sample
has 154 distinct ones among its 500), and a conversation's copies sit on adjacent rows.
speculators validates on the last 10 % of the rows, unshuffled; with the copies adjacent and no
repeats, those rows are conversations the training rows never saw, but for the one the cut falls
inside (with the copies in blocks, the validation rows repeated training prompts and validation
accuracy measured memorisation: docs/results/NOTES_training.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

ROLES = {"human": "user", "user": "user", "system": "system"}


def questions(path: Path) -> list[list[dict]]:
    text = path.read_text(encoding="utf-8")
    rows = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines() if line]
    chats = []
    for row in rows:
        if "instruction" in row:
            extra = (row.get("instances") or [{}])[0].get("input") or row.get("input") or ""
            chats.append([{"role": "user", "content": "\n\n".join(p for p in (row["instruction"], extra) if p)}])
        elif "turns" in row:
            chats.append([{"role": "user", "content": turn} for turn in row["turns"]])
        else:
            turns = row.get("conversations") or row.get("messages") or []
            chats.append(
                [
                    {"role": ROLES[t.get("from", t.get("role"))], "content": t.get("value", t.get("content"))}
                    for t in turns
                    if t.get("from", t.get("role")) in ROLES
                ]
            )
    return [c for c in chats if any(m["role"] == "user" for m in c)]


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("inputs", type=click.Path(exists=True, dir_okay=False, path_type=Path), nargs=-1, required=True)
@click.option("--copies", type=int, default=4, show_default=True, help="sampled answers per conversation")
def main(out: Path, inputs: tuple[Path, ...], copies: int) -> None:
    read = [c for path in inputs for c in questions(path)]
    unique: dict[str, list[dict]] = {}
    for chat in read:  # first occurrence wins, in reading order
        unique.setdefault(json.dumps(chat, ensure_ascii=False), chat)
    chats = list(unique.values())
    with out.open("w", encoding="utf-8") as f:
        for chat in chats:
            for _ in range(copies):
                f.write(json.dumps({"messages": chat}, ensure_ascii=False) + "\n")
    click.echo(
        f"{len(chats)} conversations ({len(read) - len(chats)} repeated ones dropped) x {copies} copies = "
        f"{len(chats) * copies} rows -> {out}"
    )


if __name__ == "__main__":
    main()
