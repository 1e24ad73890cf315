"""served_weights 2: eval_loss, rollback_of."""
import sqlalchemy as sa
from alembic import op

from service.state.migrations import FLOAT

revision = "served_weights_0002"
down_revision = "served_weights_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("served_weights", sa.Column("eval_loss", FLOAT))  # the job's final held-out loss, if any
    op.add_column("served_weights", sa.Column("rollback_of", sa.Integer))  # the version a rollback served again
