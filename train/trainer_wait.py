"""How long speculators' trainer waited for data, per epoch, from its console log (its step profile).

    python train/trainer_wait.py OFFLINE_LOG [ONLINE_LOG] [--json FILE]

speculators 0.9 profiles every step at its default --log-freq 1: `profile/fetch_ms` is the step's wait for its
batch from the loader workers, `profile/step_ms` the whole step with that wait.  Its console handler (rich)
wraps a record at the terminal's width, so the trainer must run with a wide one: `COLUMNS=4000`, as
train/end_to_end.sh runs it.  The first epoch holds the trainer's own warm-up (tens of seconds in its first
step), so the comparison is per epoch after the first.  With two logs the last line is online's wait over
offline's: the issue's target is at most 1.2.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import click

PAIR = re.compile(r"([\w/]+)=([^,\s]+)")


def epochs(log: Path) -> list[dict]:
    """Steps, seconds and seconds waiting for data, per epoch, in the order the log has them."""
    per: dict[int, dict] = {}
    for line in log.read_text(errors="replace").splitlines():
        if "profile/fetch_ms=" not in line:
            continue
        fields = dict(PAIR.findall(line))
        if "profile/step_ms" not in fields or "epoch" not in fields:
            raise click.ClickException(
                f"{log}: a step's record is cut ({line.strip()[:80]}...): run the trainer with a wide console "
                "(COLUMNS=4000), as train/end_to_end.sh does"
            )
        epoch = per.setdefault(int(fields["epoch"]), {"steps": 0, "seconds": 0.0, "waiting_s": 0.0})
        epoch["steps"] += 1
        epoch["seconds"] += float(fields["profile/step_ms"]) / 1000
        epoch["waiting_s"] += float(fields["profile/fetch_ms"]) / 1000
    if not per:
        raise click.ClickException(
            f"{log}: no step profile (profile/fetch_ms) in it: is it speculators' console output, "
            "trained with --log-freq 1 (its default)?"
        )
    return [{"epoch": e, **per[e]} for e in sorted(per)]


def after_first(rows: list[dict], key: str) -> float | None:
    """The median of an epoch's figure after the trainer's warm-up epoch (None with one epoch)."""
    return statistics.median(r[key] for r in rows[1:]) if len(rows) > 1 else None


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="write the figures here")
def main(logs: tuple[Path, ...], json_path: Path | None) -> None:
    if len(logs) > 2:
        raise click.UsageError("give the offline trainer's log, then optionally the online one's")
    result = {}
    for name, log in zip(("offline", "online"), logs):
        rows = epochs(log)
        result[name] = {"log": str(log), "epochs": rows, "epoch_s_after_first": after_first(rows, "seconds"),
                        "waiting_s_after_first": after_first(rows, "waiting_s")}  # fmt: skip
    click.echo("| log | epoch | steps | epoch s | waiting for data s |\n|---|---|---|---|---|")
    for name in result:
        for r in result[name]["epochs"]:
            click.echo(f"| {name} | {r['epoch']} | {r['steps']} | {r['seconds']:.2f} | {r['waiting_s']:.2f} |")
    if len(logs) == 2:
        offline, online = result["offline"]["waiting_s_after_first"], result["online"]["waiting_s_after_first"]
        if offline is None or online is None:
            raise click.ClickException("each log needs two epochs or more: the first is the trainer's warm-up")
        result["online_over_offline_waiting"] = online / offline if offline else None
        ratio = f"{online / offline:.2f}x" if offline else "offline never waited"
        click.echo(f"waiting for data per epoch after the first (median): offline {offline:.2f} s, "
                   f"online {online:.2f} s ({ratio})")  # fmt: skip
    if json_path:
        json_path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
