"""DDP training jobs on Ray Train: spec, SQLite store, datasets, the per-worker loop, the
run actor that owns `TorchTrainer.fit()`, and quotas. The JobManager Serve deployment that
drives them is service.deployments.job_manager."""
