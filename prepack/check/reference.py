"""`prepack verify BUILD --reference DIR`: stored reference log-probabilities checked against their manifest and
the build (`prepack.formats.reference`, `schemas/reference-logps.md`).

In order: `reference.json` read strictly; of this build (its fingerprint and shard count, and each file's
build shard sha256 and rows against the build manifest's); complete (a file per shard); then every file:
a regular file of its listed size and sha256, an Arrow stream of the format's schema and one batch, a row
per pack of its build shard, as many values per row as the pack holds documents (from the shard's
`cu_seqlens`), every value finite and at most 0. Each file's first problem is reported.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from prepack.check.verify import Problem
from prepack.errors import FormatError, InputError
from prepack.formats.common import FormatProblem
from prepack.formats.reference import (
    REFERENCE_MANIFEST,
    build_shard_documents,
    read_reference_file,
    read_reference_manifest,
    unfinished,
)
from prepack.formats.shards import read_manifest, shard_path
from prepack.storage.remote import is_uri

__all__ = ["verify_reference"]


def verify_reference(build: str | os.PathLike, directory: str | os.PathLike) -> list[Problem]:
    """Every problem of the reference directory `directory` as the values of the local build `build`."""
    if is_uri(build) or is_uri(directory):
        raise InputError("--reference checks a local build against a local directory; copy them from object storage first.")
    build, directory = Path(build), Path(directory)
    manifest = read_manifest(build)
    try:
        reference = read_reference_manifest(directory, manifest)
    except FormatError as exc:
        return [_problem(exc.problem)]
    problems = []
    if not reference.complete:
        problems.append(Problem(file=str(directory / REFERENCE_MANIFEST), column="files", message=f"{unfinished(reference)}."))
    for index, file in enumerate(reference.files):
        info = manifest.shards[index]
        try:
            documents = functools.partial(build_shard_documents, manifest, shard_path(build, index, info), info)
            read_reference_file(directory, file, documents, check_sha256=True)
        except FormatError as exc:
            problems.append(_problem(exc.problem))
    return problems


def _problem(found: FormatProblem) -> Problem:
    return Problem(file=found.file, row=found.row, column=found.column, message=found.message)
