"""The vision sweep: a tiny random model of every image-text-to-text family the installed transformers registers,
fed packed image+text samples and each sample alone, and a verdict per family and backend measured from that.

`measure_family(model_type, attn)` builds the family's tiny model (`prepack.model.tiny_vision_models.
tiny_vision_config`: every size shrunk, the image placeholder and special tokens at the top of the vocabulary
as the text sweep places them, nothing downloaded), makes three image+text samples (one image, two images,
text only; random pixels in the tower's own input layout) and runs them alone (the image sample's logits must
change with its pixels, inverted, or the family is not measured: isolation on images the logits do not see would
be vacuous), then packed into one row with `position_ids` restarting at every sample (and, for 3-D rotary
families, each sample's own rotary rows from the model's `get_rope_index`, the text row first: what
`VisionCollator` emits). A cross-attention family (Mllama: a forward that takes `cross_attention_mask`) gives each
image one placeholder and one tile, and each sample its own cross-attention mask by Mllama's processor rule,
placed over that sample's own images in the packed row. float64, logits compared.

The verdict it returns is what `prepack.model.vision_families.VISION_FAMILIES` must hold for that backend:
- a family the table gives a style (VisionCollator batches it): `enable_packing` on, the packed batch must
  equal the samples alone; its verdict is "native" when the batch is isolated without what `enable_packing`
  adds, "layer masks" when only with it (Gemma 3's image blocks). Where the table refuses, `enable_packing`
  must raise, and the refusal must be needed: the batch let through leaks or fails; the refusal's reason is then
  prepack's own (the table's, raised by its IsolationError), not measured. Where the table isolates and
  `enable_packing` or the packed forward raises IsolationError, the family is measured as refused. Of an
  isolated batch, the sweep measures whether it is isolated, not how: a family whose text verdict (its own, or its
  decoder's model type's: LFM2-VL's LFM2) runs sequence-state layers one document per row (Qwen3.5's gated delta
  rule, LFM2's short convolutions) is given that text verdict, read from `prepack.model.families`, and on flash
  every isolated family is given "native" (transformers isolates from the offsets enable_packing derives), neither
  measured apart;
- any other family is refused, with the reason measured here: no tiny model could be built (or it needs a
  package that is not installed, such as timm), transformers has no such attention for it, transformers' own
  forward fails on text alone with the error the image samples alone raise,
  the sweep could not run an image sample alone (the family takes image inputs the sweep does not form), transformers' own code
  fails on the packed batch, the packed samples see each other, or they are isolated natively but prepack has
  no data side (placeholder rule, collator style) for the family yet. A family whose decoder runs per document
  (LFM3-VL's short convolutions) and leaks natively is measured again with those layers run one sample per row,
  as `enable_packing` would run them: isolated so, it is refused for want of a data side, not as leaking.
`sweep()` runs it for every family (`prepack check-isolation --sweep` on sdpa or eager) and says where the
table and the measurement disagree. The flash and flex columns are measured by tests/model/test_vision_sweep.py
with the pure-torch stand-ins of the kernels (tests/flash_reference.py), for the families the table gives a
style; the others are refused there as not measured.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from prepack.errors import IsolationError
from prepack.model.families import NO_FLASH, NO_FLEX, NO_SDPA, BACKENDS, Verdict, backend_of
from prepack.model.isolation import default_tolerances
from prepack.model.packing import batch_document_segments, enable_packing
from prepack.model.stateful import install_decoders_per_document_layers
from prepack.model.tiny_models import DOCUMENT_VOCAB
from prepack.model import families, vision_families
from prepack.model.vision_families import (
    CROSS_ATTENTION_LEAKS, LEAKS, NO_DATA_SIDE, NO_DATA_SIDE_PER_DOCUMENT, VISION_FAMILIES, fails_alone, fails_packed,
    not_built, not_run,
)

__all__ = ["IMAGE_TEXT_TYPES", "VisionCheck", "measure_family", "sweep"]

IMAGE_TEXT_TYPES = tuple(sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))
# Which of the pixel inputs each sample holds: one image, two, none.
SAMPLE_IMAGES = (1, 2, 0)
_UNSUPPORTED = {"sdpa": NO_SDPA, "flash": NO_FLASH, "fa4": NO_FLASH, "flex": NO_FLEX}


@dataclass(frozen=True)
class VisionCheck:
    """One family on one backend: the table's verdict against the one measured."""

    model_type: str
    table: Verdict | None  # None: the table lacks the family
    measured: Verdict

    @property
    def agrees(self) -> bool:
        return self.table == self.measured


def check_family(model_type: str, attn: str, switch: Callable | None = None) -> VisionCheck:
    """`measure_family` against the table's verdict for the family on `attn`."""
    family = VISION_FAMILIES.get(model_type)
    table = None if family is None else family.verdicts[BACKENDS.index(backend_of(attn))]
    return VisionCheck(model_type, table, measure_family(model_type, attn, switch))


def sweep(attn: str = "sdpa") -> Iterator[VisionCheck]:
    """`check_family` for every image-text-to-text family the installed transformers registers, in name order."""
    for model_type in IMAGE_TEXT_TYPES:
        yield check_family(model_type, attn)


def measure_family(model_type: str, attn: str, switch: Callable | None = None) -> Verdict:
    """The measured verdict of `model_type` on `attn` (see the module docstring). `switch(model, attn)` puts
    a model built on sdpa onto `attn` after its samples ran alone on sdpa (the tests' flash and flex
    stand-ins); by default it is built on `attn`."""
    from prepack.model.tiny_vision_models import tiny_vision_model

    try:
        model = tiny_vision_model(model_type, "sdpa" if switch else attn, dtype=torch.float64)
    except Exception as exc:  # noqa: BLE001 (a family that does not build is a finding the table states)
        return _not_built_on(model_type, attn, exc)
    tolerance, _ = default_tolerances(torch.float64, attn)
    try:
        samples = _samples(model)
        # With `switch`, each sample alone runs on sdpa, the model as its family means it (Gemma 3's flash path
        # would run its image blocks causally alone too).
        alone = [_logits(model, sample) for sample in samples]
        _require_pixels_seen(model, samples[0], alone[0], tolerance)
        packed = _packed(model, samples)
    except Exception as exc:  # noqa: BLE001 (inputs the sweep does not form for this family)
        return fails_alone(_described(exc)) if _fails_without_images(model, exc) else not_run(_described(exc))
    if switch:
        try:
            switch(model, attn)
        except Exception as exc:  # noqa: BLE001
            return _not_built_on(model_type, attn, exc)
    styled = model_type in VISION_FAMILIES and VISION_FAMILIES[model_type].style is not None
    native = _isolated(model, packed, alone, tolerance)
    text_verdict = _decoder_verdict(model, attn)
    if not styled:
        if isinstance(native, Exception):
            return fails_packed(_described(native))
        if native is False and text_verdict is not None and text_verdict.per_document:
            # A decoder whose sequence-state layers enable_packing runs one sample per row (LFM3-VL's short
            # convolutions) leaks through them natively: measured with them so, the leak left is the images'.
            try:
                per_document = _isolated_per_document(model, packed, alone, tolerance)
            except IsolationError as exc:  # prepack's hooks refused: measured as refused, with prepack's reason
                per_document = exc
            if isinstance(per_document, Exception):
                return fails_packed(_described(per_document))
            return NO_DATA_SIDE_PER_DOCUMENT if per_document is True else LEAKS
        if native:
            return NO_DATA_SIDE
        return CROSS_ATTENTION_LEAKS if _cross_attends(model) else LEAKS
    expected = VISION_FAMILIES[model_type].verdicts[BACKENDS.index(backend_of(attn))]
    try:
        enable_packing(model)
        protected = _isolated(model, packed, alone, tolerance)
    except IsolationError as exc:
        if expected.isolated:  # a family the table isolates, refused: measured as refused, with prepack's reason
            return fails_packed(_described(exc))
        # Refused as the table says: the refusal must be needed (let through, natively, the batch leaks or fails).
        if native is True:
            return vision_families.NATIVE
        return expected
    if protected is False:
        return LEAKS
    if protected is not True:
        return fails_packed(_described(protected))
    # The sequence-state layers enable_packing runs one sample per row (Qwen3.5's, LFM2-VL's), as for text.
    if text_verdict is not None and text_verdict.per_document:
        return text_verdict
    # On flash, transformers isolates from the offsets enable_packing derives, as for text: "native" there too.
    flash = backend_of(attn) in ("flash", "fa4")
    return vision_families.NATIVE if native is True or flash else vision_families.LAYER_MASKS


def _decoder_verdict(model, attn: str) -> Verdict | None:
    """The text table's verdict for the family's model type, else for its decoder's (LFM2-VL's: LFM2's)."""
    found = families.verdict(model.config.model_type, attn)
    return found if found is not None else families.verdict(model.config.get_text_config().model_type, attn)


def _isolated_per_document(model, packed: dict, alone: list[torch.Tensor], tolerance: float):
    """`_isolated` with the decoder's sequence-state layers run one sample per row, as `enable_packing` runs them
    (its hooks, told the samples from the packed text positions), and removed afterwards."""
    text_positions = packed["position_ids"][0] if packed["position_ids"].ndim == 3 else packed["position_ids"]
    layers = install_decoders_per_document_layers(model, model.config.model_type)
    try:
        layers.segments = batch_document_segments({"position_ids": text_positions}, packed["input_ids"])
        return _isolated(model, packed, alone, tolerance)
    finally:
        layers.remove()


@dataclass
class _Sample:
    input_ids: torch.Tensor  # [n]
    pixels: dict[str, torch.Tensor]  # the image inputs of its images (none for a text-only sample)


def _samples(model) -> list[_Sample]:
    """Three samples: text, each image's placeholders (as many as the tower makes features), text."""
    config = model.config
    image_token = _image_token_id(config)
    rng = np.random.default_rng(0)
    made = []
    for images in SAMPLE_IMAGES:
        pixels = _pixels(model, images, seed=len(made)) if images else {}
        per_image = _features_per_image(model, pixels, images) if images else []
        tokens = list(rng.integers(2, DOCUMENT_VOCAB, 4))
        for count in per_image:
            tokens += [image_token] * count + list(rng.integers(2, DOCUMENT_VOCAB, 3))
        if images and _cross_attends(model):
            pixels["cross_attention_mask"] = _cross_attention_mask(model, tokens, images)
        made.append(_Sample(torch.tensor(tokens), pixels))
    return made


def _image_token_id(config) -> int:
    for key in ("image_token_id", "image_token_index", "image_token"):
        value = getattr(config, key, None)
        if type(value) is int:
            return value
    raise ValueError("its config names no image placeholder (image_token_id or image_token_index)")


def _inner(model):
    """The multimodal model inside the conditional-generation head (Llama 4 has none: the head itself)."""
    return getattr(model, "model", model)


def _takes(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def _cross_attends(model) -> bool:
    """A cross-attention family (Mllama): its text attends to the images' features through cross_attention_mask."""
    return _takes(model, "cross_attention_mask")


def _requires(function, name: str) -> bool:
    parameter = inspect.signature(function).parameters.get(name)
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _pixels(model, images: int, seed: int) -> dict[str, torch.Tensor]:
    """Random pixels for `images` images in the tower's input layout: Qwen-style patch rows with their grids
    (a forward that takes image_grid_thw), Gemma 4's patch rows (one that takes image_position_ids: `_patch_rows`),
    NaFlex patch rows (one that takes spatial_shapes: `_naflex_pixels`),
    else square images of the tower's image_size: one row each, or
    Idefics' row of images, or LLaVA-NeXT's whole image and one tile, with the image sizes a family requires."""
    vision = model.config.vision_config
    generator = torch.Generator().manual_seed(seed)
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    if _takes(model, "image_grid_thw"):
        patch, merge = vision.patch_size, getattr(vision, "spatial_merge_size", 1)
        temporal = getattr(vision, "temporal_patch_size", 1) or 1
        grids = torch.tensor([[1, 2 * merge, (2 + index) * merge] for index in range(images)])
        rows = int(grids.prod(-1).sum())
        pixel_values = torch.rand(rows, channels * temporal * patch * patch, generator=generator, dtype=torch.float64)
        return {"pixel_values": pixel_values, "image_grid_thw": grids}
    if _takes(model, "image_position_ids"):
        return _patch_rows(vision, images, channels, generator)
    if _takes(model, "spatial_shapes"):  # NaFlex (SigLIP2): patch rows padded to one length, each image's grid
        return _naflex_pixels(model, images, generator, channels)
    side = getattr(vision, "image_size", None)
    if side is None:
        raise ValueError(f"its vision config ({type(vision).__name__}) has no image_size")
    side = side if isinstance(side, int) else side[0]
    if _cross_attends(model):  # Mllama's: [1, images, tiles, C, H, W], each image one tile (ratio 1:1)
        tiles = vision.max_num_tiles
        pixel_values = torch.rand(1, images, tiles, channels, side, side, generator=generator, dtype=torch.float64)
        one_tile = torch.zeros(1, images, tiles, dtype=torch.long)
        one_tile[..., 0] = 1
        return {"pixel_values": pixel_values, "aspect_ratio_ids": torch.ones(1, images, dtype=torch.long),
                "aspect_ratio_mask": one_tile}
    pixel_values = torch.rand(images, channels, side, side, generator=generator, dtype=torch.float64)
    if _takes(model, "pixel_attention_mask"):  # Idefics-style: [rows, images of the row, C, H, W]
        return {"pixel_values": pixel_values[None]}
    if getattr(model.config, "image_grid_pinpoints", None):  # LLaVA-NeXT's tiles: the whole image, then one tile
        return {"pixel_values": torch.stack([pixel_values, pixel_values.flip(-1)], dim=1),
                "image_sizes": torch.tensor([[side, side]] * images)}
    if _requires(_inner(model).get_image_features, "image_sizes"):  # each image's own size: the tower's side
        return {"pixel_values": pixel_values, "image_sizes": torch.tensor([[side, side]] * images)}
    return {"pixel_values": pixel_values}


def _patch_rows(vision, images: int, channels: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Gemma 4's variable-resolution layout, as its image processor writes it: one row of patches per image, the
    image's grid of `kernel` x `kernel` pooling cells (2x3, 3x2, ...) then padding up to the largest image, and
    `image_position_ids` (x, y) per patch, -1 on the padding. The encoder-free tower (Gemma 4 unified) takes
    patches already merged by its kernel, one token each (`model_patch_size`)."""
    merged = getattr(vision, "model_patch_size", None)
    patch, kernel = (merged, 1) if merged else (vision.patch_size, vision.pooling_kernel_size)
    grids = [(2 + index % 2, 3 - index % 2 + index // 2) for index in range(images)]  # (width, height) in cells
    length = max(width * height for width, height in grids) * kernel * kernel
    pixel_values = torch.zeros(images, length, channels * patch * patch, dtype=torch.float64)
    positions = torch.full((images, length, 2), -1, dtype=torch.long)
    for image, (width, height) in enumerate(grids):
        x, y = torch.meshgrid(torch.arange(width * kernel), torch.arange(height * kernel), indexing="xy")
        count = x.numel()
        positions[image, :count] = torch.stack([x.flatten(), y.flatten()], dim=-1)
        pixel_values[image, :count] = torch.rand(count, channels * patch * patch, generator=generator,
                                                 dtype=torch.float64)
    return {"pixel_values": pixel_values, "image_position_ids": positions}


def _naflex_pixels(model, images: int, generator: torch.Generator, channels: int) -> dict[str, torch.Tensor]:
    """A NaFlex tower's input (LFM2-VL): image i is a grid of 2f by (2 + i)f patches (f: the projector's downsample
    factor), its patch rows padded to one length for every sample, two rows more than the largest grid (as the
    processor pads every image to its max_num_patches), with `pixel_attention_mask` marking each image's patches."""
    patch, factor = model.config.vision_config.patch_size, getattr(model.config, "downsample_factor", 1)
    shapes = torch.tensor([[2 * factor, (2 + index) * factor] for index in range(images)])
    length = 2 * factor * (1 + max(SAMPLE_IMAGES)) * factor + 2
    pixel_values = torch.rand(images, length, channels * patch * patch, generator=generator, dtype=torch.float64)
    mask = torch.arange(length)[None] < shapes.prod(-1)[:, None]
    return {"pixel_values": pixel_values * mask[..., None], "pixel_attention_mask": mask.long(),
            "spatial_shapes": shapes}


def _features_per_image(model, pixels: dict[str, torch.Tensor], images: int) -> list[int]:
    """How many placeholders each image takes: the tower's features per image, by the model's get_image_features
    (a cross-attention family's, one: its text attends to the image's features instead of holding them)."""
    if _cross_attends(model):
        return [1] * images
    with torch.no_grad():
        features = _inner(model).get_image_features(**pixels)
    if isinstance(features, transformers.utils.ModelOutput):
        features = features.pooler_output if getattr(features, "pooler_output", None) is not None else features[0]
    width = model.config.get_text_config().hidden_size
    if isinstance(features, (list, tuple)):
        return [part.numel() // width for part in features]
    total = features.numel() // width
    if total % images:
        raise ValueError(f"its tower made {total} features of {images} images")
    return [total // images] * images


def _cross_attention_mask(model, tokens: list[int], images: int) -> torch.Tensor:
    """Which of its images each token of a sample attends to, [1, tokens, images, tiles], by Mllama's processor
    (transformers' own rule: from an image's placeholder to the next image's, or to the sample's end)."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    spans = get_cross_attention_token_mask(tokens, _image_token_id(model.config))
    tiles = model.config.vision_config.max_num_tiles
    return torch.from_numpy(convert_sparse_cross_attention_mask_to_dense([spans], [[1] * images], tiles, len(tokens)))


def _batch(model, input_ids: torch.Tensor, pixels: dict[str, torch.Tensor]) -> dict:
    batch = {"input_ids": input_ids[None], "use_cache": False, **pixels}
    is_image = (input_ids == _image_token_id(model.config)).long()[None]
    for name in ("token_type_ids", "mm_token_type_ids"):
        if _takes(model, name):
            batch[name] = is_image
    return batch


def _logits(model, sample: _Sample) -> torch.Tensor:
    with torch.no_grad():
        return model(**_batch(model, sample.input_ids, sample.pixels)).logits[0]


def _fails_without_images(model, exc: Exception) -> bool:
    """Whether a text-only sample alone fails as the image samples did: transformers' own forward failing on
    every input (Llama 4's in 5.24 reads an output its language model does not return), not image inputs the
    sweep did not form."""
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(2, 6)[None], use_cache=False)
    except Exception as text_only:  # noqa: BLE001
        return _described(text_only) == _described(exc)
    return False


def _require_pixels_seen(model, sample: _Sample, logits: torch.Tensor, tolerance: float) -> None:
    """The sample's logits change with its pixels (inverted) by more than `tolerance`: else an isolation measured
    on its images would be vacuous (a tower that does not reach the logits cannot leak)."""
    inverted = _Sample(sample.input_ids, {**sample.pixels, "pixel_values": 1 - sample.pixels["pixel_values"]})
    if not (_logits(model, inverted) - logits).abs().max() > tolerance:
        raise ValueError("an image sample's logits do not change with its pixels")


def _packed(model, samples: list[_Sample]) -> dict:
    """The samples in one row, positions restarting at each (3-D rotary: each sample's own rotary rows)."""
    input_ids = torch.cat([sample.input_ids for sample in samples])
    with_images = [sample.pixels for sample in samples if sample.pixels]
    # Idefics-style pixel_values hold a row's images on their second axis (NaFlex's one image a row), as all
    # Mllama's image inputs do.
    if _cross_attends(model):
        on_images_axis = set(with_images[0])
    elif _takes(model, "pixel_attention_mask") and not _takes(model, "spatial_shapes"):
        on_images_axis = {"pixel_values"}
    else:
        on_images_axis = set()
    pixels = {key: torch.cat([part[key] for part in with_images], dim=1 if key in on_images_axis else 0)
              for key in with_images[0] if key != "cross_attention_mask"}
    if _cross_attends(model):  # each sample's own, over its own images
        pixels["cross_attention_mask"] = torch.block_diag(*(
            sample.pixels["cross_attention_mask"][0].flatten(1) if sample.pixels else
            torch.zeros(len(sample.input_ids), 0, dtype=torch.long) for sample in samples
        )).view(1, len(input_ids), -1, model.config.vision_config.max_num_tiles)
    batch = _batch(model, input_ids, pixels)
    text = torch.cat([torch.arange(len(sample.input_ids)) for sample in samples])[None]
    batch["position_ids"] = text
    rope_index = getattr(_inner(model), "get_rope_index", None)
    if rope_index is not None and "image_grid_thw" in pixels:
        rows = []
        for sample in samples:
            alone = _batch(model, sample.input_ids, sample.pixels)
            grids = sample.pixels.get("image_grid_thw")
            positions, _ = rope_index(alone["input_ids"], mm_token_type_ids=alone.get("mm_token_type_ids",
                                      (alone["input_ids"] == _image_token_id(model.config)).int()),
                                      image_grid_thw=grids)
            rows.append(positions)
        batch["position_ids"] = torch.cat([text[None], torch.cat(rows, dim=-1)])
    return batch


def _isolated(model, packed: dict, alone: list[torch.Tensor], tolerance: float):
    """True/False: the packed logits equal each sample's alone (within `tolerance`); an exception: transformers'
    own code failed on the packed batch. enable_packing's refusal (IsolationError) is raised."""
    try:
        with torch.no_grad():
            logits = model(**packed).logits[0]
    except IsolationError:
        raise
    except Exception as exc:  # noqa: BLE001 (transformers' own failure on a packed batch is a finding)
        return exc
    expected = torch.cat(alone)
    return bool((logits - expected).abs().max() <= tolerance)


def _not_built_on(model_type: str, attn: str, exc: Exception) -> Verdict:
    """The refusal of a family whose model could not be built on (or switched to) `attn`: transformers names the
    class without that attention, the family's own (no such attention for it) or its tower's (`tower_without`)."""
    if "does not support an attention implementation" in str(exc):
        lacking = str(exc).split(" does not support", 1)[0]
        if lacking != MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type] and backend_of(attn) in _UNSUPPORTED:
            return vision_families.tower_without(backend_of(attn), lacking)
        return _UNSUPPORTED.get(backend_of(attn), not_built(_described(exc)))
    if (package := _missing_package(exc)) is not None:
        return vision_families.needs(package)
    return not_built(_described(exc))


def _missing_package(exc: BaseException) -> str | None:
    """The package whose absence failed the build (an import, or transformers' "requires the timm library"), or None."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return exc.name.partition(".")[0]
    required = re.search(r"requires the (\S+) library but it was not found", str(exc))
    return required[1] if required else None


def _described(exc: BaseException) -> str:
    """The exception's type and message, on one line, as the table states it."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [""]
    # A message that goes on after a colon (pydantic's validators, "install it with pip:") needs its next line.
    said = " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return f"{type(exc).__name__}: {said[:160]}"
