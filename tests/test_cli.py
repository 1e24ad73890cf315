"""The `gangserve` command (the client distribution's CLI) against the suite's service.

Every command here runs as a subprocess of the real `gangserve` executable against the
`make serve` app (real Ray, Serve, HTTP; tests/conftest.py `app_url`); expected outputs come
from the dense reference (harness/reference.py, torch's nn.MultiheadAttention) with the
weights the command downloaded, never from the code under test. The newcomer's flow
(upload a dataset, train on it, download the checkpoint, serve it, infer) uses nothing but
the command. Also here: AsyncGangServeClient.session(), and the pure helpers of the CLI.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import load as st_load_numpy
from safetensors.torch import load_file as st_load_file

from gangserve_client import AsyncGangServeClient
from gangserve_client import codecs as wire
from gangserve_client.cli_training import dataset_body, init_from, new_lines
from tests.helpers import poll, rand, total
from tests.reference import dense_attention, dense_attention_masked, notes_seed_weights, reference, relative_error

GANGSERVE = str(Path(sys.executable).parent / "gangserve")  # the venv's console script
E, H = 512, 8  # the `make serve` app's model
TOL = 1e-5


def gangserve(url: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """One run of the command against `url`; its exit status, stdout and stderr."""
    return subprocess.run([GANGSERVE, "--url", url, *args], capture_output=True, text=True, timeout=timeout_s)


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"{proc.args}: exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    return proc


# ---- the CLI's own helpers (no Ray) ----------------------------------------------------------

@pytest.mark.unit
def test_new_lines_are_what_follows_the_last_look() -> None:
    assert new_lines([], ["a", "b"]) == ["a", "b"]
    assert new_lines(["a", "b"], ["a", "b", "c"]) == ["c"]  # a short log: every look starts at its first line
    assert new_lines(["a", "b", "c"], ["b", "c", "d", "e"][:3]) == ["d"]  # a window of 3 that moved by one
    assert new_lines(["a", "b", "c"], ["a", "b", "c"]) == []
    assert new_lines(["a", "b", "c"], ["x", "y", "z"]) == ["x", "y", "z"]  # more came than a window holds


@pytest.mark.unit
def test_init_from_takes_current_a_version_or_a_job() -> None:
    assert init_from("current") == {"weights_version": "current"}
    assert init_from("3") == {"weights_version": 3}
    assert init_from("job-0123abcd") == {"job_id": "job-0123abcd"}
    with pytest.raises(Exception, match="got 'latest'"):
        init_from("latest")


@pytest.mark.unit
def test_a_npz_dataset_is_uploaded_as_safetensors_with_its_masks(tmp_path: Path) -> None:
    x, y = rand(6, 3, 4, seed=1), rand(6, 3, 4, seed=2)
    mask = np.array([[1, 1, 0]] * 6, dtype=np.int64)
    np.savez(tmp_path / "ds.npz", inputs=x, targets=y, attention_mask=mask, val_attention_mask=mask[:2])
    tensors = st_load_numpy(dataset_body(tmp_path / "ds.npz"))  # read back by the safetensors library
    assert sorted(tensors) == ["attention_mask", "inputs", "targets", "val_attention_mask"]
    assert np.array_equal(tensors["inputs"], x) and np.array_equal(tensors["val_attention_mask"], mask[:2])
    (tmp_path / "ds.csv").write_text("1,2\n")
    with pytest.raises(SystemExit, match="found the suffix '.csv'"):
        dataset_body(tmp_path / "ds.csv")


@pytest.mark.unit
def test_usage_errors_exit_2_before_any_request(tmp_path: Path) -> None:
    unreachable = "http://127.0.0.1:9"  # nothing listens: a request would fail with exit 1, not 2
    proc = gangserve(unreachable, "jobs", "delete")
    assert proc.returncode == 2 and "needs a job id" in proc.stderr, proc.stderr
    proc = gangserve(unreachable, "bench", "--concurrency", "0")
    assert proc.returncode == 2 and "concurrency levels must be positive" in proc.stderr, proc.stderr
    np.save(tmp_path / "x.npy", rand(2, 3, E))
    np.save(tmp_path / "m.npy", np.ones((2, 3), np.float32))
    proc = gangserve(unreachable, "infer", str(tmp_path / "x.npy"), "--mask", str(tmp_path / "m.npy"))
    assert proc.returncode == 1 and "found dtype float32" in proc.stderr, proc.stderr


# ---- against the service ---------------------------------------------------------------------

@pytest.mark.ray
def test_newcomer_flow_with_the_cli_alone(app_url: str, tmp_path: Path) -> None:
    """Upload a dataset, train on it (--follow, and `logs --follow` beside it), download the
    checkpoint, serve it, infer; then fine-tune from it (--init-from) and clean up."""
    rng = np.random.default_rng(43)
    x = rng.standard_normal((16, 4, E), dtype=np.float32)
    np.savez(tmp_path / "ds.npz", inputs=x, targets=np.tanh(x))
    uploaded = json.loads(ok(gangserve(app_url, "datasets", "upload", str(tmp_path / "ds.npz"))).stdout)
    ds = uploaded["id"]
    assert uploaded["samples"] == 16 and uploaded["inputs_shape"] == [16, 4, E], uploaded
    assert ds in ok(gangserve(app_url, "datasets", "list")).stdout

    train = subprocess.Popen([GANGSERVE, "--url", app_url, "train", "--dataset", ds, "--epochs", "1",
                              "--world-size", "1", "--cpus-per-worker", "0.25", "--batch-size", "8",
                              "--follow", "--timeout", "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    assert train.stderr is not None
    submitted = train.stderr.readline()  # "submitted job-... (PENDING)", flushed at once
    assert submitted.startswith("submitted job-"), submitted
    job = submitted.split()[1]
    follow = subprocess.Popen([GANGSERVE, "--url", app_url, "logs", job, "--follow", "--poll", "0.5",
                               "--timeout", "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = train.communicate(timeout=420)
    assert train.returncode == 0, err
    result = json.loads(out)
    assert result["id"] == job and result["status"] == "SUCCEEDED" and len(result["losses"]) == 1
    assert "1/1 epochs" in err
    logs_out, logs_err = follow.communicate(timeout=60)  # it ends by itself once the job has
    assert follow.returncode == 0 and f"job {job} SUCCEEDED" in logs_err, logs_err
    lines = logs_out.splitlines()
    assert any("epoch 1/1" in line for line in lines), logs_out
    assert len(lines) == len(set(lines)), "a log line was printed twice"  # lines carry their time stamps
    assert lines == ok(gangserve(app_url, "logs", job, "--tail", "2000")).stdout.splitlines()

    ok(gangserve(app_url, "checkpoint", job, "-o", str(tmp_path / "trained.safetensors")))
    trained = st_load_file(str(tmp_path / "trained.safetensors"))
    assert trained["q_proj.weight"].shape == (E, E)
    probe = rng.standard_normal((2, 5, E), dtype=np.float32)
    np.save(tmp_path / "probe.npy", probe)
    try:
        served = ok(gangserve(app_url, "weights", job, timeout_s=360)).stdout
        assert f"job {job}" in served, served
        ok(gangserve(app_url, "infer", str(tmp_path / "probe.npy"), "-o", str(tmp_path / "out.npy")))
        got = torch.from_numpy(np.load(tmp_path / "out.npy"))
        assert relative_error(got, dense_attention(trained, H, torch.from_numpy(probe))) < TOL
    finally:
        ok(gangserve(app_url, "weights", "reset", timeout_s=360))  # the other modules expect the seed weights
    ok(gangserve(app_url, "infer", str(tmp_path / "probe.npy"), "-o", str(tmp_path / "seed.npy")))
    got = torch.from_numpy(np.load(tmp_path / "seed.npy"))
    assert relative_error(got, dense_attention(notes_seed_weights(E), H, torch.from_numpy(probe))) < TOL

    tuned = json.loads(ok(gangserve(app_url, "train", "--init-from", job, "--epochs", "1", "--world-size", "1",
                                    "--cpus-per-worker", "0.25", "--samples", "16", "--seq-len", "4")).stdout)
    assert tuned["spec"]["init_from"]["job_id"] == job, tuned
    for finished in (tuned["id"], job):
        deleted = json.loads(ok(gangserve(app_url, "jobs", "delete", finished)).stdout)
        assert deleted["deleted"] is True and deleted["id"] == finished, deleted
        gone = gangserve(app_url, "job", finished)
        assert gone.returncode == 1 and "404" in gone.stderr, gone.stderr
    assert json.loads(ok(gangserve(app_url, "datasets", "delete", ds)).stdout)["id"] == ds
    assert ds not in ok(gangserve(app_url, "datasets", "list")).stdout


@pytest.mark.ray
def test_infer_with_a_mask_and_causal(app_url: str, tmp_path: Path) -> None:
    x = rand(2, 5, E, seed=431)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=np.int64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "mask.npy", mask)
    weights = notes_seed_weights(E)
    xt, mt = torch.from_numpy(x), torch.from_numpy(mask)
    cases = {
        ("--mask", str(tmp_path / "mask.npy")): dense_attention_masked(weights, H, xt, mt),
        ("--causal",): dense_attention_masked(weights, H, xt, None, causal=True),
        ("--mask", str(tmp_path / "mask.npy"), "--causal", "--format", "json"):
            dense_attention_masked(weights, H, xt, mt, causal=True),
        ("--no-causal",): dense_attention(weights, H, xt),
    }
    for i, (flags, want) in enumerate(cases.items()):
        out = tmp_path / f"out{i}.safetensors"
        ok(gangserve(app_url, "infer", str(tmp_path / "x.npy"), *flags, "-o", str(out)))
        got = torch.from_numpy(np.array(wire.decode_safetensors(out.read_bytes(), "output")))
        assert relative_error(got, want) < TOL, flags
    (tmp_path / "mask.safetensors").write_bytes(wire.encode_safetensors({"attention_mask": mask}))
    ok(gangserve(app_url, "infer", str(tmp_path / "x.npy"), "--mask", str(tmp_path / "mask.safetensors"),
                 "-o", str(tmp_path / "st.npy"), "--format", "safetensors"))
    got = torch.from_numpy(np.load(tmp_path / "st.npy"))
    assert relative_error(got, dense_attention_masked(weights, H, xt, mt)) < TOL
    refused = gangserve(app_url, "infer", str(tmp_path / "x.npy"), "--mask", str(tmp_path / "mask.npy"),
                        "--format", "npy")
    assert refused.returncode == 1 and "no attention_mask" in refused.stderr, refused.stderr


@pytest.mark.ray
def test_async_client_session(app_url: str) -> None:
    prompt, rows = rand(3, E, seed=432), [rand(1, E, seed=433), rand(2, E, seed=434)]

    async def main() -> tuple[list[np.ndarray], str, int]:
        async with AsyncGangServeClient(app_url) as client:
            outs = []
            async with await client.session(prefill=prompt) as s:
                outs.append(np.array(s.prefill_output))
                for row in rows:
                    outs.append(np.array(await s.append(row, fmt="npy")))
                length = (await s.refresh())["length"]
                sid = s.id
            empty = await client.session()  # no prefill
            await empty.close()
            return outs, sid, length

    outs, sid, length = asyncio.run(main())
    assert length == 6
    seq = np.concatenate([prompt, *rows])
    want = reference(seq, causal=True)
    assert relative_error(torch.from_numpy(outs[0]), want[:3]) < TOL
    assert relative_error(torch.from_numpy(outs[1]), want[3:4]) < TOL
    assert relative_error(torch.from_numpy(outs[2]), want[4:6]) < TOL
    assert httpx.get(f"{app_url}/sessions/{sid}", timeout=30).status_code == 404  # ended on leaving the block


@pytest.mark.ray
def test_bench_reports_latency_and_throughput_per_concurrency(app_url: str, tmp_path: Path) -> None:
    before = total(poll(app_url, lambda s: True, 30, "/metrics"), "gangserve_requests_total", route="/infer",
                   code="200")
    t0 = time.monotonic()
    proc = ok(gangserve(app_url, "bench", "--shape", "1,4,512", "--format", "npy", "--concurrency", "1,3",
                        "--duration", "1.5", "--warmup", "0.2", "--json", str(tmp_path / "bench.json")))
    took = time.monotonic() - t0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    assert report["shape"] == [1, 4, 512] and report["format"] == "npy"
    assert report["request_bytes"] == len(wire.encode_npy(np.zeros((1, 4, E), np.float32)))
    for level in report["levels"]:
        assert level["requests"] > 0 and level["errors"] == 0, level
        assert 0 < level["p50_ms"] <= level["p99_ms"] <= level["max_ms"], level
        assert level["req_per_s"] == pytest.approx(level["requests"] / level["seconds"], rel=0.01), level
        assert level["seconds"] >= 1.5
    assert "CONCURRENCY" in proc.stdout and "P99_MS" in proc.stdout
    print(proc.stdout)
    assert took < 30, f"bench of 2 levels x 1.7 s took {took:.0f} s"
    sent = sum(level["requests"] for level in report["levels"])
    # The service counted at least the answered requests the bench reports (warmup ones too).
    poll(app_url, lambda s: total(s, "gangserve_requests_total", route="/infer", code="200") >= before + sent, 60,
         f"{sent} more /infer 200s in /metrics")
