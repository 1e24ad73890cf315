"""jobs 2: init_from, resumes, resumed_from_epoch; eval_loss per epoch."""
import sqlalchemy as sa
from alembic import op

from service.state.migrations import FLOAT

revision = "jobs_0002"
down_revision = "jobs_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("init_from", sa.Text))  # JSON: what the job started from (resolved)
    # runs started again after they died
    op.add_column("jobs", sa.Column("resumes", sa.Integer, nullable=False, server_default=sa.text("0")))
    op.add_column("jobs", sa.Column("resumed_from_epoch", sa.Integer))
    op.add_column("job_history", sa.Column("eval_loss", FLOAT))
