"""Where a command's CPU goes, by process kind: `python bench/cpu_by_process.py -- make test`.

Runs the command while sampling /proc every `--interval` seconds. Each process (pid and start
time) is named by the last Ray actor title it showed (`ray::RankWorker`, Serve replicas by
deployment, training workers), else by its program; its CPU time (user + system) is the
last value read, so a process that lives less than one interval is missed and one that exits
loses at most one interval. Processes that were running before the command started are left
out. Prints CPU-seconds, share and process count per kind, busiest first; `--json FILE` keeps
the raw samples.

Why by title: Ray starts every actor in a pool worker (`ray::IDLE`) and renames it, and
process accounting (`accton`) records only the title at exit, which cannot tell an actor that
was reset from a pool worker that never ran anything.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")
PROGRAMS = re.compile("|".join(re.escape(p) for p in ("pytest", "raylet", "gcs_server", "dashboard/agent.py", "dashboard.py", "log_monitor", "monitor.py",
            "postgres", "moto", "chrom", "haproxy")))


def read_processes() -> dict[str, tuple[str, float]]:
    """pid:starttime -> (command line, CPU seconds) for every readable process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after the (comm) field, which may hold spaces
        found[f"{entry}:{fields[19]}"] = (command, (int(fields[11]) + int(fields[12])) / TICKS)
    return found


def kind(titles: list[str]) -> str:
    """The process's name for the table: its last Ray actor title, else its program."""
    titles = [t for t in titles if t]
    named = [t for t in titles if t.startswith("ray::") and not t.startswith("ray::IDLE")]
    if named:
        name = named[-1].split()[0].split(".")[0]  # ray::Class.method -> ray::Class
        if name.startswith("ray::ServeReplica:"):
            name = "ray::ServeReplica:" + name.rsplit(":", 1)[-1]  # by deployment, any app
        return name
    if not titles:
        return "?"
    if any("default_worker.py" in t for t in titles):
        return "ray worker (never an actor)"
    match = PROGRAMS.search(titles[-1])
    return match.group(0) if match else titles[-1][:60]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--json", help="write the per-process samples here")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")

    before = set(read_processes())
    seen: dict[str, dict] = {}
    started = time.monotonic()
    child = subprocess.Popen(command)
    while True:
        for key, (line, cpu) in read_processes().items():
            if key in before:
                continue
            p = seen.setdefault(key, {"cpu": 0.0, "titles": []})
            p["cpu"] = cpu
            if line and (not p["titles"] or p["titles"][-1] != line[:200]):
                p["titles"].append(line[:200])
        if child.poll() is not None:
            break
        time.sleep(args.interval)
    wall = time.monotonic() - started

    if args.json:
        with open(args.json, "w") as f:
            json.dump(seen, f)
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for p in seen.values():
        row = by_kind[kind(p["titles"])]
        row[0] += 1
        row[1] += p["cpu"]
    total = sum(cpu for _, cpu in by_kind.values())
    print(f"\n{total:.1f} CPU-seconds in {wall:.0f} s over {len(seen)} processes "
          f"({100 * total / max(wall, 1e-9) / os.cpu_count():.0f} % of {os.cpu_count()} cores); exit status {child.returncode}")
    for name, (count, cpu) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{cpu:8.1f} s {100 * cpu / total if total else 0.0:5.1f} %  {count:4d} x  {name}")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
