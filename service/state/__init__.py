"""gangserve's state, one owner per piece:

- `paths`: the state directory (`GANGSERVE_STATE_DIR`) and path containment.
- `db`: the state database (`GANGSERVE_DATABASE_URL`: SQLite in the state dir by default,
  PostgreSQL for clusters): connect, transactions, migrations, the 503 `state_unavailable`.
"""
