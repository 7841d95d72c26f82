"""The local cache through which `PackedDataset` reads a build in object storage: each shard (and for
an index build, each shard of its store) is downloaded on first use, checked against the manifest's
size and sha256, and then memory-mapped from the cache as a local build's shard would be.

`verify` and `inspect` read a build in object storage through a cache too (`build_cache`): the one
given, or a temporary one deleted after the command. Problems name each shard by its URI (`ShardCache.name`,
`Store.shard_where`), never by its cached copy.

A cached shard is named by its sha256 (`CACHE_DIR/<sha256>.arrow`), so builds that share a shard share
its copy, and a new build at the same URI never reads an old build's bytes. Downloads go to a temporary
file renamed into place once checked, under an advisory lock per shard (`flock` on `<sha256>.lock`):
the ranks and DataLoader workers of a node that share a cache directory download each shard once, the
others waiting for it. A cached copy is hashed again whenever a process first opens it; one that no
longer matches (a disk error, a hand edit) is downloaded again. The cache only grows: delete the
directory to reclaim its space.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prepack.errors import InputError
from prepack.format import STORE_MANIFEST_NAME, Manifest, ShardInfo, format_error, shard_sha256
from prepack.output import output_errors
from prepack.remote import filesystem, read_output_manifest
from prepack.store_format import StoreShard
from prepack.store_read import Store, check_build_store, store_location

__all__ = ["ShardCache", "build_cache"]


class ShardCache:
    """The build at `uri` (its manifest read and validated now), its shards fetched into `directory`."""

    def __init__(self, uri: str, directory: str | os.PathLike | None) -> None:
        if directory is None:
            raise InputError(
                f"{uri}: a build in object storage is read through a local cache; pass cache_dir=, a directory "
                "with room for its shards (shared by the ranks and workers of a node)."
            )
        self.uri = uri.rstrip("/")
        self.directory = Path(directory)
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
        path = self.directory / f"{sha256}.arrow"
        if _intact(path, size, sha256):
            return path
        with _locked(self.directory / f"{sha256}.lock"):
            if _intact(path, size, sha256):  # another process downloaded it while this one waited
                return path
            self._download(uri, path, size, sha256)
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
            except OSError as exc:
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
def build_cache(uri: str, directory: str | os.PathLike | None) -> Iterator[ShardCache]:
    """The `ShardCache` of the build at `uri` in `directory`, or, when None, in a temporary directory
    (`TMPDIR`) deleted when the block ends: for a command that reads the build once (verify, inspect)."""
    if directory is not None:
        yield ShardCache(uri, directory)
        return
    with tempfile.TemporaryDirectory(prefix="prepack-cache-") as temporary:
        yield ShardCache(uri, temporary)


@dataclass(frozen=True)
class _CachedStore(Store):
    """A document store in object storage (`location`), its shards read through the cache."""

    cache: ShardCache | None = None

    def shard_file(self, shard: StoreShard) -> Path:
        return self.cache.fetch(f"{self.location}/{shard.name}", shard.bytes, shard.sha256)


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
