"""The world-size apps shared by tests/test_masks.py and tests/test_sessions.py.

One app per world size (1, 2, 4) with random weights (the softmax is far from one-hot),
deployed together on first use and deleted after the last test that uses them: a Serve app costs
15-30 s here, and the two modules used to deploy three each with nearly the same arguments.
Each app carries the settings one test is about, so the union of both modules' needs:

- ws1: a small session cache (1024 tokens: 64 blocks of 16) and a short idle timeout, for
  eviction, 507 and expiry;
- ws2: requests linger 20 ms for company (continuous batching) and batches of mixed lengths
  keep padding under half (`max_padding_fraction`);
- ws4: the data channel off (the handle and /dev/shm paths; ws1 and ws2 use the channel).

The sessions module mutates its ws2 app (a weights swap; tests that kill a rank use their
own apps, tests/test_gang_faults.py), so the two modules
run next to each other, masks first, in either file order (tests/conftest.py); the apps are
deleted when the last test that asks for `world_size_apps` ends, so they never hold the
cluster's CPUs while other modules run.
"""
from __future__ import annotations

from typing import Any

from service.parallel.weights import random_weights
from tests.conftest import local_yaml_args, submit, undeploy, wait_deployed

SEED = 3
E = 512
WEIGHTS = random_weights(E, SEED)
# The modules that use these apps, in the order they run (next to each other).
USED_BY = ("tests/test_masks.py", "tests/test_sessions.py")
SMALL_CACHE_TOKENS = 1024
EXTRA_ARGS: dict[int, dict[str, Any]] = {
    1: {"session_cache_bytes": SMALL_CACHE_TOKENS * 2 * E * 4, "max_session_tokens": 2048,
        "session_idle_timeout_s": 6},
    2: {"max_padding_fraction": 0.5, "batch_wait_timeout_s": 0.02},
    4: {"data_channel": False},
}

def app_args(world_size: int, **extra: object) -> dict[str, Any]:
    """The builder arguments of the shared apps' family (random init, SEED, 0.25 CPU a rank)."""
    return {**local_yaml_args(), "init": "random", "seed": SEED, "world_size": world_size,
            "cpus_per_rank": 0.25, "session_block_tokens": 16, **extra}


class WorldSizeApps:
    """world size -> the base URL of its shared app. The first `get` hands every world size's
    app to Serve at once and waits for the one asked for; a later `get` waits for its own.
    Started side by side, the three apps' process starts overlap with each other's waits
    (placement, health checks, the gangs' rendezvous): one after the other, each took 15-30 s
    here (bench/NOTES.md, session 18)."""

    def __init__(self, serve_url: str) -> None:
        self._serve_url = serve_url
        self._submitted: set[int] = set()
        self._ready: dict[int, str] = {}

    @staticmethod
    def name(world_size: int) -> str:
        """The app's Serve name, also its route prefix (after a slash)."""
        return f"shared-ws{world_size}"

    def get(self, world_size: int) -> str:
        if world_size not in EXTRA_ARGS:
            raise KeyError(f"no shared app of world size {world_size}; there are {sorted(EXTRA_ARGS)}")
        if world_size not in self._ready:
            for ws in EXTRA_ARGS:
                if ws not in self._submitted:
                    submit(self.name(ws), f"/{self.name(ws)}", app_args(ws, **EXTRA_ARGS[ws]))
                    self._submitted.add(ws)
            name = self.name(world_size)
            self._ready[world_size] = wait_deployed(self._serve_url, name, f"/{name}")
        return self._ready[world_size]

    def close(self) -> None:
        """Delete every submitted app (idempotent); a later get() deploys again."""
        for world_size in sorted(self._submitted):
            undeploy(self.name(world_size))
        self._submitted.clear()
        self._ready.clear()
