"""Which session ids answer 410 `session_lost` and which 404 `session_not_found`, and the
`{}` body of POST /sessions (issue 43).

An id the service issued carries a tag, an HMAC-SHA256 over `<owner>-<token>` keyed with the
app's key in Ray's GCS key-value store (service.sessions.ids). The tags these tests expect
are computed here with `hmac` from that key, never by the code under test. Only an id with a
right tag, naming a gang that is gone, is 410; any other unknown id is 404.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

import httpx
import pytest

from service.contract.errors import NotFound, SessionGone
from service.sessions.ids import OIP_PREFIX, SessionIds, app_key
from service.sessions.registry import Limits, SessionRegistry
from tests.helpers import assert_error

LIMITS = Limits(num_blocks=4, block_size=4, max_sessions=8, max_session_tokens=64, idle_timeout_s=60,
                bytes_per_token=8)
APP = "gangserve"  # the app of `app_url` (tests/conftest.py)


def tag(key: bytes, owner: str, token: str) -> str:
    """The tag of `<owner>-<token>`: the first 16 hex digits of its HMAC-SHA256 under `key`."""
    return hmac.new(key, f"{owner}-{token}".encode(), hashlib.sha256).hexdigest()[:16]


def answer(registry: SessionRegistry, session_id: str) -> str:
    """The error code registry.lookup raises for `session_id` ("live" when it finds it)."""
    try:
        registry.lookup(session_id)
    except (NotFound, SessionGone) as exc:
        return exc.code
    return "live"


@pytest.mark.unit
def test_an_id_is_owner_token_and_the_tag_over_them() -> None:
    key = secrets.token_bytes(32)
    minted = SessionIds("gangA", key).mint()
    owner, body = minted.split("-")
    token, found = body[:24], body[24:]
    assert owner == "gangA" and len(body) == 40 and int(body, 16) >= 0
    assert found == tag(key, owner, token)


@pytest.mark.unit
def test_only_an_issued_id_of_a_gone_gang_is_410() -> None:
    key = secrets.token_bytes(32)
    here = SessionRegistry(LIMITS, owner="gangA", key=key)
    gone = SessionRegistry(LIMITS, owner="gangB", key=key)  # another gang of the app
    theirs = gone.open().id
    assert answer(here, theirs) == "session_lost"
    assert "held by gang 'gangB', which is gone" in str(pytest.raises(SessionGone, here.lookup, theirs).value)
    token = secrets.token_hex(12)
    forged_right = f"gangC-{token}{tag(key, 'gangC', token)}"  # a gang that never existed, right tag
    assert answer(here, forged_right) == "session_lost"
    never = [
        "no-such-session-0000",  # the example: any id with a dash used to be a lost gang's
        "gangB-0123",
        theirs[:-1] + ("0" if theirs[-1] != "0" else "1"),  # its tag changed
        f"gangC-{token}{tag(secrets.token_bytes(32), 'gangC', token)}",  # another app's key
        f"gangB-{secrets.token_hex(12)}",  # the format before tags: nothing shows we issued it
        OIP_PREFIX + "client-chosen-7",
        "",
    ]
    for session_id in never:
        assert answer(here, session_id) == "session_not_found", session_id
    doc = str(pytest.raises(NotFound, here.lookup, "no-such-session-0000").value)
    assert "not an id this app issued" in doc
    mine = here.open().id  # this gang's own: live, then ended (404, not 410)
    assert answer(here, mine) == "live"
    here.close(mine)
    assert answer(here, mine) == "session_not_found"
    assert answer(gone, theirs) == "live"  # the holder itself still finds it


@pytest.mark.unit
def test_ids_refuse_a_bad_owner_or_a_short_key() -> None:
    with pytest.raises(ValueError, match="owner"):
        SessionIds("has-dash", secrets.token_bytes(32))
    with pytest.raises(ValueError, match="at least 16 bytes; got 3"):
        SessionIds("gangA", b"abc")


@pytest.mark.ray
def test_the_service_answers_404_for_ids_it_never_issued_and_410_for_its_lost_gangs(app_url: str) -> None:
    row = {"hidden_states": [[0.0] * 512]}
    doc = assert_error(httpx.post(f"{app_url}/sessions/no-such-session-0000/append", json=row, timeout=30),
                       404, "session_not_found")
    assert "no-such-session-0000" in doc["error"] and "not an id this app issued" in doc["error"]
    opened = httpx.post(f"{app_url}/sessions", timeout=30)
    assert opened.status_code == 201, opened.text
    live = opened.json()["session_id"]
    key = app_key(APP)  # the cluster's keeper answers this process as it answered the gang
    assert len(key) == 32
    owner, rest = live.split("-")
    assert rest[24:] == tag(key, owner, rest[:24])  # the served gang mints with the app's key
    token = secrets.token_hex(12)
    lost = f"gone0gang-{token}{tag(key, 'gone0gang', token)}"  # issued by the app's key, no such gang now
    doc = assert_error(httpx.post(f"{app_url}/sessions/{lost}/append", json=row, timeout=30),
                       410, "session_lost")
    assert "'gone0gang', which is gone" in doc["error"]
    assert_error(httpx.get(f"{app_url}/sessions/{lost[:-1]}{'0' if lost[-1] != '0' else '1'}", timeout=30),
                 404, "session_not_found")
    assert httpx.delete(f"{app_url}/sessions/{live}", timeout=30).status_code == 200


@pytest.mark.ray
def test_post_sessions_with_an_empty_object_opens_a_session_without_prefill(app_url: str) -> None:
    for content in (b"{}", b" { }\n"):
        r = httpx.post(f"{app_url}/sessions", content=content, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 201, r.text
        doc = r.json()
        assert doc["length"] == 0 and r.headers["x-session-length"] == "0"
        assert httpx.delete(f"{app_url}/sessions/{doc['session_id']}", timeout=30).status_code == 200
    doc = assert_error(httpx.post(f"{app_url}/sessions", json=[], timeout=30), 422, "invalid_input")
    assert "found a JSON list" in doc["error"], doc
    doc = assert_error(httpx.post(f"{app_url}/sessions", json={"rows": [[0.0]]}, timeout=30), 422, "invalid_input")
    assert "found an object with the keys ['rows']" in doc["error"], doc
