"""The dense reference lives in harness/reference.py (shared with bench/); re-exported here
for the tests that import it from tests.reference."""
from harness.reference import (
    dense_attention,
    dense_attention_masked,
    dense_reference,
    notes_seed_weights,
    reference,
    relative_error,
)

__all__ = ["dense_attention", "dense_attention_masked", "dense_reference", "notes_seed_weights", "reference",
           "relative_error"]
