"""One OIP v2 inference, whatever the protocol that carried it (HTTP: service.ingress.oip.routes;
gRPC: service.ingress.oip_grpc.service): its deadline, then a stateless inference or a
sequence's append (service.ingress.oip.sequences), and the output in the reply's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from service.config.builder_args import AppConfig
from service.contract import deadlines
from service.ingress import codecs
from service.ingress.deps import Gang
from service.ingress.retries import GangMethod
from service.ingress.oip.codec import CheckedInputs, causal
from service.ingress.oip.schemas import InferenceRequest
from service.ingress.oip.sequences import rows_of, sequence_of


@dataclass(frozen=True)
class Answer:
    """The output tensor (the reply's dtype; [seq, E] when the input was) and, for a sequence's
    request, the response's parameters (sequence_id, sequence_length, weights_version)."""

    output: np.ndarray
    parameters: dict[str, Any] | None


def deadline_of(req: InferenceRequest, started: float, cfg: AppConfig, stated_s: float | None,
                stated_by_a_timer_in_front: bool | None = None) -> float:
    """The request's deadline (service.contract.deadlines): `stated_s` (HTTP's
    X-Request-Timeout-Seconds, gRPC's own deadline) and `parameters.timeout`, the earlier one;
    else the app's request_timeout_s. `stated_by_a_timer_in_front`: someone in front of us
    answers at `stated_s` too (Serve's proxy, a gRPC client's own timer), so we answer a margin
    earlier (default: whether Serve's proxy is our front door)."""
    return deadlines.request_deadline(started, cfg.serving.request_timeout_s, stated_s,
                                      deadlines.oip_timeout(req.parameters), stated_by_a_timer_in_front,
                                      tunables=cfg.tunables.ingress)


async def answer(req: InferenceRequest, inputs: CheckedInputs, gang: Gang, deadline: float) -> Answer:
    """Compute the request: a sequence's rows appended to its session, or a stateless inference."""
    sequence = sequence_of(req)  # Triton's sequence parameters: a session (service.ingress.oip.sequences)
    parameters = None
    if sequence is not None:
        rows, info = await gang.session_call(GangMethod.SESSION_OIP, rows_of(inputs.x), sequence.start, sequence.end,
                                             session_id=sequence.id, deadline=deadline,
                                             idempotency_key=sequence.idempotency_key)
        out = rows[None]  # [1, n, E]
        parameters = {"sequence_id": (req.parameters or {}).get("sequence_id"), "sequence_length": info["length"],
                      "weights_version": info["weights_version"]}
    else:
        out = await gang.infer(inputs.x, inputs.mask, causal(req), deadline)  # [batch, seq, E] float32
    return Answer(codecs.cast_reply(out[0] if inputs.squeezed else out, inputs.reply_dtype), parameters)
