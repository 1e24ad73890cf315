"""The served weights as durable state: what every gang of an app serves, and since when.

Rule: **runtime swaps survive restarts; a changed declared config wins.**

Every version an app serves is a row of `served_weights` in the state dir's SQLite file
(next to the job records). Versions are per Serve application and only ever grow:

- the first bring-up of an app records its configured weights (`source = "config"`);
- a successful `POST /weights` records a new version (`source = "swap"`) whose checkpoint
  is an immutable, content-addressed copy `weights/<sha256>.safetensors` in the artifact
  store (service.state.artifacts: the state dir, or object storage), so deleting or
  rewriting the job or file it came from cannot change what is served; the row stores
  that key, and every rank loads it through the store (a node-local verified copy on S3);
  a swap from a job also keeps the job's final eval loss (`eval_loss`, None without one);
- a rollback (`POST /weights {"version": N}`) records a new version that serves version N's
  file (or, for a `config` row of the current config, its `init` weights) again, with
  `rollback_of = N` and N's sha256, job and eval loss: versions only ever grow, so the
  history says what was served when, and every bring-up serves the rollback;
- every bring-up (first start, in-replica rebuild, a replica Serve replaced, a restart of
  the app) serves the newest row, *unless* the app's declared weights config differs from
  the row's `fingerprint`: then the config wins, a new `config` row is recorded and the
  older rows are marked superseded.

A config's fingerprint covers the model shape, the declaration (`init`, `seed`,
`checkpoint`) and the sha256 of the weights it declares, so replacing a configured
checkpoint file in place counts as a changed config too.

Several GangServer replicas of one app converge because every write is one
transaction of the state database (service.state.db: `BEGIN IMMEDIATE` on SQLite, an
advisory lock on PostgreSQL) that takes `max(version) + 1`, and every replica serves the
newest row. The table lives in the state database `GANGSERVE_DATABASE_URL` names (default:
the state dir's SQLite file, next to the job records).

The values it stores and the immutable copies (`ServedWeights`, `store_immutable_copy`, ...)
are service.weights.served: the processes that only serve a version never import the database.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from service.state.db import Database, DatabaseStore, Row, Session, database_url
from service.config.tunables import StateTunables
from service.weights.served import ConfigWeights, ServedWeights, Source

# The store's schema: the Alembic branch "served_weights"
# (service/state/migrations/versions/served_weights_*.py).
STORE = "served_weights"
LOCK = "served_weights"  # the transaction lock every version allocation takes


# ---- the record ------------------------------------------------------------------------------

class WeightsRecord(DatabaseStore):
    """The `served_weights` table of the state database; every method is one short
    transaction (thread-safe). Raises service.state.db.StateUnavailable (503) when the
    database cannot be reached, at construction or later."""

    def __init__(self, state: Path, database: str | Database | None = None,
                 tunables: StateTunables | None = None) -> None:
        """`database`: a URL or an open Database (not closed by `close`); default the one
        GANGSERVE_DATABASE_URL names, else the SQLite file in `state`. `tunables`: the state
        tunables of a Database opened here."""
        self.state = state
        self._open(database or database_url(state), STORE, tunables)

    def current(self, app: str) -> ServedWeights | None:
        """The newest version of `app` (what every gang of it must serve), or None."""
        with self._db.session() as s:
            row = s.one("SELECT * FROM served_weights WHERE app = ? ORDER BY version DESC LIMIT 1", (app,))
        return _weights(row) if row else None

    def version(self, app: str, version: int) -> ServedWeights | None:
        """Version `version` of `app`, or None when it was never recorded."""
        with self._db.session() as s:
            row = s.one("SELECT * FROM served_weights WHERE app = ? AND version = ?", (app, int(version)))
        return _weights(row) if row else None

    def history(self, app: str) -> list[ServedWeights]:
        """Every recorded version of `app`, oldest first."""
        with self._db.session() as s:
            rows = s.all("SELECT * FROM served_weights WHERE app = ? ORDER BY version", (app,))
        return [_weights(r) for r in rows]

    def reconcile(self, app: str, config: ConfigWeights) -> ServedWeights:
        """What a bring-up must load: the newest row if it was written under this config,
        else (first start, or the declared config changed) a new `config` row, with every
        older row marked superseded."""
        with self._db.transaction(LOCK) as s:
            row = s.one("SELECT * FROM served_weights WHERE app = ? ORDER BY version DESC LIMIT 1", (app,))
            if row is not None and row["fingerprint"] == config.fingerprint:
                return _weights(row)
            now = time.time()
            new = self._insert(s, app, "config", config.description, None, config.checkpoint,
                               config.sha256, config.fingerprint, now)
            s.execute(
                "UPDATE served_weights SET superseded_at = ? WHERE app = ? AND version < ? AND superseded_at IS NULL",
                (now, app, new.version),
            )
            return new

    def record(self, app: str, source: Source, description: str, *, sha256: str, fingerprint: str,
               checkpoint: str | None, job_id: str | None = None, eval_loss: float | None = None,
               rollback_of: int | None = None) -> ServedWeights:
        """Append the next version of `app` (a swap, a reset to the config's weights, or a
        rollback: `rollback_of` names the version served again)."""
        with self._db.transaction(LOCK) as s:
            return self._insert(s, app, source, description, job_id, checkpoint, sha256, fingerprint, time.time(),
                                eval_loss, rollback_of)

    # -- internals ------------------------------------------------------------------------
    @staticmethod
    def _insert(s: Session, app: str, source: Source, description: str,
                job_id: str | None, checkpoint: str | None, sha256: str, fingerprint: str,
                now: float, eval_loss: float | None = None, rollback_of: int | None = None) -> ServedWeights:
        # Inside the caller's transaction, which holds LOCK: no other writer can take the
        # same max(version) + 1 (the primary key would refuse it anyway).
        top = s.value("SELECT MAX(version) AS top FROM served_weights WHERE app = ?", (app,))
        weights = ServedWeights(
            app=app, version=int(top or 0) + 1, source=source, description=description, sha256=sha256,
            fingerprint=fingerprint, checkpoint=checkpoint, job_id=job_id, recorded_at=now,
            eval_loss=None if eval_loss is None else float(eval_loss), rollback_of=rollback_of,
        )
        row = asdict(weights)
        cols = ", ".join(row)
        s.execute(f"INSERT INTO served_weights ({cols}) VALUES ({', '.join('?' for _ in row)})", tuple(row.values()))
        return weights


def _weights(row: Row) -> ServedWeights:
    return ServedWeights(**row)
