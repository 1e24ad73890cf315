"""DDP training jobs on Ray Train: spec, SQLite store, datasets, the per-worker loop,
the run actor that owns `TorchTrainer.fit()`, and the JobManager Serve deployment."""
