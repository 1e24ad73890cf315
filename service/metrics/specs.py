"""Every metric the service exports, declared once: name, type, help, labels, buckets.

`SPECS` is the one table `GET /metrics` (service.metrics.exposition), Ray's metrics export
(service.metrics.process) and the Grafana dashboard's test (tests/test_metrics.py) read.
The names, labels and bucket bounds are contract (docs/api.md, docs/operations.md,
deployments/grafana-dashboard.json): a histogram's buckets are its exported `le` labels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "histogram", "gauge"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
BYTES_BUCKETS = (0, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
PADDED_SHARE_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)
EPOCH_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


@dataclass(frozen=True)


class Spec:
    """One exported metric. `name` is the family name (a counter's samples add `_total`)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


SPECS: dict[str, Spec] = {s.name: s for s in (
    Spec("gangserve_requests", "counter", "Requests answered by the ingress, by route template (gRPC: the "
         "method's path), body format, status code (gRPC: the same error's HTTP status) and protocol (http, "
         "grpc)", ("route", "format", "code", "protocol")),
    Spec("gangserve_request_seconds", "histogram", "Time from a request's arrival at the ingress to the "
         "end of its reply", ("route", "protocol"), LATENCY_BUCKETS),
    Spec("gangserve_request_bytes", "histogram", "Request body bytes the ingress read (gRPC: the message's)",
         ("route", "protocol"), BYTES_BUCKETS),
    Spec("gangserve_gang_step_seconds", "histogram", "Duration of one successful gang step (broadcast, "
         "tensor-parallel attention, all_reduce) in the gang server", (), LATENCY_BUCKETS),
    Spec("gangserve_step_part_seconds", "histogram", "One part of a gang step on rank 0, by part (`header`, "
         "`broadcast`, `compute`, `all_reduce`, `to_numpy`: the Server-Timing parts of the step)", ("part",),
         LATENCY_BUCKETS),
    Spec("gangserve_batch_size", "histogram", "Batch rows per gang step (concurrent requests coalesced)",
         (), BATCH_BUCKETS),
    Spec("gangserve_step_padded_share", "histogram", "Share of a gang step's tokens that is padding added "
         "to batch requests of different seq lens (0: equal lengths)", (), PADDED_SHARE_BUCKETS),
    Spec("gangserve_queue_depth", "gauge", "Inference calls inside a gang server (queued or computing)",
         ("replica",)),
    Spec("gangserve_gang_ready", "gauge", "1 while the gang serves, else 0", ("replica",)),
    Spec("gangserve_gang_rebuilds", "counter", "Successful in-place gang rebuilds (after a rank died, "
         "hung or a collective failed)"),
    Spec("gangserve_collective_timeouts", "counter", "Gang steps that ran past collective_timeout_s"),
    Spec("gangserve_requests_dropped", "counter", "Inference requests dropped uncomputed: their deadline "
         "passed while queued (`deadline`), or their caller went away (`disconnected` at the ingress, "
         "`cancelled` in a gang server)", ("where", "reason")),
    Spec("gangserve_request_retries", "counter", "Inference attempts the ingress retried after a gang failure "
         "(by the failure's code)", ("code",)),
    Spec("gangserve_weights_version", "gauge", "The weights version a gang serves", ("replica",)),
    Spec("gangserve_gpu_memory_reserved_bytes", "gauge", "Device memory a CUDA rank's caching allocator holds "
         "(torch.cuda.memory_reserved; CUDA ranks only)", ("replica", "rank")),
    Spec("gangserve_gpu_max_memory_reserved_bytes", "gauge", "The peak of a CUDA rank's "
         "gangserve_gpu_memory_reserved_bytes since it started", ("replica", "rank")),
    Spec("gangserve_shm_fallbacks", "counter", "Shared-memory hand-offs that failed and went through "
         "Ray's object store instead"),
    Spec("gangserve_sessions_active", "gauge", "Open stateful sessions on a gang", ("replica",)),
    Spec("gangserve_session_cache_bytes", "gauge", "KV cache bytes of one rank of a gang: `used` (blocks held "
         "by sessions) and `capacity` (session_cache_bytes in whole blocks)", ("replica", "rank", "kind")),
    Spec("gangserve_session_evictions", "counter", "Sessions whose KV blocks were taken for others (LRU); "
         "they are recomputed from their kept inputs on their next append"),
    Spec("gangserve_session_recomputed_tokens", "counter", "Session tokens whose K/V was computed again "
         "(after an eviction, a rebuilt rank or a weights swap)"),
    Spec("gangserve_session_append_seconds", "histogram", "Session append latency in the gang server, by the "
         "session's context length before the append (`le_16`, `le_128`, `le_1024`, `le_4096`, `gt_4096`)",
         ("context",), LATENCY_BUCKETS),
    Spec("gangserve_training_jobs", "gauge", "Training jobs by status", ("status",)),
    Spec("gangserve_training_loss", "gauge", "Loss of the last finished epoch of an active training job",
         ("job",)),
    Spec("gangserve_training_eval_loss", "gauge", "Held-out (validation) loss of the last finished epoch of "
         "an active training job that holds samples out", ("job",)),
    Spec("gangserve_training_epoch_seconds", "histogram", "Wall time of one training epoch "
         "(including its checkpoint)", (), EPOCH_BUCKETS),
)}


def exported_names() -> set[str]:
    """Every sample name a scrape of /metrics can carry (from SPECS; counters end in _total,
    histograms have _bucket, _sum and _count), and the same with Ray's `ray_` prefix."""
    names: set[str] = set()
    for s in SPECS.values():
        if s.kind == "counter":
            own = {s.name + "_total"}
        elif s.kind == "histogram":
            own = {s.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            own = {s.name}
        names |= own | {"ray_" + n for n in own}
    return names
