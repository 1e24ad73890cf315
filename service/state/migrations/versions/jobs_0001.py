"""jobs 1: jobs, job_history, job_logs, managers, datasets.

The schema as it was created before versioning existed: IF NOT EXISTS, so files from then
(same tables, no version record) upgrade in place with their rows.
"""
import sqlalchemy as sa
from alembic import op

from service.state.migrations import BIGINT, FLOAT, serial_pk

revision = "jobs_0001"
down_revision = None
branch_labels = ("jobs",)
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        serial_pk("seq"),
        sa.Column("id", sa.Text, unique=True, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("spec", sa.Text, nullable=False),
        sa.Column("created_at", FLOAT, nullable=False),
        sa.Column("updated_at", FLOAT, nullable=False),
        sa.Column("started_at", FLOAT),
        sa.Column("finished_at", FLOAT),
        sa.Column("reason", sa.Text),
        sa.Column("error", sa.Text),
        sa.Column("progress", sa.Text, nullable=False),
        sa.Column("history", sa.Text, nullable=False, server_default="[]"),  # legacy: before job_history
        sa.Column("checkpoint", sa.Text),
        sa.Column("workers", sa.Text, nullable=False, server_default="[]"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("owner", sa.Text),
        sqlite_autoincrement=True, if_not_exists=True,
    )
    op.create_table(
        "job_history",
        sa.Column("job_id", sa.Text, primary_key=True),
        sa.Column("epoch", sa.Integer, primary_key=True),
        sa.Column("loss", FLOAT),
        sa.Column("at", FLOAT),
        if_not_exists=True,
    )
    op.create_table(
        "job_logs",
        serial_pk("id"),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("run_seq", BIGINT),  # the run actor's line number; NULL for the manager's own lines
        sa.Column("ts", FLOAT, nullable=False),
        sa.Column("line", sa.Text, nullable=False),
        sa.UniqueConstraint("job_id", "run_seq"),
        sqlite_autoincrement=True, if_not_exists=True,
    )
    op.create_table(
        "managers",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("heartbeat_at", FLOAT, nullable=False),
        if_not_exists=True,
    )
    op.create_table(
        "datasets",
        serial_pk("seq"),
        sa.Column("id", sa.Text, unique=True, nullable=False),
        sa.Column("created_at", FLOAT, nullable=False),
        sa.Column("info", sa.Text, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("bytes", BIGINT, nullable=False),
        sqlite_autoincrement=True, if_not_exists=True,
    )
