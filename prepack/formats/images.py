"""The image set: a corpus's images stored once, beside its build, as `schemas/image-set.md` describes.

An image set is a directory of three files: `images.json` (`ImageSetManifest`), `images.arrow` (each
distinct image once: its sha256, its encoded bytes, its size and its placeholder count) and
`documents.arrow` (for every corpus row, the numbers of its images in token order). The rule that
counts an image's placeholders from its size (`ImageRule`) is recorded in the manifest, so that a reader
recounts them without the processor. No torch, no Pillow here.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, model_validator

from prepack.formats.common import (
    COUNT_MAX,
    INT32_MAX,
    StrictModel,
    list_column,
    load_manifest_json,
    map_regular,
    read_one_batch,
    refuse,
)

__all__ = [
    "DOCUMENTS_FILE",
    "IMAGES_FILE",
    "IMAGE_SET_MANIFEST",
    "IMAGE_SET_VERSION",
    "DOCUMENTS_SCHEMA",
    "IMAGES_SCHEMA",
    "ImageLimits",
    "ImageRule",
    "ImageSet",
    "ImageSetFile",
    "ImageSetManifest",
    "MAX_IMAGE_PIXELS",
    "glm4v_resize",
    "pixtral_grid",
    "read_image_set",
    "smart_resize",
    "tiled_canvas",
]

IMAGE_SET_VERSION = 1
IMAGE_SET_MANIFEST = "images.json"
IMAGES_FILE = "images.arrow"
DOCUMENTS_FILE = "documents.arrow"
IMAGES_SCHEMA = pa.schema(
    [
        pa.field("sha256", pa.binary(32), nullable=False),
        pa.field("data", pa.large_binary(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("tokens", pa.int32(), nullable=False),
    ]
)
DOCUMENTS_SCHEMA = pa.schema(
    [pa.field("images", pa.list_(pa.field("item", pa.uint32(), nullable=False)), nullable=False)]
)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1
) -> tuple[int, int]:
    """Qwen2-VL's resize rule (transformers' `smart_resize`): sides rounded to multiples of `factor`,
    the area brought within [min_pixels, max_pixels] keeping the aspect ratio. Python's round() (half to
    even), floor and ceil, as there; `tests/formats/test_images.py` compares it with transformers'.
    `frames`: the area counted over that many frames (GLM-4V's, `glm4v_resize`; 1 leaves Qwen's rule as it is)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an aspect ratio of more than 200 ({width}x{height})")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def glm4v_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int) -> tuple[int, int]:
    """GLM-4V's resize rule (transformers' glm4v `smart_resize` for one image, which it takes as `frames` frames,
    its temporal_patch_size): a side under `factor` scales the image up first (truncated to whole pixels), then
    Qwen2-VL's rule over the frames' area. `tests/building/test_image_chat.py` compares it with transformers'."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    return smart_resize(height, width, factor, min_pixels, max_pixels, frames)


def pixtral_grid(height: int, width: int, cell: int, longest_edge: int) -> tuple[int, int]:
    """(rows, columns) of `cell`-pixel cells Pixtral's image processor makes of an image (transformers'
    `get_resize_output_image_size`): scaled down, floored, to fit `longest_edge` (never up), then each side
    rounded up to whole cells. The same float operations as there; `tests/building/test_image_chat.py` compares it
    with transformers' PixtralProcessor."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return (height - 1) // cell + 1, (width - 1) // cell + 1


def tiled_canvas(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of the square `tile`-pixel tiles GOT-OCR2's image processor crops an image into (transformers'
    `get_optimal_tiled_canvas`, as InternVL tiles): of the arrangements of min_tiles to max_tiles tiles, by tile
    count, the one whose aspect ratio is nearest the image's; a tie goes to the later one while the image's area is
    more than half the tiles'. `tests/building/test_image_chat.py` compares it with transformers' processor."""
    arrangements = sorted(
        ((columns, rows) for columns in range(1, max_tiles + 1) for rows in range(1, max_tiles + 1)
         if min_tiles <= columns * rows <= max_tiles),
        key=lambda grid: grid[0] * grid[1],
    )
    aspect, area = width / height, width * height
    nearest, best = float("inf"), (1, 1)
    for columns, rows in arrangements:
        difference = abs(aspect - columns / rows)
        if difference < nearest:
            nearest, best = difference, (columns, rows)
        elif difference == nearest and area > 0.5 * tile * tile * columns * rows:
            best = (columns, rows)
    return best


def _unless_set(value) -> bool:
    """A field later kinds added is left out of the manifest when unset, so that earlier kinds' bytes stay."""
    return value is None


class ImageRule(StrictModel):
    """How many placeholder tokens an image becomes, and the text that stands for it before tokenizing."""

    kind: Literal["grid", "fixed", "rows", "glm4v_grid", "tiles"] = Field(
        description="grid: Qwen2-VL's resize rule, one token per merge_size² patches; fixed: `tokens` per image; "
        "rows: Pixtral's (Mistral 3's) resize within longest_edge, one token per patch_size² cell, each row of cells "
        "followed by `row_end` but the last, followed by `end`; glm4v_grid: GLM-4V's resize rule over `frames` "
        "frames, one token per merge_size² patches; tiles: GOT-OCR2's tiling (InternVL's), `tokens` per view: "
        "each patch_size tile of the nearest canvas of min_tiles to max_tiles tiles, and a thumbnail when more than one."
    )
    placeholder: str = Field(min_length=1, description="The placeholder token's text, repeated once per token.")
    start: str = Field(description="Text before an image's placeholders (may be empty).")
    end: str = Field(description="Text after an image's placeholders (may be empty).")
    patch_size: int | None = Field(default=None, ge=1, le=4096)
    merge_size: int | None = Field(default=None, ge=1, le=64)
    min_pixels: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_pixels: int | None = Field(default=None, ge=1, le=INT32_MAX)
    tokens: int | None = Field(default=None, ge=1, le=65_536)
    longest_edge: int | None = Field(default=None, ge=1, le=65_536, exclude_if=_unless_set)
    row_end: str | None = Field(default=None, min_length=1, exclude_if=_unless_set,
                                description="rows: the text after each row of placeholders but the last.")
    frames: int | None = Field(default=None, ge=1, le=64, exclude_if=_unless_set,
                               description="glm4v_grid: the frames an image counts as (its temporal_patch_size).")
    min_tiles: int | None = Field(default=None, ge=1, le=64, exclude_if=_unless_set)
    max_tiles: int | None = Field(default=None, ge=1, le=64, exclude_if=_unless_set)

    @model_validator(mode="after")
    def _complete(self) -> ImageRule:
        """The fields its kind counts with are there (a manifest may leave out any field)."""
        needed = {"grid": ("patch_size", "merge_size", "min_pixels", "max_pixels"), "fixed": ("tokens",),
                  "rows": ("patch_size", "longest_edge", "row_end"),
                  "glm4v_grid": ("patch_size", "merge_size", "min_pixels", "max_pixels", "frames"),
                  "tiles": ("tokens", "patch_size", "min_tiles", "max_tiles")}[self.kind]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.kind} rule needs {', '.join(missing)}")
        if self.kind == "tiles" and self.min_tiles > self.max_tiles:
            raise ValueError(f"min_tiles {self.min_tiles} is more than max_tiles {self.max_tiles}")
        if self.kind in ("grid", "glm4v_grid") and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} is more than max_pixels {self.max_pixels}")
        return self

    def placeholders(self, width: int, height: int) -> int:
        if self.kind == "fixed":
            return self.tokens
        if self.kind == "rows":
            rows, columns = pixtral_grid(height, width, self.patch_size, self.longest_edge)
            return rows * columns
        if self.kind == "tiles":
            columns, rows = tiled_canvas(height, width, self.patch_size, self.min_tiles, self.max_tiles)
            tiles = columns * rows if self.max_tiles > 1 else 1
            return self.tokens * (tiles + 1 if tiles > 1 else 1)  # the thumbnail after several tiles
        factor = self.patch_size * self.merge_size
        if self.kind == "glm4v_grid":
            resized_h, resized_w = glm4v_resize(height, width, factor, self.min_pixels, self.max_pixels, self.frames)
        else:
            resized_h, resized_w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        return (resized_h // self.patch_size) * (resized_w // self.patch_size) // self.merge_size**2

    def text(self, width: int, height: int) -> str:
        if self.kind == "rows":
            rows, columns = pixtral_grid(height, width, self.patch_size, self.longest_edge)
            return self.start + self.row_end.join([self.placeholder * columns] * rows) + self.end
        return self.start + self.placeholder * self.placeholders(width, height) + self.end


# The most pixels (width x height) an image may decode to by default, in `prepare-images` and in the training
# `VisionCollator` alike, so that an image set never holds an image training refuses: well below Pillow's
# decompression-bomb warning (89,478,485), as four such images already take 512 MiB decoded.
MAX_IMAGE_PIXELS = 32 * 2**20


class ImageLimits(StrictModel):
    max_image_bytes: int = Field(default=32 * 2**20, ge=1, le=2**31, description="Largest encoded image.")
    max_pixels: int = Field(
        default=MAX_IMAGE_PIXELS, ge=1, le=2**31, description="Largest width x height (VisionCollator's default too)."
    )
    max_images_per_document: int = Field(default=64, ge=1, le=65_536)


class ImageSetFile(StrictModel):
    name: Literal["images.arrow", "documents.arrow"]
    bytes: int = Field(ge=1, le=COUNT_MAX)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ImageSetManifest(StrictModel):
    image_set_version: Literal[1]
    rule: ImageRule
    placeholder_id: int = Field(ge=0, le=INT32_MAX, description="The placeholder token's id in the tokenizer.")
    limits: ImageLimits
    documents: int = Field(ge=0, le=COUNT_MAX, description="Corpus rows, with or without images.")
    images: int = Field(ge=0, le=COUNT_MAX, description="Distinct images (by sha256).")
    references: int = Field(ge=0, le=COUNT_MAX, description="Images over all rows, repeats counted.")
    image_tokens: int = Field(ge=0, le=COUNT_MAX, description="Placeholder tokens over all rows.")
    files: tuple[ImageSetFile, ImageSetFile]


class ImageSet:
    """A read image set: the manifest, and per corpus row the numbers of its images (`images_of`)."""

    def __init__(self, directory: Path, manifest: ImageSetManifest, images: pa.RecordBatch, documents: pa.RecordBatch):
        self.directory, self.manifest = directory, manifest
        self._data = images.column("data")
        self.sha256 = images.column("sha256")
        self.widths = images.column("width").to_numpy()
        self.heights = images.column("height").to_numpy()
        self.tokens = images.column("tokens").to_numpy()
        self._offsets, self._numbers = list_column(documents, "images", str(directory / DOCUMENTS_FILE))

    def images_of(self, row: int) -> np.ndarray:
        """The numbers of corpus row `row`'s images, in token order."""
        return self._numbers[self._offsets[row] : self._offsets[row + 1]]

    def data(self, number: int) -> bytes:
        return self._data[number].as_py()

    def row_tokens(self) -> np.ndarray:
        """Placeholder tokens per corpus row."""
        per_reference = self.tokens[self._numbers].astype(np.int64)
        return np.add.reduceat(np.append(per_reference, 0), self._offsets[:-1]) * (np.diff(self._offsets) > 0)


def read_image_set(directory: str | os.PathLike, *, verify: bool = False) -> ImageSet:
    """Read and check an image set (FormatError naming file, row and column). `verify` also hashes the
    files and every image, and recounts every image's placeholders by the rule; Pillow is not needed."""
    directory = Path(directory)
    try:
        where, value = load_manifest_json(directory, IMAGE_SET_MANIFEST, IMAGE_SET_MANIFEST)
    except FileNotFoundError:
        refuse(directory, f"no {IMAGE_SET_MANIFEST}: not an image set.")
    if isinstance(value, dict) and value.get("image_set_version") != IMAGE_SET_VERSION:
        found = value.get("image_set_version")
        refuse(where, f"image_set_version {found!r} is not one this prepack reads ({IMAGE_SET_VERSION}).")
    try:
        manifest = ImageSetManifest.model_validate(value)
    except ValueError as exc:
        refuse(where, f"is not a valid image set manifest: {exc}")
    if [file.name for file in manifest.files] != [IMAGES_FILE, DOCUMENTS_FILE]:
        refuse(where, f"files must list {IMAGES_FILE} and {DOCUMENTS_FILE}, in that order.", column="files")
    batches = {}
    for file, schema in zip(manifest.files, (IMAGES_SCHEMA, DOCUMENTS_SCHEMA)):
        path = directory / file.name
        data = map_regular(path, "image set file")
        if data.size != file.bytes:
            refuse(path, f"holds {data.size} bytes; {IMAGE_SET_MANIFEST} says {file.bytes}.", column="bytes")
        if verify and hashlib.sha256(data).hexdigest() != file.sha256:
            refuse(path, f"its sha256 is not the one {IMAGE_SET_MANIFEST} records.", column="sha256")
        batch = read_one_batch(
            data, "image set file", str(path), lambda found, schema=schema, path=path: _schema(found, schema, path)
        )
        try:
            batch.validate(full=True)
        except pa.ArrowInvalid as exc:
            refuse(path, f"its columns are not valid Arrow data ({exc}).")
        batches[file.name] = batch
    images, documents = batches[IMAGES_FILE], batches[DOCUMENTS_FILE]
    image_set = ImageSet(directory, manifest, images, documents)
    _check_counts(image_set, images, documents)
    if verify:
        _verify_images(image_set)
    return image_set


def _schema(found: pa.Schema, expected: pa.Schema, path: Path) -> None:
    if not found.remove_metadata().equals(expected):
        refuse(path, f"its schema is {found.remove_metadata()}, not {expected}.")


def _check_counts(image_set: ImageSet, images: pa.RecordBatch, documents: pa.RecordBatch) -> None:
    manifest, manifest_file = image_set.manifest, image_set.directory / IMAGE_SET_MANIFEST
    documents_file = image_set.directory / DOCUMENTS_FILE
    if images.num_rows != manifest.images or documents.num_rows != manifest.documents:
        refuse(manifest_file, f"counts {manifest.images} images and {manifest.documents} rows; the files hold "
               f"{images.num_rows} and {documents.num_rows}.", column="images")
    numbers = image_set._numbers
    if len(numbers) != manifest.references:
        refuse(manifest_file, f"counts {manifest.references} references; {DOCUMENTS_FILE} holds {len(numbers)}.",
               column="references")
    if len(numbers) and int(numbers.max()) >= manifest.images:
        row = int(np.searchsorted(image_set._offsets, int(np.argmax(numbers >= manifest.images)), side="right")) - 1
        refuse(documents_file, f"refers to image {int(numbers.max())}; the set holds {manifest.images}.", row=row,
               column="images")
    per_row = np.diff(image_set._offsets)
    if len(per_row) and int(per_row.max()) > manifest.limits.max_images_per_document:
        refuse(documents_file, f"holds {int(per_row.max())} images, more than the limit "
               f"{manifest.limits.max_images_per_document}.", row=int(np.argmax(per_row)), column="images")
    if int(image_set.tokens[numbers].astype(np.int64).sum()) != manifest.image_tokens:
        refuse(manifest_file, "image_tokens is not the sum of the rows' placeholder tokens.", column="image_tokens")


def _verify_images(image_set: ImageSet) -> None:
    where, rule, limits = image_set.directory / IMAGES_FILE, image_set.manifest.rule, image_set.manifest.limits
    seen = set()
    for number in range(image_set.manifest.images):
        data = image_set.data(number)
        digest = image_set.sha256[number].as_py()
        if hashlib.sha256(data).digest() != digest:
            refuse(where, "the image's bytes do not have the sha256 recorded beside them.", row=number, column="sha256")
        if digest in seen:
            refuse(where, "the image is stored twice; an image set holds each image once.", row=number, column="sha256")
        seen.add(digest)
        width, height = int(image_set.widths[number]), int(image_set.heights[number])
        if len(data) > limits.max_image_bytes or width < 1 or height < 1 or width * height > limits.max_pixels:
            refuse(where, f"the image ({len(data)} bytes, {width}x{height}) is outside the set's limits.", row=number,
                   column="data")
        try:
            expected = rule.placeholders(width, height)
        except ValueError as exc:
            refuse(where, f"no placeholder count for the image: {exc}.", row=number, column="width")
        if int(image_set.tokens[number]) != expected:
            refuse(where, f"records {int(image_set.tokens[number])} placeholder tokens; the rule gives {expected} for "
                   f"{width}x{height}.", row=number, column="tokens")

