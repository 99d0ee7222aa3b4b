"""How long speculators' trainer waited for data, per epoch, from its console log (its step profile).

    python train/trainer_wait.py OFFLINE_LOG [ONLINE_LOG] [--server BEFORE AFTER] [--json FILE]

speculators 0.9 profiles every step at its default --log-freq 1: `profile/fetch_ms` is the time from the end of
the step before to the step's batch on the GPU, which is mostly the wait for the loader workers but also holds the
trainer's own work between steps (logging the step before, a few ms; a checkpoint save; at an epoch's start its
validation).  A step after a checkpoint save ("Saving checkpoint to" in the log) is left out, so what is counted
is the wait and a few ms of logging a step, alike offline and online.  Its console handler (rich) wraps a record
at the terminal's width, so the trainer must run with a wide one (`COLUMNS=4000`, as train/end_to_end.sh runs it).
The first epoch holds the trainer's warm-up (tens of seconds in its first step), so the comparison is the mean
of the epochs after the first; with two logs the last line gives online's wait against offline's.  --server: the
online server's `GET /metrics` saved before and after the online trainer ran (one server: with `serve --replicas`
each scrape is one replica's), for what its engine did meanwhile
(rows a step, a row's time from its request to its answer, the engine's seconds busy and starved of requests).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import click

PAIR = re.compile(r"([\w/]+)=([^,\s]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours, where FORCE_COLOR made rich write them into a file
SAVING = "Saving checkpoint to"


def epochs(log: Path) -> list[dict]:
    """Per epoch, in the log's order: steps counted, their seconds, their seconds waiting for data, steps left out."""
    per: dict[int, dict] = {}
    after_save = False
    for number, line in enumerate(log.read_text(errors="replace").splitlines(), 1):
        line = ANSI.sub("", line)
        if SAVING in line:
            after_save = True
        if "profile/fetch_ms=" not in line:
            continue
        fields = dict(PAIR.findall(line))
        try:
            epoch = int(fields["epoch"])
            step_ms, fetch_ms = float(fields["profile/step_ms"]), float(fields["profile/fetch_ms"])
        except (KeyError, ValueError):
            raise click.ClickException(
                f"{log}:{number}: a step's record is cut or unreadable: run the trainer with a wide console "
                "(COLUMNS=4000), as train/end_to_end.sh does"
            ) from None
        row = per.setdefault(epoch, {"steps": 0, "seconds": 0.0, "waiting_s": 0.0, "left_out": 0})
        if after_save:
            row["left_out"] += 1
            after_save = False
            continue
        row["steps"] += 1
        row["seconds"] += step_ms / 1000
        row["waiting_s"] += fetch_ms / 1000
    if not per:
        raise click.ClickException(
            f"{log}: no step profile (profile/fetch_ms) in it: is it speculators' console output of a run that "
            "trained (a resumed, finished run trains no step), with --log-freq 1 (its default)?"
        )
    return [{"epoch": e, **per[e]} for e in sorted(per)]


def counters(path: Path) -> dict[str, float]:
    """eagle-extract serve's own samples in a saved `GET /metrics` (Prometheus' text format), by name."""
    found = {}
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        name, _, value = line.rpartition(" ")
        if name.startswith("eagle_extract_") and "{" not in name:
            try:
                found[name] = float(value)
            except ValueError:
                raise click.ClickException(f"{path}:{number}: not GET /metrics' text: save its whole answer") from None
    return found


SERVER = {  # what --server reports: its name in the JSON, and the counter it is the change of
    "rows": "eagle_extract_row_seconds_count",
    "row_seconds": "eagle_extract_row_seconds_sum",
    "steps": "eagle_extract_engine_steps_total",
    "engine_step_s": "eagle_extract_engine_step_seconds_total",
    "engine_wait_s": "eagle_extract_engine_wait_seconds_total",
    "engine_starved_s": "eagle_extract_engine_starved_seconds_total",
}


def server_while(before: Path, after: Path) -> dict:
    """What the server's counters moved by between the two scrapes."""
    first, last = counters(before), counters(after)
    missing = [name for name in SERVER.values() if name not in first or name not in last]
    if missing:
        raise click.ClickException(
            f"--server {before} {after}: no {missing[0]} in them: save eagle-extract serve's GET /metrics "
            "before and after the online trainer, as train/end_to_end.sh does"
        )
    moved = {key: last[name] - first[name] for key, name in SERVER.items()}
    born = "eagle_extract_row_seconds_created"  # when the server's histogram began: one per server process
    if first.get(born) != last.get(born) or any(value < 0 for value in moved.values()):
        raise click.ClickException(
            f"--server {before} {after}: not one server's counters, before then after (two servers or replicas, a "
            "restart between them, or the files swapped): save one server's GET /metrics before the online trainer "
            "and again after it"
        )
    rows, steps = moved["rows"], moved["steps"]
    moved["rows_a_step"] = rows / steps if steps else None
    moved["row_s_mean"] = moved.pop("row_seconds") / rows if rows else None
    return moved


def after_first(rows: list[dict], key: str) -> float:
    """The mean per epoch after the first, the trainer's warm-up."""
    if len(rows) < 2:
        raise click.ClickException("the log holds one epoch: train two or more (the first is the trainer's warm-up)")
    return statistics.mean(r[key] for r in rows[1:])


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--server", nargs=2, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="one server's GET /metrics, saved before and after the online trainer")  # fmt: skip
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="write the figures here")
def main(logs: tuple[Path, ...], server: tuple[Path, Path] | None, json_path: Path | None) -> None:
    if len(logs) > 2:
        raise click.UsageError("give the offline trainer's log, then optionally the online one's")
    result = {}
    for name, log in zip(("offline", "online"), logs):
        rows = epochs(log)
        result[name] = {"log": str(log), "epochs": rows, "epoch_s_after_first": after_first(rows, "seconds"),
                        "waiting_s_after_first": after_first(rows, "waiting_s")}  # fmt: skip
    click.echo("| log | epoch | steps counted | their s | waiting for data s | steps after a save, left out |")
    click.echo("|---|---|---|---|---|---|")
    for name in result:
        for r in result[name]["epochs"]:
            click.echo(f"| {name} | {r['epoch']} | {r['steps']} | {r['seconds']:.2f} | {r['waiting_s']:.2f} | "
                       f"{r['left_out']} |")  # fmt: skip
    if len(logs) == 2:
        offline, online = result["offline"]["waiting_s_after_first"], result["online"]["waiting_s_after_first"]
        result["online_over_offline_waiting"] = online / offline if offline else None
        ratio = f"{online / offline:.2f}x offline's" if offline else "offline never waited"
        click.echo(f"waiting for data, mean per epoch after the first: offline {offline:.2f} s, online {online:.2f} s "
                   f"({ratio}; {online - offline:+.2f} s)")  # fmt: skip
    if server:
        got = result["server"] = server_while(*server)
        a_step = f"{got['rows_a_step']:.1f}" if got["rows_a_step"] is not None else "-"
        a_row = f"{got['row_s_mean'] * 1000:,.1f} ms" if got["row_s_mean"] is not None else "-"
        click.echo(f"the server meanwhile: {got['rows']:,.0f} rows in {got['steps']:,.0f} engine steps ({a_step} "
                   f"a step), a row {a_row} from its request to its answer (mean); the engine "
                   f"{got['engine_step_s']:.1f} s in steps, {got['engine_wait_s']:.1f} s in looks at its workers, "
                   f"{got['engine_starved_s']:.1f} s starved of requests")  # fmt: skip
    if json_path:
        json_path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
