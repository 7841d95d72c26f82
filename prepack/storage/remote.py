"""Object storage: resolve URIs (`s3://`, `gs://`, whatever fsspec knows) and move files between them and
the local disk. Builds, stores and loaders work on local files; this module is the only one that talks
to object storage, so every reading and writing rule stays defined once, for local files.

- Reading (`local_input`): a corpus or document store at a URI is copied into a temporary directory
  (only the files a corpus can consist of, and the manifests that tell what a prefix is), then found
  and read by the same code as a local one; its files keep their URIs as names (`Corpus.located`), so
  errors name `s3://bucket/corpus/part-1.parquet, row 7, column 'input_ids'` and a manifest's `inputs`
  are the same relative names as a local build's.
- Writing (`staged_prefix`, `Publication`): a build or store is written into a local staging directory
  as always (or uploaded shard by shard by the Ray engine's tasks), then published: every shard
  uploaded, the manifest last. Object stores have no rename, so the manifest is
  what makes a prefix a build: every reader treats a prefix without one as no build. A prefix is written
  only when it is empty or holds a prepack output of the same kind and `overwrite` is on; a failed
  publication deletes what it uploaded, and nothing else. A staging marker beside the prefix lists
  what a build may write, so that the next build clears a killed one's objects and no others; it and
  the manifest are created exclusively where the store can (`If-None-Match: *`), so that of two builds
  to one prefix one fails (`Publication`). An output goes to a prefix in a bucket (`_output_prefix`).
- `list_input`, `fetch` and `upload` list a corpus and move one file at a time, for callers that
  distribute the work (the Ray engine's workers); `Corpus.located` names local copies by their URIs;
  `scratch_prefix` is where such callers keep the objects that pass between their tasks.

fsspec and the client of each scheme (s3fs for `s3://`: `pip install 'prepack-llm[s3]'`) are imported on
first use. Clients are configured the standard way: for S3, credentials and `AWS_ENDPOINT_URL` from the
environment or the AWS configuration files.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import posixpath
import re
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prepack.errors import FormatError, InputError, OutputError, require
from prepack.formats.common import MANIFEST_MAX_BYTES, check_manifest_size
from prepack.formats.shards import (
    MANIFEST_NAME,
    OUTPUT_KINDS,
    STORE_MANIFEST_NAME,
    Manifest,
    check_shard_names,
    read_manifest,
)
from prepack.storage.output import STAGING_MARK, Staging, check_replaceable
from prepack.sources.corpus import file_kind
from prepack.formats.store import StoreManifest, read_store_manifest

__all__ = [
    "InputObjects",
    "LocalInput",
    "Publication",
    "fetch",
    "filesystem",
    "is_uri",
    "join",
    "list_input",
    "local_input",
    "read_output_manifest",
    "relative_location",
    "scratch_prefix",
    "staged_prefix",
    "upload",
]

_URI = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")
# Besides corpus files (prepack.sources.corpus's suffixes), what `find_corpus` and `open_documents` look at to
# tell what a directory is: a saved Hugging Face dataset, a build inside the corpus, a document store.
_MARKERS = {"state.json", "dataset_dict.json", MANIFEST_NAME, STORE_MANIFEST_NAME}
_CLIENTS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}  # scheme: fsspec's client for it (an extra)


def is_uri(spec: object) -> bool:
    """Whether `spec` names object storage (`scheme://…`) rather than a local path."""
    return isinstance(spec, str) and _URI.match(spec) is not None


@functools.cache
def storage_errors() -> tuple[type[BaseException], ...]:
    """What an object store's client raises when a request fails: OSError, to which fsspec's clients map
    most failures, and the credential errors that s3fs and gcsfs let through from botocore and google-auth
    (no credentials, an unknown profile), so that those too become the InputError or OutputError that
    names the URI. Evaluated only when an exception is being handled: the clients are not imported before."""
    errors: list[type[BaseException]] = [OSError]
    for module, name in (("botocore.exceptions", "BotoCoreError"), ("google.auth.exceptions", "GoogleAuthError")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except ImportError:  # that client is not installed, so it cannot have raised
            pass
    return tuple(errors)


def filesystem(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) of `uri`. Raises InputError when `uri` names no bucket
    (`s3://`, `s3:///key`) or an unknown scheme, MissingExtraError when the scheme's client is not installed."""
    scheme, _, path = uri.partition("://")
    if not path.split("/", 1)[0]:
        raise InputError(f"{uri}: names no bucket; give one, as in {scheme}://BUCKET/PREFIX.")
    fsspec_core = require("fsspec.core", uri)
    scheme = uri.split("://", 1)[0].lower()
    if scheme in _CLIENTS:
        require(_CLIENTS[scheme], uri)
    try:
        return fsspec_core.url_to_fs(uri)
    except ImportError as exc:  # a scheme whose client is no prepack extra
        raise InputError(f"{uri}: reading {scheme}:// needs fsspec's client for it ({exc})") from None
    except ValueError as exc:  # an unknown protocol
        raise InputError(f"{uri}: {exc}") from None


def join(uri: str, relative: str) -> str:
    """`relative` ('/'-separated, '..' allowed) resolved against the prefix `uri`."""
    scheme, path = uri.split("://", 1)
    return f"{scheme}://{posixpath.normpath(posixpath.join(path, relative))}"


def relative_location(target: str, base: str) -> str:
    """`target`'s path relative to `base` ('/'-separated), both URIs in one bucket, so that `join(base,
    result)` is `target` again. Raises InputError for two buckets or schemes, or a URI and a local path."""
    if not (is_uri(target) and is_uri(base)):
        raise InputError(f"{target} and {base}: an index build and its store must both be local or both in object storage.")
    (scheme, path), (base_scheme, base_path) = target.split("://", 1), base.split("://", 1)
    if scheme != base_scheme or path.split("/", 1)[0] != base_path.split("/", 1)[0]:
        raise InputError(f"{target} and {base}: an index build and its store must lie in the same bucket.")
    parts, base_parts = path.rstrip("/").split("/"), base_path.rstrip("/").split("/")
    if parts[: len(base_parts)] == base_parts or base_parts[: len(parts)] == parts:
        raise InputError(f"{target}: the document store and --out {base} must not lie inside each other; choose another --out.")
    return posixpath.relpath(path.rstrip("/"), base_path.rstrip("/"))


def fetch(uri: str, local: str | os.PathLike) -> None:
    """Download the object `uri` to the local file `local`. Raises InputError naming `uri`."""
    fs, path = filesystem(uri)
    try:
        fs.get_file(path, os.fspath(local))
    except storage_errors() as exc:
        raise InputError(f"{uri}: cannot be read ({exc}).") from None


def upload(local: str | os.PathLike, uri: str) -> None:
    """Upload the local file `local` as the object `uri`. Raises OutputError naming `uri`."""
    fs, path = filesystem(uri)
    try:
        fs.put_file(os.fspath(local), path)
    except storage_errors() as exc:
        raise OutputError(f"cannot write {uri}: {exc}.") from None


@dataclass(frozen=True)
class LocalInput:
    """What a build reads: `spec` itself when local; for a URI, the local copy and the URI it names
    its files by (`prepack.sources.documents.open_documents`'s `location`)."""

    spec: str | os.PathLike
    location: str | None = None


def _is_glob(path: str) -> bool:
    return any(char in path for char in "*?[")


@dataclass(frozen=True)
class InputObjects:
    """The objects of a corpus or document store at a URI that `local_input` copies: `names`, sorted and
    '/'-separated, relative to the prefix `root` (a URI); `single` when the URI named one object."""

    root: str
    names: list[str]
    single: bool


def list_input(uri: str) -> InputObjects:
    """The objects of the corpus or store at `uri` (a file, a prefix: everything under it, or a glob)
    that a build reads: corpus files by `prepack.sources.corpus`'s suffixes, and the manifests and dataset files
    that tell what a prefix holds. A worker copies `root/name` to `directory/name` (`fetch`) and reads
    the copy as `local_input` does. Raises InputError when there is none."""
    fs, path = filesystem(uri)
    fs.invalidate_cache()
    root, names, single = _corpus_objects(fs, uri, path)
    return InputObjects(fs.unstrip_protocol(root), names, single)


def _corpus_objects(fs: Any, uri: str, path: str) -> tuple[str, list[str], bool]:
    path = path.rstrip("/")
    try:
        if _is_glob(path):
            root = path[: min(path.index(char) for char in "*?[" if char in path)].rsplit("/", 1)[0]
            found, single = [p for p in fs.glob(path) if fs.isfile(p)], False
        elif fs.isfile(path):
            root, found, single = posixpath.dirname(path), [path], True
        else:
            root, found, single = path, fs.find(path), False
    except storage_errors() as exc:
        raise InputError(f"{uri}: cannot be listed ({exc}).") from None
    names = sorted(posixpath.relpath(p, root) for p in found)
    wanted = [n for n in names if file_kind(Path(n)) is not None or posixpath.basename(n) in _MARKERS]
    if not wanted:
        raise InputError(f"{uri}: no such object or prefix, and no corpus files match it.")
    return root, wanted, single


@contextmanager
def local_input(spec: str | os.PathLike) -> Iterator[LocalInput]:
    """A corpus or document store to read locally: a local `spec` as it is; a URI copied, for as long
    as the block runs, into a temporary directory (`TMPDIR`), with its files' relative names. Raises
    InputError when the URI holds no corpus file or cannot be read."""
    if not is_uri(spec):
        yield LocalInput(spec)
        return
    objects = list_input(spec)
    fs, _ = filesystem(spec)
    with tempfile.TemporaryDirectory(prefix="prepack-input-") as directory:
        local = [os.path.join(directory, *name.split("/")) for name in objects.names]
        for file in local:
            os.makedirs(os.path.dirname(file), exist_ok=True)
        try:  # all at once: fsspec's clients download them concurrently
            fs.get([f"{objects.root}/{name}" for name in objects.names], local)
        except storage_errors() as exc:
            raise InputError(f"{spec}: cannot be read ({exc}).") from None
        yield LocalInput(local[0] if objects.single else directory, objects.root)


def _objects(fs: Any, prefix: str) -> dict[str, bool]:
    """The objects under `prefix`, by name relative to it (always regular files: `check_replaceable`'s
    entries)."""
    fs.invalidate_cache()
    try:
        return {posixpath.relpath(p, prefix): True for p in fs.find(prefix)}
    except FileNotFoundError:
        return {}


def _manifest_text(fs: Any, uri: str, prefix: str, kind: str) -> bytes | None:
    """The bytes of the manifest `kind` under `prefix` (`uri`), or None when there is none. One larger
    than MANIFEST_MAX_BYTES is refused (FormatError naming its URI) by its size, before it is read (and
    no more than MANIFEST_MAX_BYTES + 1 bytes are read should it grow meanwhile), as a local one is."""
    path = f"{prefix}/{kind}"
    try:
        fs.invalidate_cache(path)
        check_manifest_size(fs.info(path).get("size") or 0, join(uri, kind))
        text = fs.cat_file(path, start=0, end=MANIFEST_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    check_manifest_size(len(text), join(uri, kind))
    return text


def read_output_manifest(uri: str, kind: str = MANIFEST_NAME) -> Manifest | StoreManifest:
    """The manifest of the build (`kind` MANIFEST_NAME) or document store (STORE_MANIFEST_NAME) at
    `uri`, read and validated as a local one. A prefix without one is no build: FormatError without a
    `problem`; an invalid build manifest raises FormatError whose `problem` is the finding (file: the
    manifest's URI), which `verify` reports as one."""
    fs, prefix = filesystem(uri)
    fs.invalidate_cache()
    try:
        text = _manifest_text(fs, uri, prefix.rstrip("/"), kind)
    except storage_errors() as exc:
        raise InputError(f"{join(uri, kind)}: cannot be read ({exc}).") from None
    if text is None:
        raise FormatError(
            f"{join(uri, kind)} does not exist: {uri} is not a finished prepack {OUTPUT_KINDS[kind]} "
            "(the manifest is written last)."
        )
    return _parse_manifest(text, uri, kind)


def _parse_manifest(text: bytes, uri: str, kind: str) -> Manifest | StoreManifest:
    """The manifest `kind` of the output at `uri`, parsed from its bytes `text` as a local one is read,
    its problems naming its URI; a build's must name its shards as the format does (no "../x" key)."""
    where = join(uri, kind)
    if kind == STORE_MANIFEST_NAME:
        return read_store_manifest(text, where)
    manifest = read_manifest(text, where)
    check_shard_names(manifest, where)
    return manifest


@contextmanager
def staged_prefix(uri: str, overwrite: bool, kind: str = MANIFEST_NAME, append: bool = False) -> Iterator[Staging]:
    """`prepack.storage.output.staged_directory` for a prefix in object storage: yield a local staging
    directory (in `TMPDIR`) and, when the block ends without an error, upload its `build` to `uri`, the
    manifest last (`Publication`); the staging directory is deleted whatever happens. An engine whose
    workers upload shards themselves does so through `staging.publication`; what is in `build` at the
    end goes up then, the manifest last.

    Raises OutputError, before anything is written, when the prefix holds objects and is not a prepack
    output of `kind` (the rule of `check_replaceable`), or is one and `overwrite` is off, or another
    build to it starts at the same moment; and, with nothing of another build's touched, when another
    build took the prefix over or published to it while the block ran, or an upload fails (what this
    build uploaded is deleted, also when the block fails).

    With `append`, the prefix must hold an output of `kind`, whose manifest `Staging.appending` is: the
    block writes only the new shards and the manifest into `build`; they go up without the output being
    unpublished meanwhile (its manifest is replaced last, in one PUT), so a killed append leaves it as it was.
    """
    publication = Publication(uri, overwrite, kind, append)
    with tempfile.TemporaryDirectory(prefix="prepack-build-") as directory:
        appending = publication.replacing[1] if append else None
        staging = Staging(Path(directory, "build"), Path(directory, "scratch"), publication, appending)
        staging.build.mkdir()
        staging.scratch.mkdir()
        try:
            yield staging
            publication.publish(staging.build)
        except BaseException as exc:  # an interrupted build too; after publishing, only the marker is left to delete
            try:
                publication.discard()
            except storage_errors() as cleanup:
                raise OutputError(f"{exc}; nor could what this build uploaded to {uri} be deleted: {cleanup}.") from None
            raise


@contextmanager
def scratch_prefix(publication: Publication) -> Iterator[str]:
    """A prefix for the scratch objects of the build `publication` publishes (`--engine ray`'s token
    files, which tasks on other nodes read): `.NAME.prepack-scratch-RANDOM` beside its prefix, so that
    no reader and no overwrite check takes it for part of an output, with a name no other writer picks,
    recorded in the build's staging marker before anything is written under it (a killed build's are
    deleted by the next build to the prefix). Everything under it is deleted when the block ends,
    whatever happens; nothing else is."""
    fs = publication.fs
    name = f".{publication.name}.prepack-scratch-{uuid.uuid4().hex}"
    scratch = f"{publication.parent}/{name}"
    publication.scratching(name)
    try:
        yield fs.unstrip_protocol(scratch)
    except BaseException as exc:  # an interrupted build too
        try:
            _delete_prefix(fs, scratch)
        except storage_errors() as cleanup:
            raise OutputError(f"{exc}; nor could this build's scratch objects under {fs.unstrip_protocol(scratch)} be deleted: {cleanup}.") from None
        raise
    try:
        _delete_prefix(fs, scratch)
    except storage_errors() as exc:
        raise OutputError(f"cannot delete this build's scratch objects under {fs.unstrip_protocol(scratch)}: {exc}.") from None


def _delete_prefix(fs: Any, prefix: str) -> None:
    fs.invalidate_cache()
    found = fs.find(prefix + "/")
    if found:
        fs.rm(found)


# A staging marker's `scratch` entries: `scratch_prefix`'s names, and nothing a user could mean.
_SCRATCH_NAME = re.compile(r"\.(?P<name>.+)\.prepack-scratch-[0-9a-f]{32}")


class Publication:
    """A build's way onto the prefix `uri` in object storage, one set of rules for every engine.

    Object stores have no rename and no lock, so the manifest is what makes a prefix a build, and goes
    up last; and a staging marker, the object `.NAME.prepack-staging` beside the prefix (`STAGING_MARK`
    as for a local build), is what makes a killed build's objects known as prepack's own. The marker is
    JSON: this build's random `build` id, the `objects` under the prefix it may have written or took
    over (the names, relative to the prefix) and the `scratch` prefixes beside it that it writes under.

    When the publication is made: a marker already there is a killed build's, and the objects and
    scratch prefixes it lists are deleted, then the marker (`_clear_leftovers`; never an object the
    prefix's manifest names, nor anything the marker does not list); then the prefix must be empty, or
    hold a prepack output of `kind` and `overwrite` be on (else OutputError, before anything is
    written); then this build's marker is created, exclusively where the store can (S3's
    `If-None-Match: *`): of two builds starting at once, one is refused. Before anything is written
    (`uploading`, `scratching`) the marker is read back: when it is no longer this build's, another
    build took the prefix over (believing this one dead), and this one stops. `open`, before the first
    shard goes up, refuses when the prefix's manifest changed since the check, and unpublishes the
    output being replaced: its objects are listed in the marker, then its manifest deleted (its shards
    are about to be overwritten: they take the same names). `publish` uploads the shards not up yet,
    then the manifest, exclusively where the store can and read back to compare where it cannot, then
    deletes the replaced output's other shards and the marker. `discard` deletes what this build wrote
    or took over, except what a manifest published meanwhile or another build's marker names.
    """

    def __init__(self, uri: str, overwrite: bool, kind: str, append: bool = False) -> None:
        self.uri, self.kind, self.append = uri, kind, append
        self.fs, self.prefix = _output_prefix(uri)
        self.parent, self.name = posixpath.split(self.prefix)
        self.marker = f"{self.parent}/.{self.name}{STAGING_MARK}"
        _clear_leftovers(self.fs, self.uri, self.prefix, self.marker)
        self.replacing = _replaceable_prefix(self.fs, uri, self.prefix, kind, overwrite or append)
        if append and self.replacing is None:
            raise OutputError(f"{uri} holds no prepack {OUTPUT_KINDS[kind]} to append to; leave out --append to write a new one.")
        self.build_id = uuid.uuid4().hex
        self.opened = False
        self.uploaded: list[str] = []  # names under the prefix this build may have written
        self.taken: list[str] = []  # the replaced output's, once this build unpublished it
        self.scratch: list[str] = []  # names beside the prefix that this build writes under
        try:
            self.fs.pipe_file(self.marker, self._marker_text(), mode="create")
            self.claimed = _object_version(self.fs, self.marker)
        except FileExistsError:
            raise OutputError(
                f"another prepack build to {uri} started at the same moment "
                f"({self.fs.unstrip_protocol(self.marker)} appeared); this one wrote nothing."
            ) from None
        except storage_errors() as exc:
            raise OutputError(f"cannot write {self.fs.unstrip_protocol(self.marker)}: {exc}.") from None

    def shard_uri(self, name: str) -> str:
        """Where the shard `name` goes; the caller records it with `uploading` before it uploads."""
        return self.fs.unstrip_protocol(f"{self.prefix}/{name}")

    def uploading(self, names: list[str]) -> None:
        """Record `names` (under the prefix) in the marker before they are uploaded."""
        self.open()
        self._record(lambda: self.uploaded.extend(names))

    def scratching(self, name: str) -> None:
        """Record the scratch prefix `name` (beside the prefix) in the marker before anything goes under it."""
        self._record(lambda: self.scratch.append(name))

    def open(self) -> None:
        if self.opened:
            return
        try:
            now = _manifest_text(self.fs, self.uri, self.prefix, self.kind)
        except storage_errors() as exc:
            raise OutputError(f"cannot read {self.uri}: {exc}; this build was discarded.") from None
        if now != (None if self.replacing is None else self.replacing[0]):
            raise OutputError(f"{self.uri} changed while this build ran; it was left as it is, and this build discarded.")
        self.opened = True
        if self.replacing is not None and not self.append:  # unpublish it: its shards are about to be overwritten
            self._record(lambda: self.taken.extend([self.kind, *(s.name for s in self.replacing[1].shards)]))
            self._writing(lambda: self.fs.rm_file(f"{self.prefix}/{self.kind}"))

    def publish(self, built: Path) -> None:
        """Upload the files of `built` (the manifest last), then delete the replaced output's other
        shards and the marker."""
        shards = sorted(p.name for p in built.iterdir() if p.name != self.kind)
        if self.append and (named := sorted(set(shards) & {s.name for s in self.replacing[1].shards})):
            raise ValueError(f"an append re-uploads shards of the output it appends to: {named}")
        self.uploading([*shards, self.kind])
        expected = self.replacing[0] if self.append else None  # the manifest an append replaces; else none
        target = f"{self.prefix}/{self.kind}"
        try:  # a manifest that went up meanwhile (a writer that ignored the marker): its shards stay as they are
            # Taken before the manifest is read, so that it names that manifest or one that went up later.
            replaced_etag = _s3_etag(self.fs, target) if self.append else None
            published = _manifest_text(self.fs, self.uri, self.prefix, self.kind) != expected
        except (*storage_errors(), FormatError):
            published = True
        if published:
            self._give_up(f"another prepack build published {self.uri} while this one ran; that build was left as it is")
        self._writing(lambda: self.fs.put([str(built / name) for name in shards], [f"{self.prefix}/{name}" for name in shards]))
        self.check_claim(thorough=True)
        manifest = (built / self.kind).read_bytes()
        try:
            # An append's manifest replaces the one its shards extend, and in S3 only that one (If-Match its
            # ETag): a build that took the prefix over after the check above (deleting this one's shards)
            # and published is not replaced. A new output's manifest is created exclusively.
            condition = {"IfMatch": replaced_etag} if replaced_etag is not None else {}
            self.fs.pipe_file(target, manifest, **(condition if self.append else {"mode": "create"}))
            published = _manifest_text(self.fs, self.uri, self.prefix, self.kind) == manifest
        except FileExistsError:
            published = False
        except storage_errors() as exc:
            if not (self.append and _manifest_text(self.fs, self.uri, self.prefix, self.kind) != expected):
                self._give_up(f"cannot write {self.uri}: {exc}")
            published = False  # the If-Match failed: another build's manifest is there
        if not published:  # another build's manifest went up first, or replaced this one's
            self._give_up(f"another prepack build published {self.uri} while this one ran; that build was left as it is")
        ours, self.uploaded, self.taken = set(self.uploaded), [], []  # published: nothing to discard any more
        if self.replacing is not None and not self.append:
            try:
                _delete(self.fs, [f"{self.prefix}/{s.name}" for s in self.replacing[1].shards if s.name not in ours])
            except storage_errors() as exc:
                raise OutputError(f"{self.uri} is published, but the replaced build's other shards could not be deleted: {exc}.") from None
        try:
            self.fs.rm_file(self.marker)
        except storage_errors() as exc:
            raise OutputError(f"{self.uri} is published, but its staging marker {self.fs.unstrip_protocol(self.marker)} could not be deleted: {exc}.") from None

    def discard(self) -> None:
        """Delete what this build wrote or took over (an unfinished build) and its marker, except what
        a manifest published meanwhile or another build's marker names."""
        keep = _published_names(self.fs, self.prefix)
        marker = _read_marker(self.fs, self.uri, self.marker)
        if marker is not None and marker.get("build") != self.build_id:
            keep |= set(marker["objects"])
        _delete(self.fs, [f"{self.prefix}/{name}" for name in dict.fromkeys(self.uploaded + self.taken) if name not in keep])
        self.uploaded, self.taken = [], []
        if marker is not None and marker.get("build") == self.build_id:
            self.fs.rm_file(self.marker)

    def _marker_text(self) -> bytes:
        note = f"A prepack build to {self.name} writes the objects listed; the next build to it deletes them and this marker."
        marker = {"note": note, "build": self.build_id, "objects": sorted({*self.uploaded, *self.taken}), "scratch": self.scratch}
        return json.dumps(marker, indent=1).encode()

    def _record(self, change) -> None:
        """Apply `change` to what the marker lists and rewrite the marker, once it is checked to be
        this build's still."""
        self.check_claim()
        change()
        self._writing(lambda: self.fs.pipe_file(self.marker, self._marker_text()))
        self.claimed = _object_version(self.fs, self.marker)

    def check_claim(self, thorough: bool = False) -> None:
        """Stop (OutputError, this build's objects deleted) when the marker is no longer this build's:
        a later build took the prefix over. One HEAD request while the marker is as this build wrote it;
        `thorough`: the marker read whatever its version (before the manifest goes up)."""
        try:
            if not thorough and self.claimed is not None and _object_version(self.fs, self.marker) == self.claimed:
                return
        except FileNotFoundError:
            pass
        except storage_errors() as exc:
            raise OutputError(f"cannot read {self.fs.unstrip_protocol(self.marker)}: {exc}.") from None
        marker = _read_marker(self.fs, self.uri, self.marker)
        if marker is None or marker.get("build") != self.build_id:
            self._give_up(f"another prepack build to {self.uri} started while this one ran and took the prefix over")

    def _give_up(self, reason: str) -> None:
        try:
            self.discard()
        except storage_errors() as cleanup:
            raise OutputError(f"{reason}; nor could what this build uploaded be deleted: {cleanup}.") from None
        raise OutputError(f"{reason}. This build was discarded: what it uploaded and no other build names was deleted.")

    def _writing(self, write) -> None:
        try:
            write()
        except storage_errors() as exc:
            try:
                self.discard()
            except storage_errors() as cleanup:
                raise OutputError(f"cannot write {self.uri}: {exc}; nor delete what this build uploaded: {cleanup}.") from None
            raise OutputError(f"cannot write {self.uri}: {exc}; what this build uploaded was deleted.") from None


def _s3_etag(fs: Any, path: str) -> str | None:
    """The ETag of the object `path` in S3, for a PUT conditional on it (If-Match); None elsewhere (a
    conditional PUT is S3's) or when there is no object."""
    if "s3" not in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol):
        return None
    fs.invalidate_cache(path)
    try:
        return fs.info(path).get("ETag")
    except FileNotFoundError:
        return None


def _object_version(fs: Any, path: str) -> tuple | None:
    """What the store says identifies the object's bytes now (size, ETag or generation, modification
    time), or None where it says none of that. Raises FileNotFoundError when there is no object."""
    fs.invalidate_cache(path)
    info = fs.info(path)
    fields = ("ETag", "etag", "generation", "LastModified", "mtime", "updated")
    found = tuple(str(info[key]) for key in fields if info.get(key) is not None)
    return (info.get("size"), *found) if found else None


def _output_prefix(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path) of the prefix `uri` that a build or store is written to: a key in a
    bucket (the marker and scratch objects lie beside it, in its parent), without '.' or '..' parts.
    Raises InputError for a bucket alone or such a part."""
    fs, path = filesystem(uri)
    path = path.rstrip("/")
    bucket, _, key = path.partition("/")
    if not key:
        raise InputError(f"{uri}: names a bucket but no prefix in it; write to a prefix such as {uri.rstrip('/')}/packed.")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise InputError(f"{uri}: a prefix with an empty, '.' or '..' part is not written to; give a plain one such as s3://{bucket}/packed.")
    return fs, path


def _clear_leftovers(fs: Any, uri: str, prefix: str, marker_path: str) -> None:
    """Delete what a killed build to `prefix` left (`Publication`): the objects its staging marker
    `marker_path` lists under the prefix, except those a manifest there names; everything under the
    scratch prefixes it lists beside the prefix; then the marker. Nothing else. Raises OutputError
    when the marker is not one prepack writes."""
    marker = _read_marker(fs, uri, marker_path)
    if marker is None:
        return
    parent, name = posixpath.split(prefix)
    keep = _published_names(fs, prefix)
    try:
        _delete(fs, [f"{prefix}/{n}" for n in marker["objects"] if n not in keep])
        for scratch in marker["scratch"]:
            _delete_prefix(fs, f"{parent}/{scratch}")
        fs.rm_file(marker_path)
    except storage_errors() as exc:
        raise OutputError(f"cannot delete what a killed build left at {uri}: {exc}.") from None


def _read_marker(fs: Any, uri: str, path: str) -> dict | None:
    """The staging marker at `path`, checked to be one prepack writes for `uri`, or None when there is none."""
    try:
        text = fs.cat_file(path)
    except FileNotFoundError:
        return None
    except storage_errors() as exc:
        raise OutputError(f"cannot read {fs.unstrip_protocol(path)}: {exc}.") from None
    name = posixpath.basename(path)[1 : -len(STAGING_MARK)]
    try:
        marker = json.loads(text)
        ok = (
            isinstance(marker, dict)
            and isinstance(marker.get("build"), str)
            and isinstance(marker.get("objects"), list)
            and all(isinstance(n, str) and n not in ("", ".", "..") and "/" not in n for n in marker["objects"])
            and isinstance(marker.get("scratch"), list)
            and all(isinstance(n, str) and (m := _SCRATCH_NAME.fullmatch(n)) and m["name"] == name for n in marker["scratch"])
        )
    except ValueError:
        ok = False
    if not ok:
        raise OutputError(
            f"{fs.unstrip_protocol(path)} is not a staging marker prepack writes, so prepack will not build to {uri} "
            "beside it: delete it, or choose another prefix."
        )
    return marker


def _published_names(fs: Any, prefix: str) -> set[str]:
    """The objects under `prefix` that a manifest there names (the manifest too); none without one."""
    names: set[str] = set()
    for kind in OUTPUT_KINDS:
        try:
            text = _manifest_text(fs, fs.unstrip_protocol(prefix), prefix, kind)
            if text is not None:
                names |= {kind, *(s.name for s in _parse_manifest(text, fs.unstrip_protocol(prefix), kind).shards)}
        except (*storage_errors(), FormatError):
            names.add(kind)  # unreadable: at least the manifest stays
    return names


def _replaceable_prefix(
    fs: Any, uri: str, prefix: str, kind: str, overwrite: bool
) -> tuple[bytes, Manifest | StoreManifest] | None:
    """The manifest (text, parsed) of the output at `prefix` that this build will replace, or None
    when the prefix is empty; else OutputError."""
    try:
        objects = _objects(fs, prefix)
        text = _manifest_text(fs, uri, prefix, kind)
    except storage_errors() as exc:
        raise OutputError(f"cannot read {uri}: {exc}.") from None
    except FormatError as exc:
        raise OutputError(f"{uri} is not a prepack {OUTPUT_KINDS[kind]}, so prepack will not replace or delete it: {exc}") from None
    if not objects:
        return None
    refusal = f"{uri} is not a prepack {OUTPUT_KINDS[kind]}, so prepack will not replace or delete it"
    if text is None:
        raise OutputError(f"{refusal}: it holds {len(objects)} objects and no {kind}.")
    if not overwrite:
        raise OutputError(f"{uri} already exists; pass --overwrite to replace it.")
    try:
        manifest = _parse_manifest(text, uri, kind)
    except FormatError as exc:
        raise OutputError(f"{refusal}: {exc}") from None
    check_replaceable(manifest, kind, objects, refusal)
    return text, manifest


def _delete(fs: Any, paths: list[str]) -> None:
    """Delete those of `paths` that exist: objects this build wrote, or the replaced output's."""
    fs.invalidate_cache()
    present = [p for p in paths if fs.exists(p)]
    if present:
        fs.rm(present)
