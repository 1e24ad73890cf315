"""Worked examples of user models (docs/models.md): modules outside `service/` that the
service loads by import path (`model=examples.gated_mlp:gated_mlp`)."""
