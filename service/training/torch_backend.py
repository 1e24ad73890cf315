"""Ray Train's torch backend, with each worker's process group bound to its node's interface.

Ray Train creates the DDP process group in `_TorchBackend.on_start`, before the train loop
runs, so the interface must be chosen there: this backend first runs
`service.cluster.netif.bind_ray_worker` on every worker (each on its own node), then does exactly
what Ray Train's does. (A `worker_process_setup_hook` in the workers' runtime_env would be
the declarative way, but Ray 2.60 applies that hook only from the job-level runtime_env.)
`_TorchBackend` is private Ray API: pinned by constraints.txt, covered by the multi-node tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from service.cluster.netif import bind_ray_worker


class _InterfaceBoundTorchBackend(_TorchBackend):
    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        worker_group.execute(bind_ray_worker)
        super().on_start(worker_group, backend_config)


@dataclass
class InterfaceBoundTorchConfig(TorchConfig):
    """TorchConfig whose workers bind gloo/NCCL to their node's Ray IP interface."""

    @property
    def backend_cls(self) -> type[_TorchBackend]:
        return _InterfaceBoundTorchBackend
