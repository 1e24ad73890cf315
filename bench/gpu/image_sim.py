"""The GPU machine's image, simulated here: what it has (bench/gpu/image.txt), what tier C must
carry (the wheelhouse's list, derived from pyproject.toml), and the blocker that makes every
other installed distribution unimportable in a process and in every process it starts.

The blocker is bench/gpu/blocker/sitecustomize.py. A process whose PYTHONPATH starts with that
folder and whose environment names a simulation file (GPU_IMAGE_SIM, written by `simulate`
below) refuses to import the modules the file lists, with `ModuleNotFoundError` as on the
machine. Children inherit both variables (subprocess, multiprocessing's spawn, `timeout`, a
shell, Ray's workers), so the whole GPU check runs as it would there:

    python bench/gpu/image_sim.py simulate /tmp/sim.json [--with-wheelhouse]
    PYTHONPATH=bench/gpu/blocker GPU_IMAGE_SIM=/tmp/sim.json GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh

`--with-wheelhouse` also admits what the wheelhouse carries (as if its parts were unpacked):
tier C's imports then work exactly when the derived list is complete.

    python bench/gpu/image_sim.py wheelhouse-list     # name==version, one a line (wheelhouse.sh reads it)

The list is the closure of pyproject.toml's dependencies over the installed distributions'
own requirements (importlib.metadata), markers evaluated for the machine (CPython 3.12 on
Linux x86_64), minus what the image has (whose own requirements are the image's business:
the walk stops there) and minus the checkout itself (walked, since its requirements must be
there too, but never carried); versions pinned by constraints.txt.
Needs `packaging` (on the image and in the project's venv) and the project installed here.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
IMAGE_FILE = HERE / "image.txt"
BLOCKER_DIR = HERE / "blocker"
ENV_VAR = "GPU_IMAGE_SIM"
# The checkout provides these (PYTHONPATH: the root and clients/), never an installation.
CHECKOUT = frozenset({"gangserve", "gangserve-client"})
# The GPU machine's Python, for requirement markers (KINDS.md: Python 3.12.3 on Linux x86_64).
MACHINE_MARKERS = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_python_implementation": "CPython",
    "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64",
}


def normalize(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_distributions(path: Path = IMAGE_FILE) -> frozenset[str]:
    """The distributions the GPU image has (normalized names): image.txt without its comments."""
    names = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return frozenset(normalize(n) for n in names if n)


def _applies(req: Requirement, extras: Iterable[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**MACHINE_MARKERS, "extra": e}) for e in ("", *extras))


def closure(roots: Iterable[str], stop: frozenset[str]) -> tuple[dict[str, set[str]], set[str]]:
    """Every distribution `roots` (requirement strings) need on the machine: name -> the extras
    asked of it, walking the installed distributions' requirements; the walk does not enter
    the names in `stop` (listed, not walked). Second: the needed names not installed here."""
    needed: dict[str, set[str]] = {}
    missing: set[str] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = normalize(req.name)
        extras = {normalize(e) for e in req.extras}
        seen = needed.get(name)
        if seen is not None and extras <= seen:
            continue
        needed.setdefault(name, set()).update(extras)
        if name in stop:
            continue
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            missing.add(name)
            continue
        todo += [r for r in map(Requirement, requires) if _applies(r, needed[name])]
    return needed, missing


def pyproject_dependencies(root: Path = ROOT) -> list[str]:
    """[project].dependencies of pyproject.toml, those that apply on the machine."""
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if _applies(Requirement(d), ())]


def pins(root: Path = ROOT) -> dict[str, str]:
    """constraints.txt's exact pins: name -> version."""
    found = {}
    for line in (root / "constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^]]*\])?==([^\s;#]+)", line.strip())
        if m:
            found[normalize(m.group(1))] = m.group(3)
    return found


def wheelhouse_list(root: Path = ROOT) -> tuple[list[str], set[str]]:
    """What tier C must carry: `name==version` (the pin, else the installed version) for each
    distribution `import service.app` needs that is neither on the image nor the checkout;
    second, those of them not installed here (the simulation cannot check them)."""
    image = image_distributions()
    # The checkout's distributions are walked (their requirements must be there: the client
    # distribution's stamina, orjson ...) but never carried: they come from PYTHONPATH.
    needed, missing = closure(pyproject_dependencies(root), image)
    pinned = pins(root)
    lines = []
    for name in sorted(set(needed) - image - CHECKOUT):
        version = pinned.get(name) or (None if name in missing else metadata.version(name))
        lines.append(f"{name}=={version}" if version else name)
    return lines, missing - image - CHECKOUT


def _module_names(dist: metadata.Distribution) -> Iterator[tuple[str, ...]]:
    """The importable names a distribution installs: (top,) and (top, second) per file."""
    for path in dist.files or ():
        parts = path.parts
        if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith((".dist-info", ".data", ".egg-info")):
            continue
        if len(parts) == 1:  # a top-level module: x.py, x.cpython-312-...so
            if parts[0].endswith((".py", ".so")):
                yield (parts[0].split(".", 1)[0],)
            continue
        yield (parts[0],)
        second = parts[1]
        if second.endswith((".py", ".so")) or "." not in second:
            yield (parts[0], second.split(".", 1)[0])


def blocked_modules(allowed: frozenset[str]) -> list[str]:
    """Module names (top-level, or `top.second` where a top-level folder is shared, as the
    `google` namespace is between protobuf and Google's API clients) that only distributions
    outside `allowed` install here."""
    providers: dict[tuple[str, ...], set[str]] = {}
    for dist in metadata.distributions():
        name = normalize(dist.metadata["Name"] or "")
        for mod in set(_module_names(dist)):
            if all(p.isidentifier() for p in mod):
                providers.setdefault(mod, set()).add(name)
    stdlib = set(sys.stdlib_module_names)
    blocked = []
    for mod, dists in sorted(providers.items()):
        if mod[0] in stdlib or dists & allowed:
            continue
        if len(mod) == 1 or providers[mod[:1]] & allowed:  # a second level only under a shared top
            blocked.append(".".join(mod))
    return blocked


def simulate(out: Path, with_wheelhouse: bool = False) -> dict[str, object]:
    """Write the blocker's simulation file to `out` and return it: the modules to refuse and
    why. The checkout's own packages stay importable (they come from PYTHONPATH there too)."""
    allowed = image_distributions() | CHECKOUT
    carried: list[str] = []
    if with_wheelhouse:
        carried = [line.split("==")[0] for line in wheelhouse_list()[0]]
        allowed |= frozenset(carried)
    blocked = blocked_modules(allowed)
    sim: dict[str, object] = {
        "why": f"not on the GPU machine's image (bench/gpu/image.txt{' nor in the wheelhouse' if carried else ''})",
        "blocked": blocked,
        "carried": carried,
    }
    out.write_text(json.dumps(sim, indent=1))
    return sim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sim = sub.add_parser("simulate", help="write the blocker's simulation file")
    sim.add_argument("out", type=Path)
    sim.add_argument("--with-wheelhouse", action="store_true", help="admit what the wheelhouse carries")
    sub.add_parser("wheelhouse-list", help="print what tier C must carry, name==version a line")
    args = parser.parse_args(argv)
    if args.cmd == "simulate":
        found = simulate(args.out, args.with_wheelhouse)
        print(f"{args.out}: {len(found['blocked'])} modules refused ({found['why']}); "  # type: ignore[arg-type]
              f"use PYTHONPATH={BLOCKER_DIR}:$PYTHONPATH {ENV_VAR}={args.out}")
        return 0
    lines, missing = wheelhouse_list()
    print("\n".join(lines))
    if missing:
        print(f"image_sim: not installed here, so not checked by the simulation: {sorted(missing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
