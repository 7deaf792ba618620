"""`hvdtrain where RUN_DIR`: asks a running job, from another terminal on rank 0's host, where every rank
is now (each one's Python stack and phase), without stopping it."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import click

from hvdtrain.cli.common import UserPath
from hvdtrain.errors import UserError


@click.command()
@click.argument("run_dir", type=UserPath(file_okay=False))
@click.option("--timeout", type=click.FloatRange(0.1, 3600), default=30.0, show_default=True,
              help="Seconds to wait for the answer.")
def where(run_dir: str, timeout: float) -> None:
    """Where every rank of a running job is now: its phase and Python stack (the job goes on). Run it on
    rank 0's host; every rank's whole stack is kept in RUN_DIR/where/."""
    from hvdtrain.engine.report_channel import request
    from hvdtrain.engine.whereabouts import LIVE_FILE

    live = Path(run_dir) / LIVE_FILE
    try:
        facts = json.loads(live.read_text())
    except FileNotFoundError:
        ended = _last_fit(Path(run_dir))
        raise UserError(f"no job is running in {run_dir} (no {LIVE_FILE}: it ended, has not reached its first epoch "
                        f"yet, runs as one process without a launcher, or runs with --elastic)"
                        f"{f'; {ended}' if ended else ''}") from None
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {live}: {getattr(err, 'strerror', None) or err}") from None
    if not _is_contact(facts):
        raise UserError(f"{live} is not what a running job writes (host, port, token, pid): remove it")
    host = "127.0.0.1" if facts["host"] == socket.gethostname() else facts["host"]
    try:
        answer = request(host, facts["port"], {"token": facts["token"], "ask": "where"}, timeout)
    except (OSError, ValueError) as err:  # ValueError: what answered is not a job's rank 0
        ended = _last_fit(Path(run_dir)) if facts["host"] == socket.gethostname() else ""
        if ended:  # the job that wrote where.json was killed (or failed) before it could remove it
            raise UserError(f"no job answers in {run_dir}: {ended}; a fit started there since answers once it "
                            "trains") from None
        raise UserError(f"the job in {run_dir} does not answer (rank 0: pid {facts['pid']} on {facts['host']}, port "
                        f"{facts['port']}: {getattr(err, 'strerror', None) or err}); it may have been killed before "
                        f"it could remove {LIVE_FILE}") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
        raise UserError(f"rank 0 of the job in {run_dir} did not answer within {timeout:g} s: raise --timeout")
    click.echo(f"hvdtrain where: {answer['text']}")


def _last_fit(run_dir: Path) -> str:
    """`its last fit failed at epoch 1, step 15 (hvdtrain runs DIR)`, as `hvdtrain runs` says how it ended,
    where no fit holds `run_dir` now and the last one left word (a note or a summary) on this host; else "".
    (An elastic fit takes no hold, and a fit takes it once set up: the caller's line allows for both.)"""
    from hvdtrain.after.runs import read_run

    try:
        record = read_run(run_dir)
        held, note = record.lock
    except (UserError, OSError):  # not a run directory, or one this user cannot read: the caller's line
        return ""
    if held or not (note or record.summary is not None) or note.get("host") not in (None, socket.gethostname()):
        return ""
    return f"its last fit {record.status} (hvdtrain runs {run_dir})"


def _is_contact(facts: object) -> bool:
    """`where.json` as rank 0 writes it."""
    return (isinstance(facts, dict) and isinstance(facts.get("host"), str) and isinstance(facts.get("token"), str)
            and isinstance(facts.get("port"), int) and 0 < facts["port"] < 65536 and isinstance(facts.get("pid"), int))
