"""The model kinds' torch-free halves: each kind's architecture, as its config and checkpoint
describe it, read by processes that load no torch (the builder arguments in the ingress, the
JobManager). A kind's torch half (its dense module and rank shard) lives in service.parallel.
Imports nothing from service but itself (tests/test_layout.py)."""
