"""`prepack verify BUILD --images DIR`: an image set checked, and checked against the build it serves;
`prepack inspect BUILD --images DIR`: the build's image and text tokens and the padding packing saves.

The image set alone (`read_image_set(verify=True)`): its files' sizes and sha256, every image's sha256,
limits and placeholder count by the recorded rule; then each image's header read again (Pillow) must give
the recorded width and height, and with `decode` every image is decoded as the training loader decodes it
(`prepack.sources.images.decode_failure`; off by default: decoding an image takes many times as long as
hashing it, `python benchmarks/bench_image_checks.py` prints both). Against a full build: the set
describes as many corpus rows as the build read, and every pack holds exactly the placeholder tokens of
its documents' images (a document cut by truncation or splitting, or a build of another corpus, fails
here). An index build's tokens lie in its store: only the row count is compared there. A build with an image
cap (`prepack build --max-images-per-pack M --images DIR`) must name this image set (the sha256 of its
images.json) and hold at most M images in every pack, each document counting its row's images; inspect
reports the images per pack (most and mean) of any build.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np

from prepack.check.report import InspectReport
from prepack.check.verify import Problem
from prepack.errors import FormatError, InputError, optional_imports
from prepack.formats.common import StrictModel, list_column
from prepack.formats.images import IMAGE_SET_MANIFEST, IMAGES_FILE, ImageSet, read_image_set
from prepack.formats.shards import Manifest, read_manifest, shard_path

__all__ = ["ImageReport", "image_report", "images_checked", "verify_images"]


class ImageReport(StrictModel):
    """What `inspect --images` adds: the packs' tokens by kind, and the padding packing saves (from the
    build's own report: `cost.pad_to_longest_in_batch` and `cost.pad_to_max_len` against `cost.packed`)."""

    images: int  # distinct images in the set
    image_references: int  # images over the corpus rows, repeats counted
    image_tokens: int  # placeholder tokens in the packs
    text_tokens: int  # every other token in the packs
    image_token_share: float
    padding_saved_vs_longest_in_batch: int  # padding tokens of random batches padded to their longest, less the packs'
    padding_saved_vs_max_len: int  # padding tokens of one document per max_len row, less the packs'
    images_per_pack_max: int  # the most images a pack holds, each document counting its row's (repeats counted)
    images_per_pack_mean: float


def image_report(build: str | os.PathLike, images: str | os.PathLike, report: InspectReport) -> ImageReport:
    """The image lines of `inspect` for a local build, full or index, and its image set (read, not verified)."""
    build, image_set = Path(build), read_image_set(images)
    manifest = read_manifest(build)
    if (mismatch := _rows_mismatch(image_set, manifest)) is not None:
        raise InputError(f"{Path(images) / IMAGE_SET_MANIFEST}, column 'documents': {mismatch}")
    row_tokens = image_set.row_tokens()
    image_tokens = 0
    per_pack = []
    for index, info in enumerate(manifest.shards):
        # A full shard or an index shard: both name their documents' corpus rows in `source_rows`.
        batch = manifest.open_shard(shard_path(build, index, info))
        row_offsets, rows = list_column(batch, "source_rows", info.name)
        image_tokens += int(row_tokens[rows].sum())
        per_pack.append(_images_per_pack(image_set, row_offsets, rows))
    per_pack = np.concatenate(per_pack) if per_pack else np.zeros(0, np.int64)
    cost = report.cost
    return ImageReport(
        images=image_set.manifest.images,
        image_references=image_set.manifest.references,
        image_tokens=image_tokens,
        text_tokens=report.tokens - image_tokens,
        image_token_share=image_tokens / report.tokens if report.tokens else 0.0,
        padding_saved_vs_longest_in_batch=cost.pad_to_longest_in_batch.padding_tokens - cost.packed.padding_tokens,
        padding_saved_vs_max_len=cost.pad_to_max_len.padding_tokens - cost.packed.padding_tokens,
        images_per_pack_max=int(per_pack.max()) if len(per_pack) else 0,
        images_per_pack_mean=float(per_pack.mean()) if len(per_pack) else 0.0,
    )


def _images_per_pack(image_set: ImageSet, row_offsets: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Images of every pack of a shard (its `source_rows` offsets and rows), each document counting its row's."""
    counted = np.append(0, np.cumsum(image_set.row_images()[rows]))
    return counted[row_offsets[1:]] - counted[row_offsets[:-1]]


def _cap_problems(build: Path, images: Path, image_set: ImageSet, manifest: Manifest) -> list[Problem]:
    """A build's image cap against this image set: the set it counted, and no pack over the cap."""
    cap = manifest.options.max_images_per_pack
    if cap is None:
        return []
    found = hashlib.sha256((images / IMAGE_SET_MANIFEST).read_bytes()).hexdigest()
    if found != manifest.options.image_set:
        return [Problem(file=str(images / IMAGE_SET_MANIFEST), column="image_set", message=(
            f"its sha256 is {found}; the build's image cap counted the image set of {manifest.options.image_set}: "
            "not the image set this build was planned with."))]
    problems = []
    for index, info in enumerate(manifest.shards):
        batch = manifest.open_shard(shard_path(build, index, info))
        per_pack = _images_per_pack(image_set, *list_column(batch, "source_rows", info.name))
        for row in np.flatnonzero(per_pack > cap):
            problems.append(Problem(file=info.name, row=int(row), column="source_rows", message=(
                f"{int(per_pack[row])} images, more than the manifest's max_images_per_pack = {cap}.")))
    return problems


def verify_images(build: str | os.PathLike, images: str | os.PathLike, *, decode: bool = False) -> list[Problem]:
    """Every problem of the image set `images` and of its agreement with the local build `build`; with
    `decode`, also every image that does not decode."""
    build, images = Path(build), Path(images)
    try:
        image_set = read_image_set(images, verify=True)
    except FormatError as exc:
        problem = exc.problem
        return [Problem(file=str(problem.file), row=problem.row, column=problem.column, message=problem.message)]
    problems = _header_problems(image_set, decode)
    manifest = read_manifest(build)
    if (mismatch := _rows_mismatch(image_set, manifest)) is not None:
        problems.append(Problem(file=str(images / IMAGE_SET_MANIFEST), column="documents", message=mismatch))
        return problems
    problems += _cap_problems(build, images, image_set, manifest)
    if manifest.store is not None:
        return problems
    row_tokens = image_set.row_tokens()
    for index, info in enumerate(manifest.shards):
        batch = manifest.open_shard(shard_path(build, index, info))
        token_offsets, ids = list_column(batch, "input_ids", info.name)
        row_offsets, rows = list_column(batch, "source_rows", info.name)
        is_placeholder = np.append(0, np.cumsum(ids == image_set.manifest.placeholder_id))
        found = is_placeholder[token_offsets[1:]] - is_placeholder[token_offsets[:-1]]
        per_pack = np.append(0, np.cumsum(row_tokens[rows]))
        expected = per_pack[row_offsets[1:]] - per_pack[row_offsets[:-1]]
        for row in np.flatnonzero(found != expected):
            problems.append(Problem(file=info.name, row=int(row), column="input_ids", message=(
                f"the pack holds {int(found[row])} image placeholder tokens; its documents' images make "
                f"{int(expected[row])} (a document's images cut, or another corpus).")))
        if image_set.manifest.video_rule is not None:
            problems += _video_problems(image_set, info.name, token_offsets, ids, row_offsets, rows)
    return problems


def _video_problems(image_set: ImageSet, shard: str, token_offsets, ids, row_offsets, rows) -> list[Problem]:
    """The packs of one shard whose video placeholder tokens are not those of their documents' videos."""
    is_placeholder = np.append(0, np.cumsum(ids == image_set.manifest.video_placeholder_id))
    found = is_placeholder[token_offsets[1:]] - is_placeholder[token_offsets[:-1]]
    per_pack = np.append(0, np.cumsum(image_set.row_video_tokens()[rows]))
    expected = per_pack[row_offsets[1:]] - per_pack[row_offsets[:-1]]
    return [Problem(file=shard, row=int(row), column="input_ids", message=(
        f"the pack holds {int(found[row])} video placeholder tokens; its documents' videos make {int(expected[row])} "
        "(a document's videos cut, or another corpus).")) for row in np.flatnonzero(found != expected)]


def images_checked(build: str | os.PathLike, images: str | os.PathLike, *, decode: bool = False) -> str:
    """The line a clean `verify --images` ends with: what it checked, in numbers."""
    image_set, manifest = read_image_set(images), read_manifest(Path(build))
    counts = image_set.manifest
    decoded = "every image decoded" if decode else "every header read, no image decoded (--decode decodes them)"
    against = ("the build's row count compared (an index build: its tokens lie in its store)"
               if manifest.store is not None else "matched pack by pack against the build")
    return (f"{images}: no problems ({counts.images:,} images: their {sum(f.bytes for f in counts.files):,} bytes "
            f"and every image's sha256, size and placeholder count checked, {decoded}; {counts.references:,} "
            f"references over {counts.documents:,} rows, {counts.image_tokens:,} placeholder tokens {against}).")


def _rows_mismatch(image_set: ImageSet, manifest: Manifest) -> str | None:
    """Why `image_set` cannot be the image set of the build of `manifest`, if its row count says so."""
    if image_set.manifest.documents == manifest.totals.documents:
        return None
    return (f"describes {image_set.manifest.documents} corpus rows; the build read {manifest.totals.documents}: "
            "not the image set of this build's corpus.")


def _header_problems(image_set: ImageSet, decode: bool) -> list[Problem]:
    with optional_imports("verify --images"):
        from PIL import Image

        from prepack.sources.images import decode_failure

    problems = []
    for number in range(image_set.manifest.images):
        try:
            with Image.open(io.BytesIO(image_set.data(number))) as image:
                size = image.size
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            size, why = None, f"the image cannot be read ({exc})"
        recorded = (int(image_set.widths[number]), int(image_set.heights[number]))
        if size != recorded:
            why = why if size is None else f"its header says {size[0]}x{size[1]}"
            problems.append(Problem(file=str(image_set.directory / IMAGES_FILE), row=number, column="width",
                                    message=f"{why}; the set records {recorded[0]}x{recorded[1]}."))
        elif decode and (why := decode_failure(image_set.data(number))) is not None:
            problems.append(Problem(file=str(image_set.directory / IMAGES_FILE), row=number, column="data", message=(
                f"the image cannot be decoded ({why}); the training loader would fail on it.")))
    return problems
