"""The documentation against the code it describes, without a cluster (a few seconds).

- docs/api.md's routes (every `METHOD /path` it names) against the ingress app's own
  OpenAPI description: every operation documented, nothing documented that does not exist;
- docs/api.md's auth table against the auth middleware (service/ingress/auth.py): each row's
  routes need exactly the token the row says, and every route of the app has a row;
- every relative link in README.md and docs/*.md resolves to a file, and its `#anchor` to a
  heading (GitHub's anchors) or an `<a id>` of that file; the docs/, README and bench/NOTES
  references in the code's comments and docstrings name files and headings that exist;
- user pages (README.md, docs/*.md but benchmarks.md) carry no project history (issue
  numbers, commit ids, "before:" figures, load averages), and the failure table's rows stay
  short;
- the image works as the README shows it: the CPU recipe serves a config that binds every
  interface, and the image has a HEALTHCHECK on /readyz.
"""
from __future__ import annotations

import re
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from fastapi import FastAPI
from starlette.routing import Mount, Route

from tests.conftest import ROOT
from tests.helpers import dockerfile

pytestmark = pytest.mark.unit

DOCS = ROOT / "docs"
README = ROOT / "README.md"
API_MD = DOCS / "api.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# Pages that keep measurements with their dates and history: the benchmarks, and the notes.
HISTORY_PAGES = {DOCS / "benchmarks.md", ROOT / "bench" / "NOTES.md"}
USER_PAGES = [p for p in PAGES if p not in HISTORY_PAGES]
HTTP_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
API_TOKEN = "docs-test-api-token"
INFER_TOKEN = "docs-test-infer-token"


# ---- markdown ---------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
CODE_SPAN = re.compile(r"`([^`]+)`")


def prose_lines(page: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of `page` outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text: the rendered text lower-cased, every character
    but letters, digits, '_', '-' and spaces dropped, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every `#fragment` a link into `page` may use: its headings' anchors (a repeated heading
    gets -1, -2, ... as on GitHub) and its `<a id="...">` / `<a name="...">` targets."""
    seen: Counter[str] = Counter()
    found: set[str] = set()
    for _, line in prose_lines(page):
        found.update(HTML_ANCHOR.findall(line))
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = github_anchor(heading.group(1))
            found.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


@dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: ({self.target})"


def relative_links(page: Path) -> Iterator[Link]:
    """The links of `page` to files of this repository (no scheme, not mailto)."""
    for number, line in prose_lines(page):
        for match in LINK.finditer(CODE_SPAN.sub("code", line)):
            target = match.group("target")
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                yield Link(page, number, target)


def link_problem(link: Link) -> str | None:
    """None when `link` resolves to a file (and its anchor to a heading there), else what is wrong."""
    path, _, fragment = link.target.partition("#")
    file = (link.page.parent / path).resolve() if path else link.page
    if not file.exists():
        return f"{link}: needs the file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}, which does not exist"
    if fragment:
        if file.suffix != ".md":
            return f"{link}: an anchor into {file.name}, which is not a markdown page"
        if fragment not in anchors(file):
            near = sorted(a for a in anchors(file) if a.split("-")[0] == fragment.split("-")[0])[:5]
            return f"{link}: needs the heading #{fragment} in {file.relative_to(ROOT)}; found none (similar: {near})"
    return None


# ---- the app ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def app() -> Iterator[FastAPI]:
    """The ingress's real FastAPI app (deployments/local.yaml's arguments, no gang, no
    cluster), built with both tokens set so the middleware checks both."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GANGSERVE_API_TOKEN", API_TOKEN)
        mp.setenv("GANGSERVE_INFER_TOKEN", INFER_TOKEN)
        from harness.local import local_yaml_args
        from service.config.builder_args import AppConfig
        from service.ingress.api import create_api

        yield create_api(AppConfig.model_validate(local_yaml_args()), gang=None)  # type: ignore[arg-type]


def template(path: str) -> str:
    """A route path with every `{parameter}` written `{}`, and no trailing '/' but the root's."""
    return re.sub(r"\{[^}/]*\}", "{}", path).rstrip("/") or "/"


def openapi_operations(app: FastAPI) -> set[tuple[str, str]]:
    """(METHOD, template) of every operation in the app's OpenAPI description."""
    return {(method.upper(), template(path)) for path, ops in app.openapi()["paths"].items()
            for method in ops if method.upper() in HTTP_METHODS}


def unlisted_routes(app: FastAPI) -> set[tuple[str, str]]:
    """(GET, path) of what the app serves outside OpenAPI: /docs, /redoc, /openapi.json and
    the static mounts (the status page)."""
    found: set[tuple[str, str]] = set()
    for route in app.routes:
        if isinstance(route, Mount) and not route.path.startswith("/static"):
            found.add(("GET", template(route.path)))
        elif isinstance(route, Route) and not route.include_in_schema and "oauth2" not in route.path:
            found.add(("GET", template(route.path)))
    return found


def documented_operations(page: Path) -> dict[tuple[str, str], int]:
    """(METHOD, template) -> first line, for every code span `METHOD /path` in `page`'s prose."""
    found: dict[tuple[str, str], int] = {}
    for number, line in prose_lines(page):
        for span in CODE_SPAN.findall(line):
            match = re.fullmatch(rf"({'|'.join(HTTP_METHODS)}) (/\S*)", span.strip())
            if match:
                found.setdefault((match.group(1), template(match.group(2))), number)
    return found


def test_api_md_names_exactly_the_apps_routes(app: FastAPI) -> None:
    served = openapi_operations(app)
    documented = documented_operations(API_MD)
    missing = sorted(served - documented.keys())
    assert not missing, f"docs/api.md must name every route the app serves as `METHOD /path`; missing: {missing}"
    unknown = sorted(f"{m} {p} (line {n})" for (m, p), n in documented.items()
                     if (m, p) not in served | unlisted_routes(app))
    assert not unknown, f"docs/api.md names routes the app does not serve: {unknown}"


# ---- the auth table ---------------------------------------------------------------------------

@dataclass(frozen=True)
class AuthRow:
    line: int
    routes: tuple[str, ...]  # paths as written: /train, /train/..., /sessions/{id}
    needs: str | None  # "api", "infer" or None

    def covers(self, path: str) -> bool:
        return any(route_matches(route, path) for route in self.routes)


def route_matches(documented: str, path: str) -> bool:
    """Whether the auth table's `documented` route (`{x}` one segment, a trailing `/...` any
    rest) names the app's `path` (a template: `{}` one segment)."""
    pattern = re.escape(template(documented.removesuffix("/...")))
    pattern = pattern.replace(re.escape("{}"), r"[^/]+")
    rest = r"(/.*)?" if documented.endswith("/...") else ""
    return re.fullmatch(pattern + rest, path.replace("{}", "x")) is not None


def auth_table(page: Path) -> list[AuthRow]:
    """The rows of the table under `### Auth` in `page` (columns: route | token needed)."""
    rows: list[AuthRow] = []
    in_section = False
    for number, line in prose_lines(page):
        if line.startswith("#"):
            in_section = line.strip() == "### Auth"
            continue
        if not in_section or not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "route":
            continue
        assert len(cells) == 2, f"{page.name}:{number}: the auth table has two columns, found {cells}"
        routes = []
        for span in CODE_SPAN.findall(cells[0]):
            words = span.split()
            if words and words[-1].startswith("/"):
                routes.append(words[-1])
        needed = cells[1].lower()
        needs = "api" if needed.startswith("api token") else "infer" if "inference token" in needed else None
        assert needs or needed.startswith("none"), f"{page.name}:{number}: say 'API token', 'none; the inference token ...' or 'none'"
        assert routes, f"{page.name}:{number}: no route in {cells[0]!r}"
        rows.append(AuthRow(number, tuple(routes), needs))
    assert rows, f"{page.name} has no auth table under '### Auth'"
    return rows


def example_path(route: str) -> str:
    """A concrete request path for an auth table route (`{x}` and `...` filled in)."""
    return re.sub(r"\{[^}/]*\}", "x-1", route.replace("/...", "/x-1/y"))


def middleware_needs(path: str) -> str | None:
    """What `AuthMiddleware` asks of a request to `path`: "api", "infer" or None."""
    from service.ingress.auth import AuthMiddleware

    check = AuthMiddleware(app=None, api_token=API_TOKEN, infer_token=INFER_TOKEN).check  # type: ignore[arg-type]
    if check(path, None) is None:
        return None
    return "infer" if check(path, f"Bearer {INFER_TOKEN}") is None else "api"


def test_the_auth_table_says_what_the_middleware_does() -> None:
    wrong = []
    for row in auth_table(API_MD):
        for route in row.routes:
            found = middleware_needs(example_path(route))
            if found != row.needs:
                wrong.append(f"line {row.line}: {route} needs {found or 'no token'}; the table says {row.needs or 'none'}")
    assert not wrong, "docs/api.md's auth table against service/ingress/auth.py:\n" + "\n".join(wrong)


def test_every_route_of_the_app_has_an_auth_row(app: FastAPI) -> None:
    rows = auth_table(API_MD)
    problems = []
    for method, path in sorted(openapi_operations(app) | unlisted_routes(app)):
        covering = [row for row in rows if row.covers(path)]
        if not covering:
            problems.append(f"{method} {path}: no row of docs/api.md's auth table names it")
        elif {row.needs for row in covering} != {middleware_needs(example_path(path.replace('{}', '{x}')))}:
            problems.append(f"{method} {path}: rows {[r.line for r in covering]} say {[r.needs for r in covering]}")
    assert not problems, "\n".join(problems)


# ---- links ------------------------------------------------------------------------------------

def test_github_anchor_matches_githubs_rules() -> None:
    assert github_anchor("Sessions (issue 31): `python bench/run.py --only sessions` (2026-12-02)") == (
        "sessions-issue-31-python-benchrunpy---only-sessions-2026-12-02")
    assert github_anchor("Status page (/ui)") == "status-page-ui"
    assert github_anchor("The GPU path: NCCL, and the GPU check") == "the-gpu-path-nccl-and-the-gpu-check"
    assert github_anchor("Fast rebuild: the warm spare") == "fast-rebuild-the-warm-spare"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    problems = [p for link in relative_links(page) if (p := link_problem(link))]
    assert not problems, "\n".join(problems)


CODE_REFERENCE = re.compile(r"(?<![\w/.-])((?:docs/[\w.-]+\.md|README\.md|bench/NOTES\.md)(?:#[\w-]+)?)")
CODE_FILES = ["Dockerfile", "Makefile", "service/**/*.py", "deployments/*.yaml", "harness/*.py", "bench/*.py", "bench/*.sh"]


def test_the_codes_references_to_the_docs_resolve() -> None:
    """A comment or docstring that sends the reader to `docs/x.md#heading` (or README.md,
    bench/NOTES.md) names a file and heading that exist."""
    problems = []
    for pattern in CODE_FILES:
        for file in sorted(ROOT.glob(pattern)):
            for number, line in enumerate(file.read_text().splitlines(), start=1):
                for target in CODE_REFERENCE.findall(line):
                    problem = link_problem(Link(ROOT / "README.md", number, target))
                    if problem:
                        problems.append(f"{file.relative_to(ROOT)}:{number}: {problem.split(': ', 1)[1]}")
    assert not problems, "\n".join(problems)


# ---- user pages say what is true now ----------------------------------------------------------

HISTORY = {
    "an issue number": re.compile(r"\bissues? #?\d+", re.I),
    "a commit id": re.compile(r"\bcommit [0-9a-f]{7,40}\b"),
    "a 'before:' figure": re.compile(r"\bbefore:|\bprevious session\b", re.I),
    "a load average": re.compile(r"\bload average", re.I),
}


@pytest.mark.parametrize("page", USER_PAGES, ids=[str(p.relative_to(ROOT)) for p in USER_PAGES])
def test_user_pages_carry_no_history(page: Path) -> None:
    """Measurements with their dates and history belong in docs/benchmarks.md and bench/NOTES.md."""
    found = [f"{page.relative_to(ROOT)}:{n}: {what}: {m.group(0)!r}" for n, line in prose_lines(page)
             for what, pattern in HISTORY.items() for m in pattern.finditer(line)]
    assert not found, "\n".join(found)


MAX_FAILURE_CELL_WORDS = 45


def test_the_failure_table_says_symptom_cause_action_briefly() -> None:
    page = DOCS / "operations.md"
    lines = list(prose_lines(page))
    start = next(i for i, (_, line) in enumerate(lines) if line.strip() == "## When things go wrong")
    table = []
    for number, line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            table.append((number, [c.strip() for c in line.strip().strip("|").split("|")]))
        elif table:
            break
    header = [c.lower() for c in table[0][1]]
    assert header[:3] == ["symptom", "cause", "action"], header
    long = [f"line {n}: {len(c.split())} words: {c[:60]}..." for n, cells in table[2:] for c in cells
            if len(c.split()) > MAX_FAILURE_CELL_WORDS]
    assert not long, f"each cell at most {MAX_FAILURE_CELL_WORDS} words (a line or two):\n" + "\n".join(long)


# ---- the image works as the README shows ------------------------------------------------------

def cpu_build_configs() -> set[str]:
    """The CONFIG build argument of every CPU build (one with TORCH_INDEX) the README and the
    Dockerfile's header show."""
    text = README.read_text() + "\n" + (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n#?", " ", text)  # continuation lines joined (in the Dockerfile's comments too)
    configs = set()
    for command in re.findall(r"docker build[^\n#]*", text):
        words = shlex.split(command)
        args = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--build-arg")
        if "TORCH_INDEX" in args:
            configs.add(args.get("CONFIG", ""))
    return configs


def test_the_cpu_image_serves_a_config_that_answers_from_outside() -> None:
    configs = cpu_build_configs()
    assert configs, "the README and the Dockerfile show a CPU build (--build-arg TORCH_INDEX=...)"
    for config in configs:
        assert config and (ROOT / config).is_file(), f"the CPU build's CONFIG={config!r} must be a file of the repository"
        doc = yaml.safe_load((ROOT / config).read_text())
        assert doc["http_options"]["host"] == "0.0.0.0", (
            f"{config} binds {doc['http_options']['host']}: `docker run -p 8000:8000` needs 0.0.0.0")
        local = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
        assert doc["applications"] == local["applications"], f"{config} serves local.yaml's app"


def test_the_image_has_a_healthcheck_on_readyz() -> None:
    (check,) = [args for ins, args in dockerfile() if ins == "HEALTHCHECK"]
    assert "/readyz" in check and "127.0.0.1:8000" in check, check
    start = re.search(r"--start-period=(\d+)s", check)
    assert start and int(start.group(1)) >= 120, f"a start period that covers a gang's bring-up (>= 120 s): {check}"


def test_the_podmonitor_the_docs_recommend_can_reach_the_metrics_port() -> None:
    """docs/operations.md tells KubeRay users to scrape the Ray pods' `metrics` port (8080) with
    a PodMonitor: kuberay.yaml's NetworkPolicy must admit that port from some namespace."""
    assert "PodMonitor" in (DOCS / "operations.md").read_text()
    docs = [d for d in yaml.safe_load_all((ROOT / "deployments" / "kuberay.yaml").read_text()) if d]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    admits = [rule for rule in policy["spec"]["ingress"]
              if any(p.get("port") == 8080 for p in rule.get("ports", [])) and rule.get("from")]
    assert admits, "the NetworkPolicy admits no one to port 8080, so the PodMonitor docs/operations.md recommends would see nothing"


FIRST_SCREEN_LINES = 30


def test_the_readmes_first_screen_links_the_concepts_page_and_it_draws_the_path() -> None:
    first_screen = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN_LINES])
    assert "(docs/concepts.md)" in first_screen, f"README's first {FIRST_SCREEN_LINES} lines must link docs/concepts.md"
    concepts = (DOCS / "concepts.md").read_text()
    assert "```mermaid" in concepts, "docs/concepts.md draws one request's path as a Mermaid diagram"
    for name in ("Ingress", "GangServer", "gang", "rank 0", "Controller", "JobManager", "HAProxy"):
        assert f"**{name}" in concepts, f"docs/concepts.md introduces {name} (as a bold term of its table)"
