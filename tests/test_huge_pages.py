"""service.parallel.huge_pages: the KV pool and a rank's large weights on transparent huge pages.

Whether the memory was advised is read from /proc/self/smaps (the mapping holding the tensor:
THPeligible, which in THP mode "madvise" is 1 only where huge pages were asked for), not from
anything the module says about itself; what the kernel granted (AnonHugePages) is printed.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from service.parallel.huge_pages import HUGE_PAGE, advice_problem, move_parameters, thp_mode, zeros
from service.parallel.kv_cache import PagedKVPool
from service.parallel.model import load_shard_into

pytestmark = pytest.mark.unit


def mapping_at(address: int) -> tuple[bool, int]:
    """The mapping of this process that holds `address`: whether the kernel may back it with
    huge pages (smaps' THPeligible: in THP mode "madvise", only where they were asked for) and
    how many bytes of it are on huge pages now (AnonHugePages: what the kernel could grant)."""
    inside, eligible, huge = False, None, None
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            if inside:
                break
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1]) * 1024
        elif inside and head == "THPeligible:":
            eligible = line.split()[1] == "1"
    assert eligible is not None and huge is not None, f"no mapping of this process holds {address:#x}"
    return eligible, huge


def assert_asked_for(t: torch.Tensor, what: str) -> None:
    """The tensor's mapping was advised (deterministic); what the kernel granted depends on its
    free huge pages, so it is printed, not asserted."""
    eligible, huge = mapping_at(t.data_ptr())
    print(f"{what}: {huge >> 20} MiB of its mapping on huge pages")
    assert eligible, f"{what}: its memory was not advised for huge pages (smaps THPeligible 0)"


needs_thp = pytest.mark.skipif(advice_problem() is not None or thp_mode() != "madvise",
                               reason=f"only THP mode madvise tells advised memory apart: {advice_problem() or thp_mode()}")


@needs_thp
def test_a_cpu_pool_is_zeroed_on_huge_pages() -> None:
    pool = PagedKVPool(num_blocks=512, block_size=16, heads_local=8, head_dim=64, dtype=torch.float32,
                       device=torch.device("cpu"), layers=2)  # 2 x 16 MiB
    assert pool.k.shape == (2, 512, 16, 8, 64) and pool.k.is_contiguous() and pool.k.dtype == torch.float32
    assert int(pool.k.count_nonzero()) == 0 and int(pool.v.count_nonzero()) == 0
    for t, what in ((pool.k, "the pool's K"), (pool.v, "the pool's V")):
        assert t.data_ptr() % HUGE_PAGE == 0
        assert_asked_for(t, what)


@needs_thp
def test_moved_parameters_keep_their_values_and_objects_and_land_on_huge_pages() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(1024, 1536), nn.Linear(1536, 1024, bias=False), nn.LayerNorm(1024))
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    objects = {name: p for name, p in module.named_parameters()}
    small = module[2].weight.data_ptr()
    moved = move_parameters(module)
    assert moved == 2 * 1024 * 1536 * 4  # the two weight matrices; biases and the norm are smaller than a page
    for name, p in module.named_parameters():
        assert p is objects[name] and torch.equal(p, before[name]), name
    assert module[2].weight.data_ptr() == small
    assert_asked_for(module[0].weight, "the moved weights")
    x = torch.randn(3, 1024)
    assert torch.equal(module(x), module(x))  # and it computes from the new storage


def test_a_loaded_shard_is_what_the_module_holds_whatever_its_pages() -> None:
    """load_shard_into gives the large parameters fresh storage before copying: every value is
    the shard's, small and large, and a wrong shard still writes nothing."""
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 8))
    shard = {name: torch.randn_like(p) for name, p in module.named_parameters()}
    load_shard_into(module, shard)
    for name, p in module.named_parameters():
        assert torch.equal(p, shard[name]), name
    held = {name: p.detach().clone() for name, p in module.named_parameters()}
    with pytest.raises(ValueError, match="shape"):
        load_shard_into(module, {**shard, "1.weight": torch.zeros(9, 1024)})
    for name, p in module.named_parameters():
        assert torch.equal(p, held[name]), f"{name} changed by a refused shard"


def test_small_and_non_cpu_requests_are_plain_zeros() -> None:
    t = zeros((3, 5), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and int(t.count_nonzero()) == 0
    meta = zeros((1024, 1024), torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and meta.shape == (1024, 1024)
