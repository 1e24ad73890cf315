"""DDP training jobs on the service's own worker group (a placement group, one actor per
rank): spec, SQLite store, datasets, the per-worker loop, the run actor that runs a worker
group per attempt, the epoch checkpoints, and quotas. The JobManager Serve deployment that
drives them is service.deployments.job_manager."""
