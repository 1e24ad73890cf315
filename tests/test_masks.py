"""Attention masks and causal attention end to end (issue 22): real Ray, real Serve, real HTTP.

Every expected output comes from tests.reference.dense_attention_masked, i.e. an
independent torch.nn.MultiheadAttention(key_padding_mask=(mask == 0), attn_mask=<causal>)
with the same weights and the padded rows set to 0; never from the code under test.
The apps per world size are shared with tests/test_sessions.py (tests/shared_apps.py).
"""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from gangserve_client import codecs as wire
from service.parallel.weights import random_weights
from tests.conftest import deploy, undeploy
from tests.shared_apps import WEIGHTS, WorldSizeApps, app_args
from tests.helpers import AUTH, post, rand, wait_done
from tests.reference import dense_attention_masked, reference, relative_error

pytestmark = [pytest.mark.ray, pytest.mark.slow]

INFER_OIP = "/v2/models/attention/infer"
TOL = 1e-5


def padding_mask(lengths: list[int], seq: int) -> np.ndarray:
    """[batch, seq] int64, 1 for each row's first `length` positions."""
    return (np.arange(seq)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)


def check(out: np.ndarray, x: np.ndarray, mask: np.ndarray | None, causal: bool, what: str) -> None:
    want = reference(x, mask, causal, weights=WEIGHTS)
    assert out.shape == x.shape, (what, out.shape, x.shape)
    err = relative_error(torch.from_numpy(np.array(out, dtype=np.float32)), want)
    assert err <= TOL, f"{what}: relative error {err:.3e}"
    if mask is not None:
        assert (np.asarray(out)[np.asarray(mask).reshape(out.shape[:-1]) == 0] == 0).all(), f"{what}: padded rows not 0"


def assert_invalid(reply: httpx.Response, needle: str) -> None:
    assert reply.status_code == 422, (reply.status_code, reply.text)
    doc = reply.json()
    assert doc["code"] == "invalid_input", doc
    assert needle in doc["error"], doc


@pytest.fixture
def apps(world_size_apps: WorldSizeApps) -> Callable[[int], str]:
    """world size -> the base URL of its shared app (tests/shared_apps.py)."""
    return world_size_apps.get


@pytest.fixture(params=[1, 2, 4], ids=lambda ws: f"ws{ws}")
def masked_app(request: pytest.FixtureRequest, apps: Callable[[int], str]) -> str:
    return apps(request.param)


CASES = [("mask", True, False), ("causal", False, True), ("mask+causal", True, True)]


@pytest.mark.parametrize("case,masked,causal", CASES, ids=[c[0] for c in CASES])
def test_json_and_safetensors_match_masked_reference(masked_app: str, case: str, masked: bool, causal: bool) -> None:
    x = rand(3, 10, 512, seed=1)
    mask = padding_mask([10, 6, 1], 10) if masked else None
    params = {"causal": "true"} if causal else {}
    doc = {"hidden_states": x.tolist(), **({"attention_mask": mask.tolist()} if mask is not None else {})}
    r = httpx.post(masked_app + "/infer", json=doc, params=params, timeout=60)
    assert r.status_code == 200, r.text
    check(np.asarray(r.json()["output"], dtype=np.float32), x, mask, causal, f"json {case}")

    tensors = {"hidden_states": x}
    if mask is not None:
        tensors["attention_mask"] = mask
    r = httpx.post(masked_app + "/infer", content=wire.encode_safetensors(tensors), params=params,
                   headers={"content-type": wire.SAFETENSORS}, timeout=60)
    assert r.status_code == 200, r.text
    check(st_load(r.content)["output"], x, mask, causal, f"safetensors {case}")


@pytest.mark.parametrize("binary", [False, True], ids=["oip-json", "oip-binary"])
def test_oip_mask_input_and_causal_parameter(masked_app: str, binary: bool) -> None:
    x = rand(2, 7, 512, seed=2)
    mask = padding_mask([4, 7], 7)
    for causal in (False, True):
        inputs = [{"name": "hidden_states", "shape": list(x.shape), "datatype": "FP32"},
                  {"name": "attention_mask", "shape": list(mask.shape), "datatype": "INT64"}]
        doc: dict = {"inputs": inputs, "parameters": {"causal": causal}}
        if binary:
            inputs[0]["parameters"] = {"binary_data_size": x.nbytes}
            inputs[1]["parameters"] = {"binary_data_size": mask.nbytes}
            header = json.dumps(doc).encode()
            r = httpx.post(masked_app + INFER_OIP, content=header + x.tobytes() + mask.tobytes(),
                           headers={"content-type": "application/octet-stream",
                                    "inference-header-content-length": str(len(header))}, timeout=60)
        else:
            inputs[0]["data"] = x.reshape(-1).tolist()
            inputs[1]["data"] = mask.tolist()
            r = httpx.post(masked_app + INFER_OIP, json=doc, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        check(np.asarray(out["data"], dtype=np.float32).reshape(out["shape"]), x, mask, causal,
              f"oip {'binary' if binary else 'json'} causal={causal}")


def test_mask_dtypes_squeezed_input_and_npy_causal(masked_app: str) -> None:
    x = rand(1, 9, 512, seed=4)
    mask = padding_mask([5], 9)
    for dtype in (np.bool_, np.uint8, np.int32, np.int64):
        body = wire.encode_safetensors({"hidden_states": x, "attention_mask": mask.astype(dtype)})
        r = httpx.post(masked_app + "/infer", content=body, headers={"content-type": wire.SAFETENSORS}, timeout=60)
        assert r.status_code == 200, (dtype, r.text)
        check(st_load(r.content)["output"], x, mask, False, f"mask dtype {np.dtype(dtype)}")
    # [seq, E] with a [seq] mask: the reply drops the batch dim again.
    r = httpx.post(masked_app + "/infer", json={"hidden_states": x[0].tolist(), "attention_mask": mask[0].tolist()},
                   timeout=60)
    assert r.status_code == 200, r.text
    out = np.asarray(r.json()["output"], dtype=np.float32)
    assert out.shape == (9, 512)
    check(out[None], x, mask, False, "squeezed")
    # npy carries no mask, but causal applies to every format.
    r = httpx.post(masked_app + "/infer?causal=true", content=wire.encode_npy(x),
                   headers={"content-type": wire.NPY}, timeout=60)
    assert r.status_code == 200, r.text
    check(wire.decode_npy(r.content), x, None, True, "npy causal")


def test_bad_masks_are_422(app_url: str) -> None:
    x = rand(2, 4, 512, seed=5).tolist()
    post = lambda doc, **kw: httpx.post(app_url + "/infer", json=doc, timeout=60, **kw)  # noqa: E731
    assert_invalid(post({"hidden_states": x, "attention_mask": [[1, 1, 0, 0], [0, 0, 0, 0]]}), "[1]")
    assert_invalid(post({"hidden_states": x, "attention_mask": [[1, 1, 0], [1, 1, 1]]}), "[2, 4]")
    assert_invalid(post({"hidden_states": x, "attention_mask": [1, 1, 0, 0]}), "[2, 4]")
    assert_invalid(post({"hidden_states": x, "attention_mask": [[1, 2, 0, 0], [1, 1, 1, 1]]}), "only 0")
    assert_invalid(post({"hidden_states": x, "attention_mask": [[1, 0.5, 0, 0], [1, 1, 1, 1]]}), "0 and 1")
    assert_invalid(post({"hidden_states": x, "attention_mask": [[1, "a", 0, 0], [1, 1, 1, 1]]}), "attention_mask")
    xs = rand(2, 4, 512, seed=5)
    body = st_save({"hidden_states": xs, "attention_mask": np.ones((2, 4), np.float32)})
    r = httpx.post(app_url + "/infer", content=body, headers={"content-type": wire.SAFETENSORS}, timeout=60)
    assert_invalid(r, "attention_mask")
    body = wire.encode_safetensors({"hidden_states": xs, "attention_mask": np.zeros((2, 4), np.int64)})
    r = httpx.post(app_url + "/infer", content=body, headers={"content-type": wire.SAFETENSORS}, timeout=60)
    assert_invalid(r, "padding")
    oip = {"inputs": [{"name": "hidden_states", "shape": [2, 4, 512], "datatype": "FP32", "data": xs.reshape(-1).tolist()},
                      {"name": "attention_mask", "shape": [2, 4], "datatype": "FP32", "data": [1] * 8}]}
    assert_invalid(httpx.post(app_url + INFER_OIP, json=oip, timeout=60), "datatype")
    oip["inputs"][1].update(datatype="INT32", shape=[2, 3], data=[1] * 6)
    assert_invalid(httpx.post(app_url + INFER_OIP, json=oip, timeout=60), "[2, 4]")
    oip["inputs"][1].update(shape=[2, 4], data=[0] * 8)
    assert_invalid(httpx.post(app_url + INFER_OIP, json=oip, timeout=60), "padding")
    oip["inputs"][1].update(data=[1] * 8)
    oip["parameters"] = {"causal": "yes"}
    assert_invalid(httpx.post(app_url + INFER_OIP, json=oip, timeout=60), "causal")


def test_mixed_lengths_batched_under_concurrency(apps: Callable[[int], str]) -> None:
    """Requests of lengths 1..40, some masked, some causal, sent concurrently: each reply equals
    its own reference, and /gang shows steps that padded mixed lengths within the bound."""
    base = apps(2)  # max_padding_fraction=0.5, batch_wait_timeout_s=0.02
    rng = random.Random(7)
    jobs = []
    for i in range(48):
        seq = rng.randint(1, 40)
        x = rand(1 + i % 2, seq, 512, seed=100 + i)
        mask = None
        if i % 3 == 0 and seq > 1:
            mask = padding_mask([rng.randint(1, seq)] * x.shape[0], seq)
        jobs.append((x, mask, i % 4 == 1))

    def send(job: tuple) -> tuple:
        x, mask, causal = job
        tensors = {"hidden_states": x, **({"attention_mask": mask} if mask is not None else {})}
        with httpx.Client(timeout=120) as client:
            r = client.post(base + "/infer", content=wire.encode_safetensors(tensors),
                            params={"causal": "true"} if causal else {}, headers={"content-type": wire.SAFETENSORS})
        assert r.status_code == 200, r.text
        return st_load(r.content)["output"], job

    for _ in range(2):  # a second wave: the gang is warm, batches form for sure
        with ThreadPoolExecutor(16) as pool:
            for out, (x, mask, causal) in pool.map(send, jobs):
                check(out, x, mask, causal, f"mixed seq {x.shape[1]} causal={causal} masked={mask is not None}")
    gang = httpx.get(base + "/gang", timeout=30).json()
    batching = gang["batching"]  # the one batcher on the path
    assert batching["mixed_length_steps"] >= 1, batching
    assert batching["steps"] < batching["requests"], batching  # requests did share steps
    assert 0 <= batching["padded_token_share"] <= 0.5, batching
    metrics = httpx.get(base + "/metrics", timeout=30).text
    assert "gangserve_step_padded_share_bucket" in metrics


def test_bfloat16_compute_dtype_end_to_end(serve_url: str) -> None:
    """compute_dtype=bfloat16 at ws2: replies keep the requested dtype, and stay within the
    documented bfloat16 tolerance (1e-2 relative, measured 4-5e-3) of the float64 reference."""

    base = deploy(serve_url, "masks_bf16", "/masks_bf16", app_args(2, compute_dtype="bfloat16"))
    try:
        gang = httpx.get(base + "/gang", timeout=30).json()
        assert gang["param_bytes_per_rank"][0] == (4 * 512 * 512 // 2 + 3 * 512 // 2 + 512) * 2  # bfloat16 shards
        x = rand(2, 12, 512, seed=9)
        mask = padding_mask([12, 5], 12)
        dense64 = {k: v.double() for k, v in WEIGHTS.items()}
        for masked, causal in ((False, False), (True, True)):
            want = dense_attention_masked(dense64, 8, torch.from_numpy(x).double(),
                                          torch.from_numpy(mask) if masked else None, causal)
            for dtype in (np.float32, np.float16):
                tensors = {"hidden_states": x.astype(dtype), **({"attention_mask": mask} if masked else {})}
                r = httpx.post(base + "/infer", content=wire.encode_safetensors(tensors),
                               params={"causal": str(causal).lower()}, headers={"content-type": wire.SAFETENSORS},
                               timeout=60)
                assert r.status_code == 200, r.text
                out = st_load(r.content)["output"]
                assert out.dtype == dtype
                err = relative_error(torch.from_numpy(out.astype(np.float64)), want)
                assert 1e-4 < err < 1e-2, f"bfloat16 compute, {np.dtype(dtype)} reply: relative error {err:.3e}"
    finally:
        undeploy("masks_bf16")


def test_a_causal_checkpoint_is_served_causal_unless_the_request_says_otherwise(
    serve_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Training records `causal` in the checkpoint (save_checkpoint(causal=True), as save_model
    does); a gang serving it answers causally by default, and ?causal=false still works."""

    from service.parallel.weights import save_checkpoint

    path = tmp_path_factory.mktemp("causal-ckpt") / "causal.safetensors"
    save_checkpoint(path, WEIGHTS, 8, causal=True)
    base = deploy(serve_url, "masks_ckpt", "/masks_ckpt",
                  {**app_args(2), "init": "seed", "checkpoint": str(path)})
    try:
        x = rand(2, 6, 512, seed=12)
        for params, causal in (({}, True), ({"causal": "false"}, False), ({"causal": "true"}, True)):
            r = httpx.post(base + "/infer", json={"hidden_states": x.tolist()}, params=params, timeout=60)
            assert r.status_code == 200, r.text
            check(np.asarray(r.json()["output"], dtype=np.float32), x, None, causal, f"checkpoint causal, {params}")
    finally:
        undeploy("masks_ckpt")


def test_causal_job_on_a_masked_dataset_trains_and_records_causal(app_url: str) -> None:
    """POST /datasets with attention_mask, then a causal attention job on it: it learns, the
    loss counts token positions only, and the checkpoint records causal=true."""
    from service.training.models import SelfAttention, load_dense_into

    rng = np.random.default_rng(1)
    n, seq, e = 128, 6, 32
    x = rng.standard_normal((n, seq, e), dtype=np.float32)
    lengths = rng.integers(1, seq + 1, size=n)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.uint8)
    teacher = SelfAttention(e, 4, causal=True)
    load_dense_into(teacher, random_weights(e, 5))
    with torch.no_grad():
        y = teacher(torch.from_numpy(x), torch.from_numpy(mask)).numpy()
    y[mask == 0] = 1e3  # garbage at padded positions: a loss that counted them could not fall
    reply = httpx.post(app_url + "/datasets", timeout=30, headers={**AUTH, "content-type": wire.SAFETENSORS},
                       content=st_save({"inputs": x, "targets": y, "attention_mask": mask}))
    assert reply.status_code == 201, reply.text
    spec = {"cpus_per_worker": 0.25, "world_size": 1, "epochs": 3, "optimizer": "adam", "lr": 0.01,
            "model": {"kind": "attention", "embed_dim": e, "num_heads": 4, "causal": True},
            "dataset": {"kind": "uploaded", "id": reply.json()["id"]}}
    reply = post(app_url, "/train", spec)
    assert reply.status_code == 202, reply.text
    job = wait_done(app_url, reply.json()["id"])
    assert job["status"] == "SUCCEEDED", job
    losses = [h["loss"] for h in job["history"]]
    assert losses[-1] < 0.8 * losses[0] and losses[0] < 1e3, losses
    ckpt = httpx.get(f"{app_url}/train/{job['id']}/checkpoint", headers=AUTH, timeout=60)
    assert ckpt.status_code == 200
    header, _ = wire.safetensors_header(ckpt.content)
    assert header["__metadata__"]["causal"] == "true", header["__metadata__"]


def test_client_sends_mask_and_causal(masked_app: str) -> None:
    from gangserve_client import GangServeClient

    x = rand(2, 5, 512, seed=21)
    mask = padding_mask([5, 2], 5)
    with GangServeClient(masked_app) as client:
        for fmt in ("safetensors", "json"):
            check(client.infer(x, fmt, attention_mask=mask, causal=True), x, mask, True, f"client {fmt}")
        check(client.infer(x, "npy", causal=True), x, None, True, "client npy causal")
        with pytest.raises(ValueError, match="npy"):
            client.infer(x, "npy", attention_mask=mask)


def test_mask_and_causal_on_the_handle_and_shared_memory_paths(apps: Callable[[int], str]) -> None:
    """data_channel off: small requests go by value in the handle call, large ones through
    /dev/shm (infer_shared); the mask and the flag travel on both."""
    base = apps(4)  # data_channel=False
    for shape, lengths in (((1, 3, 512), [2]), ((4, 40, 512), [40, 17, 1, 30])):  # 6 KiB, 320 KiB
        x = rand(*shape, seed=shape[1])
        mask = padding_mask(lengths, shape[1])
        body = wire.encode_safetensors({"hidden_states": x, "attention_mask": mask})
        r = httpx.post(base + "/infer?causal=true", content=body, headers={"content-type": wire.SAFETENSORS},
                       timeout=60)
        assert r.status_code == 200, r.text
        check(st_load(r.content)["output"], x, mask, True, f"handle path {shape}")
    transport = httpx.get(base + "/gang", timeout=30).json()["ingress_transport"]
    assert transport["data_channel"] == 0 and transport["object_store"] >= 1, transport
    if transport["shm_enabled"] and transport["node_id"] == httpx.get(base + "/gang", timeout=30).json()["ranks"][0]["node_id"]:
        assert transport["shared_memory"] >= 1, transport  # rank 0 on the ingress's node: the big one used /dev/shm
