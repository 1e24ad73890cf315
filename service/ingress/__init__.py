"""HTTP edge: FastAPI routes, codecs, validation, error mapping. Never owns actors or groups."""
