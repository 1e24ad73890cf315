"""Per-query cost of the state database layer (service.state.db), two code trees side by side.

    PYTHONPATH=. .venv/bin/python bench/state_db_cost.py --old /tmp/statedb-old [--rounds 3]

`--old` is a checkout of the tree to compare with (e.g. `git archive <commit> service harness
tests clients | tar -x -C /tmp/statedb-old`); the new tree is this one. Each round runs one
child process per tree (old, new, alternating, so both see the same machine load) against a
fresh SQLite file and a fresh database on one real PostgreSQL server (harness/postgres.py, on
loopback); each child times the stores' own public calls. Prints a markdown table of the
median over rounds of each child's median microseconds per call.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent

OPS = ("session SELECT 1", "get_job", "update_job", "create_job (transaction)", "append_logs (transaction)",
       "weights current", "open a migrated store")


def _time(fn: Callable[[int], Any], n: int, warmup: int = 30) -> float:
    """Median microseconds of `fn(i)` over `n` calls (after `warmup` calls)."""
    for i in range(warmup):
        fn(-1 - i)
    samples = []
    for i in range(n):
        started = time.perf_counter()
        fn(i)
        samples.append((time.perf_counter() - started) * 1e6)
    return statistics.median(samples)


def measure(url: str, n: int) -> dict[str, float]:
    """Run in the child: time every op of OPS against `url` with the tree on sys.path."""
    started = time.perf_counter()
    import service.state.db  # noqa: F401 - its import cost is one of the numbers

    import_ms = (time.perf_counter() - started) * 1e3
    from service.training.store import JobRecord, JobStore
    from service.weights.record import WeightsRecord

    def job(i: int, tag: str) -> JobRecord:
        return JobRecord(id=f"job-{tag}-{i}", status="PENDING", spec={"world_size": 1, "use_gpu": False},
                         created_at=1.0, updated_at=1.0, progress={"epoch": 0, "epochs": 1, "step": 0})

    store = JobStore(url)
    record = WeightsRecord(Path(tempfile.gettempdir()), store.database)
    store.create_job(job(0, "fixed"))
    record.record("app", "swap", "v1", sha256="aa", fingerprint="f", checkpoint=None)
    db = store.database

    def select1(_: int) -> None:
        with db.session() as s:
            s.value("SELECT 1")

    def open_store(_: int) -> None:
        JobStore(url).close()

    out = {
        "session SELECT 1": _time(select1, n),
        "get_job": _time(lambda i: store.get_job("job-fixed-0"), n),
        "update_job": _time(lambda i: store.update_job("job-fixed-0", progress={"epoch": 0, "step": i}), n),
        "create_job (transaction)": _time(
            lambda i: store.create_job(job(i, "new"), admit=lambda usage: None), n),
        "append_logs (transaction)": _time(lambda i: store.append_logs("job-fixed-0", [(i + 100, 1.0, "line")]), n),
        "weights current": _time(lambda i: record.current("app"), n),
        "open a migrated store": _time(open_store, max(10, n // 50), warmup=3),
        "import service.state.db (ms)": import_ms,
    }
    record.close()
    store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", type=Path, help="the tree to compare with (driver mode)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=1000, help="calls per op and child (SQLite; half on PostgreSQL)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a URL: measure it, print JSON
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.n)))
        return

    sys.path.insert(0, str(ROOT))
    from harness.postgres import PostgresServer

    trees = {"old": args.old.resolve(), "new": ROOT}
    server = PostgresServer()
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for _ in range(args.rounds):
            for name, tree in trees.items():
                for dialect in ("sqlite", "postgresql"):
                    with tempfile.TemporaryDirectory() as tmp:
                        url = (f"sqlite://{tmp}/jobs.sqlite" if dialect == "sqlite" else server.create_database())
                        env = {**os.environ, "PYTHONPATH": f"{tree}:{tree}/clients", "GANGSERVE_STATE_DIR": tmp}
                        env.pop("GANGSERVE_DATABASE_URL", None)
                        n = args.n if dialect == "sqlite" else args.n // 2
                        done = subprocess.run([sys.executable, __file__, "--child", url, "--n", str(n)],
                                              env=env, cwd=tree, capture_output=True, text=True, check=True)
                        results.setdefault((name, dialect), []).append(json.loads(done.stdout.splitlines()[-1]))
                        if dialect == "postgresql":
                            server.drop_database(url)
    finally:
        server.close()

    print(f"median of {args.rounds} rounds of each child's median, microseconds per call "
          f"(n={args.n} SQLite, {args.n // 2} PostgreSQL)\n")
    print("| op | SQLite old | SQLite new | new/old | PostgreSQL old | PostgreSQL new | new/old |")
    print("|---|---|---|---|---|---|---|")
    for op in (*OPS, "import service.state.db (ms)"):
        cells = []
        for dialect in ("sqlite", "postgresql"):
            old, new = (statistics.median(r[op] for r in results[(t, dialect)]) for t in ("old", "new"))
            cells += [f"{old:.0f}", f"{new:.0f}", f"{new / old:.2f}"]
        print(f"| {op} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
