"""Image+chat corpora: every image's placeholder count from its header, images stored once.

    rule, placeholder_id = processor_rule("./processor")   # image processor config + tokenizer, local
    summary = prepare_image_chat("chats.jsonl", "./processor", "prepared/")
    # then: prepack build prepared/corpus.parquet --tokenizer ./processor --chat --max-len N --out build/
    # and train on build/ with prepared/images (prepack.training.vision_dataset.ImagePackedDataset)

The corpus is a .jsonl, .json (JSON Lines, or one JSON array as LlamaFactory writes), .parquet or Arrow
file, a directory or glob of them, or a Hugging Face `save_to_disk` folder (read as `prepack build` reads
corpora, `prepack.sources.corpus`). A record is a Hugging Face chat: `messages`, each with a `role` and a
`content` that is either a string (where `<image>` marks an image, LLaVA style) or a list of items
`{"type": "text", "text": ...}` / `{"type": "image", ...}`; or a ShareGPT record as LlamaFactory writes
it: `conversations` of `{"from": "human" | "gpt" | "system" | "observation" | "function_call", "value":
...}` with `<image>` markers, and an optional `system` string; or, in a corpus of text, a `text` string with
`<image>` markers (then `corpus.parquet` has a `text` column, built without --chat). An image item holds its
image under `image`, `path` or `bytes` (a path, or the encoded bytes); one without them (and every
`<image>` marker) takes the next entry of the record's `images` column (paths or bytes, or Hugging Face's
`{"bytes", "path"}` structs), in order.

An image path is confined (`schemas/image-set.md`): relative, resolving inside the directory of the corpus
file that names it, through no symbolic link that leads out; or, given `images_root`, inside that one
directory (there an absolute path inside it is taken too). Anything else is refused before a file is
opened, with the same message whether it exists or not. An image file is opened without blocking and
refused unless it is a regular file within `max_image_bytes`, before a byte of it is read.

Each image's width and height come from its header; the processor's resize rule
(`prepack.formats.images.ImageRule`, read from the directory's `preprocessor_config.json` and
`processor_config.json`) turns them into the exact number of placeholder tokens, and the image becomes that
text (`start + placeholder × n + end`) inside its message. Each distinct image is also decoded once, as the
training loader will (`decode_failure`), so that a truncated or corrupt one is refused here by file, row
and column. The chat corpus written (`corpus.parquet`: `messages` with string contents) then tokenizes with
the ordinary chat path, the placeholders as the tokenizer's special tokens, so the plan knows every sample's
true length. The images go into an image set (`schemas/image-set.md`): each distinct image once, as its
encoded bytes with its sha256, and per corpus row the numbers of its images. Images are written out as
they are read, so memory holds one image (and a few rows of a Parquet or Arrow corpus), not all of them.

Videos (Qwen-VL, LLaVA-NeXT-Video, Video-LLaVA: `video_processor_rule`) are read as their frames, never decoded from
a video file: a record's `videos` column (each a list of frames, or a directory of frame images) placed by `<video>`
markers, or `{"type": "video", ...}` items; `video_fps` their rates. The frames are the video's samples, taken as
given, whatever their count (sample them before, as the model cards do; a video processor's own sampling is not
applied). Every frame is an image of the set (stored once by sha256); a video becomes its `VideoRule` text, and
`videos.arrow` records per row its videos' frames, rates and placeholder counts (`schemas/image-set.md`). A corpus
without videos gives the image set of before, byte for byte.

Limits (`ImageLimits`): encoded size, pixels, images per record (a video's frames counted); an image over one is refused (InputError
naming file, row and column), as is an unreadable or unsupported one. Nothing is downloaded: a URI that is
not a local path is refused.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from prepack.errors import InputError, optional_imports
from prepack.formats.common import file_type_name
from prepack.formats.images import (
    DEFAULT_VIDEO_FPS,
    DOCUMENTS_FILE,
    DOCUMENTS_SCHEMA,
    IMAGE_SET_MANIFEST,
    IMAGE_SET_VERSION,
    IMAGES_FILE,
    IMAGES_SCHEMA,
    MAX_IMAGE_TOKENS,
    ImageLimits,
    ImageRule,
    ImageSetFile,
    ImageSetManifest,
    VIDEOS_FILE,
    VIDEOS_SCHEMA,
    VideoRule,
)
from prepack.sources.corpus import (
    MAX_RECORD_BYTES,
    file_columns,
    file_kind,
    find_corpus,
    json_object_blocks,
    parse_json,
    record_batches,
)
from prepack.storage.files import write_record_batch
from prepack.storage.output import output_errors, output_file, staged_directory

with optional_imports("prepare_image_chat"):
    from PIL import Image

__all__ = ["ImageCorpusSummary", "decode_failure", "image_header", "prepare_image_chat", "processor_rule",
           "video_processor_rule"]

LLAVA_MARKER = "<image>"
VIDEO_MARKER = "<video>"  # LlamaFactory's, in a record with a `videos` column
# transformers' video processors, by `video_processor_type`: prepack's rule kind and, for Qwen-VL's, the class
# defaults (patch size, size.shortest_edge, size.longest_edge) a config may leave out.
_VIDEO_PROCESSORS = {
    "Qwen2VLVideoProcessor": ("qwen2", 14, 128 * 28 * 28, 28 * 28 * 768),
    "Qwen3VLVideoProcessor": ("qwen3", 16, 128 * 32 * 32, 32 * 32 * 768),
    "LlavaNextVideoVideoProcessor": ("frames", None, None, None),
    "VideoLlavaVideoProcessor": ("frames", None, None, None),
}
# LlavaNextVideoVideoProcessor's and VideoLlavaVideoProcessor's class default crop (transformers' video processing
# modules of both).
_FRAME_CROP = 224
_FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff")
_VIDEO_AS_FRAMES = ("prepack reads a video as its frames (it has no video decoder): a list of image paths or encoded "
                    "images, or a directory of frame images taken in name order")
_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF")
# The placeholder texts of each image processor, by its `image_processor_type` (transformers' names).
_PLACEHOLDERS = {
    "Qwen2VLImageProcessor": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "Gemma3ImageProcessor": ("<start_of_image>", "<image_soft_token>", "<end_of_image>"),
    "CLIPImageProcessor": ("", "<image>", ""),
    "VideoLlavaImageProcessor": ("", "<image>", ""),  # CLIP's steps, counted as LLaVA's
    "GotOcr2ImageProcessor": ("<img>", "<IMG_CONTEXT>", "</img>"),  # as InternVLProcessor uses it
    "PixtralImageProcessor": ("", "[IMG]", "[IMG_END]"),  # as PixtralProcessor (Mistral 3's) uses it
    "Glm4vImageProcessor": ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>"),  # as GLM-4V's chat template writes
    "SiglipImageProcessor": ("", "<image>", ""),  # as PaliGemmaProcessor uses it
    "LlavaNextImageProcessor": ("", "<image>", ""),
    "LlavaOnevisionImageProcessor": ("", "<image>", ""),
    "Idefics3ImageProcessor": ("<fake_token_around_image>", "<image>", "<fake_token_around_image>"),
    "SmolVLMImageProcessor": ("<fake_token_around_image>", "<image>", "<fake_token_around_image>"),
    "Lfm2VlImageProcessor": ("<|image_start|>", "<image>", "<|image_end|>"),  # as Lfm2VlProcessor uses it
}
# Image processors whose processor takes the placeholder texts from its tokenizer (Gemma4Processor: the tokenizer's
# boi_token, image_token and eoi_token), by `image_processor_type`.
_TOKENIZER_PLACEHOLDERS = {"Gemma4ImageProcessor": ("boi_token", "image_token", "eoi_token")}
# The budgets Gemma 4's image processor takes (its _SUPPORTED_SOFT_TOKENS).
_GEMMA4_SOFT_TOKENS = (70, 140, 280, 560, 1120)
# SigLIP's image processor serves two processors, told apart by the processor_class a processor directory records.
_SIGLIP_PROCESSORS = ("PaliGemmaProcessor", "Gemma3nProcessor")
# Idefics3's and SmolVLM's mark of the whole image after its tiles (their processors' `global_image_tag`).
_GLOBAL_IMAGE = "<global-img>"
# LlamaFactory's ShareGPT speakers (its default `tags`), as chat roles.
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "observation": "tool",
                   "function_call": "assistant"}
# corpus.parquet's columns: a chat corpus's, or a text corpus's.
_CORPUS_TYPES = {"messages": pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
                 "text": pa.string()}
_CORPUS_ROWS = 1024  # rows per row group of corpus.parquet: the expanded rows held before they are written
# Records of a Parquet or Arrow corpus made Python objects at a time: with the images inline, what is held
# besides the image at hand.
_FILE_ROWS = 64
_JSON_BLOCK = 2**20  # bytes of JSON Lines parsed at a time
# As prepack.formats.common.open_regular opens a build's files: a FIFO or device must neither block nor feed.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_PATH_RULE = ("an image path is relative to the corpus file's directory and stays inside it, symbolic links "
              "included (or give --images-root DIR, the one directory images come from)")


def _mapping(config: dict, file: Path, key: str) -> dict:
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{file}: {key} is {value!r}; expected an object.")
    return value


def _positive(config: dict, file: Path, key: str, default: int | None, prefix: str = "") -> int | None:
    """`config[key]`, a positive integer, or `default` when it is absent or null."""
    value = config.get(key)
    if value is None:
        return default
    if type(value) is not int or value < 1:
        raise InputError(f"{file}: {prefix}{key} is {value!r}; expected a positive integer.")
    return value


def _text(config: dict, file: Path, key: str, default: str) -> str:
    value = config.get(key, default)
    if not isinstance(value, str):
        raise InputError(f"{file}: {key} is {value!r}; expected a string.")
    return value


def processor_rule(directory: str | os.PathLike) -> tuple[ImageRule, int]:
    """The resize rule of a local processor directory and its placeholder's token id.

    `preprocessor_config.json` names the image processor (`image_processor_type`: Qwen2-VL's or GLM-4V's, Gemma 3's,
    CLIP's as LLaVA uses (or Video-LLaVA's), LLaVA-NeXT's or LLaVA-OneVision's tiling ones, Idefics3's or SmolVLM's,
    GOT-OCR2's as InternVL uses it, tiled or not, Pixtral's as Mistral 3 uses it, SigLIP's as PaliGemma or Gemma 3n
    uses it, by the `processor_class` recorded, LFM2-VL's, Gemma 4's, whose placeholder texts are the
    tokenizer's named special tokens, as Gemma4Processor takes them, `load_tokenizer`'s reading) and its sizes;
    `processor_config.json` (optional) may name the tokens (`image_token`, `boi_token`, `eoi_token`) and, for
    fixed-size and tiled towers, the count (`image_seq_length`, or LLaVA's `patch_size` and
    `vision_feature_select_strategy`, LLaVA-NeXT's `num_additional_image_tokens`, LLaVA-OneVision's
    `num_image_tokens` and `vision_aspect_ratio`). The placeholder must be one token of the directory's
    `tokenizer.json`. A size that is not a positive integer, or sizes that give no placeholder, are refused by file
    and field.
    """
    directory = Path(directory)
    config_file, processor_file = directory / "preprocessor_config.json", directory / "processor_config.json"
    config = _json(config_file)
    processor = _json(processor_file) if processor_file.exists() else {}
    named = config.get("image_processor_type")
    kind = named.removesuffix("Fast").removesuffix("Pil") if isinstance(named, str) else None
    if kind not in _PLACEHOLDERS and kind not in _TOKENIZER_PLACEHOLDERS:
        raise InputError(
            f"{config_file}: image_processor_type {named!r} "
            f"is not one prepack counts placeholders for ({', '.join([*_PLACEHOLDERS, *_TOKENIZER_PLACEHOLDERS])})."
        )
    siglip_for = _siglip_processor(config, processor, processor_file) if kind == "SiglipImageProcessor" else None
    if siglip_for == "Gemma3nProcessor":  # Gemma 3's image tokens, text and count (Gemma 3n's tokenizer has the same)
        kind = "Gemma3ImageProcessor"
    tokenizer = None
    if kind in _TOKENIZER_PLACEHOLDERS:
        tokenizer = _load_tokenizer(directory)
        start, placeholder, end = _tokenizer_tokens(tokenizer, directory, _TOKENIZER_PLACEHOLDERS[kind])
    else:
        start, placeholder, end = _PLACEHOLDERS[kind]
        if kind == "Gemma3ImageProcessor":  # its processor's full_image_sequence: a blank line each side of the image
            start = "\n\n" + _text(processor, processor_file, "boi_token", start)
            end = _text(processor, processor_file, "eoi_token", end) + "\n\n"
        placeholder = _text(processor, processor_file, "image_token", placeholder)
    if kind in ("Qwen2VLImageProcessor", "Glm4vImageProcessor"):
        size = _mapping(config, config_file, "size")
        pixels = {}
        defaults = (56 * 56, 28 * 28 * 1280) if kind == "Qwen2VLImageProcessor" else (112 * 112, 28 * 28 * 15000)
        for bound, size_key, key, default in (("min", "shortest_edge", "min_pixels", defaults[0]),
                                              ("max", "longest_edge", "max_pixels", defaults[1])):
            if size.get(size_key) is not None:
                pixels[bound] = (_positive(size, config_file, size_key, default, "size."), f"size.{size_key}")
            else:
                pixels[bound] = (_positive(config, config_file, key, default), key)
        (min_pixels, min_name), (max_pixels, max_name) = pixels["min"], pixels["max"]
        if min_pixels > max_pixels:
            raise InputError(f"{config_file}: {min_name} {min_pixels} is more than {max_name} {max_pixels}.")
        fields = {
            "kind": "grid", "patch_size": _positive(config, config_file, "patch_size", 14),
            "merge_size": _positive(config, config_file, "merge_size", 2), "min_pixels": min_pixels,
            "max_pixels": max_pixels,
        }
        if kind == "Glm4vImageProcessor":  # an image counts as temporal_patch_size frames
            fields |= {"kind": "glm4v_grid", "frames": _positive(config, config_file, "temporal_patch_size", 2)}
    elif kind == "Gemma3ImageProcessor":
        fields = {"kind": "fixed", "tokens": _positive(processor, processor_file, "image_seq_length", 256)}
    elif kind == "Gemma4ImageProcessor":
        fields = _gemma4_fields(config, config_file)
    elif kind == "GotOcr2ImageProcessor":
        fields = _internvl_fields(config, config_file, processor, processor_file)
    elif kind == "SiglipImageProcessor":
        fields = _paligemma_fields(config, config_file)
    elif kind == "Lfm2VlImageProcessor":
        fields = _lfm2_fields(config, config_file, processor, processor_file)
    elif kind == "PixtralImageProcessor":
        end = _text(processor, processor_file, "image_end_token", end)
        fields = _pixtral_fields(config, config_file, processor, processor_file)
    elif kind in ("LlavaNextImageProcessor", "LlavaOnevisionImageProcessor"):
        fields = _anyres_fields(config, config_file, processor, processor_file, kind == "LlavaOnevisionImageProcessor")
    elif kind in ("Idefics3ImageProcessor", "SmolVLMImageProcessor"):
        size, tile = _mapping(config, config_file, "size"), _mapping(config, config_file, "max_image_size")
        resize = config.get("do_resize", True)
        edge = _positive(tile, config_file, "longest_edge", None, "max_image_size.")
        longest = _positive(size, config_file, "longest_edge", None, "size.") if resize else None
        if edge is None or (resize and longest is None):
            raise InputError(f"{config_file}: an Idefics3 or SmolVLM image processor needs max_image_size.longest_edge "
                             "and (resizing) size.longest_edge.")
        fields = {"kind": "split", "tokens": _positive(processor, processor_file, "image_seq_len", 169),
                  "tile_height": edge, "resize_edge": longest,
                  "splitting": bool(config.get("do_image_splitting", True)), "global_token": _GLOBAL_IMAGE}
    else:
        crop, size = _mapping(config, config_file, "crop_size"), _mapping(config, config_file, "size")
        side = _positive(crop, config_file, "height", None, "crop_size.") or _positive(
            size, config_file, "shortest_edge", None, "size.")
        patch = _positive(processor, processor_file, "patch_size", None)
        if not side or not patch:
            raise InputError(
                f"{directory}: a CLIP (LLaVA) processor needs crop_size and processor_config.json's patch_size."
            )
        with_cls = processor.get("vision_feature_select_strategy") == "full"  # "default" drops the CLS token
        extra = _additional_image_tokens(processor, processor_file, 1) if with_cls else 0
        tokens = (side // patch) ** 2 + extra
        if tokens < 1:
            raise InputError(f"{directory}: an image side of {side} in patches of {patch} gives no image tokens.")
        fields = {"kind": "fixed", "tokens": tokens}
    try:
        rule = ImageRule(placeholder=placeholder, start=start, end=end, **fields)
    except ValueError as exc:  # pydantic's upper bounds
        raise InputError(f"{config_file}: the processor's sizes are out of range ({exc}).") from None
    return rule, _placeholder_id(directory, placeholder, "image", tokenizer)


def _load_tokenizer(directory: Path):
    from prepack.sources.tokenize import load_tokenizer  # here: `verify --images` reads images, no tokenizer

    return load_tokenizer(directory)


def _placeholder_id(directory: Path, placeholder: str, kind: str, tokenizer=None) -> int:
    """The id of `placeholder`, which must be one special token of the directory's tokenizer (`tokenizer`, that
    directory's `LocalTokenizer` when already read)."""
    tokenizer = (tokenizer or _load_tokenizer(directory)).tokenizer
    placeholder_id = tokenizer.token_to_id(placeholder)
    encoded = tokenizer.encode(placeholder * 2, add_special_tokens=False).ids
    if placeholder_id is None or encoded != [placeholder_id, placeholder_id]:
        raise InputError(
            f"{directory / 'tokenizer.json'}: the {kind} placeholder {placeholder!r} is not one special token of the "
            f"tokenizer; add it (tokenizers: tokenizer.add_special_tokens([...])) so that each {kind} token is one id."
        )
    return placeholder_id


def video_processor_rule(directory: str | os.PathLike) -> tuple[VideoRule, int] | None:
    """The video rule of a local processor directory and its video placeholder's id, from its
    `video_preprocessor_config.json` (transformers' Qwen2-VL or Qwen3-VL video processor: `size`, `patch_size`,
    `merge_size`, `temporal_patch_size`; the class defaults where absent; or LLaVA-NeXT-Video's or Video-LLaVA's,
    `_frame_tokens`) and `processor_config.json`'s `video_token` (default `<|video_pad|>`, `<video>` for the latter
    two); None when the directory has no video processor."""
    directory = Path(directory)
    config_file, processor_file = directory / "video_preprocessor_config.json", directory / "processor_config.json"
    if not config_file.exists():
        return None
    config = _json(config_file)
    processor = _json(processor_file) if processor_file.exists() else {}
    named = config.get("video_processor_type")
    found = _VIDEO_PROCESSORS.get(named.removesuffix("Fast") if isinstance(named, str) else None)
    if found is None:
        raise InputError(f"{config_file}: video_processor_type {named!r} is not one prepack counts placeholders for "
                         f"({', '.join(_VIDEO_PROCESSORS)}).")
    if config.get("cap_pixels_per_frame"):
        raise InputError(f"{config_file}: cap_pixels_per_frame is set; prepack counts a video's placeholders as "
                         "transformers does without it (its default), so a capped count would not match.")
    kind, patch, min_default, max_default = found
    if kind == "frames":
        placeholder = _text(processor, processor_file, "video_token", "<video>")
        try:
            rule = VideoRule(kind=kind, placeholder=placeholder, start="", end="",
                             tokens=_frame_tokens(config, config_file, processor, processor_file, named))
        except ValueError as exc:  # pydantic's bounds
            raise InputError(f"{config_file}: the video processor's sizes are out of range ({exc}).") from None
        return rule, _placeholder_id(directory, placeholder, "video")
    size = _mapping(config, config_file, "size")
    min_pixels = _positive(size, config_file, "shortest_edge", min_default, "size.")
    max_pixels = _positive(size, config_file, "longest_edge", max_default, "size.")
    if min_pixels > max_pixels:
        raise InputError(f"{config_file}: size.shortest_edge {min_pixels} is more than size.longest_edge {max_pixels}.")
    try:
        rule = VideoRule(
            kind=kind, placeholder=_text(processor, processor_file, "video_token", "<|video_pad|>"),
            patch_size=_positive(config, config_file, "patch_size", patch),
            merge_size=_positive(config, config_file, "merge_size", 2),
            temporal_patch_size=_positive(config, config_file, "temporal_patch_size", 2),
            min_pixels=min_pixels, max_pixels=max_pixels,
        )
    except ValueError as exc:  # pydantic's bounds
        raise InputError(f"{config_file}: the video processor's sizes are out of range ({exc}).") from None
    return rule, _placeholder_id(directory, rule.placeholder, "video")


def _additional_image_tokens(processor: dict, processor_file: Path, default: int) -> int:
    """processor_config.json's `num_additional_image_tokens` (the tower's tokens beside its patches, CLIP's CLS;
    `default`, the family's processor's, where it is left out): a count, or InputError naming the file."""
    extra = processor.get("num_additional_image_tokens", default)
    if type(extra) is not int or extra < 0:
        raise InputError(f"{processor_file}: num_additional_image_tokens is {extra!r}; expected a count.")
    return extra


def _frame_tokens(config: dict, config_file: Path, processor: dict, processor_file: Path, named: str) -> int:
    """A frame's placeholders as the processor counts them from the cropped frame's patches (crop over
    processor_config.json's patch_size): LLaVA-NeXT-Video's over 4, its pooling (`LlavaNextVideoProcessor.
    replace_video_token`; patch_size required, as there); Video-LLaVA's with `num_additional_image_tokens` (its CLS,
    1 by default; `VideoLlavaProcessor.replace_video_token`, patch_size 14 by default). The crop makes every frame
    one size whatever its own; without it a frame's count would follow its shape, which the towers (square
    frames) do not take."""
    if not config.get("do_center_crop", True):
        raise InputError(f"{config_file}: do_center_crop is off; prepack counts a video's frames center-cropped to "
                         "crop_size, the square frames its model's tower takes.")
    crop = _mapping(config, config_file, "crop_size")
    height, width = (_positive(crop, config_file, side, _FRAME_CROP, "crop_size.") for side in ("height", "width"))
    pooled = named.startswith("LlavaNextVideo")
    patch = _positive(processor, processor_file, "patch_size", None if pooled else 14)
    if patch is None:
        raise InputError(f"{processor_file}: a LLaVA-NeXT-Video processor needs patch_size.")
    if pooled:
        tokens = (height // patch) * (width // patch) // 4
    else:
        tokens = (height // patch) * (width // patch) + _additional_image_tokens(processor, processor_file, 1)
    if tokens < 1:
        raise InputError(f"{config_file.parent}: a frame of {width}x{height} in patches of {patch} gives no video "
                         "tokens.")
    return tokens


def _anyres_fields(config: dict, config_file: Path, processor: dict, processor_file: Path, onevision: bool) -> dict:
    """LLaVA-NeXT's tiling rule, as its processor counts (transformers' `LlavaNextProcessor._get_number_of_features`):
    a tile is the processed image's shape (the crop, or the resized size without one), its features per side the
    tile over processor_config.json's patch_size, the whole image that many features plus
    `num_additional_image_tokens` (default 0), less one where `vision_feature_select_strategy` is "default".
    LLaVA-OneVision's (`onevision`): `num_image_tokens` features per tile and for the whole image (a square of them),
    the tiles' grid scaled down to about N tiles by `vision_aspect_ratio` "anyres_max_N"; no crop unless asked."""
    pinpoints = config.get("image_grid_pinpoints")
    if not isinstance(pinpoints, list) or not pinpoints or not all(
        isinstance(pair, list) and len(pair) == 2 and all(type(side) is int and side >= 1 for side in pair)
        for pair in pinpoints
    ):
        raise InputError(f"{config_file}: image_grid_pinpoints is {pinpoints!r}; expected [[height, width], ...].")
    if config.get("do_center_crop", not onevision):
        crop = _mapping(config, config_file, "crop_size")
        tile = [_positive(crop, config_file, side, None, "crop_size.") for side in ("height", "width")]
    else:
        size = _mapping(config, config_file, "size")
        edge = _positive(size, config_file, "shortest_edge", None, "size.")
        tile = [_positive(size, config_file, side, edge, "size.") for side in ("height", "width")]
    if None in tile:
        raise InputError(f"{config_file}: a LLaVA-NeXT or -OneVision processor needs crop_size (or size).")
    without_cls = processor.get("vision_feature_select_strategy") == "default"
    if onevision:
        tokens = _positive(processor, processor_file, "num_image_tokens", None)
        aspect = _text(processor, processor_file, "vision_aspect_ratio", "anyres_max_9")
        max_tiles = re.fullmatch(r"anyres_max_([1-9][0-9]{0,4})", aspect)
        if tokens is None or max_tiles is None:
            raise InputError(f"{processor_file}: LLaVA-OneVision's processor needs num_image_tokens and a "
                             f"vision_aspect_ratio of anyres_max_N (found {aspect!r}).")
        rows = columns = math.isqrt(tokens)
        return {"kind": "anyres", "pinpoints": pinpoints, "tile_height": tile[0], "tile_width": tile[1],
                "feature_rows": rows, "feature_columns": columns, "tokens": tokens - without_cls,
                "max_tiles": int(max_tiles[1])}
    patch = _positive(processor, processor_file, "patch_size", None)
    if patch is None:
        raise InputError(f"{processor_file}: a LLaVA-NeXT processor needs patch_size.")
    extra = _additional_image_tokens(processor, processor_file, 0)
    rows, columns = tile[0] // patch, tile[1] // patch
    if not rows or not columns:
        raise InputError(f"{config_file.parent}: a tile of {tile[1]}x{tile[0]} in patches of {patch} has no features.")
    return {"kind": "anyres", "pinpoints": pinpoints, "tile_height": tile[0], "tile_width": tile[1],
            "feature_rows": rows, "feature_columns": columns, "tokens": rows * columns + extra - without_cls}


def _internvl_fields(config: dict, config_file: Path, processor: dict, processor_file: Path) -> dict:
    """InternVL's count: image_seq_length per view. Untiled (crop_to_patches false) one view; tiled, the tiles
    of GOT-OCR2's canvas and a thumbnail (`ImageRule` kind tiles), as the image processor's config says, which
    the training collator's image processor reads too. GOT-OCR2's image processor serves GOT-OCR2 too, whose
    placeholders are others: only InternVLProcessor's are counted."""
    named = processor.get("processor_class", "InternVLProcessor")
    if named != "InternVLProcessor":
        raise InputError(f"{processor_file}: processor_class {named!r}; prepack counts GOT-OCR2's image processor as "
                         "InternVLProcessor uses it.")
    tokens = _positive(processor, processor_file, "image_seq_length", 256)
    if not config.get("crop_to_patches"):
        return {"kind": "fixed", "tokens": tokens}
    size = _mapping(config, config_file, "size")
    side = _positive(size, config_file, "height", None, "size.")
    if side is None or size.get("width") != side:
        raise InputError(f"{config_file}: size is {size!r}; prepack counts InternVL's tiles when they are square "
                         "(height equal to width).")
    return {"kind": "tiles", "tokens": tokens, "patch_size": side,
            "min_tiles": _positive(config, config_file, "min_patches", 1),
            "max_tiles": _positive(config, config_file, "max_patches", 12)}


def _lfm2_fields(config: dict, config_file: Path, processor: dict, processor_file: Path) -> dict:
    """LFM2-VL's count (`ImageRule` kind lfm2), from its image processor's config with Lfm2VlImageProcessor's
    defaults: min_image_tokens and max_image_tokens as pixels (a token's pixels: (encoder_patch_size x
    downsample_factor)²), tiles of tile_size, min_tiles to max_tiles of them when do_image_splitting (1 to 1
    without, as the processor sets), the thumbnail after them when use_thumbnail. Lfm2VlProcessor's text with its
    image special tokens (its default) is counted; without them, refused."""
    if processor.get("use_image_special_tokens", True) is not True:
        raise InputError(f"{processor_file}: use_image_special_tokens is {processor['use_image_special_tokens']!r}; "
                         "prepack counts LFM2-VL's images with them, Lfm2VlProcessor's default.")
    flags = {}
    for key in ("do_image_splitting", "use_thumbnail"):
        flags[key] = config.get(key, True)
        if type(flags[key]) is not bool:
            raise InputError(f"{config_file}: {key} is {flags[key]!r}; expected true or false.")
    tolerance = config.get("max_pixels_tolerance", 2.0)
    if type(tolerance) not in (int, float) or not 0 < tolerance < math.inf:
        raise InputError(f"{config_file}: max_pixels_tolerance is {tolerance!r}; expected a positive number.")
    patch, merge = (_positive(config, config_file, key, default) for key, default in (("encoder_patch_size", 16),
                                                                                     ("downsample_factor", 2)))
    token_pixels = (patch * merge) ** 2
    min_tiles, max_tiles = (_positive(config, config_file, key, default) for key, default in (("min_tiles", 2),
                                                                                             ("max_tiles", 10)))
    if not flags["do_image_splitting"]:
        min_tiles = max_tiles = 1
    elif min_tiles > max_tiles:
        raise InputError(f"{config_file}: min_tiles {min_tiles} is more than max_tiles {max_tiles}.")
    elif min_tiles == 1:
        # transformers' own two halves disagree there: a large image split into one tile is counted in the text as
        # its thumbnail (Lfm2VlProcessor) but made a whole tile (Lfm2VlImageProcessor), so training would fail.
        raise InputError(f"{config_file}: min_tiles 1 with do_image_splitting: transformers' Lfm2VlProcessor counts "
                         "a large image split into one tile as its thumbnail, while its image processor makes the "
                         "whole tile, so the placeholders would not match the image's features in training; set "
                         "min_tiles to 2 or more, or do_image_splitting to false.")
    tile = _positive(config, config_file, "tile_size", 512)
    if flags["do_image_splitting"] and tile % patch:
        # transformers' Lfm2VlImageProcessor reshapes each tile into whole patches and fails on any other tile.
        raise InputError(f"{config_file}: tile_size {tile} is not a multiple of encoder_patch_size {patch}; "
                         "LFM2-VL's image processor cuts every tile into whole patches and fails on such a tile.")
    if flags["do_image_splitting"] and tile // patch % merge:
        # Lfm2VlProcessor rounds a tile's features per side up, its model (downsample_factor² patches a feature) down.
        raise InputError(f"{config_file}: tile_size {tile} is {tile // patch} patches of {patch} a side, not a multiple "
                         f"of downsample_factor {merge}; LFM2-VL's processor counts such a tile "
                         f"{math.ceil(tile // patch / merge) ** 2} placeholders while its model makes "
                         f"{(tile // patch // merge) ** 2} features of it, so the placeholders would not match the "
                         "image's features in training.")
    return {"kind": "lfm2", "patch_size": patch, "merge_size": merge,
            "min_pixels": _positive(config, config_file, "min_image_tokens", 64) * token_pixels,
            "max_pixels": _positive(config, config_file, "max_image_tokens", 256) * token_pixels,
            "tile_height": tile, "min_tiles": min_tiles,
            "max_tiles": max_tiles, "splitting": flags["do_image_splitting"], "tolerance": float(tolerance),
            "global_token": "<|img_thumbnail|>" if flags["use_thumbnail"] else None}


def _pixtral_fields(config: dict, config_file: Path, processor: dict, processor_file: Path) -> dict:
    """Mistral 3's rows: cells of the tower's patch times its spatial merge (processor_config.json, as
    PixtralProcessor hands them to the image processor), within the image processor's longest edge."""
    size = _mapping(config, config_file, "size")
    longest_edge = _positive(size, config_file, "longest_edge", None, "size.")
    if longest_edge is None:
        raise InputError(f"{config_file}: size.longest_edge is missing; prepack counts Pixtral's images within it.")
    cell = _positive(processor, processor_file, "patch_size", 16) * _positive(
        processor, processor_file, "spatial_merge_size", 1)
    return {"kind": "rows", "patch_size": cell, "longest_edge": longest_edge,
            "row_end": _text(processor, processor_file, "image_break_token", "[IMG_BREAK]")}


def _siglip_processor(config: dict, processor: dict, processor_file: Path) -> str:
    """The processor a SigLIP image processor serves, by the processor_class its directory records (PaliGemma's when
    none is recorded); another than `_SIGLIP_PROCESSORS` is refused."""
    named = processor.get("processor_class", config.get("processor_class", "PaliGemmaProcessor"))
    if named not in _SIGLIP_PROCESSORS:
        raise InputError(f"{processor_file}: processor_class {named!r}; prepack counts SigLIP's image processor as "
                         f"{' or '.join(_SIGLIP_PROCESSORS)} uses it.")
    return named


def _paligemma_fields(config: dict, config_file: Path) -> dict:
    """PaliGemma's count: the image_seq_length its image processor's config records (what PaliGemmaProcessor
    reads), per image."""
    tokens = _positive(config, config_file, "image_seq_length", None)
    if tokens is None:
        raise InputError(f"{config_file}: image_seq_length is missing; PaliGemma's processor reads its count there.")
    return {"kind": "fixed", "tokens": tokens}


def _gemma4_fields(config: dict, config_file: Path) -> dict:
    """Gemma 4's rule: its image processor's budget of soft tokens an image, patch and pooling kernel."""
    if config.get("do_resize", True) is not True:
        raise InputError(f"{config_file}: do_resize is {config['do_resize']!r}; prepack counts Gemma 4's images as its "
                         "image processor resizes them (do_resize true).")
    tokens = _positive(config, config_file, "max_soft_tokens", 280)
    if tokens not in _GEMMA4_SOFT_TOKENS:
        raise InputError(f"{config_file}: max_soft_tokens is {tokens}; Gemma 4's image processor takes one of "
                         f"{', '.join(map(str, _GEMMA4_SOFT_TOKENS))}.")
    return {"kind": "pooled", "tokens": tokens, "patch_size": _positive(config, config_file, "patch_size", 16),
            "merge_size": _positive(config, config_file, "pooling_kernel_size", 3)}


def _tokenizer_tokens(tokenizer, directory: Path, names: tuple[str, ...]) -> tuple[str, ...]:
    """The texts of the tokenizer's named special tokens `names` (`LocalTokenizer.special_tokens`, read as
    transformers' tokenizer reads them)."""
    found = [tokenizer.special_tokens.get(name) for name in names]
    missing = [name for name, value in zip(names, found) if not value]
    if missing:
        raise InputError(f"{directory / 'tokenizer_config.json'}: no {', '.join(missing)} (a string, or "
                         "{\"content\": ...}); the processor takes its image tokens from the tokenizer's named special "
                         "tokens.")
    return tuple(found)


def image_header(data: bytes, where: str, limits: ImageLimits) -> tuple[int, int]:
    """(width, height) from the image's header; nothing decoded. InputError for a bad or oversized image."""
    if len(data) > limits.max_image_bytes:
        raise InputError(f"{where}: the image has {len(data)} bytes, more than the limit {limits.max_image_bytes}.")
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height, kind = image.width, image.height, image.format
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InputError(f"{where}: not a readable image ({exc}).") from None
    if kind not in _FORMATS:
        raise InputError(f"{where}: {kind} images are not read; prepack takes {', '.join(_FORMATS)}.")
    if width * height > limits.max_pixels:
        raise InputError(f"{where}: the image is {width}x{height}, more than the limit of {limits.max_pixels} pixels.")
    return width, height


def decode_failure(data: bytes) -> str | None:
    """Why Pillow cannot decode the encoded image `data` as the training loader does (`convert("RGB")`,
    `prepack.training.vision_collate`), after its own integrity check (`verify`), or None when it can.
    Call it on an image whose header is within the pixel limit (`image_header`): this decodes every pixel."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
        with Image.open(io.BytesIO(data)) as image:  # verify() leaves the image unusable: open it again
            image.convert("RGB")
    # Pillow's decoders raise more than OSError on hostile bytes (SyntaxError, EOFError, struct.error,
    # IndexError...), and every one of them means the same: the loader would fail on this image.
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass(frozen=True)
class ImageCorpusSummary:
    documents: int
    images: int  # distinct
    references: int
    image_tokens: int
    corpus: Path  # the chat corpus to build
    image_set: Path
    videos: int = 0  # video references over all rows (their frames are among `images`)


@dataclass(frozen=True)
class _ImageRoot:
    """The real path of the directory images may come from; `explicit` when the caller named it
    (`images_root`), where an absolute path inside it is taken too."""

    directory: Path
    explicit: bool


def prepare_image_chat(
    corpus: str | os.PathLike,
    processor: str | os.PathLike,
    out: str | os.PathLike,
    *,
    limits: ImageLimits | None = None,
    images_root: str | os.PathLike | None = None,
) -> ImageCorpusSummary:
    """Write `out/corpus.parquet` (the chats, images as placeholder text) and `out/images` (the image set)
    from an image-chat corpus (see the module's docstring). Image paths resolve inside each corpus file's
    directory, or inside `images_root` when given. `out` must not exist (its missing parents are made);
    it appears complete or not at all, and a second run to it while one runs is refused (OutputError).
    Same input, same bytes."""
    corpus, out, limits = Path(corpus), Path(out), limits or ImageLimits()
    rule, placeholder_id = processor_rule(processor)
    # Read at the first video only: an image corpus prepares whatever video processor the folder carries.
    video_side = functools.cache(functools.partial(video_processor_rule, processor))
    explicit = None if images_root is None else _ImageRoot(_real_directory(images_root), explicit=True)
    references: list[list[int]] = []
    row_videos: list[list[tuple[list[int], float, int]]] = []  # per row: (frame numbers, fps, placeholders)
    roots: dict[str, _ImageRoot] = {}
    with staged_directory(out, overwrite=False, overwrite_option=None) as staging:
        image_dir = staging.build / "images"
        with output_errors(image_dir, "create"):
            image_dir.mkdir()
        scratch = staging.scratch / "images.data"
        with output_file(scratch) as scratch_file, _CorpusWriter(staging.build / "corpus.parquet") as rows:
            images = _ImageWriter(scratch_file, scratch, rule, limits)
            for file, row, record in _corpus_records(corpus):
                where = f"{file}, row {row}"
                if explicit is None and str(file) not in roots:
                    roots[str(file)] = _ImageRoot(Path(os.path.realpath(Path(file).parent)), explicit=False)
                root = explicit or roots[str(file)]
                kind, turns = _turns(record, where)
                expanded, numbers, videos = _expanded(kind, turns, record, where, root, images, video_side)
                rows.add(kind, expanded, where)
                references.append(numbers)
                row_videos.append(videos)
        files = (
            _write_batch(image_dir / IMAGES_FILE, images.batch()),
            _write_batch(image_dir / DOCUMENTS_FILE, pa.record_batch(
                [pa.array(references, DOCUMENTS_SCHEMA.field(0).type)], schema=DOCUMENTS_SCHEMA)),
        )
        video_fields = {}
        if any(row_videos):  # a corpus without videos: the image set of before, byte for byte
            files += (_write_batch(image_dir / VIDEOS_FILE, _videos_batch(row_videos)),)
            video_rule, video_placeholder_id = video_side()
            video_fields = dict(video_rule=video_rule, video_placeholder_id=video_placeholder_id,
                                video_references=sum(map(len, row_videos)),
                                video_tokens=sum(tokens for videos in row_videos for _, _, tokens in videos))
        manifest = ImageSetManifest(
            image_set_version=IMAGE_SET_VERSION, rule=rule, placeholder_id=placeholder_id, limits=limits,
            documents=len(references), images=len(images.tokens), references=sum(map(len, references)),
            image_tokens=sum(images.tokens[n] for numbers in references for n in numbers), files=files,
            **video_fields,
        )
        with output_errors(image_dir / IMAGE_SET_MANIFEST):
            (image_dir / IMAGE_SET_MANIFEST).write_text(manifest.json_text())
    return ImageCorpusSummary(manifest.documents, manifest.images, manifest.references, manifest.image_tokens,
                              out / "corpus.parquet", out / "images", manifest.video_references or 0)


def _videos_batch(row_videos: list[list[tuple[list[int], float, int]]]) -> pa.RecordBatch:
    columns = (
        [[frame for frames, _, _ in videos for frame in frames] for videos in row_videos],
        [[len(frames) for frames, _, _ in videos] for videos in row_videos],
        [[fps for _, fps, _ in videos] for videos in row_videos],
        [[tokens for _, _, tokens in videos] for videos in row_videos],
    )
    return pa.record_batch([pa.array(column, field.type) for column, field in zip(columns, VIDEOS_SCHEMA)],
                           schema=VIDEOS_SCHEMA)


class _ImageWriter:
    """The distinct images of a corpus: each one's bytes appended to a scratch file as it is first met,
    its other columns kept (a few bytes an image); `batch()` is images.arrow's one record batch, its
    `data` column a memory map of the scratch file, so no image is held in memory."""

    def __init__(self, file: BinaryIO, scratch: Path, rule: ImageRule, limits: ImageLimits) -> None:
        self.file, self.scratch, self.rule, self.limits = file, scratch, rule, limits
        self.numbers: dict[bytes, int] = {}  # sha256 -> number
        self.sha256: list[bytes] = []
        self.widths: list[int] = []
        self.heights: list[int] = []
        self.tokens: list[int] = []
        self.offsets = [0]

    def number(self, data: bytes, where: str) -> int:
        """The number of the image `data` in the set, after it is checked and written when first met."""
        digest = hashlib.sha256(data).digest()
        if digest in self.numbers:
            return self.numbers[digest]
        width, height = image_header(data, where, self.limits)
        try:
            tokens = self.rule.placeholders(width, height)
        except ValueError as exc:
            raise InputError(f"{where}: the processor cannot resize the image: {exc}.") from None
        if tokens > MAX_IMAGE_TOKENS:  # before its text, that many placeholders, is built
            raise InputError(f"{where}: the image ({width}x{height}) stands for {tokens} placeholder tokens, more than "
                             f"the {MAX_IMAGE_TOKENS} prepack lets one image stand for; the processor's sizes are not "
                             "ones a model is trained with.")
        if (why := decode_failure(data)) is not None:
            raise InputError(f"{where}: the image cannot be decoded ({why}); the training loader would fail on it.")
        with output_errors(self.scratch):
            self.file.write(data)
        self.numbers[digest] = len(self.sha256)
        self.sha256.append(digest)
        self.widths.append(width)
        self.heights.append(height)
        self.tokens.append(tokens)
        self.offsets.append(self.offsets[-1] + len(data))
        return self.numbers[digest]

    def batch(self) -> pa.RecordBatch:
        """Once the scratch file is closed."""
        if not self.sha256:
            data = pa.array([], pa.large_binary())
        else:
            with output_errors(self.scratch, "read"), pa.memory_map(os.fspath(self.scratch)) as source:
                values = source.read_buffer()  # zero-copy: the map outlives the file object
            offsets = pa.array(self.offsets, pa.int64()).buffers()[1]
            data = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(self.sha256), [None, offsets, values])
        columns = (self.sha256, data, self.widths, self.heights, self.tokens)
        arrays = [column if isinstance(column, pa.Array) else pa.array(column, field.type)
                  for column, field in zip(columns, IMAGES_SCHEMA)]
        return pa.record_batch(arrays, schema=IMAGES_SCHEMA)


class _CorpusWriter:
    """corpus.parquet, written _CORPUS_ROWS rows at a time: a `messages` or a `text` column, whichever
    the first record is (one kind per corpus); a corpus without records is an empty `messages` one."""

    def __init__(self, path: Path) -> None:
        self.path, self.kind, self.rows, self.writer = path, None, [], None

    def __enter__(self) -> _CorpusWriter:
        return self

    def add(self, kind: str, row: Any, where: str) -> None:
        if self.kind not in (None, kind):
            raise InputError(f"{where}: a {kind} record in a corpus of {self.kind} records; one kind per corpus.")
        self.kind = kind
        self.rows.append(row)
        if len(self.rows) == _CORPUS_ROWS:
            self._flush()

    def _flush(self) -> None:
        kind = self.kind or "messages"
        schema = pa.schema([pa.field(kind, _CORPUS_TYPES[kind])])
        with output_errors(self.path):
            if self.writer is None:
                self.writer = pq.ParquetWriter(self.path, schema)
            self.writer.write_table(pa.table({kind: pa.array(self.rows, _CORPUS_TYPES[kind])}, schema=schema))
        self.rows = []

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None and (self.rows or self.writer is None):
            self._flush()
        if self.writer is not None:
            with output_errors(self.path):
                self.writer.close()


def _write_batch(path: Path, batch: pa.RecordBatch) -> ImageSetFile:
    size, sha256 = write_record_batch(path, batch)
    return ImageSetFile(name=path.name, bytes=size, sha256=sha256)


def _json(path: Path) -> dict:
    with _regular_file(path, str(path)) as (file, size):
        data = _read_whole(file, str(path), size)
    try:
        value = parse_json(data.decode("utf-8"))
    except ValueError as exc:  # also UnicodeDecodeError
        raise InputError(f"{path}: cannot be read as JSON ({exc}).") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: expected a JSON object.")
    return value


def _real_directory(directory: str | os.PathLike) -> Path:
    real = Path(os.path.realpath(directory))
    if not real.is_dir():
        raise InputError(f"--images-root {directory}: not a directory.")
    return real


@contextmanager
def _regular_file(path: Path, named: str, limit: int | None = None) -> Iterator[tuple[BinaryIO, int]]:
    """`path` opened to read, refused (InputError starting with `named`) unless it is a regular file (of at
    most `limit` bytes, when given): opened without blocking and checked by its descriptor, so that a FIFO, a device or
    an oversized file is refused before a byte of it is read. Yields the file and its size."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        raise InputError(f"{named} cannot be read ({exc.strerror}).") from None
    with os.fdopen(fd, "rb") as file:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise InputError(f"{named} is not a regular file ({file_type_name(status.st_mode)}).")
        if limit is not None and status.st_size > limit:
            raise InputError(f"{named} has {status.st_size} bytes, more than the limit {limit}.")
        yield file, status.st_size


def _read_whole(file: BinaryIO, named: str, size: int) -> bytes:
    """The `size` bytes of an open file measured by `_regular_file` (a file that grew since is refused)."""
    try:
        data = file.read(size + 1)
    except OSError as exc:
        raise InputError(f"{named} cannot be read ({exc.strerror}).") from None
    if len(data) != size:
        raise InputError(f"{named} changed while it was read.")
    return data


def _corpus_records(spec: Path) -> Iterator[tuple[Path, int, Any]]:
    """(file, row in its file, record) for every record of the corpus `spec`, in order."""
    if spec.name.lower().endswith(".json") and not spec.is_dir():
        yield from _json_file_records(spec)
        return
    for path in find_corpus(spec).files:
        kind = file_kind(Path(path))
        if kind == "jsonl":
            for row0, records, _ in json_object_blocks(Path(path), _JSON_BLOCK):
                for row, record in enumerate(records, row0):
                    yield path, row, record
            continue
        row = 0
        for batch in record_batches(Path(path), kind, list(file_columns(Path(path), kind)), _FILE_ROWS):
            for start in range(0, batch.num_rows, _FILE_ROWS):
                for record in batch.slice(start, _FILE_ROWS).to_pylist():
                    yield path, row, record
                    row += 1


def _json_file_records(path: Path) -> Iterator[tuple[Path, int, Any]]:
    """A .json corpus: one JSON array of records (LlamaFactory's files), read whole up to
    MAX_RECORD_BYTES, or JSON Lines."""
    with _regular_file(path, str(path)) as (file, size):
        is_array = file.read(64).lstrip()[:1] == b"["
        if is_array:
            if size > MAX_RECORD_BYTES:
                raise InputError(f"{path}: a JSON array of {size} bytes, more than the {MAX_RECORD_BYTES} prepack "
                                 "reads whole; write the records as JSON Lines (.jsonl), one a line.")
            file.seek(0)
            data = _read_whole(file, str(path), size)
    if not is_array:
        for row0, records, _ in json_object_blocks(path, _JSON_BLOCK):
            for row, record in enumerate(records, row0):
                yield path, row, record
        return
    try:
        records = parse_json(data)
    except ValueError as exc:  # also UnicodeDecodeError
        raise InputError(f"{path}: not valid JSON ({exc}).") from None
    del data
    for row, record in enumerate(records):
        if not isinstance(record, dict):
            raise InputError(f"{path}, row {row}: a record must be a JSON object.")
        yield path, row, record


def _turns(record: dict, where: str) -> tuple[str, list[tuple[Any, Any, str]]]:
    """The corpus kind of a record ("messages" or "text") and its turns: (role, content, column)."""
    if isinstance(record.get("messages"), list):
        turns = []
        for index, message in enumerate(record["messages"]):
            if not isinstance(message, dict):
                raise InputError(f"{where}, column messages[{index}]: expected an object with role and content.")
            role = message.get("role")
            if role is not None and not isinstance(role, str):
                raise InputError(f"{where}, column messages[{index}].role: {role!r}; expected a string.")
            turns.append((role, message.get("content"), f"messages[{index}].content"))
        return "messages", turns
    if isinstance(record.get("conversations"), list):  # ShareGPT, as LlamaFactory writes it
        system = record.get("system")
        if system is not None and not isinstance(system, str):
            raise InputError(f"{where}, column system: {system!r}; expected a string.")
        turns = [("system", system, "system")] if system else []
        for index, turn in enumerate(record["conversations"]):
            column = f"conversations[{index}]"
            if not isinstance(turn, dict):
                raise InputError(f"{where}, column {column}: expected an object with from and value.")
            if turn.get("from") not in _SHAREGPT_ROLES:
                raise InputError(f"{where}, column {column}.from: {turn.get('from')!r} is not a speaker of "
                                 f"ShareGPT records as LlamaFactory writes them ({', '.join(_SHAREGPT_ROLES)}).")
            turns.append((_SHAREGPT_ROLES[turn["from"]], turn.get("value"), f"{column}.value"))
        return "messages", turns
    if isinstance(record.get("text"), str):
        return "text", [(None, record["text"], "text")]
    raise InputError(
        f"{where}: expected messages (a Hugging Face chat), conversations (ShareGPT, as LlamaFactory writes "
        f"it) or a text string; the record has {', '.join(map(str, record)) or 'no fields'}."
    )


def _expanded(kind: str, turns: list, record: dict, where: str, root: _ImageRoot, images: _ImageWriter,
              video_side: Callable[[], tuple[VideoRule, int] | None]):
    """The record's messages with string contents, or its text, images and videos as placeholder text; its image
    numbers; its videos as (frame numbers, fps, placeholders). `video_side()`: the video rule and placeholder id
    (`video_processor_rule`), asked for at the record's first video."""
    pending = record.get("images")
    if pending is None:
        pending = []
    if not isinstance(pending, list):
        raise InputError(f"{where}, column images: {type(pending).__name__}; expected a list of images.")
    pending = list(pending)
    numbers: list[int] = []
    rule, limits = images.rule, images.limits

    def image_text(source: Any, column: str) -> str:
        if len(numbers) >= limits.max_images_per_document:
            raise InputError(
                f"{where}, column {column}: more than {limits.max_images_per_document} images in a record."
            )
        at = f"{where}, column {column}"
        if numbers and rule.kind == "anyres" and rule.max_tiles is not None:  # OneVision; before the second image is read
            raise InputError(
                f"{at}: a second image in one record. LLaVA-OneVision's processor gives an image of a multi-image "
                "sample its base features only, not its tiles (and the model must then be told each sample's image "
                "count); prepack counts the tiled single image only: one image per record for this processor."
            )
        number = images.number(_image_bytes(source, at, root, limits), at)
        numbers.append(number)
        return rule.text(images.widths[number], images.heights[number], images.tokens[number])

    def next_pending(column: str) -> Any:
        if not pending:
            raise InputError(f"{where}, column {column}: an image without a source, and the images column has no more.")
        return pending.pop(0)

    pending_videos = record.get("videos")
    has_videos = pending_videos is not None
    if has_videos and not isinstance(pending_videos, list):
        raise InputError(f"{where}, column videos: {type(pending_videos).__name__}; expected a list of videos.")
    pending_videos = list(pending_videos or [])
    videos: list[tuple[list[int], float, int]] = []
    rates = _video_rates(record.get("video_fps"), where)

    def video_text(source: Any, column: str) -> str:
        at = f"{where}, column {column}"
        side = video_side()
        if side is None:
            raise InputError(f"{at}: a video, and the processor directory has no video processor "
                             "(video_preprocessor_config.json of a Qwen2-VL, Qwen3-VL, LLaVA-NeXT-Video or "
                             "Video-LLaVA video processor).")
        video_rule = side[0]
        frames = _video_frames(source, at, root)
        # Counted before any frame is read, as an image is; then each frame is read and stored in turn.
        if len(numbers) + sum(len(frames) for frames, _, _ in videos) + len(frames) > limits.max_images_per_document:
            raise InputError(f"{at}: more than {limits.max_images_per_document} images in a record (a video's frames "
                             "count as images).")
        frame_numbers = [images.number(_image_bytes(frame, frame_at, root, limits), frame_at)
                         for frame, frame_at in frames]
        sizes = sorted({(images.widths[number], images.heights[number]) for number in frame_numbers})
        if len(sizes) != 1:
            raise InputError(f"{at}: the video's frames are of {len(sizes)} sizes ({sizes}); a video's frames are of "
                             "one size.")
        ((width, height),) = sizes
        fps = rates(len(videos), at)
        try:
            text = video_rule.text(len(frames), width, height, fps)
        except ValueError as exc:
            raise InputError(f"{at}: the video processor cannot take the video: {exc}.") from None
        videos.append((frame_numbers, fps, video_rule.placeholders(len(frames), width, height)))
        return text

    def next_video(column: str) -> Any:
        if not pending_videos:
            raise InputError(f"{where}, column {column}: a video without a source, and the videos column has no more.")
        return pending_videos.pop(0)

    # `<video>` is a marker only in a record with a videos column (LlamaFactory's), so texts of before read alike.
    markers = f"({re.escape(LLAVA_MARKER)}|{re.escape(VIDEO_MARKER)})" if has_videos else f"({re.escape(LLAVA_MARKER)})"
    messages = []
    for role, content, column in turns:
        if isinstance(content, str):
            pieces = re.split(markers, content)
            text = "".join(
                piece if index % 2 == 0
                else image_text(next_pending("images"), "images") if piece == LLAVA_MARKER
                else video_text(next_video("videos"), "videos")
                for index, piece in enumerate(pieces)
            )
        elif isinstance(content, list):
            parts = []
            for item in content:
                item_kind = item.get("type") if isinstance(item, dict) else None
                if item_kind == "text":
                    parts.append(str(item.get("text") or ""))
                elif item_kind == "image":
                    source = next((item[key] for key in ("image", "path", "bytes") if item.get(key)), None)
                    parts.append(image_text(source if source is not None else next_pending("images"), column))
                elif item_kind == "video":
                    source = next((item[key] for key in ("video", "path") if item.get(key)), None)
                    parts.append(video_text(source if source is not None else next_video("videos"), column))
                else:
                    raise InputError(
                        f"{where}, column {column}: an item of type {item_kind!r}; expected text, image or video.")
            text = "".join(parts)
        else:
            raise InputError(f"{where}, column {column}: expected a string or a list of items.")
        messages.append({"role": role, "content": text})
    if pending:
        raise InputError(f"{where}, column images: {len(pending)} images that no message places.")
    if pending_videos:
        raise InputError(f"{where}, column videos: {len(pending_videos)} videos that no message places.")
    given_rates = record.get("video_fps")
    if isinstance(given_rates, list) and len(given_rates) > len(videos):
        raise InputError(f"{where}, column video_fps: {len(given_rates)} rates for {len(videos)} videos; give one rate "
                         "a video (or one number for all).")
    return (messages[0]["content"] if kind == "text" else messages), numbers, videos


def _video_rates(value: Any, where: str):
    """`rate(index, at)`: the frames per second of the record's video `index`, from its `video_fps` (one number
    for every video, or a list of one per video; DEFAULT_VIDEO_FPS without it)."""
    if value is None:
        return lambda index, at: DEFAULT_VIDEO_FPS
    single = not isinstance(value, list)
    for rate in [value] if single else value:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
            raise InputError(f"{where}, column video_fps: {rate!r}; a frame rate is a positive number.")

    def rate(index: int, at: str) -> float:
        if single:
            return float(value)
        if index >= len(value):
            raise InputError(f"{at}: video {index} of the record has no rate in video_fps ({len(value)} rates).")
        return float(value[index])

    return rate


def _video_frames(source: Any, where: str, root: _ImageRoot) -> list[tuple[Any, str]]:
    """A video's frames, each an image source for `_image_bytes` and where it is, unread: from a list of frames
    (paths or encoded images) or a directory of frame images (confined as an image path is; its image files in
    name order). A video file is refused: no decoder."""
    if isinstance(source, list):
        if not source:
            raise InputError(f"{where}: a video without frames.")
        return [(frame, f"{where}, frame {index}") for index, frame in enumerate(source)]
    if isinstance(source, str) and source and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", source):
        directory = _confined(source, where, root)
        if not directory.exists():
            raise InputError(f"{where}: the video {source!r} cannot be read (no such file or directory).")
        if directory.is_dir():
            names = sorted(entry.name for entry in os.scandir(directory)
                           if entry.name.lower().endswith(_FRAME_SUFFIXES) and not entry.name.startswith("."))
            if not names:
                raise InputError(f"{where}: the video directory {source!r} holds no frame images "
                                 f"({', '.join(_FRAME_SUFFIXES)}).")
            return [(f"{source.rstrip('/')}/{name}", f"{where}, frame {name}") for name in names]
    raise InputError(f"{where}: {str(source)[:80]!r} is not a list of frames or a directory of them; {_VIDEO_AS_FRAMES}.")


def _image_bytes(source: Any, where: str, root: _ImageRoot, limits: ImageLimits) -> bytes:
    if isinstance(source, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
        source = source.get("bytes") or source.get("path")
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if not isinstance(source, str) or not source:
        raise InputError(f"{where}: an image is a path or encoded bytes, not {type(source).__name__}.")
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", source) and not source.startswith("file://"):
        raise InputError(f"{where}: {source!r} is a URI; prepack reads local images only (nothing is downloaded).")
    path = _confined(source, where, root)
    named = f"{where}: the image {source!r}"
    with _regular_file(path, named, limits.max_image_bytes) as (file, size):
        return _read_whole(file, named, size)


def _confined(source: str, where: str, root: _ImageRoot) -> Path:
    """The real path of the image file `source` names, when it lies inside `root`; else InputError, decided
    before anything outside is opened, and worded alike whether a file is there or not."""
    if "\0" in source:
        raise InputError(f"{where}: the image path {source!r} holds a NUL character, which no file name holds.")
    name = source.removeprefix("file://")
    if os.path.isabs(name) and not root.explicit:
        raise InputError(f"{where}: the image path {source!r} is absolute; {_PATH_RULE}.")
    leaves = f"{where}: the image path {source!r} leads out of {root.directory}; {_PATH_RULE}."
    # The path as written first, so that one plainly outside is refused without a look at the file system;
    # then with its symbolic links resolved, so that none leads out.
    if not Path(os.path.normpath(root.directory / name)).is_relative_to(root.directory):
        raise InputError(leaves)
    real = Path(os.path.realpath(root.directory / name))
    if not real.is_relative_to(root.directory):
        raise InputError(leaves)
    return real
