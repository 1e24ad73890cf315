"""Shared fixtures: ONE Ray cluster and ONE Serve instance per test session.

Apps are deployed by the tests that need them (real Ray, real Serve, real HTTP); the
main world_size-2 app uses deployments/local.yaml's arguments, as `make serve` does.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterator

import httpx
import pytest

from harness.local import ROOT, free_port, front_door_env, local_yaml_args  # noqa: F401 - re-exported: tests import them from here


def _one_tls_context_for_one_shot_calls() -> None:
    """httpx's one-shot functions (`httpx.get`, `httpx.post`, ...) build a client, and with
    it a new TLS context, for every call, even to an http:// URL: certifi's CA bundle is
    parsed again, ~33 ms of CPU a call. The suite makes thousands of them (polls, concurrent
    clients): about half of the test process's CPU (bench/NOTES.md, session 10). In the
    test process they all take one context, httpx's own default, built once; a call that
    passes its own `verify` keeps it. Nothing else about the calls changes (a new client
    and connection per call, as before)."""
    import functools

    context = httpx.create_ssl_context()
    for name in ("request", "stream", "get", "options", "head", "post", "put", "patch", "delete"):
        setattr(httpx, name, functools.partial(getattr(httpx, name), verify=context))


_one_tls_context_for_one_shot_calls()

# The test cluster: two raylets on this machine (ray.cluster_utils.Cluster), each
# declaring one logical GPU, so multi-node placement (STRICT_SPREAD, one rank per node)
# and GPU scheduling are exercised for real; ranks find no CUDA device and use gloo.
# Logical CPUs: ranks reserve fractions of a CPU, so the apps deployed side by side fit;
# the machine itself has 2 cores.
TEST_CLUSTER_CPUS = 4
WORKER_NODE_CPUS = 2
GPUS_PER_NODE = 1
TEST_API_TOKEN = "test-token-0123456789"
# Behind HAProxy (the front door) Serve keeps a stopping ingress replica reachable for
# RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S (default 30 s) before it closes its listener,
# so every serve.delete and every replaced ingress replica waited 30 s: ~25 times a suite. On
# one machine HAProxy learns of the change within a second or two, and a late arrival is
# retried on another replica (retry-on conn-failure); the test clusters use 5 s.
TEST_CLUSTER_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5"}


# Every test is marked `unit` (no Ray: `pytest -m unit`) or `ray`; a unit test must not
# reach the session's Ray fixtures, which would start the cluster.
RAY_FIXTURES = {"ray_cluster", "serve_url", "app_url", "world_size_apps"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        unit, ray_ = item.get_closest_marker("unit"), item.get_closest_marker("ray")
        if bool(unit) == bool(ray_):
            wrong.append(f"{item.nodeid}: mark it exactly one of unit or ray")
        elif unit and RAY_FIXTURES & set(item.fixturenames):
            wrong.append(f"{item.nodeid}: marked unit but uses {sorted(RAY_FIXTURES & set(item.fixturenames))}")
    if wrong:
        raise pytest.UsageError("test markers:\n  " + "\n  ".join(wrong))
    # GANGSERVE_TEST_ORDER=reverse runs the modules in reverse file order (tests within a
    # module keep theirs): how the suite is checked for tests that depend on file order.
    if os.environ.get("GANGSERVE_TEST_ORDER") == "reverse":
        modules: dict[str, list[pytest.Item]] = {}
        for item in items:
            modules.setdefault(str(item.path), []).append(item)
        items[:] = [item for path in reversed(modules) for item in modules[path]]
    _run_shared_app_users_together(items)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _gather(order: list[str], members: list[str]) -> list[str]:
    """`order` with `members` (in their given order) moved to where the first of them is."""
    first = next(i for i, m in enumerate(order) if m in members)
    rest = [m for m in order if m not in members]
    return rest[:first] + members + rest[first:]


def _run_shared_app_users_together(items: list[pytest.Item]) -> None:
    """The modules that use a session app run next to each other, where the first of them
    would have run, and the app is deleted after the last test that uses it
    (pytest_runtest_teardown), so it never idles through the other modules: an idle app costs
    about an eighth of a core (bench/NOTES.md).

    - The world-size apps (tests/shared_apps.py): their modules run in USED_BY's order, masks
      first, because sessions swaps the weights of one app and kills one of its ranks.
    - The `make serve` app (`app_url`): its modules keep their order among themselves; when
      one of the world-size modules uses it, both world-size modules count as its users."""
    from tests.shared_apps import USED_BY

    def uses(fixture: str) -> list[pytest.Item]:
        return [item for item in items if fixture in getattr(item, "fixturenames", ())]

    order = list(dict.fromkeys(_module(item) for item in items))
    shared = [m for m in USED_BY if m in order]
    if shared:
        order = _gather(order, shared)
    app = {_module(item) for item in uses("app_url")}
    if app & set(shared):
        app |= set(shared)
    if app:
        order = _gather(order, [m for m in order if m in app])
    position = {m: i for i, m in enumerate(order)}
    items.sort(key=lambda item: position[_module(item)])  # stable: tests keep their order in a module
    _LAST_USER.clear()
    _LAST_USER.update({fixture: users[-1].nodeid for fixture in _SESSION_APPS if (users := uses(fixture))})


# A session app's fixture name -> the nodeid of the last test that uses it (set at collection),
# and -> how to delete it (set by the fixture once it deployed the app).
_SESSION_APPS = ("world_size_apps", "app_url")
_LAST_USER: dict[str, str] = {}
_CLOSE: dict[str, Callable[[], None]] = {}


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for fixture, last in _LAST_USER.items():
        if last == item.nodeid and fixture in _CLOSE:
            _CLOSE.pop(fixture)()


# Wall time per test module (setup + call + teardown of its tests, its module fixtures
# included; the session's cluster start counts to the first module that needs it), printed
# at the end of the run beside --durations: where the suite's minutes go. Beside it, how busy
# the machine's CPUs were meanwhile (every process, Ray's included, from /proc/stat between
# reports): a module far below 100 % waits (timeouts, restarts), one near it computes.
_MODULE_SECONDS: dict[str, float] = {}
_MODULE_CPU: dict[str, list[int]] = {}  # module -> [busy jiffies, all jiffies] of every CPU
_LAST_CPU: list[int] = []


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, all) jiffies of every CPU since boot; None where /proc/stat is not Linux's."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])  # user .. steal; guest is inside user


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration
    now = _cpu_jiffies()
    if now is not None:
        if _LAST_CPU:
            spent = _MODULE_CPU.setdefault(module, [0, 0])
            spent[0] += now[0] - _LAST_CPU[0]
            spent[1] += now[1] - _LAST_CPU[1]
        _LAST_CPU[:] = now


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _MODULE_SECONDS:
        return
    total = sum(_MODULE_SECONDS.values())
    terminalreporter.write_sep("=", f"slowest 15 modules (of {len(_MODULE_SECONDS)}, {total:.0f} s in all; "
                                    "CPUs busy meanwhile)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        busy, every = _MODULE_CPU.get(module, [0, 0])
        cpu = f"{100 * busy / every:5.0f} %" if every else "      "
        terminalreporter.write_line(f"{seconds:8.1f}s  {100 * seconds / total:4.1f}%  {cpu}  {module}")
    busy, every = (sum(v[i] for v in _MODULE_CPU.values()) for i in (0, 1))
    if every:
        terminalreporter.write_line(f"CPUs busy through the run: {100 * busy / every:.0f} %")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A real S3-compatible server (moto) on 127.0.0.1 for the whole session (tests/s3.py)."""
    from tests.s3 import MotoS3

    server = MotoS3().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A 2-node Ray cluster (head + one worker raylet), shared by the whole session."""
    # Before any raylet starts, so every Ray worker (JobManager, ingress, training runs)
    # inherits them: a throwaway state dir and a known API token.
    os.environ["GANGSERVE_STATE_DIR"] = str(tmp_path_factory.mktemp("gangserve-state"))
    os.environ["GANGSERVE_API_TOKEN"] = TEST_API_TOKEN
    os.environ["GANGSERVE_FAILPOINTS"] = "1"  # fault tests arm one-shot failpoints (service.gang.failpoints)
    # The product's front door (Serve's HAProxy straight to the Ingress replicas), as `make
    # serve` starts it; read by Serve's controller, proxy and replicas when they start.
    os.environ.update(front_door_env())
    os.environ.update(TEST_CLUSTER_ENV)
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        # No log monitor: it streams workers' stdout to drivers, and the suite's driver has
        # log_to_driver=False; it rescans the session's log directory ten times a second, the
        # cluster's busiest system process (~80 core-s a suite, bench/NOTES.md).
        head_node_args={"num_cpus": TEST_CLUSTER_CPUS, "num_gpus": GPUS_PER_NODE, "include_dashboard": False,
                        "include_log_monitor": False},
    )
    cluster.add_node(num_cpus=WORKER_NODE_CPUS, num_gpus=GPUS_PER_NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="session")
def serve_grpc_port() -> int:
    """The session's Serve instance's gRPC port: HAProxy's gRPC frontend to the ingress replicas
    (service.cluster.front_door.grpc_options; 9000 in the product, a free port here)."""
    return free_port()


@pytest.fixture(scope="session")
def serve_url(ray_cluster: Any, serve_grpc_port: int) -> str:
    from ray import serve

    from service.cluster.front_door import grpc_options

    port = free_port()
    # One proxy, on the head. With the default (a proxy on every node) the worker raylet's
    # proxy binds the same 127.0.0.1 port with SO_REUSEPORT, the kernel splits connections
    # between the two, and whenever the controller restarts the worker's proxy (it did, under
    # the suite's CPU load) the connections it held were reset: the rare "Connection reset
    # by peer" / "closed without a response" that polling tests used to see.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port},
                grpc_options=grpc_options(serve_grpc_port))
    return f"http://127.0.0.1:{port}"


def deploy(serve_url: str, name: str, route_prefix: str, args: dict[str, Any]) -> str:
    """Deploy build_app(args) as app `name`; return its base URL once /readyz says ready
    (`submit`, then `wait_deployed`).

    The app runs with the suite's defaults (`suite_args`)."""
    submit(name, route_prefix, args)
    return wait_deployed(serve_url, name, route_prefix)


def suite_args(args: dict[str, Any]) -> dict[str, Any]:
    """`args` with the suite's default where `args` does not set it, a cost the product pays at
    every gang bring-up for a feature most tests are not about: no warm spare rank
    (`warm_spare`, default on in the product): a spare is one more torch process per gang, and
    on this 2-core machine the suite's ~30 apps would start them all for nothing; the fault
    tests that are about it (tests/test_gang_faults.py) turn it on."""
    return {"warm_spare": False, **args}


def submit(name: str, route_prefix: str, args: dict[str, Any]) -> None:
    """Hand build_app(suite_args(args)) to Serve as app `name` and return at once (what
    `serve.run` does before it waits): apps submitted one after the other start side by side."""
    from ray import serve

    from service.app import build_app

    serve._run(build_app(suite_args(args)), name=name, route_prefix=route_prefix,  # noqa: SLF001
               _blocking=False)


def wait_deployed(serve_url: str, name: str, route_prefix: str, timeout_s: float = 180) -> str:
    """What `serve.run` waits for (Serve's status of app `name` RUNNING; DEPLOY_FAILED raises
    with Serve's message; TimeoutError after `timeout_s`), then its /readyz 200 (within
    `timeout_s` again); the app's base URL."""
    from ray.serve.context import _get_global_client

    _get_global_client()._wait_for_application_running(name, timeout_s=timeout_s)  # noqa: SLF001
    return wait_ready(serve_url + (route_prefix if route_prefix != "/" else ""), timeout_s, f"app {name}")


def undeploy(name: str) -> None:
    """Delete app `name` without waiting for its replicas to stop: for module apps whose name is
    not deployed again. A blocking delete waits out Serve's draining of the ingress replica
    (TEST_CLUSTER_ENV) and the gang's graceful shutdown, 6 to 24 s per app on this
    machine, while the next test could already run; the replicas stop beside it, and a next
    app that needs their logical CPUs waits for them like any placement. Tests that assert on
    what a delete leaves behind (freed GPUs, exited processes, a redeploy under the same name,
    a dropped database) call serve.delete and wait."""
    from ray import serve

    serve.delete(name, _blocking=False)


def wait_ready(base: str, timeout_s: float, what: str = "the app") -> str:
    """Poll `base`/readyz until 200 (returns `base`); TimeoutError with the last answer after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            reply = httpx.get(base + "/readyz", timeout=10)
            if reply.status_code == 200:
                return base
            last = reply.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s; last /readyz: {last}")


@pytest.fixture(scope="session")
def world_size_apps(serve_url: str) -> Iterator[Any]:
    """The world-size apps of tests/shared_apps.py: `.get(world_size)` -> base URL."""
    from tests.shared_apps import WorldSizeApps

    apps = WorldSizeApps(serve_url)
    _CLOSE["world_size_apps"] = apps.close
    yield apps
    apps.close()


@pytest.fixture(scope="session")
def app_url(serve_url: str) -> str:
    """The `make serve` app (deployments/local.yaml arguments) at route prefix /; deleted
    after the last test that uses it (pytest_runtest_teardown)."""
    base = deploy(serve_url, "gangserve", "/", local_yaml_args())
    _CLOSE["app_url"] = lambda: undeploy("gangserve")
    return base


# A real PostgreSQL server (session) and a fresh state database of each dialect (tests/postgres.py).
from tests.postgres import postgres_server, store_url  # noqa: E402,F401
