"""The GPU path's logic that runs without a GPU (no Ray): the NCCL error mode and abort
choice, bounded teardown, device choice, interface mirroring, dtype refusal, the mask's
size, step clocks and the resume load."""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from service.cluster import netif
from service.gang import worker
from service.gang.backends import DeadlineExceeded, call_with_deadline, leave_group_plan, prepare_cuda_allocator, prepare_env
from service.gang.devices import choose_device, cuda_index
from service.gang.stepclock import StepClock
from service.parallel import ParallelGroup, TensorParallelAttention
from service.parallel.layers import attention_bias_mask, sdpa_mask
from service.parallel.weights import random_weights, seed_weights, shard_dense

pytestmark = pytest.mark.unit


# -- the NCCL error mode and the way a group is left ----------------------------------------
def test_nccl_gets_blocking_wait_and_no_watchdog_teardown_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert prepare_env("nccl", env) == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    user = {"TORCH_NCCL_BLOCKING_WAIT": "0"}  # e.g. the GPU check's run of torch's default mode
    assert prepare_env("nccl", user)["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    gloo: dict[str, str] = {}
    assert prepare_env("gloo", gloo) == {} and gloo == {}


def test_nccl_groups_are_aborted_gloo_groups_destroyed() -> None:
    assert leave_group_plan("nccl") == "abort"
    assert leave_group_plan("gloo") == "destroy"


def test_cuda_allocator_asks_for_expandable_segments_and_keeps_the_users_settings() -> None:
    env: dict[str, str] = {}
    assert prepare_cuda_allocator(env) == "expandable_segments:True"
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert prepare_cuda_allocator(env) == "max_split_size_mb:128,expandable_segments:True"
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert prepare_cuda_allocator(env) == "expandable_segments:False"


# -- bounded calls ---------------------------------------------------------------------------
def test_a_call_that_never_returns_is_abandoned_at_its_deadline() -> None:
    never = threading.Event()
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="timed out after 0.5s") as info:
        call_with_deadline(never.wait, 0.5, "teardown")
    assert 0.45 < time.monotonic() - started < 3.0
    assert isinstance(info.value, TimeoutError)  # read as a timeout by the gang (504)
    never.set()


def test_a_bounded_call_returns_its_result_or_raises_its_own_error() -> None:
    assert call_with_deadline(lambda: 7, 5.0, "x") == 7

    def fails() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        call_with_deadline(fails, 5.0, "x")

    def own_timeout() -> None:
        raise TimeoutError("the store timed out")

    with pytest.raises(TimeoutError, match="the store timed out"):
        call_with_deadline(own_timeout, 5.0, "x")


@pytest.fixture
def single_gloo_world() -> "object":
    """A real one-process gloo default group (world_size 1), torn down afterwards."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    yield dist.group.WORLD
    worker.abandoned = None
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_teardown_that_never_returns_is_bounded_and_marks_the_process(
        single_gloo_world: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank.close with a group-leaving call that blocks (as NCCL's destroy does with a dead
    peer): close returns within its deadline with DeadlineExceeded, and the process refuses
    to rendezvous again (its rebuild fails, so the GangServer is replaced)."""
    rank = worker.Rank(0, 2, device=torch.device("cpu"), node_ip="127.0.0.1")
    rank.group = ParallelGroup(0, 2, "nccl", torch.device("cpu"), single_gloo_world)  # as after an NCCL rendezvous
    hung = threading.Event()
    monkeypatch.setattr(worker, "leave_group", lambda backend: hung.wait())
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="leaving its nccl group \\(abort\\) timed out after 0.5s"):
        rank.close(timeout_s=0.5)
    assert time.monotonic() - started < 3.0
    assert worker.abandoned and "timed out" in worker.abandoned
    again = worker.Rank(0, 2, device=torch.device("cpu"), node_ip="127.0.0.1")
    with pytest.raises(RuntimeError, match="cannot form a new group"):
        again.rendezvous("127.0.0.1", 1, "gloo", 1.0)
    hung.set()


def test_nccl_on_a_rank_without_cuda_is_refused_with_the_reason() -> None:
    rank = worker.Rank(0, 2, device=torch.device("cpu"), node_ip="127.0.0.1", device_how="use_gpu=false")
    with pytest.raises(RuntimeError, match="backend=nccl needs a CUDA device.*use_gpu=false"):
        rank.rendezvous("127.0.0.1", 1, "nccl", 1.0)


# -- which GPU is this rank's ------------------------------------------------------------------
def test_one_visible_device_is_cuda_0() -> None:
    assert cuda_index(["5"], 1, {"CUDA_VISIBLE_DEVICES": "5"})[0] == 0


def test_rays_gpu_is_found_among_several_visible_devices() -> None:
    assert cuda_index(["6"], 4, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})[0] == 2
    assert cuda_index(["3"], 8, {})[0] == 3  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: all visible
    assert cuda_index([], 8, {"LOCAL_RANK": "5"})[0] == 5  # torchrun


def test_an_ambiguous_device_is_refused_with_what_was_found() -> None:
    with pytest.raises(RuntimeError, match="8 CUDA devices are visible and nothing says which"):
        cuda_index([], 8, {})
    with pytest.raises(RuntimeError, match="not in CUDA_VISIBLE_DEVICES"):
        cuda_index(["9"], 2, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_no_cuda_here_gives_the_cpu_and_says_why() -> None:
    choice = choose_device(True, ["0"])
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert choice.device.type == "cpu" and not choice.has_cuda
    assert "torch" in choice.why and ("CPU-only" in choice.why or "no usable device" in choice.why)
    assert choose_device(False, []).why == "use_gpu=false"


# -- the interface variables ---------------------------------------------------------------------
@pytest.fixture
def clean_ifname_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in netif.SOCKET_IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(netif, "_set_by_us", {})
    return monkeypatch


def test_only_gloo_set_is_mirrored_into_nccl_as_an_exact_name(clean_ifname_env: pytest.MonkeyPatch) -> None:
    import os

    clean_ifname_env.setenv("GLOO_SOCKET_IFNAME", "lo")
    choice = netif.bind_collectives_to("127.0.0.1")
    assert (choice.iface, choice.how) == ("lo", "user")
    assert os.environ["NCCL_SOCKET_IFNAME"] == "=lo"  # "=": exactly lo, not every lo* interface
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_only_nccl_set_is_mirrored_into_gloo(clean_ifname_env: pytest.MonkeyPatch) -> None:
    import os

    clean_ifname_env.setenv("NCCL_SOCKET_IFNAME", "=eth0,=eth1")
    netif.bind_collectives_to("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0,eth1"


def test_an_nccl_exclusion_list_is_not_mirrored(clean_ifname_env: pytest.MonkeyPatch) -> None:
    import os

    clean_ifname_env.setenv("NCCL_SOCKET_IFNAME", "^docker,lo")
    assert netif.bind_collectives_to("127.0.0.1").how == "user"
    assert "GLOO_SOCKET_IFNAME" not in os.environ


# -- dtypes the weights do not fit -----------------------------------------------------------------
def test_float16_with_seed_weights_is_refused_before_anything_is_built() -> None:
    with pytest.raises(ValueError, match="float16 cannot hold init=seed weights at embed_dim=512.*262143"):
        worker.check_dtype_fits(worker.PlainModel(embed_dim=512, compute_dtype="float16", init="seed"))
    worker.check_dtype_fits(worker.PlainModel(embed_dim=512, compute_dtype="bfloat16", init="seed"))
    worker.check_dtype_fits(worker.PlainModel(embed_dim=512, compute_dtype="float16", init="random"))
    worker.check_dtype_fits(worker.PlainModel(embed_dim=64, num_heads=4, compute_dtype="float16"))  # 4095 fits


def test_a_shard_beyond_the_dtypes_range_is_refused_not_stored_as_inf() -> None:
    """Whatever the weights' source (a checkpoint too): float16 params on the CPU can hold
    values (no matmul is run), so the guard is checked here, on the real layer."""
    group = ParallelGroup.single("cpu")
    model = TensorParallelAttention(512, 8, group, dtype=torch.float16)
    with pytest.raises(ValueError, match="reach 262143.*largest finite value 65504"):
        model.load_shard(shard_dense(seed_weights(512), 0, 1))
    model.load_shard(shard_dense(random_weights(512, 0), 0, 1))
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- the mask SDPA gets -------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_the_serving_mask_attends_what_the_full_bool_mask_attends(causal: bool) -> None:
    """At every token query: the same attention output as with the full [b, 1, s, s] bool
    mask (attention_bias_mask, the training path's), left and right padding and holes."""
    gen = torch.Generator().manual_seed(5)
    batch, heads, seq, dim = 4, 2, 11, 8
    q, k, v = (torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    key_mask = torch.ones(batch, seq, dtype=torch.bool)
    key_mask[1, 7:] = False  # right padding
    key_mask[2, :4] = False  # left padding (causal: padded query 0 has no key)
    key_mask[3, 2:9:2] = False  # holes
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias_mask(key_mask, causal))
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(key_mask, causal, q.dtype))
    tokens = key_mask[:, None, :, None].expand_as(want)
    assert torch.allclose(got[tokens], want[tokens], rtol=0, atol=1e-12)


def test_the_unmasked_causal_free_mask_is_per_key_not_per_query_pair() -> None:
    key_mask = torch.ones(64, 4096, dtype=torch.bool)
    mask = sdpa_mask(key_mask, False, torch.float32)
    assert tuple(mask.shape) == (64, 1, 1, 4096) and mask.dtype == torch.bool
    assert mask.untyped_storage().nbytes() == 64 * 4096  # a view of the key mask: seq bytes per row
    causal = sdpa_mask(key_mask[:2, :32], True, torch.bfloat16)
    assert causal.dtype == torch.bfloat16 and tuple(causal.shape) == (2, 1, 32, 32)  # one tensor, compute dtype


# -- step timings ----------------------------------------------------------------------------------
def test_step_clock_stamps_each_mark_in_order_on_the_cpu() -> None:
    before = time.time_ns()
    clock = StepClock(torch.device("cpu"))
    clock.mark()
    torch.ones(256, 256) @ torch.ones(256, 256)
    clock.mark()
    stamps = clock.stamps()
    assert clock.ready() and len(stamps) == 2
    assert before <= stamps[0] <= stamps[1] <= time.time_ns()


# -- training resume ---------------------------------------------------------------------------------
def test_a_state_saved_on_a_cuda_index_loads_on_the_cpu_with_map_location(tmp_path: Path) -> None:
    """What the resume's torch.load(map_location="cpu") guards against (service.training.runner):
    optimizer state saved on cuda:N fails to load on a worker without that device."""
    path = tmp_path / "train_state.pt"
    tagger = lambda storage: "cuda:3"  # noqa: E731 - the location a GPU worker would have recorded
    torch.serialization.register_package(1, tagger, lambda obj, location: None)
    try:
        torch.save({"step": 4, "optimizer": {"m": torch.ones(3)}}, path)
    finally:
        torch.serialization._package_registry[:] = [
            entry for entry in torch.serialization._package_registry if entry[1] is not tagger]
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["step"] == 4 and state["optimizer"]["m"].device.type == "cpu"
