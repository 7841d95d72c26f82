"""The local cache through which `PackedDataset` reads a build in object storage: each shard (and for
an index build, each shard of its store) is downloaded on first use, checked against the manifest's
size and sha256, and then memory-mapped from the cache as a local build's shard would be.

`verify` and `inspect` read a build in object storage through a cache too (`build_cache`): the one
given, or a temporary one deleted after the command. `verify` downloads every shard again whatever
the cache holds (`fresh`): it checks what is in object storage now. Problems name each shard by its
URI (`ShardCache.name`, `Store.shard_where`), never by its cached copy.

A cached shard is named by its sha256 (`CACHE_DIR/<sha256>.arrow`), so builds that share a shard share
its copy, and a new build at the same URI never reads an old build's bytes. Downloads go to a temporary
file renamed into place once checked, under an advisory lock per shard (`flock` on `<sha256>.lock`):
the ranks and DataLoader workers of a node that share a cache directory download each shard once, the
others waiting for it. A cached copy is hashed again whenever a process first opens it; one that no
longer matches (a disk error, a hand edit) is downloaded again. Nor is a copy served for an object
that changed since it was downloaded: each open first asks the store for the object's size and version
(S3's ETag, GCS's generation, or whatever fsspec's `info` gives), refuses a missing object or one of
another size as a cold cache would, and downloads it again (its sha256 checked) when the version is
not one recorded for that URI in `<sha256>.sources`. The cache only grows: delete the directory to
reclaim its space.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prepack.errors import InputError
from prepack.formats.common import format_error
from prepack.formats.shards import STORE_MANIFEST_NAME, Manifest, ShardInfo, shard_sha256
from prepack.storage.output import output_errors
from prepack.storage.remote import filesystem, read_output_manifest, storage_errors
from prepack.formats.store import StoreShard
from prepack.sources.store import Store, check_build_store, store_location

__all__ = ["ShardCache", "build_cache", "cache_directory"]


def cache_directory(directory: str | os.PathLike) -> Path:
    """`directory`, named as a cache (`cache_dir`, `--cache-dir`). An empty or blank name is refused
    (InputError): as a path it is the current directory, which would fill with cached files unasked (a
    variable left unset); '.' names that directory on purpose."""
    name = os.fspath(directory)
    if not name.strip():
        raise InputError(f"cache_dir {name!r} is empty: name a directory for the cache ('.' for the current one).")
    return Path(directory)


class ShardCache:
    """The build at `uri` (its manifest read and validated now), its shards fetched into `directory`."""

    def __init__(self, uri: str, directory: str | os.PathLike | None, fresh: bool = False) -> None:
        """`fresh`: download every object again rather than serve a cached copy (`verify`)."""
        if directory is None:
            raise InputError(
                f"{uri}: a build in object storage is read through a local cache; pass cache_dir=, a directory "
                "with room for its shards (shared by the ranks and workers of a node)."
            )
        self.directory = cache_directory(directory)
        filesystem(uri)  # refuses a URI without a bucket by the name it was given
        self.uri = uri.rstrip("/")
        self.fresh = fresh
        self.manifest: Manifest = read_output_manifest(self.uri)
        with output_errors(self.directory, "create"):
            self.directory.mkdir(parents=True, exist_ok=True)

    def name(self, info: ShardInfo) -> str:
        """The URI of the build's shard `info` (its manifest entry): what its problems name it by."""
        return f"{self.uri}/{info.name}"

    def shard(self, info: ShardInfo) -> Path:
        """The cached copy of the build's shard `info` (its manifest entry), downloaded first if need
        be. Raises FormatError when the object's size or sha256 is not the manifest's."""
        return self.fetch(self.name(info), info.bytes, info.sha256)

    def store(self) -> Store:
        """The document store of this index build, its manifest read from object storage (the build
        names it relative to itself) and checked as `open_build_store` does; its shards are fetched
        into the cache as the build's are, when a pack first needs them."""
        location = store_location(self.uri, self.manifest)
        manifest = read_output_manifest(location, STORE_MANIFEST_NAME)
        return check_build_store(_CachedStore(self.directory, manifest, location, self), self.uri, self.manifest)

    def fetch(self, uri: str, size: int, sha256: str) -> Path:
        """The cached copy of the object `uri`, which the manifest says has `size` bytes and `sha256`,
        downloaded first if need be. Raises FormatError naming `uri` (`FormatError.problem`) when it is
        missing or does not match."""
        path, sources = self.directory / f"{sha256}.arrow", self.directory / f"{sha256}.sources"
        version = _version(uri, size)
        if not self.fresh and version in _recorded(sources, uri) and _intact(path, size, sha256):
            return path
        with _locked(self.directory / f"{sha256}.lock"):
            recorded = _recorded(sources, uri)
            # Another process downloaded it while this one waited.
            if not self.fresh and version in recorded and _intact(path, size, sha256):
                return path
            self._download(uri, path, size, sha256)
            _record(sources, uri, sorted({*recorded, version}), self.directory)
        return path

    def _download(self, uri: str, path: Path, size: int, sha256: str) -> None:
        fs, remote = filesystem(uri)
        with output_errors(self.directory, "write into"):
            fd, name = tempfile.mkstemp(dir=self.directory, prefix=f".{sha256}.", suffix=".tmp")
        os.close(fd)
        temporary = Path(name)
        try:
            try:
                fs.get_file(remote, name)
            except FileNotFoundError:
                raise format_error(uri, f"missing; the manifest lists it with {size} bytes.") from None
            except storage_errors() as exc:
                raise InputError(f"{uri}: cannot be read ({exc}).") from None
            found = temporary.stat().st_size
            if found != size:
                raise format_error(uri, f"{found} bytes, but the manifest says {size} (truncated or replaced?).")
            if (digest := shard_sha256(temporary)) != sha256:
                raise format_error(uri, f"sha256 {digest} does not match the manifest's {sha256}.")
            with output_errors(path):
                os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)


@contextmanager
def build_cache(uri: str, directory: str | os.PathLike | None, fresh: bool = False) -> Iterator[ShardCache]:
    """The `ShardCache` of the build at `uri` in `directory`, or, when None, in a temporary directory
    (`TMPDIR`) deleted when the block ends: for a command that reads the build once (verify, inspect).
    `fresh`: every shard downloaded again (`ShardCache`)."""
    if directory is not None:
        yield ShardCache(uri, directory, fresh)
        return
    with tempfile.TemporaryDirectory(prefix="prepack-cache-") as temporary:
        yield ShardCache(uri, temporary, fresh)


@dataclass(frozen=True)
class _CachedStore(Store):
    """A document store in object storage (`location`), its shards read through the cache."""

    cache: ShardCache | None = None

    def shard_file(self, shard: StoreShard) -> Path:
        return self.cache.fetch(f"{self.location}/{shard.name}", shard.bytes, shard.sha256)


def _version(uri: str, size: int) -> str:
    """What the store says of the object `uri` now: its size and version (`fsspec` `info`'s fields
    that change with the bytes), as one string. Raises FormatError naming `uri` when it is missing or
    not of `size` bytes, as a download would."""
    fs, remote = filesystem(uri)
    fs.invalidate_cache(remote)
    try:
        info = fs.info(remote)
    except FileNotFoundError:
        raise format_error(uri, f"missing; the manifest lists it with {size} bytes.") from None
    except storage_errors() as exc:
        raise InputError(f"{uri}: cannot be read ({exc}).") from None
    if info.get("type", "file") != "file":
        raise format_error(uri, f"missing; the manifest lists it with {size} bytes.")
    if info.get("size") != size:
        raise format_error(uri, f"{info.get('size')} bytes, but the manifest says {size} (truncated or replaced?).")
    fields = ("ETag", "etag", "generation", "md5Hash", "crc32c", "VersionId", "LastModified", "mtime", "updated")
    return json.dumps({key: str(info[key]) for key in fields if info.get(key) is not None}, sort_keys=True)


def _recorded(sources: Path, uri: str) -> list[str]:
    """The versions of the object `uri` known to hold a cached copy's bytes (`<sha256>.sources`)."""
    try:
        return json.loads(sources.read_text()).get(uri, [])
    except (FileNotFoundError, ValueError, AttributeError):
        return []  # none recorded, or a damaged record: the object is downloaded again


def _record(sources: Path, uri: str, versions: list[str], directory: Path) -> None:
    """Record `versions` of `uri` in `sources`, replacing it whole (called under the shard's lock)."""
    try:
        known = json.loads(sources.read_text())
        known = known if isinstance(known, dict) else {}
    except (FileNotFoundError, ValueError):
        known = {}
    known[uri] = versions
    with output_errors(directory, "write into"):
        fd, name = tempfile.mkstemp(dir=directory, prefix=f".{sources.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as file:
            json.dump(known, file, sort_keys=True)
        os.replace(name, sources)


def _intact(path: Path, size: int, sha256: str) -> bool:
    """Whether `path` holds the object: of its size (a stat) and its sha256 (a read of the whole file)."""
    try:
        if path.lstat().st_size != size:
            return False
    except FileNotFoundError:
        return False
    return shard_sha256(path) == sha256


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path`, waiting for it. The lock files stay (one per shard): deleting one while another process waits on it would let a third take a second lock."""
    with output_errors(path, "create"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
