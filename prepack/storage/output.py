"""The output directory of a build: it appears whole, in one rename, or not at all; two builds never
race for it; and nothing prepack did not write is ever replaced or deleted.

Everything a build to `out` touches lies beside `out`, in its parent directory:

- `.NAME.lock`: an advisory lock (`flock`) held for the whole build. A second build to the same
  `out` fails at once instead of racing the first.
- `.NAME.tmp-XXXXXXXX`: the build's staging directory, holding prepack's mark `.prepack-staging`, the
  shards (`build/`) and the scratch files (`scratch/`). A killed build leaves it behind; the next build
  to `out` deletes it, under the lock, so never one whose build still runs.
- Publishing renames `build/` to `out` without replacing anything that appeared there meanwhile; with
  `overwrite` it first checks that what is at `out` is still the build found at the start, then
  exchanges the two in one rename, and deletes the replaced build by the file names its manifest gives.

An output written a file at a time that a stopped run may go on with (reference log-probabilities,
`resumable_staging`) is staged the same way, but a stopped run's staging directory is kept, not deleted, when
it holds something, and the next run to `out` takes it up.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, TypeVar

from prepack.errors import FormatError, OutputError
from prepack.formats.common import read_manifest_bytes
from prepack.formats.shards import MANIFEST_NAME, OUTPUT_KINDS, Manifest, read_manifest, shard_name
from prepack.formats.store import StoreManifest, read_store_manifest, store_shard_name

__all__ = [
    "STAGING_MARK",
    "Staging",
    "check_replaceable",
    "is_staging",
    "output_errors",
    "output_lock",
    "output_file",
    "replaceable_build",
    "resumable_staging",
    "staged_append",
    "staged_directory",
]

# A file in every staging directory: what tells a killed build's staging directory from a user's
# directory that happens to have the same name.
STAGING_MARK = ".prepack-staging"


@contextmanager
def output_errors(path: Path, doing: str = "write") -> Iterator[None]:
    """Report an OSError raised inside (a full disk, a file-size limit, a permission, a parent that is
    not a directory) as an OutputError naming `path`."""
    try:
        yield
    except OSError as exc:
        raise OutputError(f"cannot {doing} {path}: {exc.strerror or exc}.") from exc


@contextmanager
def output_file(path: Path, mode: str = "wb") -> Iterator[BinaryIO]:
    """`open(path, mode)`, with an OSError from opening or closing it (which writes what is still
    buffered) reported as `output_errors` does. Errors of the writes themselves are the caller's."""
    with output_errors(path):
        file = open(path, mode)
    try:
        yield file
    finally:
        with output_errors(path):
            file.close()


def replaceable_build(directory: str | os.PathLike, kind: str = MANIFEST_NAME) -> Manifest | StoreManifest | None:
    """The manifest of `directory` when it is a prepack output of `kind` (MANIFEST_NAME: a build,
    STORE_MANIFEST_NAME: a document store) that prepack may replace or delete (None when it is an
    empty directory), else an OutputError saying what is there that prepack did not write.

    An output is a manifest that `read_manifest` (or `read_store_manifest`) accepts, the shards it
    names under the names the format gives them, and nothing else: no other file, directory or
    symbolic link. Shards may be missing. A build never replaces a store, nor a store a build.
    """
    return _replaceable(Path(directory), kind).manifest


class _Replaceable(NamedTuple):
    """`replaceable_build`'s manifest, with the bytes of the manifest file it was read from (None: an empty directory)."""

    manifest: Manifest | StoreManifest | None
    data: bytes | None


def _replaceable(directory: Path, kind: str, held: _Replaceable | None = None) -> _Replaceable:
    """`replaceable_build`, with the manifest file's bytes. The file is always read, and its manifest not parsed
    again where `held`, a reading of `directory` before, found the same bytes; the directory's entries are always
    read and checked against the manifest (`check_replaceable`)."""
    refusal = f"{directory} is not a prepack {OUTPUT_KINDS[kind]}, so prepack will not replace or delete it"
    if directory.is_symlink() or not directory.is_dir():
        raise OutputError(f"{refusal}: it is not a directory.")
    with output_errors(directory, "read"), os.scandir(directory) as entries:
        regular_files = {entry.name: entry.is_file(follow_symlinks=False) for entry in entries}
    if not regular_files:
        return _Replaceable(None, None)
    read = read_manifest if kind == MANIFEST_NAME else read_store_manifest
    data = None
    try:
        try:
            data = read_manifest_bytes(directory / kind)
        except FileNotFoundError:
            pass  # refused by `read` as it refuses a missing manifest (or one of the other kind)
        if data is None:
            manifest = read(directory)
        elif held is not None and data == held.data:
            manifest = held.manifest
        else:
            manifest = read(data, str(directory / kind))
    except FormatError as exc:
        raise OutputError(f"{refusal}: {exc}") from None
    check_replaceable(manifest, kind, regular_files, refusal)
    return _Replaceable(manifest, data)


def check_replaceable(manifest: Manifest | StoreManifest, kind: str, entries: dict[str, bool], refusal: str) -> None:
    """Refuse (OutputError, starting with `refusal`) an output whose manifest names shards under names
    the format does not give them, or whose `entries` (name: whether it is a regular file) hold anything
    but the manifest and its shards. `replaceable_build`'s rule, shared with object storage's
    (`prepack.storage.remote`), where the entries are the objects under a prefix."""
    name_of = shard_name if kind == MANIFEST_NAME else store_shard_name
    renamed = [shard.name for index, shard in enumerate(manifest.shards) if shard.name != name_of(index)]
    if renamed:
        raise OutputError(f"{refusal}: its manifest names shard files prepack does not write: {renamed}.")
    named = {kind, *(shard.name for shard in manifest.shards)}
    foreign = sorted(name for name, regular in entries.items() if name not in named or not regular)
    if foreign:
        raise OutputError(f"{refusal}: it holds {', '.join(foreign)}, which prepack did not write.")


def _delete_build(directory: Path, kind: str, held: _Replaceable | None = None) -> None:
    """Delete an output `replaceable_build` accepts: the files its manifest names, the manifest last,
    then the directory (which fails, keeping it, if anything else has appeared in it). `held`: a reading of
    it before (a build just swapped out for its successor), whose manifest is not parsed again where the file
    still holds its bytes; the file and the directory's entries are read and checked either way."""
    manifest = _replaceable(directory, kind, held).manifest
    with output_errors(directory, "delete"):
        for shard in manifest.shards if manifest else []:
            (directory / shard.name).unlink(missing_ok=True)
        (directory / kind).unlink(missing_ok=True)
        directory.rmdir()


def _kind(directory: Path) -> str | None:
    """The manifest file that marks `directory` as a prepack output, if any."""
    return next((kind for kind in OUTPUT_KINDS if (directory / kind).exists()), None)


class Staging(NamedTuple):
    """Where a build writes: `build` becomes the output; `scratch` is never published."""

    build: Path
    scratch: Path
    # When `build` goes to object storage: its `prepack.storage.remote.Publication`, through which an engine's
    # workers upload shards themselves.
    publication: Any = None
    # When appending (`staged_append`, `prepack.storage.remote.staged_prefix`): the manifest of the output
    # appended to, as found under the lock (or marker); `build` then receives the new shards and manifest.
    appending: Manifest | StoreManifest | None = None


class _Found(NamedTuple):
    """What is at `out` when a build decides to replace it, to check it is still there at publishing."""

    device: int
    inode: int
    reading: _Replaceable  # its manifest, and the manifest file's bytes

    @property
    def manifest(self) -> Manifest | StoreManifest | None:
        return self.reading.manifest


def _found(out: Path, kind: str, held: _Found | None = None) -> _Found | None:
    """What is at `out` (None: nothing), refused as `replaceable_build` refuses; the manifest of `held` (what was
    found there before) taken again, unparsed, where the manifest file holds the same bytes."""
    try:
        stat = os.lstat(out)
    except FileNotFoundError:
        return None
    return _Found(stat.st_dev, stat.st_ino, _replaceable(out, kind, held.reading if held is not None else None))


def _output_path(out: str | os.PathLike) -> Path:
    """`out` as a Path, refused (OutputError) when it has no name to put the lock and staging directory
    beside ("." or "..") or is a symbolic link: what a build and an append check before anything else."""
    out = Path(out)
    if out.name in ("", ".."):  # "." or "..": no name to put the lock and staging directory beside
        raise OutputError(f"--out {out} does not name a directory; give a path such as ./packed.")
    if out.is_symlink():
        raise OutputError(
            f"{out} is a symbolic link; prepack neither follows nor replaces links at --out. "
            f"Pass the directory it points to ({os.readlink(out)}) or another path."
        )
    return out


@contextmanager
def staged_directory(
    out: str | os.PathLike, overwrite: bool, kind: str = MANIFEST_NAME, overwrite_option: str | None = "--overwrite"
) -> Iterator[Staging]:
    """Hold the lock of `out`, yield a new staging directory beside it, and publish its `build` as
    `out` when the block ends without an error; whatever happens, the staging directory is deleted.

    Raises OutputError, before anything is written, when `out` is a symbolic link, when another build
    to `out` runs, or when `out` exists and `overwrite` is off (the refusal tells to pass
    `overwrite_option`) or it is not a prepack output of `kind` (see `replaceable_build`); and, with
    the build discarded and `out` left as it is, when `out` appeared or changed while the block ran.
    `overwrite_option` None is an output that never replaces anything (`overwrite` off): whatever is at
    `out` is refused as being there, unread.
    """
    out = _output_path(out)
    with output_errors(out.parent, "create"):
        out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out):
        _remove_stale_staging(out)
        if overwrite_option is None and os.path.lexists(out):
            raise OutputError(f"{out} already exists; prepack writes a new directory there and never replaces one: "
                              "remove it or choose another path.")
        replacing = _found(out, kind)
        if replacing is not None and not overwrite:
            raise OutputError(f"{out} already exists; pass {overwrite_option} to replace it.")
        with _new_staging(out) as staging:
            yield Staging(staging / "build", staging / "scratch")
            _publish(staging / "build", out, replacing, kind)


@contextmanager
def _new_staging(out: Path) -> Iterator[Path]:
    """A new staging directory beside `out` (its mark, `build/` and `scratch/` in it), deleted when the
    block ends, whatever happens. The caller holds `out`'s lock."""
    staging = _make_staging(out, f"A build to {out.name} writes here; deleted by the next build to it.\n",
                            ("build", "scratch"))
    try:
        yield staging
    finally:
        _put_back_replaced(staging, out)
        _remove_staging(staging)


@contextmanager
def staged_append(out: str | os.PathLike, kind: str = MANIFEST_NAME) -> Iterator[Staging]:
    """`staged_directory` for an append to the prepack output of `kind` at `out`: under `out`'s lock,
    yield a staging directory holding the output's shards already (hard links to the same files, so
    they stay byte for byte as they are, copied where the file system has no hard links), with
    `appending` its manifest; the block writes the new shards and the manifest into `build`, which then
    replaces `out` in one exchange, after checking that `out` is still what was found.

    A killed append leaves `out` as it was (its staging directory is cleared by the next run to
    `out`); a second append (or build) to `out` while one runs is refused. Raises OutputError when
    `out` is not a prepack output of `kind`, or holds none."""
    out = _output_path(out)
    with output_lock(out):
        _remove_stale_staging(out)
        found = _found(out, kind)
        if found is None or found.manifest is None:
            raise OutputError(
                f"{out} holds no prepack {OUTPUT_KINDS[kind]} to append to; leave out --append to write a new one."
            )
        with _new_staging(out) as staging:
            for shard in found.manifest.shards:
                with output_errors(staging / "build" / shard.name, "create"):
                    _link_or_copy(out / shard.name, staging / "build" / shard.name)
            yield Staging(staging / "build", staging / "scratch", appending=found.manifest)
            _publish(staging / "build", out, found, kind)


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link `target` to the file `source`, or, where the file system has none, a copy."""
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        shutil.copyfile(source, target, follow_symlinks=False)


def _publish(built: Path, out: Path, replacing: _Found | None, kind: str) -> None:
    if replacing is not None:
        changed = f"{out} changed while this build ran; it was left as it is, and this build discarded"
        try:
            now = _found(out, kind, replacing)
        except OutputError as exc:  # something prepack did not write is in it now
            raise OutputError(f"{changed}: {exc}") from None
        if now != replacing:
            raise OutputError(f"{changed}: it is no longer the build this one was to replace.")
        with output_errors(out, "replace"):
            _exchange(built, out)
        if now.manifest is not None:  # `built` now holds the replaced build, read again before it is deleted
            _delete_build(built, kind, now.reading)
        return  # an empty directory replaced is deleted with the staging directory
    _publish_new(built, out, f"{out} appeared while this build ran; it was left as it is, and this build discarded.")


def _publish_new(built: Path, out: Path, appeared: str) -> None:
    """Rename `built` to `out`, which must not exist: OutputError `appeared` when something is there."""
    try:
        _rename_no_replace(built, out)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise OutputError(f"cannot create {out}: {exc.strerror}.") from exc
        raise OutputError(appeared) from None


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold `.NAME.lock` beside `out`, or raise OutputError at once if another build holds it (also
    what `prepack.training.reference` holds while it writes into a reference directory).

    The lock file is deleted when the build ends, while still locked. That is safe because a build
    that gets the lock checks that the path still names the file it locked: one that locked a file
    already deleted by its last holder sees a new file, or none, at the path and tries again.
    """
    path = out.parent / f".{out.name}.lock"
    while True:
        with output_errors(path, "create"):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(
                f"another prepack build is writing {out} (it holds {path}); "
                "wait for it to finish, or choose another --out."
            ) from None
        try:
            held = os.stat(path)
        except FileNotFoundError:
            held = None
        locked = os.fstat(fd)
        if held is not None and (held.st_dev, held.st_ino) == (locked.st_dev, locked.st_ino):
            break
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


_STAGING_SUFFIX = ".tmp-"  # a staging directory is `.NAME.tmp-` and 8 hex digits (`staged_directory`)


def _make_staging(out: Path, note: str, parts: tuple[str, ...]) -> Path:
    """A new staging directory beside `out`, named as `is_staging` knows them, holding prepack's mark
    (`note`, its text, says who writes there and what becomes of it) and the empty directories `parts`.
    Where any of that fails, what was made is deleted: unmarked, no later run would know it for its own."""
    staging = out.parent / f".{out.name}{_STAGING_SUFFIX}{uuid.uuid4().hex[:8]}"
    with output_errors(staging, "create"):
        staging.mkdir()
    try:
        with output_errors(staging, "create"):
            (staging / STAGING_MARK).write_text(note)
            for part in parts:
                (staging / part).mkdir()
    except BaseException:
        _remove_staging(staging)
        raise
    return staging


def is_staging(directory: Path, out_name: str | None = None) -> bool:
    """Whether `directory` is the staging directory of a build, running or killed, to an output named
    `out_name` (to any: None): named as `staged_directory` names them and holding prepack's mark, so
    that a user's directory that happens to have such a name is not taken for one."""
    name = ".+" if out_name is None else re.escape(out_name)
    pattern = rf"\.{name}{re.escape(_STAGING_SUFFIX)}[0-9a-f]{{8}}"
    return re.fullmatch(pattern, directory.name) is not None and (directory / STAGING_MARK).is_file()


def _stale_staging(out: Path) -> list[Path]:
    """The staging directories that killed (or stopped) runs to `out` left behind, in name order. Called under
    the lock, so no run that still goes owns one; a directory without prepack's mark is not looked into."""
    with output_errors(out.parent, "read"), os.scandir(out.parent) as entries:
        return sorted(
            Path(entry.path)
            for entry in entries
            if entry.is_dir(follow_symlinks=False) and is_staging(Path(entry.path), out.name)
        )


def _remove_stale_staging(out: Path) -> None:
    """Delete the staging directories that killed builds to `out` left behind (see `_stale_staging`),
    first putting back the build at `out` that one of them was exchanging (see `_put_back_replaced`)."""
    for staging in _stale_staging(out):
        _put_back_replaced(staging, out)
        _remove_staging(staging)


def _put_back_replaced(staging: Path, out: Path) -> None:
    """Where a run was stopped between the second and third rename of `_exchange`'s fallback, `out` is
    missing, `build` holds the build it replaced and `build-new` the new one: rename `build` back to `out`,
    so that the stopped run leaves `out` as it was rather than deleting both builds with its staging."""
    with output_errors(out, "restore"):
        if not os.path.lexists(out) and (staging / _SWAPPING).is_dir() and (staging / "build").is_dir():
            _rename_no_replace(staging / "build", out)


_TakenUp = TypeVar("_TakenUp")


@contextmanager
def resumable_staging(out: Path, take_up: Callable[[Path], _TakenUp | None]) -> Iterator[tuple[Path, _TakenUp | None]]:
    """For an output written a file at a time, which a stopped run's successor goes on with: yield
    (`directory`, `found`), where the output is written, and publish `directory` as `out` (a rename that
    replaces nothing) when the block ends without an error.

    `directory` is the `build` of the first staging directory a stopped run to `out` left whose `build`
    `take_up` returns something for (`found`: what it returned), else of a new staging directory (`found`
    None); every other staging directory of `out` is deleted. When the block raises, its staging directory
    is kept for the next run if `directory` holds anything, else deleted. The caller holds
    `output_lock(out)` and has found nothing at `out`; OutputError if something appeared there meanwhile."""
    staging, found = None, None
    for stale in _stale_staging(out):
        if staging is None and (stale / "build").is_dir() and (found := take_up(stale / "build")) is not None:
            staging = stale
        else:
            _remove_staging(stale)
    if staging is None:
        staging = _make_staging(out, f"A run writing {out.name} writes here; the next run to it goes on with it.\n",
                                ("build",))
    try:
        yield staging / "build", found
    except BaseException:
        with output_errors(staging, "read"):
            kept = any((staging / "build").iterdir())
        if not kept:
            _remove_staging(staging)
        raise
    _publish_new(staging / "build", out, f"{out} appeared while this run wrote; it was left as it is, and what this "
                 f"run wrote is kept beside it ({staging.name}) for a run to {out.name}.")
    _remove_staging(staging)


def _remove_staging(staging: Path) -> None:
    """Delete a staging directory. A part of it holding a manifest is a build, never published or
    replaced by this one, and is deleted as `_delete_build` does; the rest (scratch files, shards of
    an unfinished build) was written by the build and nothing else."""
    with output_errors(staging, "delete"):
        for part in staging.iterdir():
            if part.name == STAGING_MARK:
                continue
            if (kind := _kind(part)) is not None:
                _delete_build(part, kind)
            else:
                shutil.rmtree(part)
        (staging / STAGING_MARK).unlink(missing_ok=True)
        staging.rmdir()


# Linux's renameat2(2) flags (linux/fs.h), and the "current directory" file descriptor AT_FDCWD.
_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


def _renameat2_flags(source: Path, target: Path, flags: int) -> bool:
    """Rename with renameat2 `flags`; False where there is no renameat2 or the file system does not
    support the flags (NFS, for one), so the caller must do without."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(source), None, str(target))


def _rename_no_replace(source: Path, target: Path) -> None:
    """Rename directory `source` to `target`, failing if anything is at `target`."""
    if not _renameat2_flags(source, target, _RENAME_NOREPLACE):
        # Without the flag, renaming a directory fails if `target` is a file or a directory with
        # anything in it: at worst it replaces an empty directory that appeared after this check.
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
        os.rename(source, target)


# Where `_exchange`'s fallback moves a staging directory's `build` while `out` takes its place.
_SWAPPING = "build-new"


def _exchange(built: Path, out: Path) -> None:
    """Swap directories `built` (a staging directory's `build`) and `out` in one rename where the file
    system can; elsewhere in three renames, between the second and third of which `out` does not exist
    (a run stopped there is undone by `_put_back_replaced`)."""
    if not _renameat2_flags(built, out, _RENAME_EXCHANGE):
        swapping = built.with_name(_SWAPPING)
        os.rename(built, swapping)
        os.rename(out, built)
        _rename_no_replace(swapping, out)
