"""The status page (/ui/) in a real headless browser, and the job logs it links to.

Debian's Chromium (/usr/bin/chromium) driven by Playwright for Python; Playwright's own
browser download is never used. Without Chromium the session installs it with apt-get when
it can (root, apt-get present; `make install` / `make test` do it first), else the browser
test is skipped saying why. One small real training job (2 workers) serves both
tests: the page must draw its loss curve, one point per epoch, and its logs must carry each
worker's own stdout lines tagged by rank.

Screenshot: `ui.png` in this test's pytest tmp dir (printed), and docs/ui.png too when
UPDATE_UI_SCREENSHOT=1 (the README's picture).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import ROOT, TEST_API_TOKEN
from tests.helpers import AUTH, SMALL, post, wait_done

pytestmark = pytest.mark.ray

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EPOCHS = 3
# A quarter held out for validation: 192 samples trained on (96 per rank), 64 evaluated.
JOB = {**SMALL, "model": {"kind": "linear"}, "dataset": {"samples": 256, "validation_fraction": 0.25},
       "epochs": EPOCHS, "batch_size": 32}
TRAINED = 192
# Playwright's expect() polls the page until this (ms), then fails with what it saw.
PAGE_TIMEOUT_MS = 30_000


def ensure_chromium() -> str | None:
    """The Chromium executable, installing Debian's package if needed and possible; else None
    and pytest.skip's reason is set by the caller."""
    if CHROMIUM.exists():
        return str(CHROMIUM)
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "install", "-y", "-q", "chromium"], ["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "chromium"]):
        if CHROMIUM.exists():
            break
        subprocess.run(cmd, env=env, capture_output=True, timeout=900, check=False)
    return str(CHROMIUM) if CHROMIUM.exists() else None


@pytest.fixture(scope="module")
def job_id(app_url: str) -> str:
    """The small job, submitted first so it trains while the browser starts."""
    reply = post(app_url, "/train", JOB)
    assert reply.status_code == 202, reply.text
    return reply.json()["id"]


@pytest.fixture(scope="module")
def browser_context(job_id: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")
    executable = ensure_chromium()
    if executable is None:
        pytest.skip(f"{CHROMIUM} is missing and cannot be installed here (needs root and apt-get: "
                    "`apt-get install -y chromium`)")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),  # a fresh profile every run
            executable_path=executable, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
        )
        context.set_default_timeout(PAGE_TIMEOUT_MS)
        try:
            yield context
        finally:
            context.close()


def test_status_page_shows_gangs_traffic_and_a_finished_jobs_loss_curve(
    app_url: str, job_id: str, browser_context: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    page = browser_context.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(f"console {msg.type}: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))

    page.goto(app_url + "/ui/")
    # The gang, ready, with its two ranks.
    gang = page.locator("#gangs .card.gang").first
    expect(gang.locator(".state")).to_have_text("ready")
    expect(gang.locator("tr.rank")).to_have_count(2)
    expect(page.locator("#ready-summary")).to_have_text(re.compile(r"^1/1 gang ready$"))
    # No token yet: the page asks for it instead of reading /train.
    expect(page.locator("#token-form")).to_be_visible()

    # The token, once; the job list appears and the token stays in this tab's sessionStorage.
    page.fill("#token-input", TEST_API_TOKEN)
    page.click("#token-form button[type=submit]")
    expect(page.locator("#jobs-bar")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('gangserve.apiToken')") == TEST_API_TOKEN
    # A reload keeps it: the jobs show without asking again.
    page.reload()
    expect(page.locator("#jobs-bar")).to_be_visible()
    expect(page.locator("#token-form")).to_be_hidden()

    # Traffic: the page's request rate turns positive while requests flow (bounded).
    body = {"hidden_states": [[0.01] * 512 for _ in range(4)]}
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=app_url, timeout=30) as http:
        while True:
            for _ in range(5):
                assert http.post("/infer", json=body).status_code == 200
            rate = page.locator("#req-rate").inner_text()
            if rate not in ("–", "0"):
                break
            assert time.monotonic() < deadline, f"request rate still {rate!r} after 60 s of requests"
    assert float(rate) > 0, rate
    expect(page.locator("#step-p50")).to_contain_text("ms")
    # Light traffic from here to the screenshot, so the picture shows a rate (paced, not waited on).
    stop = threading.Event()
    traffic = threading.Thread(target=_paced_requests, args=(app_url, body, stop), daemon=True)
    traffic.start()

    job = wait_done(app_url, job_id)
    assert job["status"] == "SUCCEEDED", job
    card = page.locator(f'.card.job[data-job-id="{job_id}"]')
    expect(card).to_have_attribute("data-status", "SUCCEEDED")
    points = card.locator("svg.loss circle.point")
    expect(points).to_have_count(EPOCHS)
    drawn = [(int(points.nth(i).get_attribute("data-epoch")), float(points.nth(i).get_attribute("data-loss")))
             for i in range(EPOCHS)]
    assert drawn == [(h["epoch"], pytest.approx(h["loss"])) for h in job["history"]], (drawn, job["history"])
    # Left to right in epoch order.
    xs = [float(points.nth(i).get_attribute("cx")) for i in range(EPOCHS)]
    assert xs == sorted(xs) and len(set(xs)) == EPOCHS, xs
    # The held-out loss, a second curve with one point per epoch.
    evals = card.locator("svg.loss circle.eval-point")
    expect(evals).to_have_count(EPOCHS)
    assert [float(evals.nth(i).get_attribute("data-eval-loss")) for i in range(EPOCHS)] == [
        pytest.approx(h["eval_loss"]) for h in job["history"]], job["history"]

    # The job's logs, workers' output included, in the page.
    card.locator("details.logs summary").click()
    expect(card.locator("details.logs pre")).to_contain_text("[rank 1] epoch")

    shot = tmp_path / "ui.png"
    page.screenshot(path=str(shot), full_page=True)
    stop.set()
    traffic.join(timeout=60)
    print(f"status page screenshot: {shot}")
    if os.environ.get("UPDATE_UI_SCREENSHOT") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "ui.png")
    assert shot.stat().st_size > 10_000

    assert errors == [], errors
    # Same origin only: the page loads nothing from anywhere else.
    origin = app_url.rstrip("/")
    assert requested and all(u.startswith(origin + "/") or u.startswith("data:") for u in requested), \
        sorted({u for u in requested if not u.startswith(origin)})

    # A wrong token is refused, forgotten, and asked for again.
    page.click("#forget-token")
    page.fill("#token-input", "not-the-token")
    page.click("#token-form button[type=submit]")
    expect(page.locator("#token-error")).to_contain_text("token rejected")
    expect(page.locator("#token-form")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('gangserve.apiToken')") is None
    page.close()


def _paced_requests(app_url: str, body: dict[str, Any], stop: threading.Event) -> None:
    with httpx.Client(base_url=app_url, timeout=30) as http:
        while not stop.wait(0.1):
            http.post("/infer", json=body)


def test_job_logs_show_each_workers_output_by_rank(app_url: str, job_id: str) -> None:
    job = wait_done(app_url, job_id)
    assert job["status"] == "SUCCEEDED", job
    reply = httpx.get(f"{app_url}/train/{job_id}/logs", params={"tail": 2000}, headers=AUTH, timeout=30)
    assert reply.status_code == 200, reply.text
    lines = reply.json()["lines"]
    # Each rank printed one line per epoch in its own process; the run's log has them, tagged.
    for rank in (0, 1):
        for epoch in range(1, EPOCHS + 1):
            tag = re.compile(rf"\[rank {rank}\] epoch {epoch}/{EPOCHS}: local loss [0-9.e+-]+ over \d+ samples")
            assert sum(1 for line in lines if tag.search(line)) == 1, (rank, epoch, lines)
            # Once: a print is captured on stdout only, never again as stderr.
            assert not any(f"epoch {epoch}/{EPOCHS}: local loss" in line and f"[rank {rank} " in line
                           for line in lines), lines
    # Ranks see disjoint shards: each rank's sample count is about half of the dataset.
    counts = {int(m.group(1)): int(m.group(2)) for line in lines
              if (m := re.search(r"\[rank (\d)\] epoch 1/\d+: local loss \S+ over (\d+) samples", line))}
    assert set(counts) == {0, 1} and sum(counts.values()) == TRAINED, counts
