"""`model=llama checkpoint=DIR` served through Serve and HTTP at world size 2, against Hugging
Face's own `LlamaModel` in float64 (tests/test_llama.py checks the seam at every world size).

The directory is a `LlamaForCausalLM.save_pretrained` (names under `model.`, with the
`embed_tokens` and `lm_head` the service does not load), grouped-query attention with 2 K/V
heads for 4 query heads, and the llama3 rope scaling."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LlamaModel

from safetensors.torch import load as st_load_torch

from tests.conftest import deploy, undeploy
from tests.helpers import AUTH, SMALL, assert_error, post, wait_done
from tests.reference import relative_error

pytestmark = pytest.mark.ray

TOL = 1e-5
WIDTH = 64
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}
ARCH = {"hidden_size": WIDTH, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_parameters": ROPE}


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


@pytest.fixture(scope="module")
def llama_app(serve_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LlamaModel]]:
    torch.manual_seed(11)
    config = LlamaConfig(**ARCH, vocab_size=32, max_position_embeddings=64)
    full = LlamaForCausalLM(config)
    directory: Path = tmp_path_factory.mktemp("llama") / "checkpoint"
    full.save_pretrained(directory)
    reference = LlamaModel(config).double().eval()
    reference.load_state_dict({k: v.double() for k, v in full.model.state_dict().items()}, strict=True)
    base = deploy(serve_url, "models-llama", "/models-llama",
                  {"world_size": 2, "model": "llama", "checkpoint": str(directory), "cpus_per_rank": 0.25,
                   "session_block_tokens": 4})
    yield base, reference
    undeploy("models-llama")


def test_served_llama_answers_like_hugging_face_padded_causal_and_in_sessions(
        llama_app: tuple[str, LlamaModel]) -> None:
    base, reference = llama_app
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, WIDTH), dtype=np.float32)
    with torch.no_grad():
        want = reference(inputs_embeds=torch.from_numpy(x).double()).last_hidden_state
    # Causal by declaration: no flag needed, and true is accepted.
    for query in ("", "?causal=true"):
        r = httpx.post(f"{base}/infer{query}", content=_npy(x), headers={"content-type": "application/x-npy"},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert relative_error(torch.from_numpy(np.load(io.BytesIO(r.content))), want) <= TOL, query
    # Left padding: the real rows are the sequence computed alone (positions 0..n-1), padding 0.
    tokens = np.ones((2, 7), dtype=bool)
    tokens[1, :3] = False
    r = httpx.post(f"{base}/infer", timeout=60,
                   json={"hidden_states": x.tolist(), "attention_mask": tokens.astype(int).tolist()})
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["output"], dtype=np.float64)
    with torch.no_grad():
        alone = reference(inputs_embeds=torch.from_numpy(x[1, 3:])[None].double()).last_hidden_state[0]
    assert relative_error(torch.from_numpy(got[1, 3:]), alone) <= TOL
    assert relative_error(torch.from_numpy(got[0]), want[0]) <= TOL
    assert not got[1, :3].any()
    # A session: a prefill of 5, then 1 row, then 3: Hugging Face's incremental decode of the same rows.
    seq = rng.standard_normal((9, WIDTH), dtype=np.float32)
    cache, steps, at = DynamicCache(config=reference.config), [], 0
    with torch.no_grad():
        for n in (5, 1, 3):
            step = reference(inputs_embeds=torch.from_numpy(seq[at:at + n])[None].double(), past_key_values=cache,
                             use_cache=True)
            cache, at = step.past_key_values, at + n
            steps.append(step.last_hidden_state[0])
    r = httpx.post(f"{base}/sessions", content=_npy(seq[:5]), headers={"content-type": "application/x-npy"},
                   timeout=60)
    assert r.status_code == 201, r.text
    sid = r.headers["x-session-id"]
    assert relative_error(torch.from_numpy(np.load(io.BytesIO(r.content))).reshape(5, WIDTH), steps[0]) <= TOL
    at = 5
    for n, want_rows in zip((1, 3), steps[1:]):
        r = httpx.post(f"{base}/sessions/{sid}/append", content=_npy(seq[at:at + n]),
                       headers={"content-type": "application/x-npy"}, timeout=60)
        assert r.status_code == 200, r.text
        assert relative_error(torch.from_numpy(np.load(io.BytesIO(r.content))).reshape(n, WIDTH), want_rows) <= TOL
        at += n
    gang = httpx.get(f"{base}/gang", timeout=10).json()
    # each rank caches its own one K/V head of the two: 2 (K, V) x 2 layers x 1 head x 16 x float32
    assert gang["sessions"]["bytes_per_token_per_rank"] == 2 * 2 * 1 * 16 * 4


def test_bidirectional_attention_is_refused_for_a_causal_model(llama_app: tuple[str, LlamaModel]) -> None:
    base, _ = llama_app
    x = np.zeros((1, 3, WIDTH), dtype=np.float32)
    r = httpx.post(f"{base}/infer?causal=false", content=_npy(x), headers={"content-type": "application/x-npy"},
                   timeout=60)
    doc = assert_error(r, 422, "invalid_input")
    assert "causal by declaration" in doc["error"]
    assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200  # the service stays healthy


def test_a_llama_job_is_served_by_post_weights_and_loads_into_hugging_face(llama_app: tuple[str, LlamaModel]) -> None:
    """A job of the app's architecture (its config.json's fields as model_args) trains; its
    checkpoint loads into LlamaModel with strict=True under Hugging Face's names; POST /weights
    swaps it in (the architecture survives the swap to a file) and the gang answers as that
    LlamaModel; another width is refused with 409 naming both."""
    base, _ = llama_app
    reply = post(base, "/train", {**SMALL, "model": {"kind": "llama", "model_args": ARCH}, "world_size": 1,
                                  "epochs": 1, "batch_size": 8, "dataset": {"samples": 16, "seq_len": 4}})
    assert reply.status_code == 202, reply.text
    job = wait_done(base, reply.json()["id"])
    assert job["status"] == "SUCCEEDED", job
    blob = httpx.get(f"{base}/train/{job['id']}/checkpoint", headers=AUTH, timeout=60)
    assert blob.status_code == 200, blob.text
    trained = LlamaModel(LlamaConfig(**ARCH, vocab_size=8)).double().eval()
    trained.embed_tokens = None  # type: ignore[assignment]  # hidden states in: no token lookup
    trained.load_state_dict({k: v.double() for k, v in st_load_torch(blob.content).items()}, strict=True)

    swapped = post(base, "/weights", {"job_id": job["id"]}, timeout=330)
    assert swapped.status_code == 200, swapped.text
    try:
        x = np.random.default_rng(5).standard_normal((2, 6, WIDTH)).astype(np.float32)
        r = httpx.post(f"{base}/infer", content=_npy(x), headers={"content-type": "application/x-npy"}, timeout=60)
        assert r.status_code == 200, r.text
        with torch.no_grad():
            want = trained(inputs_embeds=torch.from_numpy(x).double()).last_hidden_state
        assert relative_error(torch.from_numpy(np.load(io.BytesIO(r.content))), want) <= TOL
    finally:
        back = post(base, "/weights", {"version": 1}, timeout=330)  # the directory's weights again
        assert back.status_code == 200, back.text
