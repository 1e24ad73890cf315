"""Where every gang of an app says how it is: one row per GangServer replica, refreshed.

An app may run several gangs (`num_replicas`, autoscaling), one per GangServer replica, and
Serve's handle reaches *some* replica, never a chosen one. So each replica publishes its
`/gang` description every few seconds into the state dir's SQLite file (next to the jobs and
the served-weights record, on the storage every node sees), and the ingress reads the
fresh rows for `GET /gangs`, `/readyz` counts and the outcome of a weights rollout. A row
older than `STALE_AFTER_S` belongs to a replica that is gone (or cannot write): it is not
counted, and it is deleted when its replica shuts down gracefully.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from service.served_weights import connect_state_db

PUBLISH_INTERVAL_S = 2.0
STALE_AFTER_S = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS gangs (
    app        TEXT NOT NULL,
    replica_id TEXT NOT NULL,
    updated_at REAL NOT NULL,
    info       TEXT NOT NULL,   -- the replica's /gang description (JSON)
    PRIMARY KEY (app, replica_id)
);
"""


class GangRegistry:
    """The `gangs` table; every method is one short statement (thread-safe)."""

    def __init__(self, state: Path) -> None:
        self._db = connect_state_db(state, _SCHEMA)
        self._lock = threading.Lock()

    def publish(self, app: str, replica_id: str, info: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO gangs (app, replica_id, updated_at, info) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(app, replica_id) DO UPDATE SET updated_at = excluded.updated_at, info = excluded.info",
                (app, replica_id, time.time(), json.dumps(info)),
            )

    def remove(self, app: str, replica_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM gangs WHERE app = ? AND replica_id = ?", (app, replica_id))

    def fresh(self, app: str, max_age_s: float = STALE_AFTER_S) -> list[dict[str, Any]]:
        """The live gangs of `app` (their latest descriptions, `replica_id` included), oldest replica id first."""
        cutoff = time.time() - max_age_s
        with self._lock:
            rows = self._db.execute(
                "SELECT replica_id, updated_at, info FROM gangs WHERE app = ? AND updated_at >= ? ORDER BY replica_id",
                (app, cutoff),
            ).fetchall()
            # Rows of replicas long gone (killed, never shut down) are dropped on the way.
            self._db.execute("DELETE FROM gangs WHERE app = ? AND updated_at < ?", (app, cutoff - 3600))
        return [{**json.loads(info), "replica_id": rid, "reported_s_ago": round(time.time() - at, 1)}
                for rid, at, info in rows]
