"""The artifact store's contract (service.state.artifacts), on both backends: the local
directory and a real S3-compatible server on loopback (moto, tests/s3.py) through the
same pyarrow code path production uses. The bucket is checked independently with boto3.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from service.contract.errors import GangServeError
from service.state.artifacts import (
    ArtifactCorrupt,
    ArtifactStore,
    StorageConfigError,
    StorageUnavailable,
    open_store,
    redact,
)
from tests.s3 import ACCESS_KEY, SECRET_KEY, MotoS3

pytestmark = pytest.mark.unit

BUCKET = "gangserve-artifacts"


def _s3_env(server: MotoS3) -> dict[str, str]:
    return {k: v for k, v in server.env("").items() if k != "GANGSERVE_STORAGE_URL"}


@pytest.fixture(scope="module")
def bucket(s3_server: MotoS3) -> str:
    return s3_server.bucket(BUCKET)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ArtifactStore]:
    """A fresh store: the state dir itself, or a fresh prefix of the test bucket."""
    if request.param == "local":
        yield open_store(None, local_state=tmp_path / "state")
        return
    server: MotoS3 = request.getfixturevalue("s3_server")
    request.getfixturevalue("bucket")
    yield open_store(f"s3://{BUCKET}/t-{uuid.uuid4().hex[:8]}", local_state=tmp_path / "state",
                     env=_s3_env(server))


def _object(server: MotoS3, store: ArtifactStore, key: str) -> bytes:
    """The object's bytes as boto3 sees them (independent of pyarrow)."""
    bucket, _, prefix = store.root.partition("/")
    return server.client().get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()


def test_write_is_atomic_and_reads_back(store: ArtifactStore) -> None:
    store.check_reachable()
    assert not store.exists("datasets/a.bin")
    assert store.write_bytes("datasets/a.bin", b"first") == 5
    assert store.read_bytes("datasets/a.bin") == b"first"
    store.write_bytes("datasets/a.bin", b"second version")
    assert store.read_bytes("datasets/a.bin") == b"second version"
    assert store.size("datasets/a.bin") == 14 and store.exists("datasets/a.bin")
    assert b"".join(store.iter_chunks("datasets/a.bin", chunk=4)) == b"second version"
    if store.local:  # no temp file is left next to it
        assert sorted(p.name for p in Path(store.root, "datasets").iterdir()) == ["a.bin"]
    with pytest.raises(FileNotFoundError, match="no artifact 'datasets/none.bin'"):
        store.size("datasets/none.bin")
    with pytest.raises(FileNotFoundError):
        store.iter_chunks("datasets/none.bin")  # raised before the first chunk is asked for


def test_keys_never_leave_the_root(store: ArtifactStore) -> None:
    for bad in ("../x", "/etc/passwd", "a//b", "a/./b", "", "a\\b"):
        with pytest.raises(ValueError):
            store.path(bad)
    if store.local:
        link = Path(store.root, "checkpoints", "escape")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("/etc")
        with pytest.raises(ValueError, match="outside the state dir"):
            store.path("checkpoints/escape/hostname")


def test_put_file_hashes_what_it_wrote(store: ArtifactStore, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    src = tmp_path / "w.bin"
    src.write_bytes(b"x" * 5_000_000)  # more than one chunk
    size, sha = store.put_file("checkpoints/job-1.safetensors", src)
    assert (size, sha) == (5_000_000, hashlib.sha256(src.read_bytes()).hexdigest())
    if not store.local:
        assert _object(request.getfixturevalue("s3_server"), store, "checkpoints/job-1.safetensors") == src.read_bytes()


def test_immutable_copy_keeps_the_first(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "w.safetensors"
    src.write_bytes(b"weights v1")
    key, sha = store.put_immutable("weights", src)
    assert key == f"weights/{sha}.safetensors" and sha == hashlib.sha256(b"weights v1").hexdigest()
    # Same content again: nothing is written over it (the first object stays).
    if store.local:
        mtime = Path(store.path(key)).stat().st_mtime_ns
    assert store.put_immutable("weights", src) == (key, sha)
    if store.local:
        assert Path(store.path(key)).stat().st_mtime_ns == mtime
        assert Path(store.path(key)).stat().st_mode & 0o777 == 0o444
    # A lying sha (the content under that name is different) never replaces the first.
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"something else")
    assert store.put_immutable("weights", other, sha256=sha) == (key, sha)
    assert store.read_bytes(key) == b"weights v1"


def test_materialize_downloads_once_and_verifies(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "w.safetensors"
    src.write_bytes(b"the served weights" * 1000)
    key, sha = store.put_immutable("weights", src)
    first = store.materialize(key)
    assert first.read_bytes() == src.read_bytes()
    if store.local:
        assert first == Path(store.path(key))  # the file itself: no copy
        Path(store.path(key)).chmod(0o644)
        Path(store.path(key)).write_bytes(b"tampered")
        with pytest.raises(ArtifactCorrupt, match="expected"):
            store.materialize(key)
        return
    assert first.parent == store.cache_dir and first.name == f"{sha}.safetensors"
    stamp = first.stat().st_mtime_ns
    time.sleep(0.01)  # by design: a re-download now would show as a newer mtime
    assert store.materialize(key) == first and first.stat().st_mtime_ns == stamp  # not downloaded again
    # A tampered cache file is never served: it is replaced by a fresh, verified download.
    first.write_bytes(b"tampered cache")
    assert store.materialize(key).read_bytes() == src.read_bytes()
    # An object whose bytes do not match its content name is refused.
    store.write_bytes(f"weights/{'0' * 64}.safetensors", b"not what the name says")
    with pytest.raises(ArtifactCorrupt, match="refusing"):
        store.materialize(f"weights/{'0' * 64}.safetensors")
    assert not (store.cache_dir / f"{'0' * 64}.safetensors").exists()


def test_fetch_returns_a_local_file_and_its_sha(store: ArtifactStore, tmp_path: Path) -> None:
    store.write_bytes("checkpoints/job-2.safetensors", b"trained")
    path, sha = store.fetch("checkpoints/job-2.safetensors")
    assert path.read_bytes() == b"trained" and sha == hashlib.sha256(b"trained").hexdigest()
    absolute = tmp_path / "abs.safetensors"
    absolute.write_bytes(b"abs")
    assert store.fetch(str(absolute)) == (absolute, hashlib.sha256(b"abs").hexdigest())
    with pytest.raises(FileNotFoundError):
        store.fetch("checkpoints/none.safetensors")


def test_delete_and_delete_prefix(store: ArtifactStore) -> None:
    store.write_bytes("runs/job-3/result.json", b"{}")
    store.write_bytes("runs/job-3/epoch-000001/model.safetensors", b"12345")
    store.write_bytes("runs/job-33/keep.txt", b"other job")
    store.write_bytes("checkpoints/job-3.safetensors", b"abc")
    assert store.delete("checkpoints/job-3.safetensors") == 3
    assert store.delete("checkpoints/job-3.safetensors") == 0
    assert store.delete_prefix("runs/job-3") == 7
    assert not store.exists("runs/job-3/result.json")
    assert store.read_bytes("runs/job-33/keep.txt") == b"other job"  # a sibling with the same start stays
    assert store.delete_prefix("runs/never") == 0


def test_record_paths_from_before_keys_still_resolve(tmp_path: Path) -> None:
    local = open_store(None, local_state=tmp_path)
    assert local.key_of(str(tmp_path / "datasets" / "ds-1.safetensors")) == "datasets/ds-1.safetensors"
    assert local.key_of("datasets/ds-1.safetensors") == "datasets/ds-1.safetensors"
    with pytest.raises(ValueError):
        local.key_of("/etc/passwd")


# ---- configuration and failures ----------------------------------------------------------------

def test_urls_are_redacted() -> None:
    assert redact("s3://AKIA123:topsecret@bucket/prefix") == "s3://***@bucket/prefix"
    assert "topsecret" not in redact("s3://bucket/p?secret_key=topsecret&region=x")
    assert redact("s3://bucket/p") == "s3://bucket/p"


def test_bad_urls_are_refused_with_what_was_expected(tmp_path: Path) -> None:
    for url, message in (("gs://bucket/x", "unsupported scheme 'gs'"), ("s3:///x", "no bucket"),
                         ("relative/dir", "absolute path"), ("s3://bucket/a/../b", "relative path")):
        with pytest.raises((StorageConfigError, ValueError), match=message):
            open_store(url, local_state=tmp_path)
    with pytest.raises(StorageConfigError, match="must be http"):
        open_store("s3://bucket/x", endpoint="ftp://host", local_state=tmp_path)


def test_missing_bucket_at_start_names_the_redacted_url(s3_server: MotoS3, tmp_path: Path) -> None:
    url = f"s3://{ACCESS_KEY}:{SECRET_KEY}@no-such-bucket-{uuid.uuid4().hex[:6]}/p"
    store = open_store(url, local_state=tmp_path, env=_s3_env(s3_server))
    with pytest.raises(StorageUnavailable) as info:
        store.check_reachable()
    message = info.value.message
    assert "does not exist" in message and "s3://***@no-such-bucket-" in message, message
    assert SECRET_KEY not in message and ACCESS_KEY not in message
    assert (info.value.status, info.value.code) == (503, "storage_unavailable")


def test_unreachable_endpoint_fails_fast_and_maps_to_503(tmp_path: Path) -> None:
    dead = MotoS3()  # a free port nobody listens on
    store = open_store(f"s3://{BUCKET}/p", local_state=tmp_path, env=_s3_env(dead))
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable) as info:
        store.check_reachable()
    assert time.monotonic() - t0 < 30, "a dead endpoint must fail within the bounded retries"
    assert f"s3://{BUCKET}/p (endpoint {dead.endpoint})" in info.value.message
    assert isinstance(info.value, GangServeError) and info.value.status == 503
    assert SECRET_KEY not in info.value.message


def test_store_lost_mid_run_raises_storage_unavailable(tmp_path: Path) -> None:
    """Its own server, stopped after the first write: every operation then answers 503."""
    server = MotoS3().start()
    try:
        server.bucket(BUCKET)
        store = open_store(f"s3://{BUCKET}/p", local_state=tmp_path, env=_s3_env(server))
        store.check_reachable()
        store.write_bytes("datasets/d.bin", b"data")
    finally:
        server.stop()
    for op in (lambda: store.read_bytes("datasets/d.bin"), lambda: store.write_bytes("datasets/e.bin", b"x"),
               lambda: store.exists("datasets/d.bin"), lambda: store.delete_prefix("runs/x"),
               lambda: store.materialize(f"weights/{'1' * 64}.safetensors")):
        with pytest.raises(StorageUnavailable, match=r"artifact store s3://gangserve-artifacts/p .*unavailable"):
            op()


def _launch(config: dict[str, Any], tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "app.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "service.launch", str(path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "GANGSERVE_STATE_DIR": str(tmp_path / "state"), **env})


def test_launcher_exits_nonzero_when_the_bucket_is_unreachable(s3_server: MotoS3, tmp_path: Path) -> None:
    """Checked before Ray is touched: exit 4 with the redacted URL and the reason."""
    config = {"applications": [{"name": "s3", "route_prefix": "/", "import_path": "service.app:build_app",
                                "args": {"world_size": 1}}]}
    env = {**_s3_env(s3_server), "GANGSERVE_STORAGE_URL": f"s3://{ACCESS_KEY}:{SECRET_KEY}@missing-bucket/p"}
    proc = _launch(config, tmp_path, env)
    assert proc.returncode == 4, proc.stderr
    assert "s3://***@missing-bucket/p" in proc.stderr and "does not exist" in proc.stderr, proc.stderr
    assert SECRET_KEY not in proc.stderr + proc.stdout
    dead = MotoS3()
    proc = _launch(config, tmp_path, {**_s3_env(dead), "GANGSERVE_STORAGE_URL": f"s3://{BUCKET}/p"})
    assert proc.returncode == 4, proc.stderr
    assert f"endpoint {dead.endpoint}" in proc.stderr and "unavailable" in proc.stderr, proc.stderr
