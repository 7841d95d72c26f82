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
  publication deletes what it uploaded, and nothing else.
- `list_input`, `fetch` and `upload` list a corpus and move one file at a time, for callers that
  distribute the work (the Ray engine's workers); `Corpus.located` names local copies by their URIs;
  `scratch_prefix` is where such callers keep the objects that pass between their tasks.

fsspec and the client of each scheme (s3fs for `s3://`: `pip install 'prepack-llm[s3]'`) are imported on
first use. Clients are configured the standard way: for S3, credentials and `AWS_ENDPOINT_URL` from the
environment or the AWS configuration files.
"""

from __future__ import annotations

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
from prepack.format import MANIFEST_NAME, STORE_MANIFEST_NAME, Manifest, format_error, read_manifest, shard_path
from prepack.output import Staging, check_replaceable
from prepack.read import file_kind
from prepack.store_format import StoreManifest, read_store_manifest

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
# Besides corpus files (prepack.read's suffixes), what `find_corpus` and `open_documents` look at to
# tell what a directory is: a saved Hugging Face dataset, a build inside the corpus, a document store.
_MARKERS = {"state.json", "dataset_dict.json", MANIFEST_NAME, STORE_MANIFEST_NAME}
_CLIENTS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}  # scheme: fsspec's client for it (an extra)
_KINDS = {MANIFEST_NAME: "build", STORE_MANIFEST_NAME: "document store"}


def is_uri(spec: object) -> bool:
    """Whether `spec` names object storage (`scheme://…`) rather than a local path."""
    return isinstance(spec, str) and _URI.match(spec) is not None


def filesystem(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) of `uri`. Raises MissingExtraError when the scheme's client is
    not installed, InputError when the scheme is unknown."""
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
    return posixpath.relpath(path.rstrip("/"), base_path.rstrip("/"))


def fetch(uri: str, local: str | os.PathLike) -> None:
    """Download the object `uri` to the local file `local`. Raises InputError naming `uri`."""
    fs, path = filesystem(uri)
    try:
        fs.get_file(path, os.fspath(local))
    except OSError as exc:
        raise InputError(f"{uri}: cannot be read ({exc}).") from None


def upload(local: str | os.PathLike, uri: str) -> None:
    """Upload the local file `local` as the object `uri`. Raises OutputError naming `uri`."""
    fs, path = filesystem(uri)
    try:
        fs.put_file(os.fspath(local), path)
    except OSError as exc:
        raise OutputError(f"cannot write {uri}: {exc}.") from None


@dataclass(frozen=True)
class LocalInput:
    """What a build reads: `spec` itself when local; for a URI, the local copy and the URI it names
    its files by (`prepack.documents.open_documents`'s `location`)."""

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
    that a build reads: corpus files by `prepack.read`'s suffixes, and the manifests and dataset files
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
    except OSError as exc:
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
        except OSError as exc:
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


def _manifest_text(fs: Any, prefix: str, kind: str) -> bytes | None:
    try:
        return fs.cat_file(f"{prefix}/{kind}")
    except FileNotFoundError:
        return None


def read_output_manifest(uri: str, kind: str = MANIFEST_NAME) -> Manifest | StoreManifest:
    """The manifest of the build (`kind` MANIFEST_NAME) or document store (STORE_MANIFEST_NAME) at
    `uri`, read and validated as a local one. A prefix without one is no build: FormatError without a
    `problem`; an invalid build manifest raises FormatError whose `problem` is the finding (file: the
    manifest's URI), which `verify` reports as one."""
    fs, prefix = filesystem(uri)
    fs.invalidate_cache()
    try:
        text = _manifest_text(fs, prefix.rstrip("/"), kind)
    except OSError as exc:
        raise InputError(f"{join(uri, kind)}: cannot be read ({exc}).") from None
    if text is None:
        raise FormatError(
            f"{join(uri, kind)} does not exist: {uri} is not a finished prepack {_KINDS[kind]} "
            "(the manifest is written last)."
        )
    return _parse_manifest(text, uri, kind)


def _parse_manifest(text: bytes, uri: str, kind: str) -> Manifest | StoreManifest:
    with tempfile.TemporaryDirectory(prefix="prepack-manifest-") as directory:
        Path(directory, kind).write_bytes(text)
        try:
            if kind == STORE_MANIFEST_NAME:
                return read_store_manifest(directory)
            manifest = read_manifest(directory)
            for index, shard in enumerate(manifest.shards):  # the format's names only: no "../x" key
                shard_path(directory, index, shard)
            return manifest
        except FormatError as exc:
            if exc.problem is not None:
                raise format_error(join(uri, kind), exc.problem.message, column=exc.problem.column) from None
            raise FormatError(f"{join(uri, kind)}: {str(exc).replace(directory, uri)}") from None


@contextmanager
def staged_prefix(uri: str, overwrite: bool, kind: str = MANIFEST_NAME) -> Iterator[Staging]:
    """`prepack.output.staged_directory` for a prefix in object storage: yield a local staging
    directory (in `TMPDIR`) and, when the block ends without an error, upload its `build` to `uri`, the
    manifest last (`Publication`); the staging directory is deleted whatever happens. An engine whose
    workers upload shards themselves does so through `staging.publication`; what is in `build` at the
    end goes up then, the manifest last.

    Raises OutputError, before anything is written, when the prefix holds objects and is not a prepack
    output of `kind` (the rule of `check_replaceable`), or is one and `overwrite` is off; and, with
    nothing published, when its manifest changed while the block ran or an upload fails (what this
    build uploaded is deleted, also when the block fails).
    """
    publication = Publication(uri, overwrite, kind)
    with tempfile.TemporaryDirectory(prefix="prepack-build-") as directory:
        staging = Staging(Path(directory, "build"), Path(directory, "scratch"), publication)
        staging.build.mkdir()
        staging.scratch.mkdir()
        try:
            yield staging
        except BaseException as exc:  # an interrupted build too
            try:
                publication.discard()
            except OSError as cleanup:
                raise OutputError(f"{exc}; nor could what this build uploaded to {uri} be deleted: {cleanup}.") from None
            raise
        publication.publish(staging.build)


@contextmanager
def scratch_prefix(uri: str) -> Iterator[str]:
    """A prefix for the scratch objects of a build to the prefix `uri` (`--engine ray`'s token files,
    which tasks on other nodes read): `.NAME.prepack-scratch-RANDOM` beside it, so that no reader and no
    overwrite check takes it for part of an output, with a name no other writer picks. Everything under
    it is deleted when the block ends, whatever happens; nothing else is."""
    fs, path = filesystem(uri)
    parent, name = posixpath.split(path.rstrip("/"))
    random = uuid.uuid4().hex
    scratch = f"{parent}/.{name}.prepack-scratch-{random}" if parent else f"{name}/.prepack-scratch-{random}"
    try:
        yield fs.unstrip_protocol(scratch)
    except BaseException as exc:  # an interrupted build too
        try:
            _delete_prefix(fs, scratch)
        except OSError as cleanup:
            raise OutputError(f"{exc}; nor could this build's scratch objects under {fs.unstrip_protocol(scratch)} be deleted: {cleanup}.") from None
        raise
    try:
        _delete_prefix(fs, scratch)
    except OSError as exc:
        raise OutputError(f"cannot delete this build's scratch objects under {fs.unstrip_protocol(scratch)}: {exc}.") from None


def _delete_prefix(fs: Any, prefix: str) -> None:
    fs.invalidate_cache()
    found = fs.find(prefix + "/")
    if found:
        fs.rm(found)


class Publication:
    """A build's way onto the prefix `uri` in object storage, one set of rules for every engine.

    Object stores have no rename and no lock, so the manifest is what makes a prefix a build, and goes
    up last. The prefix is checked when the publication is made: it must be empty, or hold a prepack
    output of `kind` and `overwrite` be on (else OutputError, before anything is written). `open`,
    before the first shard goes up, refuses when the prefix's manifest changed since, and deletes the
    manifest of the output being replaced (its shards are about to be overwritten: they take the same
    names); `publish` uploads the shards not up yet and the manifest, then deletes the replaced
    output's other shards; `discard` deletes what this build uploaded (`uploading` records what a
    worker may have uploaded), and nothing else. Two builds to one prefix at once are not detected.
    """

    def __init__(self, uri: str, overwrite: bool, kind: str) -> None:
        self.uri, self.kind = uri, kind
        self.fs, prefix = filesystem(uri)
        self.prefix = prefix.rstrip("/")
        self.replacing = _replaceable_prefix(self.fs, uri, self.prefix, kind, overwrite)
        self.opened = False
        self.uploaded: list[str] = []  # names under the prefix this build may have written

    def shard_uri(self, name: str) -> str:
        """Where the shard `name` goes; the caller records it with `uploading` before it uploads."""
        return self.fs.unstrip_protocol(f"{self.prefix}/{name}")

    def uploading(self, names: list[str]) -> None:
        self.open()
        self.uploaded.extend(names)

    def open(self) -> None:
        if self.opened:
            return
        try:
            now = _manifest_text(self.fs, self.prefix, self.kind)
        except OSError as exc:
            raise OutputError(f"cannot read {self.uri}: {exc}; this build was discarded.") from None
        if now != (None if self.replacing is None else self.replacing[0]):
            raise OutputError(f"{self.uri} changed while this build ran; it was left as it is, and this build discarded.")
        self.opened = True
        if self.replacing is not None:  # unpublish it: its shards are about to be overwritten
            self._writing(lambda: self.fs.rm_file(f"{self.prefix}/{self.kind}"))

    def publish(self, built: Path) -> None:
        """Upload the files of `built` (the manifest last), then delete the replaced output's other shards."""
        shards = sorted(p.name for p in built.iterdir() if p.name != self.kind)
        self.uploading([*shards, self.kind])
        self._writing(lambda: self.fs.put([str(built / name) for name in shards], [f"{self.prefix}/{name}" for name in shards]))
        self._writing(lambda: self.fs.put_file(str(built / self.kind), f"{self.prefix}/{self.kind}"))
        if self.replacing is not None:
            ours = set(self.uploaded)
            try:
                _delete(self.fs, [f"{self.prefix}/{s.name}" for s in self.replacing[1].shards if s.name not in ours])
            except OSError as exc:
                raise OutputError(f"{self.uri} is published, but the replaced build's other shards could not be deleted: {exc}.") from None
        self.uploaded = []  # published: nothing to discard any more

    def discard(self) -> None:
        """Delete what this build uploaded (an unfinished build), if anything."""
        if self.uploaded:
            _delete(self.fs, [f"{self.prefix}/{name}" for name in self.uploaded])
            self.uploaded = []

    def _writing(self, write) -> None:
        try:
            write()
        except OSError as exc:
            try:
                self.discard()
            except OSError as cleanup:
                raise OutputError(f"cannot write {self.uri}: {exc}; nor delete what this build uploaded: {cleanup}.") from None
            raise OutputError(f"cannot write {self.uri}: {exc}; what this build uploaded was deleted.") from None


def _replaceable_prefix(
    fs: Any, uri: str, prefix: str, kind: str, overwrite: bool
) -> tuple[bytes, Manifest | StoreManifest] | None:
    """The manifest (text, parsed) of the output at `prefix` that this build will replace, or None
    when the prefix is empty; else OutputError."""
    try:
        objects = _objects(fs, prefix)
        text = _manifest_text(fs, prefix, kind)
    except OSError as exc:
        raise OutputError(f"cannot read {uri}: {exc}.") from None
    if not objects:
        return None
    refusal = f"{uri} is not a prepack {_KINDS[kind]}, so prepack will not replace or delete it"
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
