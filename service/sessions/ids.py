"""Session ids: how we mint them, and how we tell an id we issued from one we never did.

Its own module (no torch, no registry) because the ingress reads it: the ingress process
imports neither torch nor the KV cache (tests/test_layout.py checks it).

An id we mint is `<owner>-<token><tag>`: `owner` the replica id of the gang that holds the
session (Serve's request router sends the session's calls there, service.gang.router),
`token` 24 random hex digits (what makes the id unguessable), and `tag` 16 hex digits, an
HMAC-SHA256 over `<owner>-<token>` keyed with the app's session-id key. The key is 32
random bytes made once per app name and cluster and kept by the cluster's named detached
actor `SessionKeyKeeper` (`app_key`), so every gang of the app, and every later deployment
of the app under that name on that cluster, can check a tag.

Why: an id whose gang is gone answers 410 `session_lost` only when we can tell we issued it
(the tag checks); any other id, e.g. one a client made up, is 404 `session_not_found`. Ids
minted before tags existed (`<owner>-<24 hex>`, LEGACY) still work while their session
lives; once their gang is gone they carry nothing that proves where they came from, so they
answer 404 `session_not_found` too (after such an upgrade every old gang is gone anyway).

Ids chosen by OIP clients (`sequence_id`) live beside ours in one registry under OIP_PREFIX;
they never name a gang.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError

OIP_PREFIX = "oip:"  # ids chosen by OIP clients (`sequence_id`) live beside ours in one registry
TOKEN_HEX = 24  # 96 random bits
TAG_HEX = 16  # 64 bits of HMAC-SHA256
KEY_BYTES = 32
KEEPER_NAME = "session-id-keys"  # the cluster's SessionKeyKeeper actor
KEEPER_NAMESPACE = "gangserve"
KEEPER_ANSWER_S = 60.0  # the first call starts the actor: a worker process on a busy node takes seconds
_ID = re.compile(rf"(?P<owner>[A-Za-z0-9_]{{1,64}})-(?P<token>[0-9a-f]{{{TOKEN_HEX}}})(?P<tag>[0-9a-f]{{{TAG_HEX}}})")
# Our ids' shape, tagged or LEGACY (no tag): what the request router reads an owner from.
_SHAPE = re.compile(rf"(?P<owner>[A-Za-z0-9_]{{1,64}})-[0-9a-f]{{{TOKEN_HEX}}}(?:[0-9a-f]{{{TAG_HEX}}})?")


@dataclass(frozen=True)
class IssuedId:
    """A session id this app minted (its tag checked): the gang that holds (or held) it."""

    session_id: str
    owner: str


class SessionIds:
    """Mints the session ids of one gang (`owner`: its replica id) and checks any gang's, with
    the app's key (`app_key`; a test may pass any bytes)."""

    def __init__(self, owner: str, key: bytes) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_]{1,64}", owner):
            raise ValueError(f"a session id's owner must be 1-64 letters, digits or '_' (a Serve replica id); "
                             f"got {owner!r}")
        if len(key) < 16:
            raise ValueError(f"the session-id key must have at least 16 bytes; got {len(key)}")
        self.owner = owner
        self._key = key

    def mint(self) -> str:
        """A new id held by this gang."""
        stem = f"{self.owner}-{secrets.token_hex(TOKEN_HEX // 2)}"
        return stem + self._tag(stem)

    def issued(self, session_id: str) -> IssuedId | None:
        """The id's gang when this app minted it (its tag checks), else None (made up, garbled,
        another app's, an OIP client's, or minted before tags existed)."""
        found = _ID.fullmatch(session_id)
        if found is None:
            return None
        stem = f"{found['owner']}-{found['token']}"
        if not hmac.compare_digest(found["tag"], self._tag(stem)):
            return None
        return IssuedId(session_id, found["owner"])

    def _tag(self, stem: str) -> str:
        return hmac.new(self._key, stem.encode(), hashlib.sha256).hexdigest()[:TAG_HEX]


def named_owner(session_id: str) -> str | None:
    """The replica id an id of our shape names (tagged or LEGACY; the tag is not checked: the
    request router only needs where to send the call, and the gang checks the tag), None for
    an OIP client's id (OIP_PREFIX) or any other."""
    found = _SHAPE.fullmatch(session_id)
    return found["owner"] if found else None


@ray.remote(num_cpus=0)
class SessionKeyKeeper:
    """The session-id keys of every app on this cluster: a named detached actor (one per
    cluster, in namespace KEEPER_NAMESPACE), so a key outlives any deployment of its app.
    Its methods run one at a time, so the first gang of an app that asks makes the key and
    every other gets that one."""

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}

    def key_of(self, app_name: str) -> bytes:
        return self._keys.setdefault(app_name, secrets.token_bytes(KEY_BYTES))


def app_key(app_name: str, timeout_s: float = KEEPER_ANSWER_S, keeper_name: str = KEEPER_NAME) -> bytes:
    """The app's session-id key (32 random bytes made by the first gang of the app that asks,
    read by every other) from the cluster's SessionKeyKeeper (named `keeper_name`; a test names
    one of its own), started by the first caller (this process must be connected to Ray) outside
    any placement group, so it outlives the gang that started it. Bounded by `timeout_s`.

    The keeper lives as long as the cluster, like Ray's own key-value store: if its node
    is lost, a new keeper makes new keys, and an id minted before, once its gang is gone,
    answers 404 `session_not_found` instead of 410 `session_lost` (as an id from before tags)."""
    # "DEFAULT": not the caller's placement group. The caller is a gang's Serve replica, placed in
    # the gang's group with child tasks captured: a keeper placed there died with the gang.
    keeper = SessionKeyKeeper.options(  # type: ignore[attr-defined]
        name=keeper_name, namespace=KEEPER_NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy="DEFAULT").remote()
    try:
        key = ray.get(keeper.key_of.remote(app_name), timeout=timeout_s)
    except GetTimeoutError:
        raise RuntimeError(f"the session-id key of app {app_name!r} needs an answer from the cluster's "
                           f"{keeper_name!r} actor (namespace {KEEPER_NAMESPACE!r}); none came within "
                           f"{timeout_s:g}s") from None
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise RuntimeError(f"the session-id key of app {app_name!r} must be {KEY_BYTES} bytes; the "
                           f"{keeper_name!r} actor answered {type(key).__name__} of length {len(key)}")
    return key
