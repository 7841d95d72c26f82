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
from typing import Annotated, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, model_serializer, model_validator

from prepack.formats.common import (
    COUNT_MAX,
    INT32_MAX,
    StrictModel,
    list_column,
    load_manifest_json,
    map_regular,
    read_manifest_bytes,
    read_one_batch,
    refuse,
)

__all__ = [
    "DEFAULT_VIDEO_FPS",
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
    "MAX_IMAGE_TOKENS",
    "VIDEOS_FILE",
    "VIDEOS_SCHEMA",
    "VideoRule",
    "glm4v_resize",
    "lfm2_grid",
    "pixtral_grid",
    "pooled_resize",
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
# An image set with videos: per corpus row its videos in token order, each its frames (image numbers), its frame
# rate and its placeholder count (`schemas/image-set.md`).
VIDEOS_FILE = "videos.arrow"
VIDEOS_SCHEMA = pa.schema(
    [
        pa.field("frames", pa.list_(pa.field("item", pa.uint32(), nullable=False)), nullable=False),
        pa.field("frame_counts", pa.list_(pa.field("item", pa.uint32(), nullable=False)), nullable=False),
        pa.field("fps", pa.list_(pa.field("item", pa.float64(), nullable=False)), nullable=False),
        pa.field("tokens", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
    ]
)
# Frames per second of a video whose corpus record does not say: qwen-vl-utils' sampling rate (FPS = 2.0), which
# Qwen2.5-VL's `second_per_grid_ts` and Qwen3-VL's step times are written for.
DEFAULT_VIDEO_FPS = 2.0


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, *, frames: int = 1,
                 temporal: int = 1, upscale: bool = False, lfm2: bool = False) -> tuple[int, int]:
    """Qwen2-VL's resize rule (transformers' `smart_resize`): sides rounded to multiples of `factor`,
    the area brought within [min_pixels, max_pixels] keeping the aspect ratio. Python's round() (half to
    even), floor and ceil, as there; `tests/building/test_image_chat.py` compares it with transformers'.
    With `frames`, `temporal` and `upscale`, Qwen3-VL's video rule (transformers'
    `qwen3_vl.video_processing_qwen3_vl.smart_resize`, run by `tests/formats/test_video_rule.py`): the bounds
    hold for all frames together (their count rounded to a multiple of `temporal`), and a frame narrower than
    `factor` is first scaled up. With `lfm2`, LFM2-VL's (transformers' `Lfm2VlImageProcessor.smart_resize`): each
    side at least `factor` before the area is checked, and no aspect ratio refused. The defaults (one frame, no
    upscaling) are the image rule."""
    if frames < temporal:
        raise ValueError(f"{frames} frames, fewer than the temporal patch of {temporal}")
    if upscale and (height < factor or width < factor):
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if not lfm2 and max(height, width) / min(height, width) > 200:
        raise ValueError(f"an aspect ratio of more than 200 ({width}x{height})")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if lfm2:
        h_bar, w_bar = max(factor, h_bar), max(factor, w_bar)
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def glm4v_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int) -> tuple[int, int]:
    """GLM-4V's resize rule for one image (transformers' glm4v `smart_resize`, which takes the image as `frames`
    frames, its temporal_patch_size): the same rule as Qwen3-VL's for a whole video, here of `frames` frames in one
    temporal step. `tests/building/test_image_chat.py` compares it with transformers'."""
    return smart_resize(height, width, factor, min_pixels, max_pixels, frames=frames, temporal=frames, upscale=True)


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
    return _nearest_arrangement(height, width, tile, arrangements)


def _nearest_arrangement(height: int, width: int, tile: int, arrangements) -> tuple[int, int]:
    """Of the (columns, rows) `arrangements` in the processor's order, the one whose aspect ratio is nearest the
    image's; a tie goes to the later one while the image's area is more than half the tiles'."""
    aspect, area = width / height, width * height
    nearest, best = float("inf"), (1, 1)
    for columns, rows in arrangements:
        difference = abs(aspect - columns / rows)
        if difference < nearest:
            nearest, best = difference, (columns, rows)
        elif difference == nearest and area > 0.5 * tile * tile * columns * rows:
            best = (columns, rows)
    return best


def pooled_resize(height: int, width: int, patch_size: int, max_patches: int, kernel: int) -> tuple[int, int]:
    """(height, width) Gemma 4's image processor resizes an image to (transformers' gemma4
    `get_aspect_ratio_preserving_size`): the largest keeping the aspect ratio within `max_patches` patches, each side
    a multiple of `kernel` patches (a side that rounds to none is one kernel, the other its ratio's, bounded).
    ValueError where it makes no image, as there. The same float operations; `tests/building/test_image_chat.py`
    compares it with transformers' Gemma4Processor."""
    factor = math.sqrt(max_patches * patch_size**2 / (height * width))
    side = kernel * patch_size
    target_height = int(math.floor(factor * height / side)) * side
    target_width = int(math.floor(factor * width / side)) * side
    if target_height == 0 and target_width == 0:
        raise ValueError(f"it resizes to 0x0 in multiples of {side} pixels")
    longest = (max_patches // kernel**2) * side
    if target_height == 0:
        target_height, target_width = side, min(int(math.floor(width / height)) * side, longest)
    elif target_width == 0:
        target_width, target_height = side, min(int(math.floor(height / width)) * side, longest)
    if target_height * target_width > max_patches * patch_size**2:
        raise ValueError(
            f"it resizes to {target_width}x{target_height}, more than {max_patches} patches of {patch_size}")
    return target_height, target_width


def lfm2_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of the `tile`-pixel tiles LFM2-VL's image processor splits a large image into (transformers'
    `Lfm2VlImageProcessor._get_grid_layout`): GOT-OCR2's search over its own order of arrangements (a set of them
    sorted by tile count, as there, which orders ties of one count otherwise)."""
    arrangements = sorted(
        {(columns, rows) for n in range(min_tiles, max_tiles + 1) for columns in range(1, n + 1)
         for rows in range(1, n + 1) if min_tiles <= columns * rows <= max_tiles},
        key=lambda grid: grid[0] * grid[1],
    )
    return _nearest_arrangement(height, width, tile, arrangements)


def select_best_resolution(height: int, width: int, resolutions) -> tuple[int, int]:
    """LLaVA-NeXT's choice of tiling (transformers' `select_best_resolution`): of the (height, width)
    resolutions, the one that keeps most of the image's pixels when it is scaled to fit, then wastes least."""
    best, most_kept, least_wasted = None, 0, float("inf")
    for tiled_height, tiled_width in resolutions:
        scale = min(tiled_width / width, tiled_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = tiled_width * tiled_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (tiled_height, tiled_width), kept, wasted
    return best


def _unpadded_features(
    height: int, width: int, rows: int, columns: int, tile_rows: int, max_tiles: int | None
) -> tuple[int, int]:
    """(features, newlines) of a tiled image's feature grid of `rows` x `columns` once the padding its tiling added
    is cut off (transformers' `_get_unpadded_features` of LLaVA-NeXT's and LLaVA-OneVision's processors); the
    latter's `anyres_max_N` then scales a grid of more than about N tiles of `tile_rows`² features down to that."""
    current_height, current_width = rows, columns
    if width / height > current_width / current_height:
        new_height = int(round(height * (current_width / width), 7))
        current_height -= (current_height - new_height) // 2 * 2
    else:
        new_width = int(round(width * (current_height / height), 7))
        current_width -= (current_width - new_width) // 2 * 2
    features, newlines = current_height * current_width, current_height
    if max_tiles is not None and (ratio := math.sqrt(features / (max_tiles * tile_rows**2))) > 1.1:
        features, newlines = int(current_height // ratio) * int(current_width // ratio), int(current_height // ratio)
    return features, newlines


_Side = Annotated[int, Field(ge=1, le=65_536)]
# The rule fields later kinds added, each with the kinds that count with it: a rule of any other kind carrying one
# is refused (`_complete`), and is written without it, as before it existed, so that an image set prepared with the
# same options keeps its bytes.
_TILING = ("anyres", "split", "lfm2")
_KIND_FIELDS = {
    "pinpoints": ("anyres",), "tile_height": _TILING, "tile_width": ("anyres",), "feature_rows": ("anyres",),
    "feature_columns": ("anyres",), "max_tiles": ("anyres", "tiles", "lfm2"), "resize_edge": ("split",),
    "splitting": ("split", "lfm2"), "global_token": ("split", "lfm2"), "longest_edge": ("rows",),
    "row_end": ("rows",), "frames": ("glm4v_grid",), "min_tiles": ("tiles", "lfm2"), "tolerance": ("lfm2",),
}
# The most placeholder tokens one image may stand for: one per pixel of the largest image prepack decodes by default
# (MAX_IMAGE_PIXELS), well within the int32 `tokens` column, so that an image's text (its placeholders repeated) is
# never built past a few hundred MiB, and a rule whose fields are each in range but whose product is not is refused.
MAX_IMAGE_TOKENS = 32 * 2**20
# The most tiles GOT-OCR2's canvas may have (its arrangements are searched in full: max_tiles² of them).
_MAX_CANVAS_TILES = 64


# Idefics3's and SmolVLM's image processors never make a side longer than this (their MAX_IMAGE_SIZE).
_SPLIT_MAX_SIDE = 4096


def _longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """Idefics3's and SmolVLM's first resize (transformers' `get_resize_output_image_size`): the longest side to
    `longest_edge`, the other by the aspect ratio (int(), rounded up to even), then both within 4096."""
    aspect_ratio = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect_ratio = width / height
    if width >= height and width > _SPLIT_MAX_SIDE:
        width = _SPLIT_MAX_SIDE
        height = int(width / aspect_ratio)
    elif height > width and height > _SPLIT_MAX_SIDE:
        height = _SPLIT_MAX_SIDE
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


class ImageRule(StrictModel):
    """How many placeholder tokens an image becomes, and the text that stands for it before tokenizing."""

    kind: Literal["grid", "fixed", "anyres", "split", "rows", "glm4v_grid", "tiles", "pooled", "lfm2"] = Field(
        description="grid: Qwen2-VL's resize rule, one token per merge_size² patches; fixed: `tokens` per image; "
        "anyres: LLaVA-NeXT's (and LLaVA-OneVision's) tiling, the image's tiles (by `pinpoints`) unpadded with a "
        "newline per row, then `tokens` for the whole image; split: Idefics3's and SmolVLM's, the image resized to "
        "whole tiles, `tokens` per tile and for the whole image, in the processor's text of rows and columns; "
        "rows: Pixtral's (Mistral 3's) resize within longest_edge, one token per patch_size² cell, each row of cells "
        "followed by `row_end` but the last, followed by `end`; glm4v_grid: GLM-4V's resize rule over `frames` "
        "frames, one token per merge_size² patches; tiles: GOT-OCR2's tiling (InternVL's), `tokens` per view: "
        "each patch_size tile of the nearest canvas of min_tiles to max_tiles tiles, and a thumbnail when more than "
        "one; pooled: Gemma 4's resize keeping the aspect ratio within `tokens` x merge_size² patches of patch_size, "
        "each side a multiple of merge_size patches, one token per merge_size² patches; "
        "lfm2: LFM2-VL's, an image over its pixels (max_pixels x tolerance) split into tile_height tiles (the nearest "
        "grid of min_tiles to max_tiles), each after its <|img_row_r_col_c|>, then `global_token` and the image "
        "resized within [min_pixels, max_pixels] in sides of patch_size x merge_size; else that resized image alone; "
        "a token per merge_size² patches."
    )
    placeholder: str = Field(min_length=1, description="The placeholder token's text, repeated once per token.")
    start: str = Field(description="Text before an image's placeholders (may be empty).")
    end: str = Field(description="Text after an image's placeholders (may be empty).")
    patch_size: int | None = Field(default=None, ge=1, le=4096)
    merge_size: int | None = Field(default=None, ge=1, le=64)
    min_pixels: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_pixels: int | None = Field(default=None, ge=1, le=INT32_MAX)
    tokens: int | None = Field(default=None, ge=1, le=65_536)
    # anyres: the (height, width) resolutions an image is tiled to, a tile's sides in pixels, and its features
    # per side (tile side over patch size); `tokens` then counts the whole image's features (the processor's count
    # with its extra tokens, CLS or not).
    pinpoints: tuple[tuple[_Side, _Side], ...] | None = Field(default=None, min_length=1, max_length=1024)
    tile_height: int | None = Field(default=None, ge=1, le=65_536)
    tile_width: int | None = Field(default=None, ge=1, le=65_536)
    feature_rows: int | None = Field(default=None, ge=1, le=4096)
    feature_columns: int | None = Field(default=None, ge=1, le=4096)
    max_tiles: int | None = Field(
        default=None, ge=1, le=65_536,
        description="anyres: LLaVA-OneVision's anyres_max_N, the N (None for LLaVA-NeXT); tiles, lfm2: the most tiles "
        f"of GOT-OCR2's canvas, of LFM2-VL's grid (at most {_MAX_CANVAS_TILES}).",
    )
    # split: the longest side images are first resized to (None: not resized), whether they are split into tiles
    # of tile_height (= tile_width) pixels, and the text that marks the whole image after its tiles.
    resize_edge: int | None = Field(default=None, ge=1, le=65_536)
    splitting: bool | None = None
    global_token: str | None = None
    longest_edge: int | None = Field(default=None, ge=1, le=65_536)
    row_end: str | None = Field(default=None, min_length=1,
                                description="rows: the text after each row of placeholders but the last.")
    frames: int | None = Field(default=None, ge=1, le=64,
                               description="glm4v_grid: the frames an image counts as (its temporal_patch_size).")
    min_tiles: int | None = Field(default=None, ge=1, le=_MAX_CANVAS_TILES)
    tolerance: float | None = Field(default=None, gt=0, le=1024, allow_inf_nan=False,
                                    description="lfm2: how many times max_pixels an image may be before it is split.")

    @model_validator(mode="after")
    def _complete(self) -> ImageRule:
        """The fields its kind counts with are there (a manifest may leave out any field)."""
        needed = {
            "grid": ("patch_size", "merge_size", "min_pixels", "max_pixels"),
            "fixed": ("tokens",),
            "anyres": ("tokens", "pinpoints", "tile_height", "tile_width", "feature_rows", "feature_columns"),
            "split": ("tokens", "tile_height", "splitting", "global_token"),
            "rows": ("patch_size", "longest_edge", "row_end"),
            "glm4v_grid": ("patch_size", "merge_size", "min_pixels", "max_pixels", "frames"),
            "tiles": ("tokens", "patch_size", "min_tiles", "max_tiles"),
            "pooled": ("tokens", "patch_size", "merge_size"),
            "lfm2": ("patch_size", "merge_size", "min_pixels", "max_pixels", "tile_height", "min_tiles", "max_tiles",
                     "splitting", "tolerance"),
        }[self.kind]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.kind} rule needs {', '.join(missing)}")
        foreign = [name for name, kinds in _KIND_FIELDS.items() if self.kind not in kinds and getattr(self, name) is not None]
        if foreign:
            raise ValueError(f"a rule of kind {self.kind} has no {', '.join(foreign)}")
        if self.kind in ("tiles", "lfm2") and self.max_tiles > _MAX_CANVAS_TILES:
            raise ValueError(f"max_tiles {self.max_tiles} is more than {_MAX_CANVAS_TILES}")
        if self.kind in ("tiles", "lfm2") and self.min_tiles > self.max_tiles:
            raise ValueError(f"min_tiles {self.min_tiles} is more than max_tiles {self.max_tiles}")
        if self.kind == "lfm2" and self.splitting and self.min_tiles == 1:
            # (prepack.sources.images refuses such a processor config: transformers' text and pixels disagree.)
            raise ValueError("min_tiles 1 with splitting: LFM2-VL's processor counts and makes such an image apart")
        if self.kind in ("grid", "glm4v_grid") and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} is more than max_pixels {self.max_pixels}")
        if self.kind == "anyres":
            for height, width in self.pinpoints:
                if height < self.tile_height or width < self.tile_width:
                    raise ValueError(f"pinpoint ({height}, {width}) (height, width) is smaller than a tile of "
                                     f"{self.tile_width}x{self.tile_height}")
            # An image's count is at most its pinpoint's whole feature grid, a newline per row, and `tokens`.
            most = self.tokens + max(
                self.feature_rows * (height // self.tile_height) * (self.feature_columns * (width // self.tile_width) + 1)
                for height, width in self.pinpoints
            )
            if most > MAX_IMAGE_TOKENS:
                raise ValueError(f"its largest pinpoint gives up to {most} placeholders an image, more than the "
                                 f"{MAX_IMAGE_TOKENS} prepack lets one image stand for")
        return self

    @model_serializer(mode="wrap")
    def _without_other_kinds_fields(self, handler):
        """Written without the fields later kinds added that its kind does not write (`_KIND_FIELDS`)."""
        data = handler(self)
        for name, kinds in _KIND_FIELDS.items():
            if self.kind not in kinds:
                data.pop(name, None)
        return data

    def placeholders(self, width: int, height: int) -> int:
        if self.kind == "fixed":
            return self.tokens
        if self.kind == "rows":
            rows, columns = pixtral_grid(height, width, self.patch_size, self.longest_edge)
            return rows * columns
        if self.kind == "tiles":
            columns, rows = tiled_canvas(height, width, self.patch_size, self.min_tiles, self.max_tiles)
            tiles = columns * rows
            return self.tokens * (tiles + 1 if tiles > 1 else 1)  # the thumbnail after several tiles
        if self.kind == "anyres":
            tiled_height, tiled_width = select_best_resolution(height, width, self.pinpoints)
            rows = self.feature_rows * (tiled_height // self.tile_height)  # at least one tile: `_complete`
            columns = self.feature_columns * (tiled_width // self.tile_width)
            features, newlines = _unpadded_features(height, width, rows, columns, self.feature_rows, self.max_tiles)
            return features + newlines + self.tokens
        if self.kind == "split":
            rows, columns = self._tiles(width, height)
            return (rows * columns + 1) * self.tokens
        if self.kind == "pooled":
            cells = self.merge_size**2
            resized_h, resized_w = pooled_resize(height, width, self.patch_size, self.tokens * cells, self.merge_size)
            return (resized_h // self.patch_size) * (resized_w // self.patch_size) // cells
        if self.kind == "lfm2":
            rows, columns, resized = self._lfm2_layout(width, height)
            tiles = rows * columns
            if tiles == 1:
                return resized
            return tiles * self._lfm2_tile_tokens() + (resized if self.global_token is not None else 0)
        factor = self.patch_size * self.merge_size
        if self.kind == "glm4v_grid":
            resized_h, resized_w = glm4v_resize(height, width, factor, self.min_pixels, self.max_pixels, self.frames)
        else:
            resized_h, resized_w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        return (resized_h // self.patch_size) * (resized_w // self.patch_size) // self.merge_size**2

    def text(self, width: int, height: int, count: int | None = None) -> str:
        """The image's text; `count`, its `placeholders` already counted (not recounted; a split rule's text
        follows its tiles, and a rows rule's its grid, a few operations)."""
        if self.kind == "rows":
            rows, columns = pixtral_grid(height, width, self.patch_size, self.longest_edge)
            return self.start + self.row_end.join([self.placeholder * columns] * rows) + self.end
        if self.kind == "lfm2":
            return self._lfm2_text(width, height)
        if self.kind != "split":
            count = self.placeholders(width, height) if count is None else count
            return self.start + self.placeholder * count + self.end
        # Idefics3's and SmolVLM's processors (`replace_image_token`): each tile after its row and column, a line
        # per row of tiles, then the whole image.
        rows, columns = self._tiles(width, height)
        tile = self.placeholder * self.tokens
        tiles = "".join(
            "".join(f"{self.start}<row_{row}_col_{column}>{tile}" for column in range(1, columns + 1)) + "\n"
            for row in range(1, rows + 1)
        )
        return tiles + ("\n" if rows else "") + self.start + self.global_token + tile + self.end

    def _lfm2_tile_tokens(self) -> int:
        """The placeholders of one of LFM2-VL's tiles (`Lfm2VlProcessor._compute_tokens_per_tile`)."""
        return math.ceil((self.tile_height // self.patch_size) / self.merge_size) ** 2

    def _lfm2_layout(self, width: int, height: int) -> tuple[int, int, int]:
        """(rows, columns) of LFM2-VL's tiles of an image ((1, 1): not split) and the placeholders of the image
        resized (alone, or as the thumbnail after its tiles): transformers' `Lfm2VlImageProcessor.resize_and_split`
        and `Lfm2VlProcessor._compute_tokens_for_image`, int() and ceil as there."""
        factor = self.patch_size * self.merge_size
        resized_h, resized_w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels, lfm2=True)
        resized = (math.ceil((resized_h // self.patch_size) / self.merge_size)
                   * math.ceil((resized_w // self.patch_size) / self.merge_size))
        rounded_h = max(self.patch_size, round(height / factor) * factor)  # `_is_image_too_large`'s rounding
        rounded_w = max(self.patch_size, round(width / factor) * factor)
        split = self.splitting and rounded_h * rounded_w > self.max_pixels * self.tolerance
        if not split or self.global_token is not None:  # the resized image is a view: alone, or the thumbnail
            self._lfm2_check_view(width, height, resized_w, resized_h)
        if not split:
            return 1, 1, resized
        columns, rows = lfm2_grid(height, width, self.tile_height, self.min_tiles, self.max_tiles)
        return rows, columns, resized

    def _lfm2_check_view(self, width: int, height: int, view_w: int, view_h: int) -> None:
        """ValueError where LFM2-VL's image processor would make the image's resized view longer than it pads every
        view's patch rows to: max_image_tokens x downsample_factor² (or a tile's, if more:
        `Lfm2VlImageProcessor.max_num_patches`). It cannot stack such a view with the image's tiles; an image not split
        goes through alone, but fails in a batch with any other image of another patch count, and prepare time cannot
        know the batches. Its resize keeps a side of at least one token's pixels, so an image of an extreme aspect
        ratio outgrows that bound."""
        patches = (view_h // self.patch_size) * (view_w // self.patch_size)
        most = max(self.max_pixels // self.patch_size**2,
                   (self.tile_height // self.patch_size) ** 2 if self.splitting else 0)
        if patches > most:
            raise ValueError(
                f"LFM2-VL's image processor would make the {width}x{height} image a view of {view_w}x{view_h} pixels, "
                f"{patches} patches of {self.patch_size}, more than the {most} it pads every view to (max_image_tokens "
                "x downsample_factor², or a tile's patches): it cannot stack such a view with the image's tiles, and "
                "fails on it in a batch with any other image of another patch count")

    def _lfm2_text(self, width: int, height: int) -> str:
        """`Lfm2VlProcessor._build_image_tokens` with its image special tokens: each tile after its row and column
        (from 1), then the thumbnail after `global_token` (none without one), all between `start` and `end`."""
        rows, columns, resized = self._lfm2_layout(width, height)
        if rows * columns == 1:
            return self.start + self.placeholder * resized + self.end
        tile = self.placeholder * self._lfm2_tile_tokens()
        tiles = "".join(f"<|img_row_{row}_col_{column}|>{tile}" for row in range(1, rows + 1)
                        for column in range(1, columns + 1))
        thumbnail = "" if self.global_token is None else self.global_token + self.placeholder * resized
        return self.start + tiles + thumbnail + self.end

    def _tiles(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of tiles an Idefics3 or SmolVLM image processor splits the image into, (0, 0) for none
        (transformers' `resize`, `resize_for_vision_encoder` and `split_images`, int() and ceil as there)."""
        if self.resize_edge is not None:
            height, width = _longest_edge_size(height, width, self.resize_edge)
        if not self.splitting:
            return 0, 0
        edge, aspect_ratio = self.tile_height, width / height
        if width >= height:
            width = math.ceil(width / edge) * edge
            height = math.ceil(int(width / aspect_ratio) / edge) * edge
        else:
            height = math.ceil(height / edge) * edge
            width = math.ceil(int(height * aspect_ratio) / edge) * edge
        if height > edge or width > edge:
            return (height - edge) // edge + 1, (width - edge) // edge + 1
        return 0, 0


# The VideoRule fields of each kind: a rule of one kind carrying another's is refused (`_complete`), and each is
# written without the other kinds' fields, so that a Qwen-VL rule keeps the bytes it had before `frames` existed.
_VIDEO_KIND_FIELDS = {
    "qwen2": ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"),
    "qwen3": ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"),
    "frames": ("tokens",),
}
_VIDEO_FIELDS = sorted({name for fields in _VIDEO_KIND_FIELDS.values() for name in fields})


class VideoRule(StrictModel):
    """How many placeholder tokens a video of `frames` frames of one size becomes, as the video processors count
    them, and its text before tokenizing.

    The frames are taken as given (already sampled; no decoder here). Qwen-VL: `temporal_patch_size` frames make
    one temporal grid step (the last frame repeated to fill the last step), and each step holds h·w/merge² tokens.
    `qwen2` (Qwen2-VL's and Qwen2.5-VL's `Qwen2VLVideoProcessor`): each frame resized by `smart_resize`
    within [min_pixels, max_pixels]; the text is `start + placeholder × N + end`. `qwen3` (Qwen3-VL's
    `Qwen3VLVideoProcessor`): the bounds hold for the whole video; each temporal step is its own
    `<{seconds:.1f} seconds>` + start + placeholders + end, its time the mean of its first and last frame's
    (frame i at i / fps), as `Qwen3VLProcessor` writes it. Both as transformers 5.24 counts them with
    `cap_pixels_per_frame` unset (its default there). `frames` (LLaVA-NeXT-Video's
    `LlavaNextVideoProcessor`, Video-LLaVA's `VideoLlavaProcessor`): every frame center-cropped to one size, `tokens`
    placeholders a frame (LLaVA-NeXT-Video's patches pooled 2×2, Video-LLaVA's patches and CLS), whatever the
    frame's own size; the text is `start + placeholder × frames·tokens + end`."""

    kind: Literal["qwen2", "qwen3", "frames"]
    placeholder: str = Field(default="<|video_pad|>", min_length=1)
    start: str = "<|vision_start|>"
    end: str = "<|vision_end|>"
    patch_size: int | None = Field(default=None, ge=1, le=4096)
    merge_size: int | None = Field(default=None, ge=1, le=64)
    temporal_patch_size: int | None = Field(default=None, ge=1, le=64)
    min_pixels: int | None = Field(default=None, ge=1, le=2**40)
    max_pixels: int | None = Field(default=None, ge=1, le=2**40)
    tokens: int | None = Field(default=None, ge=1, le=65_536, description="frames: the placeholders of a frame.")

    @model_validator(mode="after")
    def _complete(self) -> VideoRule:
        """The fields its kind counts with are there, and no other kind's."""
        needed = _VIDEO_KIND_FIELDS[self.kind]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.kind} video rule needs {', '.join(missing)}")
        foreign = [name for name in _VIDEO_FIELDS if name not in needed and getattr(self, name) is not None]
        if foreign:
            raise ValueError(f"a {self.kind} video rule has no {', '.join(foreign)}")
        return self

    @model_serializer(mode="wrap")
    def _without_other_kinds_fields(self, handler):
        data = handler(self)
        for name in _VIDEO_FIELDS:
            if name not in _VIDEO_KIND_FIELDS[self.kind]:
                data.pop(name, None)
        return data

    def grid(self, frames: int, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w): a Qwen-VL video's patch grid, `video_grid_thw` of the processor. ValueError if none."""
        if frames < 1:
            raise ValueError("a video without frames")
        if self.kind == "frames":
            raise ValueError("a frames video rule has no patch grid: each frame is `tokens` placeholders")
        factor = self.patch_size * self.merge_size
        if self.kind == "qwen2":
            resized_h, resized_w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        else:
            resized_h, resized_w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels, frames=frames,
                                                temporal=self.temporal_patch_size, upscale=True)
        steps = -(-frames // self.temporal_patch_size)
        return steps, resized_h // self.patch_size, resized_w // self.patch_size

    def placeholders(self, frames: int, width: int, height: int) -> int:
        if self.kind == "frames":
            if frames < 1:
                raise ValueError("a video without frames")
            return frames * self.tokens
        t, h, w = self.grid(frames, width, height)
        return t * h * w // self.merge_size**2

    def step_seconds(self, frames: int, fps: float) -> list[float]:
        """Qwen3-VL's time of each temporal step: frame i at i / fps, the mean of a step's first and last
        frame (the last frame repeated to fill the last step), as `Qwen3VLProcessor._calculate_timestamps`."""
        step = self.temporal_patch_size
        indices = list(range(frames)) + [frames - 1] * (-frames % step)
        return [(indices[i] / fps + indices[i + step - 1] / fps) / 2 for i in range(0, len(indices), step)]

    def text(self, frames: int, width: int, height: int, fps: float) -> str:
        if self.kind != "qwen3":
            return self.start + self.placeholder * self.placeholders(frames, width, height) + self.end
        t, h, w = self.grid(frames, width, height)
        per_step = self.start + self.placeholder * (h * w // self.merge_size**2) + self.end
        return "".join(f"<{seconds:.1f} seconds>" + per_step for seconds in self.step_seconds(frames, fps))


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
    name: Literal["images.arrow", "documents.arrow", "videos.arrow"]
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
    files: tuple[ImageSetFile, ImageSetFile] | tuple[ImageSetFile, ImageSetFile, ImageSetFile]
    # Only in a set with videos (absent from the JSON of one without: its bytes are those of before videos).
    video_rule: VideoRule | None = Field(default=None, description="How a video's placeholder count follows.")
    video_placeholder_id: int | None = Field(default=None, ge=0, le=INT32_MAX, description="The video placeholder's id.")
    video_references: int | None = Field(default=None, ge=0, le=COUNT_MAX, description="Videos over all rows.")
    video_tokens: int | None = Field(default=None, ge=0, le=COUNT_MAX, description="Video placeholder tokens.")

    @model_validator(mode="after")
    def _videos_complete(self) -> ImageSetManifest:
        fields = (self.video_rule, self.video_placeholder_id, self.video_references, self.video_tokens)
        if any(field is None for field in fields) != all(field is None for field in fields):
            raise ValueError("video_rule, video_placeholder_id, video_references and video_tokens go together")
        if (self.video_rule is not None) != (len(self.files) == 3):
            raise ValueError(f"a set with videos lists {VIDEOS_FILE} as its third file, and only such a set does")
        return self

    def json_text(self) -> str:
        """images.json: a set without videos leaves the video fields out."""
        video_fields = {"video_rule", "video_placeholder_id", "video_references", "video_tokens"}
        return self.model_dump_json(indent=2, exclude=video_fields if self.video_rule is None else None) + "\n"


class ImageSet:
    """A read image set: the manifest (and the sha256 of the images.json bytes it was read from, which names the
    set: a build's image cap records it), and per corpus row the numbers of its images (`images_of`)."""

    def __init__(self, directory: Path, manifest: ImageSetManifest, manifest_sha256: str, images: pa.RecordBatch,
                 documents: pa.RecordBatch, videos: pa.RecordBatch | None = None):
        self.directory, self.manifest, self.manifest_sha256 = directory, manifest, manifest_sha256
        # Per corpus row (videos.arrow, when the set has videos): its frames, frames per video, rates and counts.
        self._videos = {
            column: list_column(videos, column, str(directory / VIDEOS_FILE)) for column in VIDEOS_SCHEMA.names
        } if videos is not None else None
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

    def row_images(self) -> np.ndarray:
        """Images (repeats counted) per corpus row, int64, a video's frames among them: as the collator's pixel
        limits and prepare-images' max_images_per_document count them."""
        images = np.diff(self._offsets).astype(np.int64)
        if self._videos is not None:
            images += np.diff(self._videos["frames"][0]).astype(np.int64)
        return images

    def row_tokens(self) -> np.ndarray:
        """Placeholder tokens per corpus row."""
        per_reference = self.tokens[self._numbers].astype(np.int64)
        return np.add.reduceat(np.append(per_reference, 0), self._offsets[:-1]) * (np.diff(self._offsets) > 0)

    def videos_of(self, row: int) -> list[tuple[np.ndarray, float, int]]:
        """Corpus row `row`'s videos in token order: (frame image numbers, frames per second, placeholders)."""
        if self._videos is None:
            return []
        (frame_offsets, frames), (offsets, counts) = self._videos["frames"], self._videos["frame_counts"]
        fps, tokens = self._videos["fps"][1], self._videos["tokens"][1]
        first, videos = int(frame_offsets[row]), []
        for video in range(int(offsets[row]), int(offsets[row + 1])):
            videos.append((frames[first : first + int(counts[video])], float(fps[video]), int(tokens[video])))
            first += int(counts[video])
        return videos

    def row_video_tokens(self) -> np.ndarray:
        """Video placeholder tokens per corpus row (zeros in a set without videos)."""
        if self._videos is None:
            return np.zeros(self.manifest.documents, np.int64)
        offsets, tokens = self._videos["tokens"]
        sums = np.append(0, np.cumsum(tokens.astype(np.int64)))
        return sums[offsets[1:]] - sums[offsets[:-1]]


def read_image_set(directory: str | os.PathLike, *, verify: bool = False) -> ImageSet:
    """Read and check an image set (FormatError naming file, row and column). `verify` also hashes the
    files and every image, and recounts every image's placeholders by the rule; Pillow is not needed."""
    directory = Path(directory)
    try:
        manifest_bytes = read_manifest_bytes(directory / IMAGE_SET_MANIFEST)
    except FileNotFoundError:
        refuse(directory, f"no {IMAGE_SET_MANIFEST}: not an image set.")
    where, value = load_manifest_json(manifest_bytes, IMAGE_SET_MANIFEST, str(directory / IMAGE_SET_MANIFEST))
    if isinstance(value, dict) and value.get("image_set_version") != IMAGE_SET_VERSION:
        found = value.get("image_set_version")
        refuse(where, f"image_set_version {found!r} is not one this prepack reads ({IMAGE_SET_VERSION}).")
    try:
        manifest = ImageSetManifest.model_validate(value)
    except ValueError as exc:
        refuse(where, f"is not a valid image set manifest: {exc}")
    if [file.name for file in manifest.files] not in ([IMAGES_FILE, DOCUMENTS_FILE],
                                                      [IMAGES_FILE, DOCUMENTS_FILE, VIDEOS_FILE]):
        refuse(where, f"files must list {IMAGES_FILE} and {DOCUMENTS_FILE} (then {VIDEOS_FILE} in a set with videos), "
               "in that order.", column="files")
    batches = {}
    for file, schema in zip(manifest.files, (IMAGES_SCHEMA, DOCUMENTS_SCHEMA, VIDEOS_SCHEMA)):
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
    image_set = ImageSet(directory, manifest, hashlib.sha256(manifest_bytes).hexdigest(), images, documents,
                         batches.get(VIDEOS_FILE))
    _check_counts(image_set, images, documents)
    if VIDEOS_FILE in batches:
        _check_videos(image_set, batches[VIDEOS_FILE])
    per_row = image_set.row_images()  # a video's frames counted, once videos.arrow is checked
    if len(per_row) and int(per_row.max()) > manifest.limits.max_images_per_document:
        refuse(directory / DOCUMENTS_FILE, f"holds {int(per_row.max())} images (a video's frames counted), more than "
               f"the limit {manifest.limits.max_images_per_document}.", row=int(np.argmax(per_row)), column="images")
    if verify:
        _verify_images(image_set)
        if VIDEOS_FILE in batches:
            _verify_videos(image_set)
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
    if int(image_set.tokens[numbers].astype(np.int64).sum()) != manifest.image_tokens:
        refuse(manifest_file, "image_tokens is not the sum of the rows' placeholder tokens.", column="image_tokens")


def _check_videos(image_set: ImageSet, videos: pa.RecordBatch) -> None:
    """videos.arrow against the manifest: a row per corpus row, the per-video lists of one length, the frame counts
    adding up to the frames, every frame an image of the set, rates positive and finite, the counts' sums."""
    manifest, where = image_set.manifest, image_set.directory / VIDEOS_FILE
    manifest_file = image_set.directory / IMAGE_SET_MANIFEST
    if videos.num_rows != manifest.documents:
        refuse(where, f"has {videos.num_rows} rows; the set describes {manifest.documents} corpus rows.")
    (frame_offsets, frames), (offsets, counts) = image_set._videos["frames"], image_set._videos["frame_counts"]
    for column in ("fps", "tokens"):
        if not np.array_equal(image_set._videos[column][0], offsets):
            row = int(np.argmax(image_set._videos[column][0] != offsets))
            refuse(where, "does not hold one value per video of the row.", row=max(row - 1, 0), column=column)
    per_row = np.append(0, np.cumsum(counts.astype(np.int64)))
    if not np.array_equal(per_row[offsets], frame_offsets.astype(np.int64)) or (len(counts) and counts.min() < 1):
        refuse(where, "its frame counts do not add up to its rows' frames (or a video has none).",
               column="frame_counts")
    if len(frames) and int(frames.max()) >= manifest.images:
        refuse(where, f"refers to image {int(frames.max())}; the set holds {manifest.images}.", column="frames")
    fps = image_set._videos["fps"][1]
    if len(fps) and not (np.isfinite(fps).all() and fps.min() > 0):
        refuse(where, "a frame rate is not a positive number.", column="fps")
    tokens = image_set._videos["tokens"][1]
    if len(counts) != manifest.video_references or int(tokens.astype(np.int64).sum()) != manifest.video_tokens:
        refuse(manifest_file, f"counts {manifest.video_references} videos of {manifest.video_tokens} placeholders; "
               f"{VIDEOS_FILE} holds {len(counts)} of {int(tokens.astype(np.int64).sum())}.", column="video_tokens")


def _verify_videos(image_set: ImageSet) -> None:
    """Every video's frames of one size and its placeholder count by the video rule."""
    where, rule = image_set.directory / VIDEOS_FILE, image_set.manifest.video_rule
    for row in np.flatnonzero(np.diff(image_set._videos["frame_counts"][0])).tolist():  # the rows with videos
        for frames, fps, tokens in image_set.videos_of(row):
            sizes = set(zip(image_set.widths[frames].tolist(), image_set.heights[frames].tolist()))
            if len(sizes) != 1:
                refuse(where, f"a video's frames are of {len(sizes)} sizes; a video's frames are of one size.",
                       row=row, column="frames")
            ((width, height),) = sizes
            try:
                expected = rule.placeholders(len(frames), width, height)
            except ValueError as exc:
                refuse(where, f"no placeholder count for a video: {exc}.", row=row, column="frames")
            if tokens != expected:
                refuse(where, f"records {tokens} placeholder tokens for a video; the rule gives {expected} for "
                       f"{len(frames)} frames of {width}x{height}.", row=row, column="tokens")


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

