"""Observability: GET /metrics (Prometheus text), Ray's metrics, the Grafana dashboard,
request ids and JSON logs.

The Ray tests deploy their own small app ("obs" at /obs, JSON logs) on the session cluster;
values are read through real HTTP scrapes and compared as deltas, polling with bounded waits.
"""
from __future__ import annotations

import io
import json
import os
import re
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest

from service.config.tunables import FleetTunables
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, TEST_API_TOKEN, deploy, local_yaml_args, undeploy
from tests.helpers import poll, scrape, total, wait_done
from tests.statuses import gang_report

AUTH = {"authorization": f"Bearer {TEST_API_TOKEN}"}
DASHBOARD = ROOT / "deployments" / "grafana-dashboard.json"


# ---------------------------------------------------------------- helpers

def npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()


@pytest.fixture(scope="module")
def obs_url(serve_url: str) -> Iterator[str]:
    args = {**local_yaml_args(), "cpus_per_rank": 0.25, "collective_timeout_s": 5.0, "log_encoding": "JSON"}
    base = deploy(serve_url, "obs", "/obs", args)
    yield base
    undeploy("obs")


# ---------------------------------------------------------------- unit

@pytest.mark.unit
def test_dashboard_references_only_exported_metrics() -> None:
    from service.metrics.specs import SPECS, exported_names

    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    exported = exported_names()
    referenced = set()
    for expr in exprs:
        names = set(re.findall(r"\b(?:ray_)?gangserve_[a-z0-9_]+\b", expr))
        assert names, f"query {expr!r} uses no gangserve metric"
        referenced |= names
    unknown = sorted(referenced - exported)
    assert not unknown, f"the dashboard queries metrics the service does not export: {unknown}"
    # What the issue asks the dashboard to show.
    for needed in ("gangserve_requests_total", "gangserve_request_seconds_bucket", "gangserve_gang_step_seconds_bucket",
                   "gangserve_batch_size_bucket", "gangserve_gang_ready", "gangserve_gang_rebuilds_total",
                   "gangserve_training_loss"):
        assert needed in referenced, f"no panel shows {needed}"
    assert len(SPECS) == len({s.name for s in SPECS.values()})


@pytest.mark.unit
def test_counters_survive_replicas_that_go_away() -> None:
    """A gone replica's counters keep counting (folded into the retired snapshot); its gauges do not."""
    from service.metrics.exposition import exposition, merge
    from service.metrics.process import MetricSet
    from service.state import fleet as f

    fleet = f.Fleet()
    a, b, c = MetricSet(), MetricSet(), MetricSet()
    for _ in range(3):
        a.inc("gangserve_gang_rebuilds")
    b.inc("gangserve_gang_rebuilds")
    c.inc("gangserve_gang_rebuilds", value=2)
    a.observe("gangserve_gang_step_seconds", 0.02)
    a.set("gangserve_gang_ready", 1.0, ("A",))
    c.set("gangserve_gang_ready", 1.0, ("C",))
    t0 = 1000.0
    fleet.report_metrics("gang:A", a.snapshot(), t0)
    fleet.report_metrics("gang:B", b.snapshot(), t0)
    fleet.report(gang_report(replica_id="C"), t0, metrics=c.snapshot())

    def service_wide(now: float) -> dict:
        return merge(fleet.metrics(now))

    before = service_wide(t0)
    assert before["gangserve_gang_rebuilds"][()] == 6
    assert before["gangserve_gang_ready"][("A",)] == 1.0
    # A goes silent: past staleness its gauges drop, past folding its counters still count.
    # C's process dies (the controller sees it): folded at once, counted once.
    fleet.mark_lost("C", "died", t0 + 1)
    for age in (FleetTunables().stale_after_s + 1, FleetTunables().fold_after_s + 1):
        fleet.report_metrics("gang:B", b.snapshot(), t0 + age)  # B keeps reporting
        now = service_wide(t0 + age)
        assert now["gangserve_gang_rebuilds"][()] == 6
        assert now["gangserve_gang_step_seconds"][()]["c"] == 1
        assert ("A",) not in now.get("gangserve_gang_ready", {})
        assert ("C",) not in now.get("gangserve_gang_ready", {})
    text = exposition(service_wide(t0 + FleetTunables().fold_after_s + 2)).decode()
    families = {fam.name: fam for fam in text_string_to_metric_families(text)}
    assert families["gangserve_gang_rebuilds"].samples[0].value == 6


@pytest.mark.unit
def test_request_labels_are_templates_and_formats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Route labels are route templates (a 401 from auth included), never raw paths."""
    monkeypatch.setenv("GANGSERVE_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("GANGSERVE_API_TOKEN", TEST_API_TOKEN)
    from fastapi.testclient import TestClient

    from service.config.builder_args import AppConfig
    from service.ingress.api import create_api

    client = TestClient(create_api(AppConfig(), None))  # type: ignore[arg-type]
    secret_id = f"job-{uuid.uuid4().hex[:12]}"
    client.get(f"/train/{secret_id}")  # 401: answered by auth, before routing
    client.post("/infer", content=b"not npy", headers={"content-type": "application/x-npy"})  # 400
    client.get("/no/such/route")
    reply = client.get("/metrics")
    assert reply.status_code == 200
    assert secret_id not in reply.text and "/no/such/route" not in reply.text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(reply.text) for s in f.samples}
    assert total(samples, "gangserve_requests_total", route="/train/{job_id}", code="401") >= 1
    assert total(samples, "gangserve_requests_total", route="/infer", format="npy", code="400") >= 1
    assert total(samples, "gangserve_requests_total", route="unmatched", code="404") >= 1
    assert total(samples, "gangserve_request_bytes_count", route="/infer") >= 1


# ---------------------------------------------------------------- ray

@pytest.mark.ray
def test_metrics_count_requests_and_gang_steps(obs_url: str) -> None:
    before = poll(obs_url, lambda s: total(s, "gangserve_gang_ready") == 1, 30, "gang_ready 1")
    assert set(n for n, _ in before) >= {"gangserve_requests_total", "gangserve_gang_step_seconds_count",
                                         "gangserve_gang_rebuilds_total", "gangserve_training_jobs"}
    n = 7
    x = np.random.default_rng(0).standard_normal((1, 4, 512), dtype=np.float32)
    with httpx.Client(timeout=60) as client:
        for _ in range(n):
            r = client.post(obs_url + "/infer", content=npy(x), headers={"content-type": "application/x-npy"})
            assert r.status_code == 200, r.text
    after = scrape(obs_url)  # this ingress replica's own request counts are live
    key = dict(route="/infer", format="npy", code="200")
    assert total(after, "gangserve_requests_total", **key) - total(before, "gangserve_requests_total", **key) == n
    assert (total(after, "gangserve_request_seconds_count", route="/infer")
            - total(before, "gangserve_request_seconds_count", route="/infer")) == n
    assert (total(after, "gangserve_request_bytes_sum", route="/infer")
            - total(before, "gangserve_request_bytes_sum", route="/infer")) == n * len(npy(x))
    # The gang server's values arrive with its next publication (every 2 s).
    steps0 = total(before, "gangserve_gang_step_seconds_count")
    later = poll(obs_url, lambda s: total(s, "gangserve_gang_step_seconds_count") >= steps0 + 1, 30, "gang steps")
    assert total(later, "gangserve_batch_size_count") >= total(before, "gangserve_batch_size_count") + 1
    # Each step's parts, by the names Server-Timing and /gang's step timings use.
    for part in ("broadcast", "compute", "to_numpy"):
        assert (total(later, "gangserve_step_part_seconds_count", part=part)
                >= total(before, "gangserve_step_part_seconds_count", part=part) + 1), part
    assert total(later, "gangserve_weights_version") >= 1


@pytest.mark.ray
def test_request_id_is_echoed_or_assigned_and_logged_as_json(obs_url: str, ray_cluster: Any) -> None:
    mine = f"obs-{uuid.uuid4().hex}"
    echoed = httpx.get(obs_url + "/healthz", headers={"X-Request-Id": mine}, timeout=30)
    assert echoed.headers.get_list("x-request-id") == [mine]
    assigned = [httpx.get(obs_url + "/healthz", timeout=30).headers.get_list("x-request-id") for _ in range(2)]
    assert all(len(ids) == 1 and ids[0] for ids in assigned) and assigned[0] != assigned[1]

    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    deadline = time.monotonic() + 30
    found: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    while time.monotonic() < deadline and not (found and ours):
        for path in logs.glob("replica_obs_Ingress_*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if not line.startswith("{"):
                    continue
                record = json.loads(line)  # JSON logs: every line one object
                if record.get("request_id") == mine:
                    found = record
                if record.get("filename") == "api.py" and "token from" in record.get("message", ""):
                    ours = record  # service.ingress.api's start-up line (logger gangserve.ingress)
        time.sleep(0.5)
    assert found, f"no JSON log line with request_id {mine} in {sorted(p.name for p in logs.glob('replica_obs_*'))}"
    assert ours, "the service's own log lines do not reach the replica's JSON log"


def _json_records(logs: Path, pattern: str) -> list[dict[str, Any]]:
    """Every JSON record of the replica logs matching `pattern` (JSON encoding: one object a line)."""
    return [json.loads(line) for path in logs.glob(pattern)
            for line in path.read_text(errors="replace").splitlines() if line.startswith("{")]


@pytest.mark.unit
def test_serves_failed_call_line_keeps_its_traceback_for_internal_and_foreign_errors() -> None:
    """The other side of the test below, on real log records: a 5xx we state is one WARNING
    line; an `internal` error and an exception that is not ours keep Serve's ERROR and traceback."""
    import logging
    import sys

    from service.contract.errors import GangServeError, GangUnavailable
    from service.metrics.logs import SERVE_CALL_FAILED, AnsweredErrors

    def record_of(exc: Exception) -> logging.LogRecord:
        try:
            raise exc
        except Exception:  # noqa: BLE001 - a real exc_info, as logger.exception makes it
            return logging.LogRecord("ray.serve", logging.ERROR, "replica.py", 1, SERVE_CALL_FAILED, None,
                                     sys.exc_info())

    rebuilding = record_of(GangUnavailable("gang is rebuilding"))
    assert AnsweredErrors().filter(rebuilding)
    assert (rebuilding.levelname, rebuilding.exc_info) == ("WARNING", None)
    assert rebuilding.getMessage() == "call answered 503 gang_unavailable: gang is rebuilding"
    for kept in (record_of(GangServeError("unexpected")), record_of(ValueError("a bug"))):
        assert AnsweredErrors().filter(kept)
        assert kept.levelname == "ERROR" and kept.exc_info is not None and kept.getMessage() == SERVE_CALL_FAILED


@pytest.mark.ray
def test_an_error_a_handle_call_answers_is_one_line_not_a_traceback(obs_url: str, ray_cluster: Any) -> None:
    """The JobManager raises `job_not_found` through its handle call; Serve logs any exception
    raised there as ERROR "Request failed." with a traceback. Ours are answers: one INFO line
    with the status, the code and the message, and no traceback (service.metrics.logs)."""
    import ray

    missing = f"job-{uuid.uuid4().hex[:12]}"
    mine = f"obs-{uuid.uuid4().hex}"
    reply = httpx.get(f"{obs_url}/train/{missing}", headers={**AUTH, "X-Request-Id": mine}, timeout=30)
    assert reply.status_code == 404 and reply.json()["code"] == "job_not_found", reply.text
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"  # noqa: SLF001
    ours: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not ours:
        ours = [r for r in _json_records(logs, "replica_obs_JobManager_*.log") if r.get("request_id") == mine]
        time.sleep(0.5)
    answered = [r for r in ours if r.get("message", "").startswith("call answered")]
    assert len(answered) == 1, ours
    assert answered[0]["levelname"] == "INFO" and missing in answered[0]["message"], answered
    assert answered[0]["message"].startswith("call answered 404 job_not_found: "), answered
    assert not any("Traceback" in json.dumps(r) or r.get("message") == "Request failed." for r in ours), ours


@pytest.mark.ray
@pytest.mark.slow
def test_finished_training_job_is_counted(obs_url: str) -> None:
    def succeeded(s: dict) -> float:
        return total(s, "gangserve_training_jobs", status="SUCCEEDED")

    before = scrape(obs_url)
    spec = {"cpus_per_worker": 0.25, "model": {"kind": "linear"}, "dataset": {"samples": 64}, "epochs": 2}
    reply = httpx.post(obs_url + "/train", json=spec, headers=AUTH, timeout=60)
    assert reply.status_code == 202, reply.text
    job = wait_done(obs_url, reply.json()["id"], 240)
    job_id = job["id"]
    assert job["status"] == "SUCCEEDED", job
    after = poll(obs_url, lambda s: succeeded(s) >= succeeded(before) + 1, 30, "a SUCCEEDED job")
    assert total(after, "gangserve_training_epoch_seconds_count") >= total(
        before, "gangserve_training_epoch_seconds_count") + 1
    assert total(after, "gangserve_training_loss", job=job_id) == 0  # finished: no longer active


@pytest.mark.ray
@pytest.mark.slow
def test_rank_kill_counts_a_rebuild(obs_url: str) -> None:
    before = poll(obs_url, lambda s: total(s, "gangserve_gang_ready") == 1, 60, "gang_ready 1")
    info = httpx.get(obs_url + "/gang", timeout=30).json()
    victim = info["ranks"][1]["pid"]
    os.kill(victim, signal.SIGKILL)
    rebuilds0 = total(before, "gangserve_gang_rebuilds_total")
    after = poll(obs_url, lambda s: total(s, "gangserve_gang_rebuilds_total") >= rebuilds0 + 1
                 and total(s, "gangserve_gang_ready") == 1, 90, "a counted rebuild")
    assert total(after, "gangserve_gang_rebuilds_total") == rebuilds0 + 1
    # Counters of the surviving process never went backwards.
    for name in ("gangserve_gang_step_seconds_count", "gangserve_requests_total"):
        assert total(after, name) >= total(before, name)


@pytest.mark.ray
def test_ray_metrics_export_carries_the_same_metrics(obs_url: str) -> None:
    """The request and gang metrics also reach Ray's Prometheus export (ray.serve.metrics)."""
    import ray

    ports = [(n["NodeManagerAddress"], n.get("MetricsExportPort")) for n in ray.nodes() if n["Alive"]]
    ports = [(ip, port) for ip, port in ports if port]
    httpx.post(obs_url + "/infer", json={"hidden_states": [[0.1] * 512]}, timeout=60).raise_for_status()
    wanted = {"ray_gangserve_requests_total", "ray_gangserve_gang_step_seconds_count"}
    seen: set[str] = set()
    errors: list[str] = []
    deadline = time.monotonic() + 60  # Ray reports metrics every few seconds
    while time.monotonic() < deadline and not wanted <= seen:
        for ip, port in ports:
            try:
                text = httpx.get(f"http://{ip}:{port}/metrics", timeout=10).text
            except httpx.HTTPError as exc:
                errors.append(f"{ip}:{port}: {exc!r}")
                continue
            for family in text_string_to_metric_families(text):
                seen |= {s.name for s in family.samples if s.name.startswith("ray_gangserve_")}
        time.sleep(1.0)
    if not ports or (errors and not seen and len(errors) >= len(ports) * 10):
        pytest.skip(f"no Ray metrics export reachable on this cluster: ports {ports}, errors {errors[:2]}")
    assert wanted <= seen, f"missing {sorted(wanted - seen)}; seen {sorted(seen)}"
