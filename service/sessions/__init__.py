"""Stateful sessions (issue 31): a sharded, paged KV cache held by the gang.

- `ids`: the id namespace (also read by the ingress, which imports no torch).
- `keys`: appends' idempotency keys (their rule, the rows' digest; read by the ingress too).
- `registry`: the one owner of session state (ids, lengths, kept inputs, block tables,
  LRU, idle expiry), in rank 0's process (the GangServer replica); it plans every append
  step's block placement on the gang's sequencer.
- `batcher`: continuous batching of appends: many sessions' new rows share one gang step.
- `service`: what the GangServer calls (open, append, info, close, stats, the sweeper).

The rank side is service.parallel.kv_cache (the pool and the attention over it); the step
travels as an append step (service.gang.steps.APPEND).
"""
