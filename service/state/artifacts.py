"""The artifact store: where datasets, training runs and checkpoints, and the served-weights
copies live (`GANGSERVE_STORAGE_URL`).

    unset, a path, or file:///abs/path   the state dir (default) or that directory on the
                                         local file system (on a cluster: a shared volume)
    s3://bucket[/prefix]                 an S3-compatible bucket, through pyarrow.fs; the
                                         endpoint comes from GANGSERVE_S3_ENDPOINT_URL, else
                                         AWS_ENDPOINT_URL (http:// or https://; unset: AWS),
                                         region and credentials the AWS way (AWS_REGION /
                                         AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, ..., ~/.aws)

Layout under the root (the same on both backends): `datasets/<id>.safetensors`,
`runs/<job>/...` (a run's epoch checkpoints and result.json),
`checkpoints/<job>.safetensors`, `weights/<sha256>.safetensors`. Records (SQLite rows)
store *keys*, paths relative to the root with `/` separators, so a record means the same
thing on every node; an absolute local path (the `checkpoint=` builder argument, rows
written before keys existed) is used as the file it names.

Contract of the operations (`ArtifactStore`):
- a write is atomic: readers see the old object or the whole new one, never part (a temp
  file, fsync and rename locally; a single PUT, which S3 makes visible only when complete);
- `weights/<sha256>...` copies are immutable: `put_immutable` never overwrites one;
- `materialize` returns a local file with the given sha256: on S3 a node-local,
  content-addressed cache (`<local state dir>/cache/`) downloads each object once per node
  and re-verifies the cached bytes on every call (a tampered cache file is replaced, an
  object whose bytes do not match its sha is refused), because safetensors' `safe_open`
  needs a local file (each rank then maps only its own slice of it);
- an unreachable, missing or refusing bucket raises `StorageUnavailable` (HTTP 503,
  code `storage_unavailable`, with the reason); every message names the storage URL with
  any credentials redacted. `check_reachable()` is the start-up check (the launcher exits
  non-zero with its message; the deployments fail to start with it).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from service.contract.errors import ErrorCode, GangServeError
from service.state.paths import resolve_inside, state_dir
from service.state.urls import redact
from service.config.tunables import StateTunables

STORAGE_URL_ENV = "GANGSERVE_STORAGE_URL"
# The first one set wins: our own name first, so it can differ from the AWS CLI's.
ENDPOINT_ENVS = ("GANGSERVE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")
LAYOUT = ("datasets", "checkpoints", "runs", "weights")
CACHE_SUBDIR = "cache"

_SHA_NAME = re.compile(r"(?:^|/)([0-9a-f]{64})(?:\.[A-Za-z0-9]+)?$")
_SECRET_ENVS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
log = logging.getLogger("gangserve.artifacts")
T = TypeVar("T")


class StorageUnavailable(GangServeError):
    """The artifact store cannot be reached or refuses us (bucket missing, endpoint down,
    credentials refused). Retryable: the service itself is fine."""

    status, code = 503, ErrorCode.STORAGE_UNAVAILABLE
    retry_after_s = 5.0


class StorageConfigError(ValueError):
    """GANGSERVE_STORAGE_URL (or an endpoint variable) is not something we can use."""


class ArtifactCorrupt(RuntimeError):
    """An object's bytes do not have the sha256 its key or record says."""


def _scrub(text: str, secrets: tuple[str, ...]) -> str:
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def check_key(key: str) -> str:
    """`key` if it is a relative artifact key (`a/b.c`: no empty, `.` or `..` segments, no
    leading `/`, no backslash); ValueError naming the problem otherwise."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"artifact key must be a non-empty relative path, got {key!r}")
    if key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"artifact key {key!r} must be a relative path inside the storage root "
                         "(no leading '/', no '..' or empty segments)")
    return key


def sha_of_key(key: str) -> str | None:
    """The sha256 a content-addressed key names (`weights/<sha256>.safetensors`), else None."""
    match = _SHA_NAME.search(key)
    return match.group(1) if match else None


def file_sha256(path: str | os.PathLike[str], chunk_bytes: int) -> str:
    """The file's sha256, read `chunk_bytes` at a time (the state tunable copy_chunk_bytes).

    A directory (a Hugging Face `save_pretrained` checkpoint: config.json and safetensors
    files) hashes as the sha256 of its regular files' `<relative name> <sha256>` lines, sorted
    by name: any changed, added or removed file changes it."""
    if os.path.isdir(path):
        root = Path(path)
        lines = sorted(f"{f.relative_to(root).as_posix()} {file_sha256(f, chunk_bytes)}\n"
                       for f in root.rglob("*") if f.is_file() and not f.name.startswith("."))
        return hashlib.sha256("".join(lines).encode()).hexdigest()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


class ArtifactStore:
    """One artifact store (a local directory or an S3 bucket/prefix); thread-safe. Other
    processes build their own from the same environment (`store()`). Its chunk size and
    download-lock wait are the state tunables it is built with (S3's waits are in `fs`)."""

    def __init__(self, fs: pafs.FileSystem, root: str, url: str, *, local: bool, cache_dir: Path,
                 secrets: tuple[str, ...] = (), tunables: StateTunables | None = None) -> None:
        self.tunables = tunables or StateTunables()
        self.filesystem = fs
        self.root = root.rstrip("/")  # the file-system path of the root: /abs/dir or bucket/prefix
        self.url = url  # for messages: already redacted
        self.local = local
        self.cache_dir = cache_dir
        self._secrets = secrets

    def __repr__(self) -> str:
        return f"ArtifactStore({self.url})"

    # ---- keys and paths ---------------------------------------------------------------------

    def path(self, key: str) -> str:
        """The file-system path of `key` (ValueError: not a key, or a local one escaping the root)."""
        check_key(key)
        if self.local:
            return str(resolve_inside(Path(self.root), key))  # `..` and symlinks cannot escape
        return f"{self.root}/{key}"

    def key_of(self, recorded: str) -> str:
        """A recorded reference as a key: a key as it is; an absolute path (rows from before
        keys) as its key when it lies inside a local root. ValueError otherwise."""
        if not os.path.isabs(recorded):
            return check_key(recorded)
        if not self.local:
            raise ValueError(f"{recorded!r} is a local path; the artifact store is {self.url}")
        resolved = resolve_inside(Path(self.root), recorded)
        return resolved.relative_to(Path(self.root).resolve()).as_posix()

    # ---- start-up check ---------------------------------------------------------------------

    def check_reachable(self) -> None:
        """StorageUnavailable (naming the URL and why) unless the root can be used now.

        Local: the root directory exists or can be created (with the layout's folders).
        S3: the bucket exists and answers a HEAD of a key under the prefix (so an
        unreachable endpoint, a missing bucket and refused credentials all fail here, at
        start, rather than at the first upload)."""
        if self.local:
            try:
                for sub in LAYOUT:
                    Path(self.root, sub).mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                raise StorageUnavailable(f"artifact store {self.url}: cannot create {self.root}: "
                                         f"{exc.strerror or exc}") from None
            return
        bucket = self.root.split("/", 1)[0]
        info = self._io("check the bucket", bucket, lambda: self.filesystem.get_file_info(bucket))
        if info.type == pafs.FileType.NotFound:
            raise StorageUnavailable(f"artifact store {self.url}: bucket {bucket!r} does not exist "
                                     "(create it, or fix GANGSERVE_STORAGE_URL)")
        probe = f"{self.root}/.gangserve-probe"
        self._io("read the prefix", ".gangserve-probe", lambda: self.filesystem.get_file_info(probe))

    # ---- reads ------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        path = self.path(key)
        info = self._io("look up", key, lambda: self.filesystem.get_file_info(path))
        return info.type == pafs.FileType.File

    def size(self, key: str) -> int:
        """Bytes of `key`; FileNotFoundError naming it if there is none."""
        path = self.path(key)
        info = self._io("look up", key, lambda: self.filesystem.get_file_info(path))
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(f"no artifact {key!r} in {self.url}")
        return int(info.size or 0)

    @contextlib.contextmanager
    def open_input(self, key: str) -> Iterator[pafs.NativeFile]:
        """A binary input stream of `key` (FileNotFoundError if missing)."""
        path = self.path(key)
        stream = self._io("open", key, lambda: self.filesystem.open_input_stream(path))
        try:
            yield stream
        finally:
            stream.close()

    def read_bytes(self, key: str) -> bytes:
        with self.open_input(key) as f:
            return self._io("read", key, f.read)

    def iter_chunks(self, key: str, chunk: int = 1024 * 1024) -> Iterator[bytes]:
        """The bytes of `key` in chunks. The object is opened *before* this returns, so a
        missing key or an unreachable store raises here, not in the middle of a response."""
        path = self.path(key)
        stream = self._io("open", key, lambda: self.filesystem.open_input_stream(path))

        def chunks() -> Iterator[bytes]:
            try:
                while data := self._io("read", key, lambda: stream.read(chunk)):
                    yield data
            finally:
                stream.close()

        return chunks()

    # ---- writes -----------------------------------------------------------------------------

    def write_bytes(self, key: str, data: bytes) -> int:
        """Write `key` atomically; returns its size."""
        return self._write(key, lambda out: out.write(data))

    def put_file(self, key: str, src: str | os.PathLike[str]) -> tuple[int, str]:
        """Copy the local file `src` to `key` atomically, hashing the bytes written;
        returns (size, sha256)."""
        digest = hashlib.sha256()

        def copy(out: object) -> None:
            with open(src, "rb") as fin:
                while chunk := fin.read(self.tunables.copy_chunk_bytes):
                    digest.update(chunk)
                    out.write(chunk)  # type: ignore[attr-defined]

        size = self._write(key, copy)
        return size, digest.hexdigest()

    def put_immutable(self, subdir: str, src: str | os.PathLike[str], sha256: str | None = None,
                      suffix: str = ".safetensors") -> tuple[str, str]:
        """Store the local file `src` as the content-addressed `<subdir>/<sha256><suffix>`;
        returns (key, sha256). An object already there is kept as it is (never overwritten:
        same name, same content). The sha is computed here unless given."""
        sha = sha256 or self._sha256(src)
        key = f"{check_key(subdir)}/{sha}{suffix}"
        if self.exists(key):
            return key, sha
        _, written = self.put_file(key, src)
        if written != sha:  # the file changed under us between hashing and copying
            self.delete(key)
            raise ArtifactCorrupt(f"{src} changed while it was copied to {self.url}/{key}; try again")
        if self.local:
            os.chmod(self.path(key), 0o444)  # read-only: a reminder that nobody rewrites it
        return key, sha

    def delete(self, key: str) -> int:
        """Remove `key` if present; bytes freed (0 when there was none)."""
        path = self.path(key)
        info = self._io("look up", key, lambda: self.filesystem.get_file_info(path))
        if info.type != pafs.FileType.File:
            return 0
        try:
            self._io("delete", key, lambda: self.filesystem.delete_file(path))
        except FileNotFoundError:  # deleted meanwhile by someone else
            return 0
        return int(info.size or 0)

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under `prefix/` (a local directory tree; symlinks are removed,
        never followed); bytes freed."""
        check_key(prefix)
        if self.local:
            return _remove_tree(Path(self.root) / prefix)
        path = f"{self.root}/{prefix}"
        infos = self._io("list", prefix + "/", lambda: self.filesystem.get_file_info(
            pafs.FileSelector(path, allow_not_found=True, recursive=True)))
        freed = 0
        for info in infos:
            if info.type == pafs.FileType.File:
                try:
                    self._io("delete", info.path, lambda p=info.path: self.filesystem.delete_file(p))
                    freed += int(info.size or 0)
                except FileNotFoundError:
                    pass
        return freed

    # ---- local copies -----------------------------------------------------------------------

    def fetch(self, ref: str) -> tuple[Path, str]:
        """A local file holding `ref` and its sha256: an absolute path as it is; a key on
        the local backend as its file; a key on S3 downloaded (hashed on the way) into the
        node's cache. For checking and copying a file whose sha is not known yet."""
        if os.path.isabs(ref):
            return Path(ref), self._sha256(ref)
        if self.local:
            path = Path(self.path(ref))
            if not path.is_file():
                raise FileNotFoundError(f"no artifact {ref!r} in {self.url}")
            return path, self._sha256(path)
        return self._download(ref, expect=None)

    def materialize(self, ref: str, sha256: str | None = None) -> Path:
        """A local file with the bytes of `ref` whose sha256 is `sha256` (default: the sha a
        content-addressed key names). ArtifactCorrupt if the stored bytes differ.

        An absolute path and a local-backend key are that file, verified in place; on S3 the
        node cache holds `<sha256><suffix>`: downloaded once per node (one rank downloads
        while the others on the node wait for it), re-hashed on every call so a changed
        cache file is replaced by a fresh download rather than served."""
        sha = sha256 or (None if os.path.isabs(ref) else sha_of_key(ref))
        if os.path.isabs(ref) or self.local:
            path = Path(ref) if os.path.isabs(ref) else Path(self.path(ref))
            # An absolute directory is a Hugging Face checkpoint (file_sha256 hashes it whole).
            if not (path.is_file() or (os.path.isabs(ref) and path.is_dir())):
                if os.path.isabs(ref):  # the OS's own wording, as opening it would say
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), ref)
                raise FileNotFoundError(f"no artifact {ref!r} in {self.url}")
            if sha is not None:
                actual = self._sha256(path)
                if actual != sha:
                    raise ArtifactCorrupt(f"{path} has sha256 {actual[:16]}..., expected {sha[:16]}...")
            return path
        if sha is None:
            return self._download(ref, expect=None)[0]
        cached = self._cache_path(ref, sha)
        if cached.is_file() and self._sha256(cached) == sha:
            return cached
        with self._cache_lock(sha):
            if cached.is_file():  # another rank may have just downloaded it
                if self._sha256(cached) == sha:
                    return cached
                log.warning("cached %s does not have sha256 %s; downloading it again", cached, sha[:16])
                cached.unlink(missing_ok=True)
            return self._download(ref, expect=sha)[0]

    # ---- internals --------------------------------------------------------------------------

    def _sha256(self, path: str | os.PathLike[str]) -> str:
        return file_sha256(path, self.tunables.copy_chunk_bytes)

    def _cache_path(self, key: str, sha: str) -> Path:
        suffix = Path(key).suffix if re.fullmatch(r"\.[A-Za-z0-9]{1,16}", Path(key).suffix or "") else ""
        return self.cache_dir / f"{sha}{suffix}"

    @contextlib.contextmanager
    def _cache_lock(self, sha: str) -> Iterator[None]:
        """A node-wide lock per object (flock: every process of this node shares the cache)."""
        self.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.cache_dir / f".lock-{sha}", "a+") as handle:
            wait_s = self.tunables.cache_lock_timeout_s
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StorageUnavailable(
                            f"artifact store {self.url}: another process on this node has been downloading "
                            f"{sha[:16]}... for over {wait_s:.0f}s") from None
                    time.sleep(0.1)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _download(self, key: str, expect: str | None) -> tuple[Path, str]:
        """Download `key` into the cache as <sha><suffix> (temp file, fsync, rename)."""
        self.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.cache_dir / f".incoming-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
        digest = hashlib.sha256()
        try:
            with self.open_input(key) as fin, open(tmp, "xb") as fout:
                while chunk := self._io("read", key, lambda: fin.read(self.tunables.copy_chunk_bytes)):
                    digest.update(chunk)
                    fout.write(chunk)
                fout.flush()
                os.fsync(fout.fileno())
            sha = digest.hexdigest()
            if expect is not None and sha != expect:
                raise ArtifactCorrupt(f"{self.url}/{key} has sha256 {sha[:16]}..., expected {expect[:16]}...; "
                                      "refusing to use altered bytes")
            final = self._cache_path(key, sha)
            os.replace(tmp, final)
            log.info("downloaded %s/%s into %s", self.url, key, final)
            return final, sha
        finally:
            tmp.unlink(missing_ok=True)

    def _write(self, key: str, fill: Callable[[object], object]) -> int:
        path = self.path(key)
        if self.local:
            final = Path(path)
            final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")
            try:
                with open(tmp, "xb") as out:
                    fill(out)
                    out.flush()
                    os.fsync(out.fileno())
                size = tmp.stat().st_size
                os.replace(tmp, final)  # atomic: a reader never sees half a file
            finally:
                tmp.unlink(missing_ok=True)
            return size

        def put() -> int:
            # One object, visible only once the stream is closed (S3 commits PUTs whole).
            with self.filesystem.open_output_stream(path) as out:
                fill(out)
            return int(self.filesystem.get_file_info(path).size or 0)

        return self._io("write", key, put)

    def _io(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run one storage call; on S3 an OSError other than not-found becomes
        StorageUnavailable naming the URL, the key and the SDK's reason (secrets scrubbed)."""
        try:
            return fn()
        except FileNotFoundError:
            raise
        except OSError as exc:
            if self.local:
                raise
            reason = _scrub(str(exc), self._secrets)
            raise StorageUnavailable(f"artifact store {self.url} unavailable: could not {what} {key!r}: "
                                     f"{reason}") from None


def _remove_tree(root: Path) -> int:
    """Delete a local directory tree without following symlinks; bytes of regular files freed."""
    if not root.exists() and not root.is_symlink():
        return 0
    if root.is_symlink() or root.is_file():
        size = root.lstat().st_size if root.is_file() and not root.is_symlink() else 0
        root.unlink(missing_ok=True)
        return size
    freed = 0
    for dirpath, dirnames, filenames in os.walk(root, topdown=False, followlinks=False):
        for name in filenames:
            p = Path(dirpath, name)
            try:
                if not p.is_symlink():
                    freed += p.stat().st_size
                p.unlink()
            except OSError:
                pass
        for name in dirnames:
            p = Path(dirpath, name)
            try:
                p.unlink() if p.is_symlink() else p.rmdir()
            except OSError:
                pass
    try:
        root.rmdir()
    except OSError:
        pass
    return freed


# ---- construction -----------------------------------------------------------------------------

def open_store(url: str | None, *, endpoint: str | None = None, local_state: Path | None = None,
               env: dict[str, str] | None = None, tunables: StateTunables | None = None) -> ArtifactStore:
    """The store `url` names (None/"": the state dir). `endpoint` overrides the endpoint
    variables; `env` (default os.environ) is where region/credential hints are read;
    `tunables`: its S3 waits, chunk size and lock wait (default: the state tunables' defaults).
    StorageConfigError for a URL we cannot use; nothing is contacted here."""
    env = dict(os.environ if env is None else env)
    t = tunables or StateTunables()
    local_state = local_state or state_dir()
    cache = local_state / CACHE_SUBDIR
    if not url:
        return ArtifactStore(pafs.LocalFileSystem(), str(local_state), str(local_state), local=True, cache_dir=cache, tunables=t)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise StorageConfigError(f"{STORAGE_URL_ENV} is not a URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme in ("", "file"):
        raw = parts.path if scheme == "file" else url
        if not os.path.isabs(os.path.expanduser(raw)):
            raise StorageConfigError(f"{STORAGE_URL_ENV}={redact(url)}: a local store needs an absolute path")
        root = Path(os.path.expanduser(raw)).resolve()
        return ArtifactStore(pafs.LocalFileSystem(), str(root), str(root), local=True, cache_dir=cache, tunables=t)
    if scheme != "s3":
        raise StorageConfigError(
            f"{STORAGE_URL_ENV}={redact(url)}: unsupported scheme {scheme!r}; use s3://bucket[/prefix] "
            "(any S3-compatible service) or an absolute local path")
    if not parts.hostname:
        raise StorageConfigError(f"{STORAGE_URL_ENV}={redact(url)}: no bucket (expected s3://bucket[/prefix])")
    bucket = parts.hostname
    prefix = parts.path.strip("/")
    if prefix:
        check_key(prefix)
    access_key = parts.username or None
    secret_key = parts.password or None
    endpoint = endpoint or next((env[e] for e in ENDPOINT_ENVS if env.get(e)), None)
    options: dict[str, object] = {
        "connect_timeout": t.s3_connect_timeout_s,
        "request_timeout": t.s3_request_timeout_s,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=t.s3_max_attempts),
    }
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    shown_endpoint = None
    if endpoint:
        ep = urlsplit(endpoint)
        if ep.scheme not in ("http", "https") or not ep.hostname:
            raise StorageConfigError(f"S3 endpoint {redact(endpoint)} must be http://host[:port] or https://host[:port]")
        options["scheme"] = ep.scheme
        options["endpoint_override"] = ep.netloc.rsplit("@", 1)[-1]
        shown_endpoint = redact(endpoint)
    if access_key:
        options["access_key"], options["secret_key"] = access_key, secret_key
    try:
        fs = pafs.S3FileSystem(**options)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad options
        raise StorageConfigError(f"{STORAGE_URL_ENV}={redact(url)}: {type(exc).__name__}: {exc}") from None
    shown = redact(url) + (f" (endpoint {shown_endpoint})" if shown_endpoint else "")
    secrets = tuple(s for s in (secret_key, access_key, *(env.get(e) for e in _SECRET_ENVS)) if s)
    return ArtifactStore(fs, f"{bucket}/{prefix}" if prefix else bucket, shown, local=False,
                         cache_dir=cache, secrets=secrets, tunables=t)


_stores: dict[tuple[object, ...], ArtifactStore] = {}
_stores_lock = threading.Lock()


def store(tunables: StateTunables | None = None) -> ArtifactStore:
    """This process's artifact store, from the environment and the state `tunables` (default:
    their defaults); one per distinct setting."""
    env = os.environ
    t = tunables or StateTunables()
    url = env.get(STORAGE_URL_ENV, "")
    key = (url, *(env.get(e, "") for e in ENDPOINT_ENVS), str(state_dir()), t)
    with _stores_lock:
        found = _stores.get(key)
        if found is None:
            found = _stores[key] = open_store(url or None, tunables=t)
        return found


def check_reachable(tunables: StateTunables | None = None) -> ArtifactStore:
    """The start-up check of this process's store (see ArtifactStore.check_reachable);
    StorageConfigError / StorageUnavailable with the redacted URL when it is not usable."""
    found = store(tunables)
    found.check_reachable()
    return found
