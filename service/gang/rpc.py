"""Lifecycle calls from rank 0 to the peer actors: submitted together, waited for bounded.

A lifecycle operation (create, rendezvous, load, stage/commit weights, probe, failpoints)
submits one Ray call per peer, lets rank 0 do its own side meanwhile, then waits for all of
them with one deadline. Two ways to wait:

- `get_all`: every peer must answer; the first failure raises. A timeout raises
  GangStartupError naming the stage and the late ranks (and, for `create`, why their bundles
  may not be placed).
- `settle`: collect what each peer answered and a "rank r: why" line per failure, without
  raising, for the two-phase weights swap, which must decide what to keep on every rank.

Ranks are numbered from 1 here: refs[i] is rank i + 1 (rank 0 is the calling process).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from service.errors import GangStartupError
from service.gang.failures import cause, first_line


def call(actors: Sequence[Any], method: str, *args: Any) -> list:
    """Submit `method(*args)` on every peer actor; the refs, in rank order."""
    return [getattr(actor, method).remote(*args) for actor in actors]


def get_all(refs: list, stage: str, timeout_s: float, diagnose: Callable[[], str] | None = None) -> list:
    """Every peer's result of `stage` within timeout_s; a timeout names the stage and the
    late ranks (plus `diagnose()`, when given, for why they may be late)."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        late = [i + 1 for i, r in enumerate(refs) if r not in ready]
        why = f"stage {stage!r}: ranks {late} did not answer within {timeout_s:.0f}s"
        if diagnose is not None:
            why += f"; {diagnose()}"
        raise GangStartupError(why) from None


def settle(refs: list, stage: str, timeout_s: float, failures: list[str],
           on_died: Callable[[int], None]) -> list:
    """Each peer's result of `stage` within one deadline of timeout_s; appends 'rank r: why'
    to `failures` for every peer that did not answer, raised, or died (then `on_died(r)`)."""
    results: list = []
    deadline = time.monotonic() + timeout_s
    for rank, ref in enumerate(refs, start=1):
        try:
            results.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
        except GetTimeoutError:
            failures.append(f"rank {rank}: no answer within stage_timeout_s={timeout_s:.0f}s")
        except RayActorError as exc:
            failures.append(f"rank {rank}: its process died ({first_line(exc)})")
            on_died(rank)
        except RayError as exc:
            inner = cause(exc)
            failures.append(f"rank {rank}: {type(inner).__name__}: {first_line(inner)}")
    return results
