"""Exports: a build written in the format another training stack reads as its own (`prepack export`).

    result = export_build("packed/", "parquet", "packed-parquet/")
    problems = verify_export("packed-parquet/", "packed/")     # [] while it is still that build's export

Each format is a module of this package named in `FORMATS`, with one function `write(batches, directory,
build, scratch)` (`prepack.exports.common` says what it gets). `export_build` reads the build (full, index, mixture:
`pack_batches`), has the format write into a staging directory beside `out`, records `export.json` (format,
its version, the build's fingerprint, options, every file's size and sha256) and publishes the directory in
one rename, as a build is published (`prepack.storage.output.staged_directory`): whole, or not at all, and
never over anything at `out`. Building wing: no torch.
"""

from __future__ import annotations

import json
import os
import stat
from importlib import import_module
from importlib.metadata import version
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import Field, ValidationError

from prepack.errors import DISTRIBUTION, FormatError, InputError
from prepack.exports.common import ExportBuild, open_export_build, pack_batches
from prepack.formats.common import StrictModel, load_manifest_json
from prepack.formats.shards import check_shard_sha256, shard_file_problems, shard_sha256
from prepack.storage.output import output_errors, staged_directory

__all__ = ["EXPORT_MANIFEST_NAME", "FORMATS", "ExportFile", "ExportManifest", "ExportResult", "export_build", "verify_export"]

EXPORT_MANIFEST_NAME = "export.json"


class ExportFormat(NamedTuple):
    module: str  # the module whose `write` writes it
    version: int  # the version of its layout: raised when the files a reader sees change


# The formats `prepack export --to` takes, by name. A new format: its module, and one line here.
FORMATS: dict[str, ExportFormat] = {
    "parquet": ExportFormat("prepack.exports.parquet", 1),
    "lance": ExportFormat("prepack.exports.lance", 1),
    "megatron": ExportFormat("prepack.exports.megatron", 1),
    "olmo-core": ExportFormat("prepack.exports.olmo_core", 1),
}


class ExportFile(StrictModel):
    path: str = Field(description="Relative to the export, '/'-separated.")
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class SourceBuildRecord(StrictModel):
    """The build an export was written from, as `verify_export` finds it again."""

    name: str = Field(description="The build directory's name.")
    kind: str = Field(description="full, index, mixture full or mixture index.")
    fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$", description="The build's manifest fingerprint (its documents).")
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the build's manifest.json: its shards' sha256 and options.")
    packs: int = Field(ge=0)
    tokens: int = Field(ge=0)


class ExportManifest(StrictModel):
    """`export.json`, written last: what `verify_export` holds an export to."""

    export_version: Literal[1] = 1
    prepack_version: str
    format: str
    format_version: int = Field(ge=1)
    options: dict[str, str | int | float | bool | None] = Field(description="The export's own options (none yet).")
    build: SourceBuildRecord
    files: list[ExportFile] = Field(description="Every file of the export but export.json, by path.")


class ExportResult(NamedTuple):
    path: Path
    manifest: ExportManifest


def export_build(build: str | os.PathLike, to: str, out: str | os.PathLike) -> ExportResult:
    """Write the local build at `build` as format `to` (a name in `FORMATS`) into the new directory `out`.

    The packs stream from the build (`pack_batches`: a full build's shards memory-mapped, an index build's
    gathered from its store a bounded batch at a time). Same build, same format: byte-identical files
    (Lance excepted: its file names and manifests carry random ids and times, its rows are identical).
    Raises InputError for an unknown format or a build the format cannot hold, OutputError when `out`
    exists (an export never replaces anything) or another export to it runs, FormatError for a build
    that breaks its format."""
    if to not in FORMATS:
        raise InputError(f"--to {to!r}: prepack exports to {', '.join(sorted(FORMATS))}.")
    out = Path(out)
    source = open_export_build(build)
    if out.resolve().is_relative_to(source.path.resolve()):
        raise InputError(f"--out {out} lies inside the build {build}, which holds prepack's files alone; choose a directory beside it.")
    chosen = FORMATS[to]
    writer = import_module(chosen.module)
    with staged_directory(out, overwrite=False, overwrite_option=None) as staging:
        writer.write(pack_batches(source), staging.build, source, staging.scratch)
        manifest = ExportManifest(
            prepack_version=version(DISTRIBUTION),
            format=to,
            format_version=chosen.version,
            options={},
            build=_record(source),
            files=list(_files(staging.build)),
        )
        _write_manifest(staging.build, manifest)
    return ExportResult(out, manifest)


def _record(source: ExportBuild) -> SourceBuildRecord:
    t = source.manifest.totals
    return SourceBuildRecord(
        name=source.name, kind=source.kind, fingerprint=source.manifest.fingerprint,
        manifest_sha256=source.manifest_sha256, packs=t.packs, tokens=t.tokens,
    )


def _files(directory: Path):
    """Every file under `directory` but export.json, in path order, with its size and sha256."""
    for path in sorted(p for p in directory.rglob("*") if not p.is_dir()):
        name = path.relative_to(directory).as_posix()
        if name != EXPORT_MANIFEST_NAME:
            yield ExportFile(path=name, bytes=path.stat().st_size, sha256=shard_sha256(path))


def _write_manifest(directory: Path, manifest: ExportManifest) -> None:
    path = directory / EXPORT_MANIFEST_NAME
    with output_errors(path):
        path.write_text(json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_export_manifest(directory: str | os.PathLike) -> ExportManifest:
    """`export.json` of the export `directory`, strictly validated. FormatError when it is missing or not one."""
    try:
        path, raw = load_manifest_json(directory, EXPORT_MANIFEST_NAME, EXPORT_MANIFEST_NAME)
    except FileNotFoundError:
        raise FormatError(f"{Path(directory) / EXPORT_MANIFEST_NAME} does not exist: {directory} is not a prepack export.") from None
    try:
        return ExportManifest.model_validate(raw, strict=True)
    except ValidationError as exc:
        raise FormatError(f"{path} is not a valid prepack export record:\n{exc}") from None


def verify_export(export: str | os.PathLike, build: str | os.PathLike, *, check_build: bool = True) -> list[str]:
    """The ways the export at `export` is no longer the export of the build at `build`, as messages ([] when
    it still is): the build's manifest changed (other packs, options or shards); a shard of the build is
    missing, not a regular file, or of another size or sha256 than its manifest lists (`check_build`; the
    CLI, which has just verified the build, passes False); a file the record lists is missing, not a regular
    file, or of another size or sha256; a file is there that the record does not list. FormatError when
    `export` has no valid export.json or `build` is not a build."""
    export = Path(export)
    record = read_export_manifest(export)
    source = open_export_build(build)
    problems = list(_changed_shards(source)) if check_build else []
    if source.manifest_sha256 != record.build.manifest_sha256:
        problems.append(
            f"{export / EXPORT_MANIFEST_NAME}: written from the build whose manifest.json has sha256 "
            f"{record.build.manifest_sha256} (fingerprint {record.build.fingerprint}); {build}'s is now "
            f"{source.manifest_sha256} (fingerprint {source.manifest.fingerprint}): the build changed, export it again."
        )
    listed = {file.path for file in record.files}
    for file in record.files:
        path = export / file.path
        try:
            status = os.lstat(path)
        except FileNotFoundError:
            problems.append(f"{path}: missing; {EXPORT_MANIFEST_NAME} lists it with {file.bytes} bytes.")
            continue
        if not stat.S_ISREG(status.st_mode):
            problems.append(f"{path}: not a regular file; prepack exports regular files only.")
        elif status.st_size != file.bytes:
            problems.append(f"{path}: {status.st_size} bytes, but {EXPORT_MANIFEST_NAME} says {file.bytes}: the file changed.")
        elif (digest := shard_sha256(path)) != file.sha256:
            problems.append(f"{path}: sha256 {digest}, but {EXPORT_MANIFEST_NAME} says {file.sha256}: the file changed.")
    for path in sorted(export.rglob("*")):
        name = path.relative_to(export).as_posix()
        if name != EXPORT_MANIFEST_NAME and name not in listed and not path.is_dir():
            problems.append(f"{path}: not listed in {EXPORT_MANIFEST_NAME}; the export did not write it.")
    return problems


def _changed_shards(source: ExportBuild):
    """The build's shard files that are not those its manifest lists (`shard_file_problems`, then each
    sound one's sha256, `check_shard_sha256`), as messages."""
    damaged = set()
    for problem in shard_file_problems(source.path, source.manifest):
        damaged.add(problem.index)
        yield f"{source.path / problem.file}: {problem.message}"
    for index, info in enumerate(source.manifest.shards):
        if index not in damaged:
            try:
                check_shard_sha256(source.path / info.name, info)
            except FormatError as exc:
                yield f"{exc} The build is no longer the one exported: export it again."
