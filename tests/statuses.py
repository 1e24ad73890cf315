"""Gang reports for tests that need one without a gang: a full, valid GangStatus (every field
its producer always sets), with the fields a test is about given by name."""
from __future__ import annotations

from typing import Any

from service.contract.gang_status import GangStatus

_BATCHING = {"steps": 0, "requests": 0, "inline_steps": 0, "recent_step_ms_p50": 0.0, "mixed_length_steps": 0,
             "tokens": 0, "padded_tokens": 0, "padded_token_share": 0.0, "recent_padded_token_share_mean": 0.0,
             "max_padding_fraction": 0.25, "expired_queued": 0, "expired_running": 0, "cancelled_queued": 0}


def gang_report(state: str = "ready", reason: str = "ready", **fields: Any) -> GangStatus:
    """A two-rank gloo gang's report in `state`; `fields` replace the defaults (validated: a
    field the contract does not declare is refused here too)."""
    ranks = [{"rank": r, "node_id": f"node{r}", "node_ip": "10.0.0.1", "pid": 100 + r, "device": "cpu", "iface": None}
             for r in range(2)]
    base: dict[str, Any] = {
        "world_size": 2, "backend": "gloo", "state": state, "reason": reason, "weights_version": 0,
        "weights_source": None, "generation": 1, "last_bring_up": {}, "spare": {"state": "none"},
        "param_bytes_per_rank": [0, 0], "batching": _BATCHING, "ranks": ranks, "failed_rebuilds": 0,
        "replica_id": "r1", "data_channel": {"listening": False, "requests": 0, "refused_overloaded": 0,
                                             "disconnected": 0, "in_flight": 0},
        "step_timings": {},
    }
    return GangStatus.model_validate({**base, **fields})
