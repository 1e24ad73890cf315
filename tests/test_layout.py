"""The import structure of `service/` (read with ast; one test imports, in a child process).

The house rules, each a test:
- no import cycles between modules;
- the Serve deployments (service.deployments) sit on top: only the app builder imports them;
- the three subsystems below them do not import each other sideways: the gang (rank
  processes), the ingress (HTTP) and training share code only through modules below all
  three (service.cluster, service.config, service.contract, service.metrics, ...).
  The exceptions are the training job spec (a plain pydantic model: the ingress describes
  POST /train's body in OpenAPI with it, the JobManager validates) and the jobs' response models
  (service.training.public, over service.training.status);
- service.parallel (the tensor-parallel math) depends on torch and service.models only;
- service.models (each model kind's torch-free description) imports nothing else from service;
- service.config.tunables (every timing and sizing knob) imports nothing from service, so any
  module may read it;
- error codes are ErrorCode members (service.contract.errors, the one registry), not string literals;
- the ingress -> rank 0 hop has one owner (service.transport.link): no other module of the
  ingress or the deployments opens the data channel or hands tensors through /dev/shm;
- the weights rollout has one home: only service.weights.rollout drives the gang's swap and
  asks the Controller to record a version; only the gang (and the rank that implements
  them) stages, commits or discards a rank's weights;
- the ingress's process loads no torch (nor the tensor-parallel math or the KV cache): its
  replicas start in a fraction of the time and hold a fraction of the memory;
- only the processes that own a store (the Controller, the JobManager) load the state
  database's code (SQLAlchemy): a gang, the ingress and training read the served weights'
  values from service.weights.served.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SUBSYSTEMS = ("service.gang", "service.ingress", "service.training")
ALLOWED_SIDEWAYS = {
    ("service.ingress.routes.train", "service.training.spec"),
    # The response models of the /train routes: plain pydantic over the JobStatus table
    # (service.training.status), the shape the JobManager's dicts have; no training code runs.
    ("service.ingress.routes.train", "service.training.public"),
}
FOUNDATIONS = ("service.cluster", "service.transport", "service.weights", "service.state", "service.parallel",
               "service.models", "service.config", "service.contract", "service.metrics")
# The only modules directly under service/: the two entry points and the index of the environment.
TOP_LEVEL = {"service", "service.app", "service.launch", "service.environment"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (ROOT / "service").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mods[name] = path
    return mods


def _imports() -> dict[str, set[str]]:
    """module -> the service modules it imports (any depth: function-level imports count)."""
    mods = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for target in (node.module, *(f"{node.module}.{a.name}" for a in node.names)):
                    if target in mods and target != name:
                        edges[name].add(target)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in mods and a.name != name)
    return edges


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_import_cycles() -> None:
    edges = _imports()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for module in sorted(_modules()):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_module_lives_in_a_package_but_the_entry_points() -> None:
    """A reader finds a module by its concern: under service/ sit only `app` (Serve's entry point,
    named in every config), `launch` (the CLI) and `environment` (the index of every environment
    variable, which imports from every package)."""
    flat = sorted(name for name in _modules() if name.count(".") <= 1 and name not in TOP_LEVEL
                  and not (ROOT / "service" / name.split(".")[-1]).is_dir())
    assert not flat, f"modules beside the packages: {flat}"
    assert TOP_LEVEL <= set(_modules()), sorted(TOP_LEVEL - set(_modules()))


def test_only_the_app_builder_imports_the_deployments() -> None:
    offenders = sorted(
        f"{src} -> {dst}" for src, dsts in _imports().items() for dst in dsts
        if _inside(dst, "service.deployments") and not _inside(src, "service.deployments")
        and src != "service.app"
    )
    assert not offenders, f"modules below the deployments import them: {offenders}"


def test_subsystems_do_not_import_each_other() -> None:
    offenders = []
    for src, dsts in _imports().items():
        home = next((p for p in SUBSYSTEMS if _inside(src, p)), None)
        if home is None:
            continue
        for dst in dsts:
            other = next((p for p in SUBSYSTEMS if _inside(dst, p)), None)
            if other not in (None, home) and (src, dst) not in ALLOWED_SIDEWAYS:
                offenders.append(f"{src} -> {dst}")
            if _inside(dst, "service.deployments") or dst == "service.app":
                offenders.append(f"{src} -> {dst} (upward)")
    assert not offenders, f"sideways or upward imports: {sorted(offenders)}"


def test_shared_packages_import_no_subsystem() -> None:
    offenders = sorted(
        f"{src} -> {dst}" for src, dsts in _imports().items()
        if any(_inside(src, p) for p in FOUNDATIONS)
        for dst in dsts if any(_inside(dst, p) for p in (*SUBSYSTEMS, "service.deployments", "service.app"))
    )
    assert not offenders, f"a shared package imports a subsystem or a deployment: {offenders}"


def test_parallel_math_depends_on_nothing_else_in_service() -> None:
    """The torch half of the models reads only their torch-free half (service.models)."""
    offenders = sorted(
        f"{src} -> {dst}" for src, dsts in _imports().items() if _inside(src, "service.parallel")
        for dst in dsts if not (_inside(dst, "service.parallel") or _inside(dst, "service.models"))
    )
    assert not offenders, f"service.parallel must stay torch-only: {offenders}"


def test_the_model_descriptions_import_nothing_else_from_service() -> None:
    """service.models is read by processes that load no torch: it imports only itself."""
    offenders = sorted(
        f"{src} -> {dst}" for src, dsts in _imports().items() if _inside(src, "service.models")
        for dst in dsts if not _inside(dst, "service.models")
    )
    assert not offenders, f"service.models must stay torch-free and self-contained: {offenders}"
    assert "service.models.llama" in _imports()["service.parallel.llama"]


def test_the_tunables_import_nothing_from_service() -> None:
    assert not _imports().get("service.config.tunables"), f"service.config.tunables imports {sorted(_imports()['service.config.tunables'])}"


def test_the_rules_see_the_tree() -> None:
    """Guard against a vacuous pass: the walk finds the modules and edges the rules are about."""
    edges = _imports()
    assert "service.deployments.gang_server" in _modules()
    assert "service.gang.gang" in edges["service.deployments.gang_server"]
    assert "service.cluster.placement" in edges["service.gang.lifecycle"]
    assert "service.transport.channel" in edges["service.deployments.gang_server"]
    assert "service.weights.record" in edges["service.deployments.controller"]
    assert "service.contract.gang_status" in edges["service.state.fleet"]  # the status contract, below the state
    assert "service.config.tunables" in edges["service.config.builder_args"]  # the tunables reach the code through AppConfig
    assert "service.metrics.recorders" in edges["service.deployments.gang_server"]


def test_request_dependencies_never_run_in_a_thread_pool() -> None:
    """FastAPI runs a plain `def` dependency (or endpoint) in a thread pool: one thread hop
    per call per request (the profile: bench/NOTES.md). Every route's
    endpoint and dependency must be a coroutine (or an object with an async __call__)."""
    import importlib
    import inspect

    from fastapi.routing import APIRoute

    def is_async(call: object) -> bool:
        return inspect.iscoroutinefunction(call) or inspect.iscoroutinefunction(getattr(call, "__call__", None))

    sync: list[str] = []

    def walk(dependant: object, where: str) -> None:
        call = getattr(dependant, "call", None)
        if call is not None and not is_async(call):
            sync.append(f"{where}: {getattr(call, '__qualname__', call)!r}")
        for sub in getattr(dependant, "dependencies", ()):
            walk(sub, where)

    routes = 0
    modules = [f"service.ingress.routes.{p.stem}" for p in sorted((ROOT / "service" / "ingress" / "routes").glob("*.py"))]
    for module in [*modules, "service.ingress.oip.routes"]:
        router = getattr(importlib.import_module(module), "router", None)
        for route in getattr(router, "routes", ()):
            if isinstance(route, APIRoute):
                routes += 1
                walk(route.dependant, f"{sorted(route.methods)} {route.path}")
    assert routes > 20, f"found only {routes} routes: the walk missed the routers"
    assert not sync, "sync dependencies/endpoints (run in a thread pool per request):\n" + "\n".join(sync)


def test_no_test_module_imports_another() -> None:
    """Shared test code lives in tests/helpers.py, faults.py, reference.py, ... (no `test_`
    prefix): a test module that imports another runs that module's fixtures and globals
    in a different order than pytest would, and cannot be run alone."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.name} -> {n}" for n in names if n.startswith("tests.test_")]
    assert not offenders, f"test modules importing test modules: {offenders}"


def test_error_codes_are_written_only_through_the_registry() -> None:
    """Outside service/contract/errors.py a code is an ErrorCode member (`code=ErrorCode.X`, a
    class's `code = ErrorCode.X`, `"code": ErrorCode.X`), never a string literal or an
    f-string: the registry is the one list of codes, docs/api.md's table is made from it."""
    from tests.helpers import code_sites

    written = [s for s in code_sites(ROOT) if s.literal is not None or s.fstring is not None]
    offenders = sorted(f"{s.path}:{s.line} {s.literal or s.fstring}" for s in written
                       if s.path != "service/contract/errors.py")
    assert not offenders, "error codes written as strings (use service.contract.errors.ErrorCode):\n" + "\n".join(offenders)


def test_the_hop_to_rank_0_has_one_owner() -> None:
    """Only service.transport.link imports the data channel's client, and no ingress module
    but it creates shared-memory tensor refs: the route to rank 0 is chosen in one place."""
    def imported_names(path: Path) -> set[str]:
        return {f"{node.module}.{a.name}" for node in ast.walk(ast.parse(path.read_text(), str(path)))
                if isinstance(node, ast.ImportFrom) and node.module for a in node.names}

    mods = _modules()
    channel_clients = sorted(m for m, path in mods.items()
                             if "service.transport.channel.ChannelClient" in imported_names(path))
    assert channel_clients == ["service.transport.link"], channel_clients
    shm_creators = sorted(m for m, path in mods.items() if _inside(m, "service.ingress") and "shm.create(" in path.read_text())
    assert shm_creators == [], f"ingress modules creating shared-memory refs themselves: {shm_creators}"
    assert "service.transport.link" in _imports()["service.ingress.requests"]


def test_the_code_walk_sees_the_tree(tmp_path: Path) -> None:
    """Guard against a vacuous pass: the walk finds members in the tree, and literals, class
    codes and f-strings wherever they are written (a file of each kind, written here)."""
    from tests.helpers import code_sites

    sites = code_sites(ROOT)
    assert any(s.path == "service/ingress/auth.py" and s.member == "MISSING_TOKEN" for s in sites)
    assert any(s.path == "service/contract/errors.py" and s.raised is None and s.member == "MALFORMED" for s in sites)
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "bad.py").write_text(
        'class Late(Exception):\n    status, code = 429, "quota_exceeded"\n\n\n'
        'def f(state):\n    raise Late("m", code=f"gang_{state}")\n')
    found = code_sites(tmp_path)
    assert any(s.literal == "quota_exceeded" and s.raised is None for s in found), found
    assert any(s.fstring == 'f"gang_{state}"' and s.raised == "Late" for s in found), found

# Who may name each step of a swap (as an attribute, or as the method name of a call by
# name such as a Controller `_ask("record_weights", ...)`); a definition is not a use.
SWAP_STEPS = {
    "swap_weights": {"service/weights/rollout.py"},
    "record_weights": {"service/weights/rollout.py"},
    **{step: {"service/gang/swap.py",  # the Gang's primitive, over every rank (the gang's swap)
              "service/gang/worker.py",  # the rank implementing it
              "service/gang/failpoints.py"}  # the failpoints named after the steps
       for step in ("stage_weights", "commit_weights", "discard_staged")},
}


def _swap_step_uses(root: Path) -> dict[str, set[str]]:
    """step name -> the files under root/service that name it (attribute or string)."""
    uses: dict[str, set[str]] = defaultdict(set)
    for path in (root / "service").rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.attr if isinstance(node, ast.Attribute) else \
                node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
            if name in SWAP_STEPS:
                uses[name].add(rel)
    return uses


def test_only_the_rollout_drives_a_swap() -> None:
    uses = _swap_step_uses(ROOT)
    offenders = sorted(f"{path} names {step}" for step, paths in uses.items()
                       for path in paths - SWAP_STEPS[step])
    assert not offenders, "the weights rollout has one home (service.weights.rollout):\n" + "\n".join(offenders)
    # Not vacuous: the walk sees the rollout drive the swap and the gang stage and commit.
    assert "service/weights/rollout.py" in uses["swap_weights"] & uses["record_weights"], uses
    assert "service/gang/swap.py" in uses["stage_weights"] & uses["commit_weights"], uses


def test_no_module_binds_a_tunable_at_import() -> None:
    """Tunables come from the deployed config (AppConfig.tunables), passed down as objects:
    no module of service/ reads a module-level tunables instance or binds a tunable's value
    at import (`X = Tunables().a.b`, a default read in a module constant)."""
    offenders = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only: a constructor default is a value, not a binding
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            value = getattr(node, "value", None)
            if value is None or not targets:
                continue
            text = ast.unparse(value)
            if "Tunables(" in text or "TUNABLES" in text:
                offenders.append(f"{name}:{node.lineno}: {ast.unparse(node)[:80]}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "TUNABLES":
                offenders.append(f"{name}:{node.lineno}: reads TUNABLES")
            if isinstance(node, ast.ImportFrom) and node.module == "service.config.tunables":
                offenders += [f"{name}:{node.lineno}: imports TUNABLES" for a in node.names if a.name == "TUNABLES"]
    assert not offenders, "tunables bound at import: " + "; ".join(offenders)


def _loaded(module: str, heavy: tuple[str, ...]) -> list[str]:
    """The modules of `heavy` (and their submodules) a fresh interpreter has loaded after
    `import module`."""
    probe = (f"import json, sys; import {module}; "
             f"heavy = {heavy!r}; "
             "print(json.dumps(sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in heavy))))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["service.deployments.ingress", "service.deployments.gang_server",
                                    "service.gang.rank", "service.training.run", "service.training.runner"])
def test_the_processes_without_a_store_load_no_database(module: str) -> None:
    """The ingress, a gang's rank 0 and peers, a job's run actor and its training workers
    (one process each, started ~30 to ~40 times a suite) read no table: SQLAlchemy and the
    state database's code stay out of their module trees (~0.3 s of CPU per process start)."""
    loaded = _loaded(module, ("sqlalchemy", "alembic", "service.state.db", "service.weights.record"))
    assert not loaded, f"importing {module} loads {loaded[:8]}: import service.weights.served, not the record"


@pytest.mark.parametrize("module", ["service.deployments.ingress", "service.deployments.controller",
                                    "service.deployments.job_manager", "service.training.run",
                                    "service.training.worker_group"])
def test_the_light_processes_load_no_torch(module: str) -> None:
    """The Ingress, the Controller, the JobManager and a job's run actor never compute a tensor:
    their processes start without torch (what that saves: bench/NOTES.md). The JobManager's
    one torch step, materializing an `init` version for init_from, imports it when it runs,
    and a run's training workers import the training code when they are first called."""
    heavy = ("torch", "safetensors.torch", "ray.train", "service.parallel", "service.gang",
             "service.sessions.registry", "service.training.runner", "service.training.models",
             "service.training.datasets")
    loaded = _loaded(module, heavy)
    assert not loaded, f"importing {module} loads {loaded[:8]}: keep those imports out of its module tree"
