"""`python -m service.launch CONFIG.yaml`: `serve run` with an exit status.

Ray 2.60's `serve run CONFIG` submits the config and then sleeps forever, even when the
application can never start (its build fails, or its gang can never be placed): the
reason scrolls by in the logs but the command neither exits nor says so. This launcher
does what `serve run` does (start or join Ray, start Serve with the config's HTTP
options, deploy every application) and then *watches*:

- exit 2 at once if an application's arguments are invalid;
- exit 4 at once if the state database (`GANGSERVE_DATABASE_URL`, default the SQLite file in
  the state dir) cannot be reached or opened; the message names the URL, password redacted;
  likewise if the artifact store (GANGSERVE_STORAGE_URL, from this environment or
  an application's runtime_env env_vars) cannot be used: the message names the URL with
  credentials redacted and why (service.state.artifacts);
- exit 3 within seconds if a gang can never be placed, or gave up after
  `schedule_timeout_s` (the message names needed vs available);
- exit 1 if Serve reports DEPLOY_FAILED;
- otherwise stays in the foreground serving; Ctrl-C shuts Serve down (exit 0).
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import httpx
import yaml

from service.app import InvalidAppArgs, parse_args
from service.cluster.placement import GangUnschedulable, check_feasible, cluster_snapshot, gang_request
from service.contract.errors import ErrorCode
from service.state import artifacts
from service.state.db import StateUnavailable, connect


def _say(message: str) -> None:
    print(f"[gangserve.launch] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path, help="a Serve config file, e.g. deployments/local.yaml")
    parser.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else start a local Ray)")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0,
                        help="give up (exit 1) if the apps are not ready by then")
    args = parser.parse_args(argv)

    import ray
    from ray.serve._private import api as serve_private_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load(args.config.read_text())
    config = ServeDeploySchema.model_validate(doc)
    configs = {}
    for app in config.applications:
        try:
            configs[app.name] = parse_args(app.args or {})
        except InvalidAppArgs as exc:
            _say(f"application {app.name!r}: {exc}")
            return 2
    code = _check_state_database()
    if code:
        return code

    for name, why in _storage_problems(config):
        _say(f"application {name!r} cannot use its artifact store: {why}")
        return 4

    ray.init(address=args.address, namespace="serve", log_to_driver=True)
    snapshot = cluster_snapshot()
    for name, cfg in configs.items():
        try:
            check_feasible(snapshot, gang_request(cfg.gang))
        except GangUnschedulable as exc:
            _say(f"application {name!r} can never start: {exc.message}")
            return 3

    client = serve_private_api.serve_start(
        http_options=config.http_options.model_dump(),
        proxy_location=config.proxy_location,
        grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
    )
    client.deploy_apps(config, _blocking=False)
    _say(f"deployed {sorted(configs)} from {args.config}; waiting for the gangs")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        code = _watch(config, args.ready_timeout_s)
        if code != 0:
            from ray import serve

            serve.shutdown()
            return code
        _say("all applications ready; serving (Ctrl-C to stop)")
        while True:
            time.sleep(10)
    except KeyboardInterrupt:
        from ray import serve

        _say("shutting down")
        serve.shutdown()
        return 0


def _storage_problems(config) -> list[tuple[str, str]]:
    """(application, why) for every application whose artifact store is not reachable now.

    Each application's deployments see this environment plus its runtime_env env_vars
    (Serve merges them), so that is the environment its store is opened from; a setting
    shared by several applications is checked once."""
    import os

    checked: dict[tuple[str, ...], str | None] = {}
    problems = []
    for app in config.applications:
        env = {**os.environ, **{k: str(v) for k, v in ((app.runtime_env or {}).get("env_vars") or {}).items()}}
        setting = (env.get(artifacts.STORAGE_URL_ENV, ""), *(env.get(e, "") for e in artifacts.ENDPOINT_ENVS))
        if setting not in checked:
            try:
                store = artifacts.open_store(setting[0] or None, env=env)
                store.check_reachable()
                checked[setting] = None
            except (artifacts.StorageConfigError, artifacts.StorageUnavailable) as exc:
                checked[setting] = str(exc)
        if checked[setting]:
            problems.append((app.name, checked[setting]))
    return problems


def _check_state_database() -> int:
    """0 if the state database answers (this process sees the same GANGSERVE_DATABASE_URL and
    state dir as the replicas it starts), else 4 with the reason."""
    try:
        connect().close()
    except (StateUnavailable, ValueError) as exc:
        _say(f"the state database cannot be used: {exc}")
        return 4
    return 0


def _watch(config, timeout_s: float) -> int:
    """0 when every app is RUNNING and its gang ready; else the exit status to use."""
    from ray import serve

    host = config.http_options.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{host}:{config.http_options.port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        statuses = serve.status().applications
        pending = []
        for app in config.applications:
            st = statuses.get(app.name)
            if st is not None and st.status == "DEPLOY_FAILED":
                _say(f"application {app.name!r} failed to deploy: {st.message}")
                return 1
            prefix = "" if (app.route_prefix or "/") == "/" else app.route_prefix
            try:
                reply = httpx.get(f"{base}{prefix}/readyz", timeout=5)
            except httpx.HTTPError:
                pending.append(app.name)
                continue
            if reply.status_code == 200:
                continue
            body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
            if body.get("code") in (ErrorCode.UNSCHEDULABLE, ErrorCode.SCHEDULE_TIMEOUT):
                _say(f"application {app.name!r} cannot be placed: {body.get('error')}")
                return 3
            pending.append(app.name)
        if not pending:
            return 0
        time.sleep(1.0)
    _say(f"applications not ready after {timeout_s:.0f}s")
    return 1


if __name__ == "__main__":
    sys.exit(main())
