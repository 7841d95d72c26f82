"""Image+chat corpora: every image's placeholder count from its header, images stored once.

    rule, placeholder_id = processor_rule("./processor")   # image processor config + tokenizer, local
    summary = prepare_image_chat("chats.jsonl", "./processor", "prepared/")
    # then: prepack build prepared/corpus.parquet --tokenizer ./processor --mode chat --max-len N --out build/
    # and train on build/ with prepared/images (prepack.training.vision_dataset.ImagePackedDataset)

A record is a Hugging Face chat: `messages`, each with a `role` and a `content` that is either a string
(where `<image>` marks an image, LLaVA style) or a list of items `{"type": "text", "text": ...}` /
`{"type": "image", ...}`; or, in a corpus of text, a `text` string with `<image>` markers (then
`corpus.parquet` has a `text` column, built without --chat). An image item holds its image under
`image`, `path` or `bytes` (a path relative to the corpus file, or the encoded bytes); one without them
(and every `<image>` marker) takes the next entry of the record's `images` column (paths or bytes, or
Hugging Face's `{"bytes", "path"}` structs), in order.

Each image's width and height come from its header (Pillow opens it without decoding pixels); the
processor's resize rule (`prepack.formats.images.ImageRule`, read from the directory's
`preprocessor_config.json` and `processor_config.json`) turns them into the exact number of placeholder
tokens, and the image becomes that text (`start + placeholder × n + end`) inside its message. The chat
corpus written (`corpus.parquet`: `messages` with string contents) then tokenizes with the ordinary chat
path, the placeholders as the tokenizer's special tokens, so the plan knows every sample's true length
without a pixel decoded. The images go into an image set (`schemas/image-set.md`): each distinct image once,
as its encoded bytes with its sha256, and per corpus row the numbers of its images.

Limits (`ImageLimits`): encoded size, pixels, images per record; an image over one is refused (InputError
naming file, row and column), as is an unreadable or unsupported one. Nothing is downloaded: a URI that is
not a local path is refused.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from prepack.errors import InputError, OutputError, optional_imports
from prepack.formats.images import (
    DOCUMENTS_FILE,
    DOCUMENTS_SCHEMA,
    IMAGE_SET_MANIFEST,
    IMAGE_SET_VERSION,
    IMAGES_FILE,
    IMAGES_SCHEMA,
    ImageLimits,
    ImageRule,
    ImageSetFile,
    ImageSetManifest,
)
from prepack.storage.files import write_record_batch

with optional_imports("prepare_image_chat"):
    from PIL import Image
    from tokenizers import Tokenizer

__all__ = ["ImageCorpusSummary", "image_header", "prepare_image_chat", "processor_rule"]

LLAVA_MARKER = "<image>"
_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF")
# The placeholder texts of each image processor, by its `image_processor_type` (transformers' names).
_PLACEHOLDERS = {
    "Qwen2VLImageProcessor": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "Gemma3ImageProcessor": ("<start_of_image>", "<image_soft_token>", "<end_of_image>"),
    "CLIPImageProcessor": ("", "<image>", ""),
}


def processor_rule(directory: str | os.PathLike) -> tuple[ImageRule, int]:
    """The resize rule of a local processor directory and its placeholder's token id.

    `preprocessor_config.json` names the image processor (`image_processor_type`: Qwen2-VL's, Gemma 3's
    or CLIP's, as LLaVA uses) and its sizes; `processor_config.json` (optional) may name the tokens
    (`image_token`, `boi_token`, `eoi_token`) and, for fixed-size towers, the count (`image_seq_length`,
    or LLaVA's `patch_size` and `vision_feature_select_strategy`). The placeholder must be one token of
    the directory's `tokenizer.json`.
    """
    directory = Path(directory)
    config = _json(directory / "preprocessor_config.json")
    processor = _json(directory / "processor_config.json") if (directory / "processor_config.json").exists() else {}
    kind = config.get("image_processor_type", "").removesuffix("Fast").removesuffix("Pil")
    if kind not in _PLACEHOLDERS:
        raise InputError(
            f"{directory / 'preprocessor_config.json'}: image_processor_type {config.get('image_processor_type')!r} "
            f"is not one prepack counts placeholders for ({', '.join(_PLACEHOLDERS)})."
        )
    start, placeholder, end = _PLACEHOLDERS[kind]
    start = processor.get("boi_token", start) if kind == "Gemma3ImageProcessor" else start
    end = processor.get("eoi_token", end) if kind == "Gemma3ImageProcessor" else end
    placeholder = processor.get("image_token", placeholder)
    if kind == "Qwen2VLImageProcessor":
        size = config.get("size") or {}
        rule = ImageRule(
            kind="grid",
            placeholder=placeholder,
            start=start,
            end=end,
            patch_size=config.get("patch_size", 14),
            merge_size=config.get("merge_size", 2),
            min_pixels=size.get("shortest_edge", config.get("min_pixels", 56 * 56)),
            max_pixels=size.get("longest_edge", config.get("max_pixels", 28 * 28 * 1280)),
        )
    elif kind == "Gemma3ImageProcessor":
        rule = ImageRule(kind="fixed", placeholder=placeholder, start=start, end=end,
                         tokens=processor.get("image_seq_length", 256))
    else:
        side = (config.get("crop_size") or {}).get("height") or (config.get("size") or {}).get("shortest_edge")
        patch = processor.get("patch_size")
        if not side or not patch:
            raise InputError(
                f"{directory}: a CLIP (LLaVA) processor needs crop_size and processor_config.json's patch_size."
            )
        with_cls = processor.get("vision_feature_select_strategy") == "full"  # "default" drops the CLS token
        extra = processor.get("num_additional_image_tokens", 1) if with_cls else 0
        rule = ImageRule(
            kind="fixed", placeholder=placeholder, start=start, end=end, tokens=(side // patch) ** 2 + extra
        )
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    placeholder_id = tokenizer.token_to_id(placeholder)
    encoded = tokenizer.encode(placeholder * 2, add_special_tokens=False).ids
    if placeholder_id is None or encoded != [placeholder_id, placeholder_id]:
        raise InputError(
            f"{directory / 'tokenizer.json'}: the image placeholder {placeholder!r} is not one special token of the "
            "tokenizer; add it (tokenizers: tokenizer.add_special_tokens([...])) so that each image token is one id."
        )
    return rule, placeholder_id


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


@dataclass(frozen=True)
class ImageCorpusSummary:
    documents: int
    images: int  # distinct
    references: int
    image_tokens: int
    corpus: Path  # the chat corpus to build
    image_set: Path


def prepare_image_chat(
    corpus: str | os.PathLike,
    processor: str | os.PathLike,
    out: str | os.PathLike,
    *,
    limits: ImageLimits | None = None,
) -> ImageCorpusSummary:
    """Write `out/corpus.parquet` (the chats, images as placeholder text) and `out/images` (the image set)
    from an image-chat corpus file (.jsonl or .parquet). `out` must not exist; it appears complete or not
    at all. Same input, same bytes."""
    corpus, out, limits = Path(corpus), Path(out), limits or ImageLimits()
    rule, placeholder_id = processor_rule(processor)
    if out.exists():
        raise OutputError(f"{out} exists; prepack writes a new directory and never replaces one.")
    images: dict[bytes, int] = {}  # sha256 -> number
    columns: dict[str, list] = {name: [] for name in IMAGES_SCHEMA.names}
    rows, references, column = [], [], None
    for row, record in enumerate(_records(corpus)):
        where = f"{corpus}, row {row}"
        kind = "messages" if isinstance(record, dict) and "messages" in record else "text"
        if column not in (None, kind):
            raise InputError(f"{where}: a {kind} record in a corpus of {column} records; one kind per corpus.")
        column = kind
        expanded, numbers = _expanded(record, where, corpus.parent, rule, limits, images, columns)
        rows.append(expanded)
        references.append(numbers)
    temporary = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        pq.write_table(pa.table({column or "messages": rows}), temporary / "corpus.parquet")
        image_dir = temporary / "images"
        image_dir.mkdir()
        image_arrays = [pa.array(columns[name], IMAGES_SCHEMA.field(name).type) for name in IMAGES_SCHEMA.names]
        document_arrays = [pa.array(references, DOCUMENTS_SCHEMA.field(0).type)]
        files = (
            _write_batch(image_dir / IMAGES_FILE, pa.record_batch(image_arrays, schema=IMAGES_SCHEMA)),
            _write_batch(image_dir / DOCUMENTS_FILE, pa.record_batch(document_arrays, schema=DOCUMENTS_SCHEMA)),
        )
        manifest = ImageSetManifest(
            image_set_version=IMAGE_SET_VERSION, rule=rule, placeholder_id=placeholder_id, limits=limits,
            documents=len(references), images=len(images), references=sum(map(len, references)),
            image_tokens=sum(columns["tokens"][n] for numbers in references for n in numbers), files=files,
        )
        (image_dir / IMAGE_SET_MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")
        os.rename(temporary, out)
    except BaseException:
        for path in sorted(temporary.rglob("*"), reverse=True):  # only what this call wrote
            path.rmdir() if path.is_dir() else path.unlink()
        temporary.rmdir()
        raise
    return ImageCorpusSummary(manifest.documents, manifest.images, manifest.references, manifest.image_tokens,
                              out / "corpus.parquet", out / "images")


def _write_batch(path: Path, batch: pa.RecordBatch) -> ImageSetFile:
    size, sha256 = write_record_batch(path, batch)
    return ImageSetFile(name=path.name, bytes=size, sha256=sha256)


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot be read as JSON ({exc}).") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: expected a JSON object.")
    return value


def _records(corpus: Path):
    if corpus.suffix == ".parquet":
        for batch in pq.ParquetFile(corpus).iter_batches(batch_size=256):
            yield from batch.to_pylist()
    elif corpus.suffix in (".jsonl", ".json"):
        with open(corpus, encoding="utf-8") as lines:
            for row, line in enumerate(lines):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError as exc:
                        raise InputError(f"{corpus}, line {row + 1}: not JSON ({exc}).") from None
    else:
        raise InputError(f"{corpus}: an image-chat corpus is a .jsonl or .parquet file.")


def _expanded(record: Any, where: str, root: Path, rule: ImageRule, limits: ImageLimits, images: dict, columns: dict):
    """The record's messages with string contents, or its text, images as placeholder text; its image numbers."""
    if isinstance(record, dict) and "messages" not in record and isinstance(record.get("text"), str):
        record = {**record, "messages": [{"role": "text", "content": record["text"]}]}
        text_only = True
    else:
        text_only = False
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise InputError(f"{where}, column messages: expected a list of messages (or a text column).")
    pending = list(record.get("images") or [])
    numbers: list[int] = []

    def image_text(source: Any, column: str) -> str:
        if len(numbers) >= limits.max_images_per_document:
            raise InputError(
                f"{where}, column {column}: more than {limits.max_images_per_document} images in a record."
            )
        data = _image_bytes(source, f"{where}, column {column}", root)
        digest = hashlib.sha256(data).digest()
        if digest not in images:
            width, height = image_header(data, f"{where}, column {column}", limits)
            try:
                tokens = rule.placeholders(width, height)
            except ValueError as exc:
                raise InputError(f"{where}, column {column}: the processor cannot resize the image: {exc}.") from None
            images[digest] = len(images)
            for name, value in zip(IMAGES_SCHEMA.names, (digest, data, width, height, tokens)):
                columns[name].append(value)
        number = images[digest]
        numbers.append(number)
        return rule.start + rule.placeholder * columns["tokens"][number] + rule.end

    def next_pending(column: str) -> Any:
        if not pending:
            raise InputError(f"{where}, column {column}: an image without a source, and the images column has no more.")
        return pending.pop(0)

    messages = []
    for index, message in enumerate(record["messages"]):
        column = "text" if text_only else f"messages[{index}].content"
        if not isinstance(message, dict):
            raise InputError(f"{where}, column messages[{index}]: expected an object with role and content.")
        content = message.get("content")
        if isinstance(content, str):
            pieces = content.split(LLAVA_MARKER)
            text = pieces[0] + "".join(image_text(next_pending("images"), "images") + piece for piece in pieces[1:])
        elif isinstance(content, list):
            parts = []
            for item in content:
                kind = item.get("type") if isinstance(item, dict) else None
                if kind == "text":
                    parts.append(str(item.get("text") or ""))
                elif kind == "image":
                    source = next((item[key] for key in ("image", "path", "bytes") if item.get(key)), None)
                    parts.append(image_text(source if source is not None else next_pending("images"), column))
                else:
                    raise InputError(f"{where}, column {column}: an item of type {kind!r}; expected text or image.")
            text = "".join(parts)
        else:
            raise InputError(f"{where}, column {column}: expected a string or a list of items.")
        messages.append({"role": message.get("role"), "content": text})
    if pending:
        raise InputError(f"{where}, column images: {len(pending)} images that no message places.")
    return (messages[0]["content"] if text_only else messages), numbers


def _image_bytes(source: Any, where: str, root: Path) -> bytes:
    if isinstance(source, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
        source = source.get("bytes") or source.get("path")
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if not isinstance(source, str) or not source:
        raise InputError(f"{where}: an image is a path or encoded bytes, not {type(source).__name__}.")
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", source) and not source.startswith("file://"):
        raise InputError(f"{where}: {source!r} is a URI; prepack reads local images only (nothing is downloaded).")
    path = root / source.removeprefix("file://")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputError(f"{where}: the image {path} cannot be read ({exc.strerror}).") from None
