"""Session ids: one namespace in the registry for ids we choose and ids OIP clients choose.

Its own module (no torch, no registry) because the ingress reads it: the ingress process
imports neither torch nor the KV cache (tests/test_layout.py checks it)."""

OIP_PREFIX = "oip:"  # ids chosen by OIP clients (`sequence_id`) live beside ours in one registry
