"""The service's tunables: every timing and sizing knob of its own machinery, in one place.

Builder arguments (service.config.builder_args.AppConfig) are what an app is deployed with; tunables are
the numbers the machinery runs on: how often a gang is probed, how long a rebuild backs off,
how stale a report may be, how big a shared region gets, how long a store waits for a lock.
Like torchtitan's config sections, each concern is one frozen, typed dataclass whose every
field says what it bounds and why that default. They are set at deploy time in the builder
arguments' optional `tunables:` section (`AppConfig.tunables`, e.g. `tunables: {gang:
{probe_interval_s: 1.0}}`): pydantic validates a partial override against these classes and
refuses an unknown key, naming it. `python -m service.config.tunables` prints the reference
(docs/tunables.md, `make docs`; tests/test_config.py checks it is current).

How code uses them: there is no module-level instance. The app builder validates one
`Tunables` as part of `AppConfig` and passes it down: a deployment takes it from its
AppConfig, a class takes the section it needs in its constructor, a free function takes
the value as a parameter (tests/test_layout.py refuses a module that binds a tunable at
import). A section built without a config (a test, a CLI) is default-constructed. Values
that must agree are one field, or derived from one in code (the properties below);
relations that must hold (a store's lock wait below the ingress's call timeout, ...) are
listed by `Tunables.orderings()` and checked, with the builder arguments they relate to,
by AppConfig's one validator, which names both numbers.

Not here, on purpose: protocol and format constants (the step-loop header layout, frame
structs, file and key names), input limits that are part of the HTTP API (the deadline cap,
JSON-bomb and OIP shape bounds, body caps of the small JSON routes, the error-message cap the
client distribution shares), metric histogram buckets (their `le` labels are exported
series), and seeds. They stay next to the code they define.

This module imports nothing from `service` (tests/test_layout.py): any module may read it.
Nor does it import pydantic: the rank class (service.gang.worker) reads its section here, and
it must import on a machine without pydantic (the GPU check's image, bench/gpu/image.txt).
Each class's `__pydantic_config__` is therefore a plain dict, which is all pydantic's
`ConfigDict` is at runtime (a TypedDict); pydantic reads it only when AppConfig validates.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

KIB = 1024
MIB = 1024 * KIB
FLOAT32_BYTES = 4  # the wire dtype of request and reply tensors (service.ingress.codecs.MODEL_DTYPE)


def knob(default: Any, doc: str) -> Any:
    """A tunable field: its default and what it bounds (shown in docs/tunables.md)."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class GangTunables:
    """Gang supervision: the GangServer's supervisor, the gang's lifecycle and its step loop
    (service.deployments.gang_server, service.gang)."""

    __pydantic_config__ = {"extra": "forbid"}  # an unknown key is refused, named

    probe_interval_s: float = knob(2.0, (
        "How often the supervisor probes a ready gang's peers (one small Ray call per rank) and asks "
        "the Controller for a newer weights version. A peer that dies while no request runs is found "
        "within this; a request that hits it first wakes the supervisor at once."))
    supervisor_tick_s: float = knob(0.25, (
        "Longest sleep of the supervisor loop between looks at the gang (it is also woken at once when "
        "the gang breaks): bounds how late a state change is published or a due probe starts."))
    max_rebuild_attempts: int = knob(5, (
        "Failed rebuilds in a row after which check_health fails and Serve replaces the replica (a fresh "
        "placement group), instead of retrying in place forever."))
    max_backoff_s: float = knob(30.0, (
        "Cap of the exponential backoff between failed rebuilds (1, 2, 4 ... s): a cluster that lacks a "
        "node is not hammered, and a returning one is used within this."))
    controller_timeout_s: float = knob(60.0, (
        "Bound on a GangServer's calls to the Controller (the weights record): the Controller starts with "
        "the app, so a first bring-up may wait this long for it."))
    drain_timeout_s: float = knob(10.0, (
        "How long a shutting-down GangServer waits for its accepted requests (data channel and queue) "
        "before the gang goes; must stay inside graceful_shutdown_timeout_s, which also covers Serve's "
        "own handle drain."))
    graceful_shutdown_timeout_s: float = knob(20.0, (
        "Serve's graceful_shutdown_timeout_s for the GangServer (Serve's default, set explicitly so that "
        "drain_timeout_s can be checked against it)."))
    health_check_period_s: float = knob(5.0, "Serve's health_check_period_s for the GangServer.")
    health_check_timeout_s: float = knob(30.0, (
        "Serve's health_check_timeout_s for the GangServer: a replica silent this long is replaced "
        "(fleet.fold_after_s is longer, so a silent replica's counters are folded only once it is gone)."))
    shutdown_timeout_s: float = knob(10.0, (
        "Bound on the gang's teardown at shutdown (peers killed, rank 0 leaves the group, the spare "
        "dropped): a hung teardown is logged, never waited for."))
    peer_exit_grace_s: float = knob(2.0, (
        "A peer whose step loop failed stays this long (so rank 0 can still ask it why over Ray), then "
        "exits its process: nothing outlives a failed gang for longer."))
    heartbeats_per_timeout: int = knob(4, (
        "With the step loop, an idle rank 0 sends a heartbeat header every collective_timeout_s / this: "
        "two heartbeats may be late (a busy core) before a peer's wait for a header times out."))
    min_heartbeat_s: float = knob(0.05, "Shortest heartbeat period, whatever collective_timeout_s is.")
    timings_kept: int = knob(512, "Per-step timestamps each rank keeps for GET /gang's step-loop timings.")
    header_spin_us_cpu: float = knob(0.0, (
        "A peer on a CPU rank polls for rank 0's next step header this long before its thread sleeps in "
        "the wait (service.gang.worker wait_header): a header that comes within it skips one thread wake-up, "
        "and every wait costs up to this much of a core. 0 on CPUs: the ranks share the cores the "
        "computation needs, and a spinning peer takes them from it (bench/NOTES.md, measured)."))
    header_spin_us_gpu: float = knob(200.0, (
        "The same for a peer on a CUDA rank: its host core is otherwise idle while the GPU computes, so "
        "polling up to this long for the next header costs a core that nothing else uses, and saves the "
        "wake-up on back-to-back small steps, where it is a large share of the step. Chosen, not yet "
        "measured on a GPU host (bench/step_levers.py header measures it)."))
    routing_stats_period_s: float = knob(1.0, (
        "How often Serve asks each GangServer for its routing stats (is its gang ready): a gang that just "
        "broke may get requests for up to this long, which fail fast (503), never wait."))
    routing_stats_timeout_s: float = knob(5.0, "Serve's bound on one routing-stats call.")
    peer_answer_timeout_s: float = knob(5.0, (
        "Bound on the sequencer's small questions to the peers: a liveness probe and, after a poisoned "
        "step, why a rank refused it (`step_error`); capped at collective_timeout_s. The sequencer waits "
        "on them, so a peer that does not answer within this marks the gang BROKEN instead of stalling "
        "every queued request."))
    stats_timeout_s: float = knob(2.0, (
        "Bound on reading the peers' step timings and device memory for GET /gang (off the sequencer, "
        "refreshed in the background): a slow peer leaves the last summary in place, never delays /gang."))
    session_answers_kept: int = knob(16, (
        "Idempotency keys each session remembers with their answers (the last this many appends; "
        "service.sessions.registry): an append retried with one of them gets the first answer and appends "
        "nothing; an older key is forgotten, and its retry would append again. Cost per session: the "
        "kept answers' output rows (n x E x 4 bytes each, 2 KiB for one row at E=512; in all at most the "
        "session's own rows, so at most its kept inputs' bytes again) plus about 2 KiB each for the key, "
        "digest and state: 16 one-row appends at E=512 hold about 64 KiB. At least 1 (checked when the "
        "gang server starts)."))
    cpu_matmul: Literal["native", "onednn", "blas"] = knob("native", (
        "How a CPU rank multiplies by its float32 weight matrices (service.parallel.linear): `native` "
        "sends one or two rows (a decode step of one or two appends, a one-row request) through this "
        "package's C++ kernel over the dense weights (built once per machine, ~1 s; 1.5x oneDNN at one "
        "row on the machine measured, bench/NOTES.md) and more rows through oneDNN, as `onednn` does for "
        "every row count; `onednn` reorders each matrix once into oneDNN's blocked layout and multiplies "
        "with oneDNN (1.4-3.5x torch's MKL for the few rows of a decode step or a small request), where "
        "this torch has the ops and a probe matmul at start equals F.linear's; it holds a second, packed "
        "copy of each weight matrix (the dense one stays), so a rank's weights take about twice their "
        "memory; `blas` is torch's own F.linear (MKL), no copy. Each falls back to the next where it "
        "cannot serve (no compiler, no oneDNN). CUDA ranks and bfloat16 weights always use F.linear. The "
        "rank logs which one runs and why."))
    session_attention: Literal["auto", "gather"] = knob("auto", (
        "How a session step's attention reads the KV pool (service.parallel.paged_kernel): `auto` builds a "
        "C++ decode kernel (once per machine, ~1 s; later processes load it) and checks it at bring-up (the "
        "`compile` stage of last_bring_up, before the gang is ready) where a C++ compiler is found (CPU ranks): "
        "one-row appends then read each session's blocks where they lie; a CUDA rank in bfloat16/float16 with "
        "session_block_tokens a multiple of 256 reads the pool through torch's varlen_attn instead "
        "(service.parallel.paged_varlen), once a warm-up step equals the gather path; else the gather path, "
        "said in one log line; `gather` always copies each session's blocks first (~3x the K/V bytes of a "
        "one-row append). GET /gang `sessions.attention` says which path runs and why."))
    session_compile_budget_s: float = knob(60.0, (
        "Most seconds one rank spends building the in-place decode kernel at bring-up (~1 s measured, "
        "bench/NOTES.md); a build that takes longer is stopped and the gang keeps the gather path, so a "
        "user's append never waits for a compiler. Must stay well inside gang.stage_timeout_s, which bounds "
        "the stage."))
    session_prefill_chunk_tokens: int = knob(256, (
        "Chunked prefill (service.sessions.batcher): an append (or a recompute) longer than a chunk is "
        "computed a chunk per step, a chunk being at most this many rows (fewer beside other appends: "
        "session_prefill_step_ratio), each step shared with other sessions' appends, so their one-row "
        "appends do not wait behind a long prefill; its answer comes when its last chunk is done, and it is "
        "applied only then (a failure between chunks appends nothing). Measured on the 12-layer E768 stack "
        "at world size 1 (bench/NOTES.md, bench/decode.py's prefill goal): 8 decoding sessions' one-row "
        "appends beside a 4,096-row prefill (fixed chunks, session_prefill_step_ratio 0) had a p99 of "
        "2.7-3.9x their p50 alone at 256 rows, the prefill taking 9.0-11 s; at 128 rows 2.3-3.1x and 15-20 s. "
        "0: no chunking."))
    session_prefill_step_ratio: float = knob(2.0, (
        "A step that carries a prefill chunk beside other sessions' appends should take at most this many "
        "times a step of one-row appends alone (service.sessions.chunk_budget): the chunk's rows shrink "
        "to fit, estimated from the steps before (a chunk's cost grows with its position, so a long "
        "prefill's later chunks get fewer rows), at least session_prefill_chunk_tokens / 16 (also the size of "
        "the first such chunk, a probe, before any chunk's cost was seen); a chunk "
        "alone computes session_prefill_chunk_tokens. Measured (bench/NOTES.md; 8 decoding sessions' "
        "one-row appends beside a 4,096-row prefill, the 12-layer E768 stack, world size 1, the default "
        "batching, back to back): 2.0: their p99 3.00 and 2.26x their p50 alone, the prefill 19.8 and 20.4 s; "
        "2.5: 3.30x, 16.6 s; 0 (fixed 256-row chunks): 3.54-3.93x, 10.6-12.4 s: the decoders' latency is "
        "bought with the prefill's. 0: every chunk session_prefill_chunk_tokens rows. Else above 1."))
    session_prefill_chunk_linger_s: float = knob(0.05, (
        "The longest a prefill chunk waits, before its step, for the sessions whose appends the step "
        "before answered (service.sessions.batcher): their next appends arrive a client round trip after "
        "their answers, and a chunk taken at once would run a step alone that they then wait behind. The "
        "wait ends as soon as they are all queued; it costs at most this much per chunk when a session "
        "stopped appending. Measured (bench/NOTES.md; 8 decoding sessions beside a 4,096-row prefill, "
        "the 12-layer E768 stack, world size 1, no batch_wait_timeout_s): 0 -> 0.05 s, the appends' p99 "
        "1,115-1,209 -> 778-814 ms and p50 764-860 -> 540-556 ms, twice the appends during the prefill, "
        "the prefill 7.2-7.8 -> 9.4-9.5 s; 0.02 s was too short for 8 appends to arrive through one "
        "ingress here. 0: a chunk never waits."))

    def header_spin_us(self, device_type: str) -> float:
        """How long a peer on a `device_type` ("cpu", "cuda") rank polls for the next header."""
        return self.header_spin_us_gpu if device_type == "cuda" else self.header_spin_us_cpu

    def heartbeat_interval(self, collective_timeout_s: float) -> float:
        """Idle time after which rank 0 sends a heartbeat header to the step loops."""
        return max(self.min_heartbeat_s, collective_timeout_s / self.heartbeats_per_timeout)


@dataclass(frozen=True)
class FleetTunables:
    """Fleet reporting: what the Controller knows of the gangs and the replicas' metrics
    (service.state.fleet, service.deployments.controller, service.metrics)."""

    __pydantic_config__ = {"extra": "forbid"}  # an unknown key is refused, named

    report_interval_s: float = knob(1.0, (
        "A gang's report period to the Controller (it also reports at once on every state change): "
        "/gangs and the metrics are at most this old."))
    metrics_report_interval_s: float = knob(2.0, "An ingress replica's metrics report period to the Controller.")
    stale_after_s: float = knob(5.0, (
        "A gang whose last report is older than this is not counted as ready: it is hung, cut off, or "
        "gone. Several report periods, so one late report never flips readiness."))
    fold_after_s: float = knob(60.0, (
        "A replica silent this long has its counters folded into the `retired` snapshot: longer than the "
        "GangServer's health-check timeout, so such a replica has been replaced and never reports again."))
    lost_kept_s: float = knob(120.0, "How long a lost gang is still named in /gangs' `lost` and readiness reasons.")
    warm_up_reports: int = knob(3, (
        "A Controller up for less than this many report periods may not have heard from every gang "
        "yet: readiness then asks a gang directly (warm_up_s below)."))
    watch_interval_s: float = knob(0.5, (
        "The Controller pings every gang's replica actor this often: a dead rank 0 stops counting as "
        "ready within one period, before Serve's health check or a stale report."))
    watch_fleet_max_s: float = knob(10.0, (
        "The longest the Controller holds an ingress replica's long poll of the fleet view before it "
        "answers unchanged (the ingress asks again at once)."))
    ping_timeout_s: float = knob(5.0, (
        "A ping slower than this is left to the staleness rule (the gang may be busy), not taken as a loss."))
    ray_flush_interval_s: float = knob(1.0, (
        "How often a replica hands its queued observations to Ray's metrics (off the request path: a Ray "
        "record costs far more than ours). Ray exports every few seconds anyway."))
    ray_queue_max: int = knob(100_000, (
        "Observations waiting for that flush; beyond this they are dropped (and counted), so a stuck "
        "flusher never grows memory."))

    @property
    def warm_up_s(self) -> float:
        """warm_up_reports x report_interval_s."""
        return self.warm_up_reports * self.report_interval_s


@dataclass(frozen=True)
class TransportTunables:
    """Transport: the ingress -> rank 0 data plane (service.transport, the ingress's request policy)."""

    __pydantic_config__ = {"extra": "forbid"}  # an unknown key is refused, named

    min_shared_bytes: int = knob(64 * KIB, (
        "Tensors of this many bytes or more go through /dev/shm (a shared region or file) instead of by "
        "value. Ray sends objects under 100 KiB inline in the RPC, so little is saved below; the "
        "shm_transport builder argument's description quotes this value."))
    max_shared_region_bytes: int = knob(64 * MIB, (
        "Largest shared region a data-channel connection keeps in /dev/shm; larger (rare) requests go "
        "inline on the socket."))
    channel_max_header_bytes: int = knob(16 * KIB, (
        "Largest JSON header of one data-channel frame, both sides (also the socket reader's line limit): "
        "a header is a few hundred bytes, anything near this is not one."))
    stale_socket_s: float = knob(60.0, (
        "A data-channel socket file nobody accepts on, older than this, is a dead replica's and is "
        "removed at start (a replica that is just starting is younger)."))
    shm_retry_after_s: float = knob(30.0, "After a shared-memory hand-off failed, tensors go by value for this long.")
    channel_retry_after_s: float = knob(5.0, (
        "After a data-channel failure, requests use the Serve handle for this long (same replica), then "
        "the channel is tried again."))


@dataclass(frozen=True)
class IngressTunables:
    """Ingress: its waits on the gang, the Controller and the JobManager, and its request path
    (service.ingress, service.contract.deadlines, the Ingress deployment)."""

    __pydantic_config__ = {"extra": "forbid"}  # an unknown key is refused, named

    desired_max_age_s: float = knob(5.0, (
        "One read of Serve's replica target (the desired gang count when autoscaling) serves /gangs and "
        "/readyz this long: it is a round trip to Serve's controller, and the autoscaler moves it every few seconds at most."))
    status_max_age_s: float = knob(1.0, "How stale the cached gang status may be on the request path.")
    describe_timeout_s: float = knob(2.0, (
        "Bound on one /gang describe call to a GangServer (status, readiness fallback)."))
    retry_backoff_s: tuple[float, ...] = knob((0.0, 0.05, 0.1, 0.2, 0.25), (
        "Pauses before the ingress retries a request after a gang failure, by attempt; the last one "
        "repeats (a rebuild takes seconds). Every retry stays inside the request's deadline."))
    wait_poll_s: float = knob(0.1, (
        "How often a request waiting for a gang (rebuilding, restarting) looks at its state again."))
    default_outage_s: float = knob(5.0, (
        "Expected time to a serving gang before any outage was measured: a request whose deadline ends "
        "sooner gets 503 deadline_unmeetable at once instead of waiting."))
    snapshot_timeout_s: float = knob(1.0, (
        "Bound on the ingress's read of the cluster's resources (Ray's GCS) for a diagnosis of needed vs "
        "free (a request waiting for a gang, readiness, /gangs); past it the diagnosis says they are unknown."))
    snapshot_max_age_s: float = knob(0.5, "One read of the cluster's resources serves every diagnosis this long.")
    readiness_timeout_s: float = knob(1.0, (
        "Bound on readiness's call to the Controller (it answers from memory in milliseconds); slower, "
        "readiness asks a gang instead."))
    fleet_timeout_s: float = knob(5.0, "Bound on the status routes' Controller calls (/gangs, rollouts): no fallback there.")
    skip_after_failure_s: float = knob(2.0, (
        "After a failed readiness call, readiness skips the Controller this long (answers from the "
        "fallback at once): Serve may keep routing to a dead Controller replica until it notices."))
    jobs_call_timeout_s: float = knob(30.0, (
        "Bound on the training routes' calls to the JobManager; the state stores' own waits stay below "
        "it, so the caller gets the store's 503 with a reason, not this timeout."))
    jobs_metrics_timeout_s: float = knob(5.0, "A /metrics scrape waits at most this long for the JobManager's figures.")
    swap_timeout_s: float = knob(300.0, (
        "Bound on POST /weights' swap call to one gang (every rank loads, stages and commits the new "
        "weights; a big checkpoint on slow storage takes minutes); rollout_timeout_s then bounds the "
        "wait for the other gangs."))
    rollout_timeout_s: float = knob(120.0, (
        "POST /weights waits this long for every gang to serve the new version (the others follow the "
        "record within a probe interval or two), then answers rolled_out: false."))
    drain_timeout_s: float = knob(125.0, (
        "Serve's graceful_shutdown_timeout_s for the Ingress: a replica being replaced keeps the requests "
        "that wait for a gang this long, the time a new gang takes to come up. Above the builder argument "
        "request_timeout_s, so a request with the default deadline gets its answer (or its 504) first."))
    inline_decode_bytes: int = knob(64 * KIB, (
        "Binary bodies up to this size are decoded on the event loop (a zero-copy view and a float32 "
        "check cost less than a hop to a decode thread); larger ones, and every compressed one, go to "
        "the decode pool. Replies of as many float32 values are encoded inline (inline_encode_values)."))
    proxy_margin_s: float = knob(0.05, (
        "A deadline from X-Request-Timeout-Seconds is set this much earlier than the header says (plus "
        "proxy_margin_share of it, at most proxy_margin_max_s): Serve's proxy answers a plain-text 408 "
        "when the header's time is up, and the client must get our JSON 504 first."))
    proxy_margin_share: float = knob(0.02, (
        "... plus this share of the header's time (the proxy-to-ingress hop grows under load, and "
        "longer deadlines can spare more) ..."))
    proxy_margin_max_s: float = knob(0.5, "... at most this much in all.")

    @property
    def inline_encode_values(self) -> int:
        """inline_decode_bytes / 4: replies of as many float32 values as an inline-decoded body."""
        return self.inline_decode_bytes // FLOAT32_BYTES


@dataclass(frozen=True)
class TrainingTunables:
    """Training and job polling: the JobManager's loop, the run actors and the workers
    (service.deployments.job_manager, service.training)."""

    __pydantic_config__ = {"extra": "forbid"}  # an unknown key is refused, named

    poll_interval_s: float = knob(0.5, "The JobManager's poll loop period (run snapshots, heartbeats, adoption, schedules).")
    heartbeat_interval_s: float = knob(2.0, "A JobManager replica writes its heartbeat to the job store this often.")
    owner_stale_s: float = knob(15.0, (
        "A manager whose heartbeat is this old is presumed dead; another adopts its active jobs. Several "
        "heartbeat periods, so a slow store write is not a death."))
    adopt_interval_s: float = knob(5.0, "How often a manager looks for orphaned jobs to adopt.")
    snapshot_timeout_s: float = knob(10.0, "Bound on one poll of a run actor (its progress, logs and history since the last poll).")
    max_missed_polls: int = knob(12, (
        "Unanswered polls in a row before a run actor is declared hung and stopped (about 2 minutes at "
        "poll_interval_s + snapshot_timeout_s each)."))
    pending_reason_interval_s: float = knob(2.0, "How often a PENDING job's reason (what the cluster lacks) is recomputed.")
    max_poll_failures: int = knob(20, (
        "Failed rounds of the poll loop in a row (store or Ray errors) before check_health fails and Serve "
        "restarts the replica (about 10 s of rounds at poll_interval_s; the new replica adopts the jobs "
        "once this one's heartbeat is owner_stale_s old)."))
    late_sweep_s: tuple[float, ...] = knob((5.0, 20.0), (
        "After deleting a job whose run was still active, its files are removed again after these pauses: "
        "a run being killed may still write a checkpoint or result.json."))
    max_resumes: int = knob(3, (
        "Times one job's run is started again after it died with the service (not worker failures: those "
        "are the job's max_failures) before the job FAILS."))
    checkpoint_wait_s: float = knob(600.0, (
        "Longest rank 0 waits for the previous epoch's checkpoint upload before writing the next (and "
        "for the last one at the end): slower storage fails the run, naming it."))
    group_timeout_s: float = knob(300.0, (
        "Bound on a worker group's start (its rank actors up, their process group formed) and on each "
        "of its collectives: a rank that died or hangs fails the attempt within it, never a hang."))
    progress_interval_s: float = knob(0.5, "Rank 0 reports step progress (fire-and-forget) at most this often.")
    ack_timeout_s: float = knob(30.0, "Bound on the run actor's acknowledgement of a worker's start and of each finished epoch.")
    output_interval_s: float = knob(5.0, (
        "Captured worker output is sent after each epoch and, within a long epoch, at most this often."))
    output_ack_timeout_s: float = knob(10.0, "Bound on the run actor's acknowledgement of a batch of worker output.")
    output_ring_lines: int = knob(200, (
        "Output lines a worker keeps between two sends (older ones are dropped and counted in one line)."))
    output_line_chars: int = knob(1000, (
        "A captured output line is cut at this many characters: in the worker, and again in the run "
        "actor that receives it (one value for both)."))
    max_output_lines_per_call: int = knob(500, (
        "Lines the run actor takes from one worker_output call; more than a worker's ring holds, so "
        "nothing a worker sends is cut here."))
    max_run_log_lines: int = knob(1000, (
        "Newest log lines a run actor keeps for the JobManager's polls (each poll takes those it has not "
        "seen; the job store keeps max_log_lines_per_job)."))
    finished_linger_s: float = knob(600.0, (
        "A finished run whose manager never collects it (manager gone) exits after this long; its outcome "
        "stays in result.json."))
    max_log_lines_per_job: int = knob(2000, "Newest log lines the job store keeps per job (GET /train/{id}/logs).")


@dataclass(frozen=True)
class StateTunables:
    """State: the database (SQLite or PostgreSQL) and the artifact storage (state dir or S3)
    (service.state.db, service.state.artifacts)."""

    __pydantic_config__ = {"extra": "forbid"}  # an unknown key is refused, named

    sqlite_busy_timeout_s: float = knob(10.0, (
        "SQLite's busy wait for another writer's lock; below the ingress's jobs_call_timeout_s, so the "
        "caller gets the store's 503 with a reason."))
    connect_timeout_s: float = knob(5.0, "One PostgreSQL connection attempt (libpq connect_timeout; whole seconds).")
    pool_timeout_s: float = knob(5.0, "Wait for a pooled PostgreSQL connection (the server may be gone).")
    pg_lock_timeout_ms: int = knob(10_000, (
        "PostgreSQL lock_timeout: the wait for the advisory lock or a row lock (below jobs_call_timeout_s)."))
    pg_statement_timeout_ms: int = knob(20_000, "PostgreSQL statement_timeout (below jobs_call_timeout_s).")
    pg_idle_in_transaction_ms: int = knob(60_000, (
        "PostgreSQL idle_in_transaction_session_timeout: a writer that died mid-transaction frees its lock."))
    pool_min_size: int = knob(1, "PostgreSQL connections a process keeps open.")
    pool_max_size: int = knob(4, "Most PostgreSQL connections one process opens.")
    copy_chunk_bytes: int = knob(4 * MIB, "Read size of artifact copies, hashes and downloads.")
    s3_connect_timeout_s: float = knob(3.0, (
        "S3 connect timeout: a dead endpoint fails within seconds instead of the SDK's minutes of retries."))
    s3_request_timeout_s: float = knob(30.0, "S3 timeout per socket read: a slow but live endpoint still gets this.")
    s3_max_attempts: int = knob(3, "S3 attempts per request (the SDK's standard retry strategy).")
    cache_lock_timeout_s: float = knob(600.0, (
        "Whoever does not get a node's download lock within this long reports the wait (another rank on "
        "the node may still be downloading a big checkpoint)."))


@dataclass(frozen=True)
class Tunables:
    """Every tunable, by concern (the builder arguments' `tunables:` section). The relations
    between values (`orderings`) are checked by AppConfig's validator."""

    __pydantic_config__ = {"extra": "forbid"}  # an unknown key is refused, named

    gang: GangTunables = field(default_factory=GangTunables)
    fleet: FleetTunables = field(default_factory=FleetTunables)
    transport: TransportTunables = field(default_factory=TransportTunables)
    ingress: IngressTunables = field(default_factory=IngressTunables)
    training: TrainingTunables = field(default_factory=TrainingTunables)
    state: StateTunables = field(default_factory=StateTunables)

    def orderings(self) -> list[tuple[str, str, float, str, float]]:
        """(why, smaller, its value, larger, its value): what the code relies on, each value
        named as the builder arguments' `tunables:` section spells it."""
        g, f, i, t, s = self.gang, self.fleet, self.ingress, self.training, self.state
        return [
            ("a store's wait answers before the caller gives up", "tunables.state.sqlite_busy_timeout_s",
             s.sqlite_busy_timeout_s, "tunables.ingress.jobs_call_timeout_s", i.jobs_call_timeout_s),
            ("a store's wait answers before the caller gives up", "tunables.state.pg_lock_timeout_ms / 1000",
             s.pg_lock_timeout_ms / 1000, "tunables.ingress.jobs_call_timeout_s", i.jobs_call_timeout_s),
            ("a store's wait answers before the caller gives up", "tunables.state.pg_statement_timeout_ms / 1000",
             s.pg_statement_timeout_ms / 1000, "tunables.ingress.jobs_call_timeout_s", i.jobs_call_timeout_s),
            ("the gang server drains inside Serve's shutdown bound", "tunables.gang.drain_timeout_s",
             g.drain_timeout_s, "tunables.gang.graceful_shutdown_timeout_s", g.graceful_shutdown_timeout_s),
            ("a silent replica's counters fold only once Serve replaced it", "tunables.gang.health_check_timeout_s",
             g.health_check_timeout_s, "tunables.fleet.fold_after_s", f.fold_after_s),
            ("one late report never makes a gang stale", "2 x tunables.fleet.report_interval_s",
             2 * f.report_interval_s, "tunables.fleet.stale_after_s", f.stale_after_s),
            ("a slow heartbeat write is not a manager's death", "2 x tunables.training.heartbeat_interval_s",
             2 * t.heartbeat_interval_s, "tunables.training.owner_stale_s", t.owner_stale_s),
            ("the run actor takes every line a worker's ring holds", "tunables.training.output_ring_lines",
             t.output_ring_lines, "tunables.training.max_output_lines_per_call", t.max_output_lines_per_call),
        ]


# -- the reference (docs/tunables.md is generated from this) --------------------------------
def _value_text(name: str, value: Any) -> str:
    if isinstance(value, tuple):
        return ", ".join(_value_text(name, v) for v in value)
    if name.endswith("_bytes") and isinstance(value, int) and value >= KIB and value % KIB == 0:
        return f"{value // MIB} MiB" if value % MIB == 0 else f"{value // KIB} KiB"
    return f"{value:g}" if isinstance(value, float) else str(value)


def tunables_markdown(tunables: Tunables | None = None) -> str:
    """The tunables reference as Markdown: one table per section, each field with its value
    and description, then the values derived from them and the relations checked."""
    tunables = tunables or Tunables()
    lines = [
        "# Tunables",
        "",
        "Generated from `service/config/tunables.py` (`make docs`; `tests/test_config.py` checks it is current).",
        "They are the timing and sizing knobs of the service's own machinery, one frozen section per",
        "concern, set at deploy time in the `tunables:` section of the builder arguments",
        "([builder-arguments.md](builder-arguments.md)); a partial override keeps the other defaults,",
        "an unknown key is refused. Example (a Serve config's `args:`):",
        "",
        "```yaml",
        "tunables:",
        "  gang: {probe_interval_s: 1.0}",
        "  state: {s3_request_timeout_s: 120.0}",
        "```",
    ]
    for section in dataclasses.fields(tunables):
        part = getattr(tunables, section.name)
        doc = " ".join((type(part).__doc__ or "").split())
        lines += ["", f"## `{section.name}`", "", doc, "", "| tunable | value | what it bounds, and why |", "|---|---|---|"]
        for f in dataclasses.fields(part):
            text = " ".join(f.metadata["doc"].split()).replace("|", "\\|")
            lines.append(f"| `{section.name}.{f.name}` | {_value_text(f.name, getattr(part, f.name))} | {text} |")
        for name, attr in vars(type(part)).items():
            if isinstance(attr, property):
                text = " ".join((attr.__doc__ or "").split()).replace("|", "\\|")
                lines.append(f"| `{section.name}.{name}` | {_value_text(name, getattr(part, name))} | derived: {text} |")
    lines += ["", "## Relations checked when the builder arguments are validated", ""]
    lines += [f"- `{a}` < `{b}`: {why}" for why, a, _, b, _ in tunables.orderings()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m service.config.tunables > docs/tunables.md
    print(tunables_markdown(), end="")
