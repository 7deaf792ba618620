"""horovodrun's elastic mode (--host-discovery-script), made to start on one host and to say in one
line what is wrong with a discovery script, before Horovod's driver would raise it in a thread."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

DISCOVERY_SECONDS = 30


def prepare(launch: Any, gloo_run: Any) -> None:
    """Before `launch.run_commandline()`: its elastic run exits with one line (status 2) for a discovery
    script whose output Horovod cannot read, and starts where that script lists this host alone."""
    run_elastic = launch._run_elastic

    def checked(args: Any) -> Any:
        problem = args.host_discovery_script and discovery_problem(args.host_discovery_script, args.slots)
        if problem:
            print(f"horovodrun: the host discovery script {args.host_discovery_script} {problem}", file=sys.stderr,
                  flush=True)
            sys.exit(2)
        return run_elastic(args)

    launch._run_elastic = checked
    _one_host_needs_no_second(gloo_run)


def discovery_problem(script: str, default_slots: int | None) -> str | None:
    """What Horovod would fail on: the script not running, or a line that is not `host:slots`
    (`host` alone where --slots-per-host gives the slots); None when it can be read."""
    try:
        done = subprocess.run(script, shell=True, capture_output=True, text=True, errors="replace",
                              timeout=DISCOVERY_SECONDS)
    except subprocess.TimeoutExpired:  # slow, not wrong: Horovod's driver waits for it as long as it takes
        return None
    said = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode != 0:
        why = {126: "it could not be run (not executable? chmod +x it)", 127: "it, or a command in it, was not found"}
        return (f"exited with status {done.returncode}{f' ({said})' if said else ''}"
                f"{': ' + why.get(done.returncode, 'it must exit 0')}")
    for line in filter(None, (line.strip() for line in done.stdout.splitlines())):
        if re.fullmatch(r"[^\s:]+:\d+", line) or (default_slots and re.fullmatch(r"[^\s:]+", line)):
            continue
        hint = (f" (a hostfile's form: print {line.split()[0]}:N)" if "slots=" in line else
                " (or give horovodrun --slots-per-host N)" if re.fullmatch(r"[^\s:]+", line) else "")
        return f"printed '{line}'{hint}: it must print one host:slots line per host now usable"
    return None


def _one_host_needs_no_second(gloo_run: Any) -> None:
    """Horovod's elastic driver, to find the network interfaces hosts share, waits for 2 hosts unless
    --network-interface names one: with the discovery script listing this host alone it waited,
    silently, until its --elastic-timeout (600 s) ended the job. It starts there now, over the loopback
    interface (Horovod's choice for local hosts), which a host added later cannot reach: said where the
    job may grow past this host's slots."""
    from horovod.runner.util import network

    wait_for = gloo_run._get_min_start_hosts

    def min_start_hosts(settings: Any) -> int:
        try:
            hosts = settings.discovery.find_available_hosts_and_slots()
        except Exception:  # noqa: BLE001 - the driver's own discovery says what is wrong
            return wait_for(settings)
        if not hosts or network.filter_local_addresses(list(hosts)):
            return wait_for(settings)
        if settings.max_num_proc is None or settings.max_num_proc > sum(hosts.values()):
            print("horovodrun: the host discovery script lists this host alone: the job starts on it over the "
                  "loopback interface, which hosts added later cannot reach; for a job that grows onto other "
                  "hosts, give --network-interface IFACE", file=sys.stderr, flush=True)
        return 1

    gloo_run._get_min_start_hosts = min_start_hosts
