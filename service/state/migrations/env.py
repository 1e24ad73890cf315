"""Alembic's environment: only through service.state.db.Database.migrate, which passes its
connection (already inside the transaction that holds the schema lock) and the store's version
table in `config.attributes`; the migrations join that transaction."""
from __future__ import annotations

from alembic import context

_attributes = context.config.attributes
context.configure(connection=_attributes["connection"], version_table=_attributes["version_table"])
with context.begin_transaction():
    context.run_migrations()
