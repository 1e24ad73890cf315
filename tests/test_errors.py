"""The error-code registry (service.contract.errors.ErrorCode): every code the source writes is in it
with the status it is sent with, the retry rule and the gang-state codes agree with it, the
client's copies agree with it, docs/api.md's table is the one it generates, and an error
leaves the HTTP edge with its registered wire string."""
from __future__ import annotations

import importlib
import pickle
import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.contract.errors import (
    RETRYABLE_CODES,
    TABLE_BEGIN,
    TABLE_END,
    ErrorCode,
    GangServeError,
    GangUnavailable,
    InvalidInput,
    error_from_wire,
    error_table_markdown,
    error_to_wire,
    gang_state_code,
    main,
    with_error_table,
)
from tests.conftest import ROOT
from tests.helpers import code_sites

pytestmark = pytest.mark.unit

# Every module that defines a GangServeError subclass (imported so that they all exist).
ERROR_MODULES = ("service.contract.errors", "service.cluster.placement", "service.ingress.jobs_client",
                 "service.state.artifacts", "service.state.db", "service.training.limits",
                 "service.training.status")


def _error_classes() -> dict[str, type[GangServeError]]:
    for module in ERROR_MODULES:
        importlib.import_module(module)
    found: dict[str, type[GangServeError]] = {"GangServeError": GangServeError}
    todo = [GangServeError]
    while todo:
        for sub in todo.pop().__subclasses__():
            found[sub.__name__] = sub
            todo.append(sub)
    return found


def test_codes_are_unique_snake_case_wire_strings_with_a_meaning() -> None:
    # A repeated value would make an alias silently (one member, two names).
    assert len(ErrorCode.__members__) == len(list(ErrorCode)), "two members share a wire string"
    for code in ErrorCode:
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", code), code
        assert code.name == code.value.upper() and isinstance(code, str) and f"{code}" == code.value
        assert len(code.meaning) > 15 and "|" not in code.meaning, code
        assert all(400 <= s < 600 for s in code.statuses), code


def test_every_error_class_is_sent_with_a_status_its_code_registers() -> None:
    classes = _error_classes()
    assert {"OverLimit", "QuotaExceeded", "StateUnavailable", "GangUnschedulable", "JobsUnavailable"} <= set(classes)
    for name, cls in classes.items():
        code = ErrorCode(cls.code)
        assert cls.status in code.statuses, f"{name}: status {cls.status}, but {code} is sent with {code.statuses}"


def test_every_code_the_source_writes_is_registered_with_the_status_it_is_raised_with() -> None:
    classes = _error_classes()
    sites = code_sites(ROOT)
    checked = 0
    for site in sites:
        where = f"{site.path}:{site.line}"
        if site.literal is not None:
            code = ErrorCode(site.literal)  # ValueError: a code missing from the registry
        elif site.member is not None:
            code = ErrorCode[site.member]
        else:
            continue  # a variable or an f-string (the gang's state: see the test below)
        raised = classes.get(site.raised or "")
        if raised is not None:
            assert raised.status in code.statuses, f"{where}: {site.raised} ({raised.status}) with {code}"
            checked += 1
    assert checked > 50, f"only {checked} raise sites found: the walk missed the source"


def test_a_gang_that_is_not_ready_answers_the_code_of_its_state() -> None:
    """Today's wire strings (service.gang.gang writes f"gang_{state}") are the registry's."""
    from service.contract.gang_status import AbsentState, GangState, ObservedState

    for state in GangState:
        if state is not GangState.READY:
            assert gang_state_code(state) == f"gang_{state.value}" and gang_state_code(state).retryable
    assert {s.value: gang_state_code(s) for s in (*AbsentState, *ObservedState)} == {
        "scheduling": "gang_scheduling", "unschedulable": "unschedulable", "unreachable": "gang_unreachable"}
    assert gang_state_code(GangState.READY) == "gang_unavailable"


def test_only_failures_of_the_gang_are_retried() -> None:
    assert "gang_broken" in RETRYABLE_CODES and "collective_timeout" in RETRYABLE_CODES
    for code in RETRYABLE_CODES:
        assert set(code.statuses) <= {503, 504}, code
    # Not the request's own faults, nor waits that cannot help, nor an unexpected failure.
    for code in ("invalid_input", "deadline_exceeded", "deadline_unmeetable", "unschedulable", "overloaded",
                 "gang_error", "quota_exceeded"):
        assert code not in RETRYABLE_CODES, code


def test_the_clients_codes_agree_with_the_registry() -> None:
    """gangserve_client installs alone (no `service`), so it keeps its own strings."""
    from gangserve_client import errors as client_errors

    for (status, code), cls in client_errors._BY_CODE.items():
        assert status in ErrorCode(code).statuses, (status, code, cls.__name__)


def test_the_api_docs_error_table_is_current() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    assert with_error_table(text) == text, "docs/api.md's error table is stale: run `make docs`"
    table = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    for code in ErrorCode:
        assert f"| `{code.value}` |" in table, code


def test_the_table_is_written_between_its_markers_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "api.md"
    doc.write_text(f"# API\nbefore\n{TABLE_BEGIN}\n| stale |\n{TABLE_END}\nafter\n")
    assert main(["--update", str(doc)]) == 0
    written = doc.read_text()
    assert written.startswith("# API\nbefore\n") and written.endswith(f"{TABLE_END}\nafter\n")
    assert "| stale |" not in written and "| 409 | `eval_gate` |" in written
    assert main([]) == 0 and capsys.readouterr().out == error_table_markdown()
    doc.write_text("# API without markers\n")
    with pytest.raises(ValueError, match="no .* section"):
        main(["--update", str(doc)])


def test_an_error_keeps_its_code_across_ray_and_the_data_channel() -> None:
    err = GangUnavailable("a rank died", code=ErrorCode.GANG_BROKEN, retry_after_s=2.0)
    for back in (pickle.loads(pickle.dumps(err)), error_from_wire(error_to_wire(err))):
        assert type(back) is GangUnavailable and back.code is ErrorCode.GANG_BROKEN
        assert (back.status, back.retry_after_s, back.message) == (503, 2.0, "a rank died")
    # A string code from elsewhere becomes the member it names; an unknown one is kept as is.
    assert InvalidInput("x", code="invalid_deadline").code is ErrorCode.INVALID_DEADLINE
    foreign = error_from_wire({"type": "SomethingElse", "message": "m", "code": "not_ours", "status": 502})
    assert (type(foreign), foreign.code, foreign.status) == (GangServeError, "not_ours", 502)


def test_errors_leave_the_http_edge_as_their_wire_strings() -> None:
    from service.ingress.api import install_error_handlers

    app = FastAPI()

    @app.get("/broken")
    async def broken() -> None:
        raise GangUnavailable("a rank died", code=ErrorCode.GANG_BROKEN)

    @app.get("/crash")
    async def crash() -> None:
        raise RuntimeError("secret internals")

    @app.get("/typed")
    async def typed(n: int) -> int:
        return n

    install_error_handlers(app)
    with TestClient(app, raise_server_exceptions=False) as client:
        reply = client.get("/broken")
        assert (reply.status_code, reply.json()["code"], reply.headers["retry-after"]) == (503, "gang_broken", "5")
        assert (reply.status_code, reply.json()) == (503, {"error": "a rank died", "code": "gang_broken"})
        for method, path, status, code in (("GET", "/nowhere", 404, "not_found"),
                                           ("POST", "/broken", 405, "method_not_allowed"),
                                           ("GET", "/typed?n=x", 422, "invalid_request"),
                                           ("GET", "/crash", 500, "internal")):
            reply = client.request(method, path)
            assert (reply.status_code, reply.json()["code"]) == (status, code), (method, path, reply.text)
            assert "secret" not in reply.text


def test_a_deployments_failure_is_named_after_that_deployment() -> None:
    from ray.exceptions import RayActorError, RayError

    from service.ingress.handle_errors import map_handle_error

    for what, gone, unreachable in (("gang server", "gang_restarting", "gang_unreachable"),
                                    ("controller", "controller_restarting", "controller_unreachable")):
        assert map_handle_error(RayActorError(), what=what, method="m").code == gone  # type: ignore[union-attr]
        assert map_handle_error(RayError(), what=what, method="m").code == unreachable  # type: ignore[union-attr]
