"""Lifecycle calls from rank 0 to the peer actors: one entry point, `PeerGroup.call`.

A lifecycle operation (create, rendezvous, load, the step loop's start, stage / commit /
discard weights, probe, a refused step's reason, step timings, failpoints) is one Ray call
per peer, waited for with one deadline, as vLLM's `collective_rpc`. When rank 0 has its own
side to do meanwhile, `submit` sends the calls and `collect` waits for them afterwards.

Every wait is bounded: by the group's `stage_timeout_s`, or by less when the caller says so
(a probe, a stats read). Every answer is read per rank, and each failure becomes one line:
- the peer's call raised: "rank r: Type: message" (the exception inside Ray's wrapper);
- the peer's process died: "rank r: its process died (...)", and `on_died(group, r, stage)`
  is told at once (the gang marks itself BROKEN);
- no answer by the deadline: "rank r: no answer within N s".

Two ways to collect (`collect=`):
- "all": every peer must answer. The first failure ends the wait (later answers would not
  change the outcome) and raises PeerCallFailed, naming the stage and the failed ranks,
  plus `diagnose()` for a stage whose lateness has a known cause (`create`: unplaced bundles).
- "settle": wait for every peer and never raise: a `Settled` with each rank's result and
  the failure lines, for the two-phase weights swap, which must decide what to keep on
  every rank.

`on_wait()` runs on the calling thread between slices of a wait (at most `wait_slice_s`
apart): the gang's heartbeats to the step loops, which must go out from the sequencer
thread while it waits on a lifecycle call longer than the control group's timeout. A caller
on another thread passes `tick=False`.

Ranks are numbered from 1 here: actors[i] is rank i + 1 (rank 0 is the calling process).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import ray
from ray.exceptions import RayActorError, RayError

from service.gang.failures import PeerCallFailed, cause, first_line, kill_quietly


@dataclass(frozen=True)
class Calls:
    """Calls in flight: refs[i] is rank ranks[i]'s."""

    ranks: list[int]
    refs: list


@dataclass
class Settled:
    """What every peer answered: `results` by rank (the ranks that answered), `failures`
    one "rank r: why" line per rank that did not (in rank order)."""

    results: dict[int, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


class PeerGroup:
    """The peer rank actors of one gang generation (ranks 1..N-1) and the one way to call them."""

    def __init__(self, actors: Sequence[Any], stage_timeout_s: float,
                 on_died: Callable[[PeerGroup, int, str], None] | None = None,
                 on_wait: Callable[[], None] | None = None, wait_slice_s: float = 1.0) -> None:
        self.actors = list(actors)
        self.stage_timeout_s = stage_timeout_s
        self._on_died = on_died
        self._on_wait = on_wait
        self._slice_s = wait_slice_s

    def __len__(self) -> int:
        return len(self.actors)

    def submit(self, method: str, *args: Any, ranks: Sequence[int] | None = None) -> Calls:
        """Send `method(*args)` to every peer (or to `ranks` only); returns at once."""
        chosen = list(ranks) if ranks is not None else list(range(1, len(self.actors) + 1))
        for rank in chosen:
            if not 1 <= rank <= len(self.actors):
                raise ValueError(f"rank {rank} is not a peer of this gang (peers are ranks 1..{len(self.actors)})")
        return Calls(chosen, [getattr(self.actors[rank - 1], method).remote(*args) for rank in chosen])

    def call(self, method: str, *args: Any, stage: str, timeout_s: float | None = None,
             collect: Literal["all", "settle"] = "all", ranks: Sequence[int] | None = None,
             diagnose: Callable[[], str] | None = None, tick: bool = True) -> list | Settled:
        """`method(*args)` on every peer (or `ranks`), waited for as `collect` says (see the
        module docstring): "all" returns the results in rank order or raises PeerCallFailed;
        "settle" returns a Settled."""
        calls = self.submit(method, *args, ranks=ranks)
        return self.collect(calls, stage=stage, timeout_s=timeout_s, collect=collect,
                            diagnose=diagnose, tick=tick)

    def collect(self, calls: Calls, *, stage: str, timeout_s: float | None = None,
                collect: Literal["all", "settle"] = "all", diagnose: Callable[[], str] | None = None,
                tick: bool = True) -> list | Settled:
        """Wait for `calls` (from `submit`) within min(timeout_s, stage_timeout_s); see `call`."""
        bound = self.stage_timeout_s if timeout_s is None else min(timeout_s, self.stage_timeout_s)
        deadline = time.monotonic() + bound
        rank_of = {ref: rank for rank, ref in zip(calls.ranks, calls.refs)}
        settled = Settled()
        failed: dict[int, str] = {}
        pending = list(calls.refs)
        while pending and not (failed and collect == "all"):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, self._slice_s))
            for ref in ready:
                rank = rank_of[ref]
                try:
                    settled.results[rank] = ray.get(ref, timeout=0)
                except RayActorError as exc:
                    failed[rank] = f"rank {rank}: its process died ({first_line(exc)})"
                    if self._on_died is not None:
                        self._on_died(self, rank, stage)
                except RayError as exc:
                    inner = cause(exc)
                    failed[rank] = f"rank {rank}: {type(inner).__name__}: {first_line(inner)}"
            if pending and tick and self._on_wait is not None:
                self._on_wait()
        late = [] if failed and collect == "all" else sorted(rank_of[ref] for ref in pending)
        for rank in late:
            failed[rank] = f"rank {rank}: no answer within {bound:g}s"
        settled.failures = [failed[rank] for rank in sorted(failed)]
        if collect == "settle":
            return settled
        if failed:
            why = f"stage {stage!r}: " + "; ".join(settled.failures)
            if late and diagnose is not None:
                why += f"; {diagnose()}"
            raise PeerCallFailed(why, stage, sorted(failed), late)
        return [settled.results[rank] for rank in calls.ranks]

    def kill(self) -> None:
        """Kill every peer process (without restart); one already gone is not an error."""
        for actor in self.actors:
            kill_quietly(actor)
