"""Alembic revision scripts of the state database (a package so that installs ship them; Alembic skips this file)."""
