"""The local cache through which `PackedDataset` reads a build in object storage: each shard is
downloaded on first use, checked against the manifest's size and sha256, and then memory-mapped from
the cache as a local build's shard would be.

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
from pathlib import Path

from prepack.errors import FormatError, InputError
from prepack.format import Manifest, ShardInfo, shard_sha256
from prepack.output import output_errors
from prepack.remote import filesystem, read_output_manifest

__all__ = ["ShardCache"]


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

    def shard(self, info: ShardInfo) -> Path:
        """The cached copy of the shard `info` (its manifest entry), downloaded first if need be.
        Raises FormatError when the object's size or sha256 is not the manifest's."""
        path = self.directory / f"{info.sha256}.arrow"
        if _intact(path, info):
            return path
        with _locked(self.directory / f"{info.sha256}.lock"):
            if _intact(path, info):  # another process downloaded it while this one waited
                return path
            self._download(f"{self.uri}/{info.name}", path, info)
        return path

    def _download(self, uri: str, path: Path, info: ShardInfo) -> None:
        fs, remote = filesystem(uri)
        with output_errors(self.directory, "write into"):
            fd, name = tempfile.mkstemp(dir=self.directory, prefix=f".{info.sha256}.", suffix=".tmp")
        os.close(fd)
        temporary = Path(name)
        try:
            try:
                fs.get_file(remote, name)
            except FileNotFoundError:
                raise FormatError(f"{uri}: missing; the manifest lists it with {info.rows} packs, {info.bytes} bytes.") from None
            except OSError as exc:
                raise InputError(f"{uri}: cannot be read ({exc}).") from None
            size = temporary.stat().st_size
            if size != info.bytes:
                raise FormatError(f"{uri}: {size} bytes, but the manifest says {info.bytes} (truncated or replaced?).")
            if (digest := shard_sha256(temporary)) != info.sha256:
                raise FormatError(f"{uri}: sha256 {digest} does not match the manifest's {info.sha256}.")
            with output_errors(path):
                os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)


def _intact(path: Path, info: ShardInfo) -> bool:
    """Whether `path` holds the shard: of its size (a stat) and its sha256 (a read of the whole file)."""
    try:
        if path.lstat().st_size != info.bytes:
            return False
    except FileNotFoundError:
        return False
    return shard_sha256(path) == info.sha256


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
