"""The promotion gate of `POST /weights {"job_id", "max_eval_loss"}`.

A job's checkpoint goes to every gang only when its final held-out loss (the job record's
`final_eval_loss`: the last epoch's eval loss of a SUCCEEDED job) is known, finite and at
most the caller's bound. Jobs recorded before validation existed have no eval loss: with a
bound they are refused, not waved through. Pure: no I/O, no Ray.
"""
from __future__ import annotations

import math
from typing import Any

from service.contract.errors import Conflict, ErrorCode


def job_eval_loss(job: dict[str, Any]) -> float | None:
    """The job record's `final_eval_loss` as a float, or None (absent, null, or not a number)."""
    value = job.get("final_eval_loss")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def check_eval_gate(job: dict[str, Any], max_eval_loss: float | None) -> None:
    """Raise Conflict (409 `eval_gate`) unless `job` may be promoted under `max_eval_loss`
    (None: no gate). The message names the job, its loss and the bound."""
    if max_eval_loss is None:
        return
    job_id = job.get("id", "?")
    loss = job_eval_loss(job)
    if loss is None:
        raise Conflict(
            f"job {job_id} has no eval loss (final_eval_loss is null: it ran without validation, or before "
            f"validation existed), so it cannot pass max_eval_loss={max_eval_loss!r}; promote it without "
            "max_eval_loss, or train it again with a validation split",
            code=ErrorCode.EVAL_GATE,
        )
    if not math.isfinite(loss) or loss > max_eval_loss:
        raise Conflict(
            f"job {job_id}'s final eval loss {loss!r} is above max_eval_loss={max_eval_loss!r}; nothing changed",
            code=ErrorCode.EVAL_GATE,
        )
