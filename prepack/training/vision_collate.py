"""Collate packs of image+text samples into the batch a vision-language model takes, samples kept apart.

A vision pack is a pack (`input_ids`, `cu_seqlens`, optional `labels`; see `prepack.training.collate`) whose
documents are image+text samples: each image stands in the tokens as a run of its placeholder id (as many
as the model's tower makes of it), and the pack carries `images`, the encoded bytes of its images in token
order. `VisionCollator` pads the tokens as `PackedCollator` does, decodes and preprocesses the images with the
model's image processor (in DataLoader workers) and emits, by the family's style
(`prepack.model.vision_families`):

    input_ids     [B, L] int64   padding: pad_token_id (never an image placeholder)
    labels        [B, L] int64   -100 at padding, at each sample's first token and at image placeholders
    pixel_values  what the image processor gives for the batch's images, in token order
    image_grid_thw [N, 3] int64  (3-D rotary) each image's patch grid, from the image processor
    image_sizes   [N, 2] int64   each image's (height, width), from the image processor: (tiled, LLaVA-NeXT) from
                                 which the model finds how many of the image's padded row of tiles in pixel_values
                                 [N, tiles, C, H, W] are its own; (Mistral 3) its resized size beside the padded
                                 pixel_values, each pack's placeholders checked against its images' cells (and,
                                 InternVL tiled, against the views the image processor made of its images)
    pixel_values_videos, video_grid_thw  (3-D rotary, packs with `videos`) what the video processor gives
    pixel_values_videos [1, F, C, H, W]  (LLaVA-NeXT-Video, Video-LLaVA, packs with `videos`) every frame of the
                                 batch's videos in token order in one row (the video processor's per-video frames
                                 joined): the models run (and pool) each frame alone, so videos of any frame
                                 counts share a batch
    second_per_grid_ts [V] float32 (Qwen2.5-VL, packs with `videos`) temporal_patch_size / each video's fps
    pixel_attention_mask         (split, Idefics3, SmolVLM) the image processor's mask of real pixels beside
                                 pixel_values [1, tiles, C, H, W], every tile of the batch's images in token order
    pixel_attention_mask, spatial_shapes (LFM2-VL) the image processor's: each view (tile, thumbnail, or the
                                 resized image) one row of patches in pixel_values; each pack's placeholders checked
                                 against the features its images' views make
    position_ids  [B, L] int64   (restart, image blocks) 0, 1, ... restarting at every sample
                  [4, B, L] int64 (3-D rotary) row 0 the text positions restarting at every sample (what
                                 transformers builds the per-sample mask from), rows 1-3 the temporal,
                                 height and width rotary positions of Qwen2-VL's `get_rope_index`, computed
                                 for each sample alone, so they restart at 0 at every sample
    token_type_ids [B, L] int64  (image blocks) 1 at image placeholders: Gemma 3's bidirectional image
                                 blocks, kept inside their sample by the layer masks enable_packing builds
    mm_token_type_ids [B, L] int64 (image blocks, Gemma 4) the same, under Gemma 4's name
    image_position_ids [N, P, 2] int64 (Gemma 4) each image's patch (x, y) beside its padded row of patches in
                                 pixel_values [N, P, 3·patch²], -1 on the padding; each pack's placeholders checked
                                 against the soft tokens the image processor made of its images
                  [B, L] int64  (prefix blocks) PaliGemma's: 0 on each sample's prefix (before its first target),
                                 1 after it and on padding; its position_ids then count from 1, as PaliGemma's do.
                                 The prefix follows the labels: with several turns it ends at the first
                                 target (later turns' images and prompts run causally); with every token a
                                 target (`--train-on all`, a text corpus) it holds the leading images and
                                 the first token only
    use_cache     False
    image_spans   [N, 3] int64   (with `image_spans=True`) one row per image, in the order of `pixel_values`
                                 (and `image_grid_thw`): (row, start, end), the image's placeholder tokens being
                                 `input_ids[row, start:end]` (end exclusive), every one of them and nothing
                                 else; for users who weight image and text tokens differently.
                                 `row * L + start` is the image's first token in `input_ids.flatten()`. Pop it
                                 from the batch before the forward: models take no such argument. In the fixed
                                 styles (restart, image blocks) each image's placeholders must then be one run
                                 (a pack with an image's run split is refused by pack and image); without
                                 `image_spans` the collator leaves the runs to the model.

There is no attention mask and no `cu_seq_lens_*`: transformers builds the block-diagonal mask from
`position_ids` on sdpa and eager (the backends `prepack.model.vision_families` measured; Gemma 3's image
batches get theirs from `enable_packing`). The vision towers keep
patches inside their image by themselves: Qwen's from `image_grid_thw`, CLIP's, SigLIP's and Gemma 3n's
MobileNetV5 one image per row of `pixel_values`. A batch field that would override that (`cu_seqlens`, which Qwen's tower takes as
given) is what `enable_packing` refuses (`prepack.model.vision_packing`).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prepack.training.collate import PackedCollator
from prepack.errors import InputError, UsageError, optional_imports
from prepack.formats.images import DEFAULT_VIDEO_FPS, MAX_IMAGE_PIXELS
from prepack.formats.shards import IGNORE_INDEX
from prepack.model.vision_families import IMAGE_BLOCKS, VIDEO_RULES, ImageStyle, image_style

with optional_imports("VisionCollator"):
    import torch
    from PIL import Image

__all__ = ["DEFAULT_VIDEO_FPS", "MAX_BATCH_PIXELS", "MAX_IMAGE_PIXELS", "VisionCollator", "VisionSpec",
           "rotary_3d_positions"]

# Families whose image processor splits an image into tiles plus the whole image (Idefics3's), all of a batch's
# tiles in one row of pixel_values [1, tiles, C, H, W] with pixel_attention_mask, the model dropping the padding.
SPLITTING_FAMILIES = ("idefics3", "smolvlm")
# Decoded pixels the collator accepts, by the images' headers: per image, `prepare-images`' own limit
# (prepack.formats.images), and per batch, whose images are all decoded before the image processor takes them.
MAX_BATCH_PIXELS = 128 * 2**20


@dataclass(frozen=True)
class VisionSpec:
    """What the collator needs to know of a vision-language model: its style and its image placeholder."""

    style: ImageStyle
    image_token_id: int
    merge_size: int = 1  # 3-D rotary: patches merged per side into one token (Qwen's spatial_merge_size)
    # restart, image blocks, prefix blocks: the fixed number of placeholders per image (None for a tiled tower,
    # LLaVA-NeXT's or Idefics3's, and Mistral 3's, whose count follows each image's size)
    tokens_per_image: int | None = None
    # Mistral 3: the pixels one placeholder covers per side (the tower's patch x its spatial merge), handed to the
    # image processor as its patch_size as PixtralProcessor does; each image then takes (h / cell) x (w / cell).
    image_cell: int | None = None
    # Videos (3-D rotary families of VIDEO_RULES): the video placeholder; whether each temporal step is its own
    # run of placeholders, positioned as a one-step video (Qwen3-VL); Qwen2.5-VL's temporal position scale.
    video_token_id: int | None = None
    video_steps_apart: bool = False
    tokens_per_second: float | None = None
    # Image blocks: the field that marks the placeholders (IMAGE_BLOCKS': Gemma 3's token_type_ids, Gemma 4's
    # mm_token_type_ids).
    token_types: str | None = None
    # The image processor's output that gives each image's placeholders (Gemma 4's num_soft_tokens_per_image, by
    # its size), checked per pack and kept out of the batch.
    image_counts: str | None = None
    # LLaVA-NeXT-Video, Video-LLaVA (VIDEO_RULES' frames): the placeholders of a frame, by the tower's patches.
    tokens_per_frame: int | None = None
    # LFM2-VL: the patches merged per side into one feature (its downsample_factor): a view's features are its
    # spatial_shapes over it per side, an image's its views' (tiles and thumbnail), checked per pack.
    downsample_factor: int | None = None

    @classmethod
    def of(cls, config) -> VisionSpec:
        """The spec of a transformers vision-language config (a family of `prepack.model.vision_families`)."""
        style = image_style(config.model_type)
        image_token_id = getattr(config, "image_token_id", None)
        image_token_id = config.image_token_index if image_token_id is None else image_token_id
        if style == "3-D rotary":
            video = {}
            if config.model_type in VIDEO_RULES:
                video = dict(video_token_id=config.video_token_id,
                             video_steps_apart=VIDEO_RULES[config.model_type] == "qwen3",
                             tokens_per_second=getattr(config.vision_config, "tokens_per_second", None))
            return cls(style, image_token_id, merge_size=config.vision_config.spatial_merge_size, **video)
        if style == "image blocks":
            blocks = IMAGE_BLOCKS[config.model_type]
            count = {"image_counts": blocks.image_counts} if blocks.image_counts else {
                "tokens_per_image": config.mm_tokens_per_image}
            return cls(style, image_token_id, token_types=blocks.token_types, **count)
        if config.model_type == "lfm2_vl":  # NaFlex tiles: the count follows the image's size
            return cls(style, image_token_id, downsample_factor=config.downsample_factor)
        if getattr(config, "image_grid_pinpoints", None) or config.model_type in SPLITTING_FAMILIES:
            # tiled: the count follows the image's size
            return cls(style, image_token_id, **_frame_video(config))
        vision = config.vision_config
        if style == "prefix blocks":  # PaliGemma: SigLIP's patches, one token each
            return cls(style, image_token_id, tokens_per_image=config.text_config.num_image_tokens)
        if config.model_type == "mistral3":
            return cls(style, image_token_id, image_cell=vision.patch_size * config.spatial_merge_size)
        if config.model_type == "gemma3n":  # MobileNetV5's fused feature map, a fixed grid per image
            return cls(style, image_token_id, tokens_per_image=config.vision_soft_tokens_per_image)
        if config.model_type == "internvl":  # InternViT's patches less its CLS token, pixel-shuffled
            side = vision.image_size[0] // vision.patch_size[0]
            return cls(style, image_token_id, tokens_per_image=int(side * config.downsample_ratio) ** 2)
        patches = (vision.image_size // vision.patch_size) ** 2
        # "default" drops the CLS token of CLIP's output, "full" keeps it.
        with_cls = config.vision_feature_select_strategy == "full"
        return cls(style, image_token_id, tokens_per_image=patches + with_cls, **_frame_video(config))


def _frame_video(config) -> dict[str, int]:
    """The video fields of a family whose frames each take a fixed count (VIDEO_RULES' frames): its placeholder and
    a frame's features. LLaVA-NeXT-Video's: the tower's patches per side pooled by spatial_pool_stride (its pooler's
    kernel and stride, floored); Video-LLaVA's: its video tower's patches and CLS token (its video features keep
    every token). None for other families."""
    if VIDEO_RULES.get(config.model_type) != "frames":
        return {}
    side = config.vision_config.image_size // config.vision_config.patch_size
    if config.model_type == "video_llava":
        return {"video_token_id": config.video_token_id, "tokens_per_frame": side**2 + 1}
    return {"video_token_id": config.video_token_id, "tokens_per_frame": (side // config.spatial_pool_stride) ** 2}


def rotary_3d_positions(
    input_ids: np.ndarray,
    grids: np.ndarray,
    image_token_id: int,
    merge_size: int,
    *,
    video_token_id: int | None = None,
    video_grids: np.ndarray | None = None,
    video_intervals: np.ndarray | None = None,
) -> np.ndarray:
    """[3, n] temporal/height/width rotary positions of one sample, as Qwen2-VL's `get_rope_index` gives them.

    Text tokens count on in all three rows; an image of patch grid (t, h, w) is t·h·w/merge² placeholders,
    positioned over its merged grid from where the text stood, after which the text goes on from the
    largest merged side. `grids` [k, 3]: the sample's images in order; the placeholders must add up.
    Videos likewise, by their placeholder `video_token_id` and `video_grids` (one row per run of video
    placeholders: Qwen3-VL's steps as one-step videos), the temporal positions scaled by `video_intervals`
    (float32, one per row: Qwen2.5-VL's tokens_per_second x second_per_grid_ts; 1 elsewhere) and truncated,
    as transformers does in float32.
    """
    positions = np.empty((3, len(input_ids)), dtype=np.int64)
    kinds = [("image", image_token_id, grids, None)]
    if video_token_id is not None:
        intervals = np.ones(len(video_grids), np.float32) if video_intervals is None else video_intervals
        kinds.append(("video", video_token_id, video_grids, np.asarray(intervals, np.float32)))
    is_vision = np.isin(input_ids, [token_id for _, token_id, _, _ in kinds])
    token, current, used = 0, 0, [0] * len(kinds)
    while token < len(input_ids):
        if not is_vision[token]:
            run = token + int(np.argmax(is_vision[token:])) if is_vision[token:].any() else len(input_ids)
            positions[:, token:run] = np.arange(current, current + run - token)
            current += run - token
            token = run
            continue
        kind = 0 if input_ids[token] == image_token_id else 1
        name, token_id, kind_grids, intervals = kinds[kind]
        number = used[kind]
        if number >= len(kind_grids):
            raise InputError(f"More {name} placeholders than {name}s ({len(kind_grids)}) in a sample.")
        t, h, w = (int(side) for side in kind_grids[number])
        merged_h, merged_w = h // merge_size, w // merge_size
        count = t * merged_h * merged_w
        if token + count > len(input_ids) or not (input_ids[token : token + count] == token_id).all():
            raise InputError(
                f"{name.capitalize()} {number} of a sample has {count} placeholders by its grid {(t, h, w)}, but the "
                "sample's run of placeholders is shorter."
            )
        temporal = np.arange(t)
        if intervals is not None:
            temporal = (temporal.astype(np.float32) * intervals[number]).astype(np.int64)
        grid_t, grid_h, grid_w = np.meshgrid(temporal, np.arange(merged_h), np.arange(merged_w), indexing="ij")
        positions[:, token : token + count] = np.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + current
        current += max(merged_h, merged_w)
        token += count
        used[kind] += 1
    for (name, _, kind_grids, _), number in zip(kinds, used):
        if number != len(kind_grids):
            raise InputError(f"A sample has {len(kind_grids)} {name}s but placeholders for {number}.")
    return positions


class VisionCollator:
    """Collate vision packs (see the module docstring) for `VisionSpec.of(model.config)`.

    - `image_processor`: the model's image processor (transformers' PIL ones work without torchvision),
      called on each batch's decoded images; `image_processor_options` go with that call.
    - `max_len`: the row length L and the longest pack accepted; None pads to the batch's longest pack.
    - `pad_token_id`: the id written at padding (labels -100 there); never the image placeholder.
    - `max_image_pixels`, `max_batch_pixels`: the most pixels one image, and all the images of a batch, may
      decode to (by default `MAX_IMAGE_PIXELS`, 32·2²⁰, and `MAX_BATCH_PIXELS`, 128·2²⁰). Every image's size
      is read from its header first; an image or a batch over its limit is refused (InputError naming the
      pack and the image) before any image of the batch is decoded. A video's frames count as images.
    - `image_spans`: also emit `image_spans` (see the module docstring); off by default, as the model's
      forward would be handed a field it does not take. Refused (UsageError) for towers whose images are not one
      run of placeholders each: LLaVA-NeXT's, LLaVA-OneVision's, Idefics3's and SmolVLM's tiles, Mistral 3's rows.
      Images only: a video's placeholders have no spans (find them as `input_ids == spec.video_token_id`).
    - `video_processor`: for packs with `videos` (Qwen-VL families, LLaVA-NeXT-Video and Video-LLaVA: `VIDEO_RULES`),
      called on the batch's videos (each a list of decoded RGB frames) as transformers' video processors are, giving
      `pixel_values_videos` (and Qwen-VL's `video_grid_thw`): transformers' own Qwen2VLVideoProcessor/
      Qwen3VLVideoProcessor/LlavaNextVideoVideoProcessor/VideoLlavaVideoProcessor (with `do_sample_frames=False`: the
      frames are the samples) where torchvision is installed (LLaVA-NeXT-Video's and Video-LLaVA's videos need it),
      or `prepack.training.video_frames.FrameVideoProcessor` (Qwen-VL: the image processor per frame, no
      torchvision).
    - `video_fps`: the frame rate of a video whose pack gives none in `video_fps` (default 2.0, qwen-vl-utils');
      Qwen2.5-VL's `second_per_grid_ts` is temporal_patch_size / fps, as its processor computes it.

    A pack's `videos` are its videos in token order, each a list of encoded frames (images of one size); its
    optional `video_fps`, one rate per video. The batch then also holds `pixel_values_videos`, `video_grid_thw`
    and, for Qwen2.5-VL, `second_per_grid_ts`; the rotary rows position each video as `get_rope_index` does.
    """

    def __init__(
        self,
        spec: VisionSpec,
        image_processor,
        *,
        max_len: int | None = None,
        pad_token_id: int = 0,
        image_processor_options: Mapping[str, Any] | None = None,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        max_batch_pixels: int = MAX_BATCH_PIXELS,
        image_spans: bool = False,
        video_processor=None,
        video_fps: float = DEFAULT_VIDEO_FPS,
    ):
        if pad_token_id == spec.image_token_id:
            raise UsageError(f"pad_token_id {pad_token_id} is the image placeholder; pick another id.")
        if spec.style == "image blocks" and spec.token_types is None:
            raise UsageError("An image-blocks VisionSpec needs token_types, the field that marks its placeholders "
                             "(VisionSpec.of gives each family's).")
        if not 1 <= max_image_pixels <= max_batch_pixels:
            raise UsageError(
                f"max_image_pixels ({max_image_pixels}) must be at least 1 and at most max_batch_pixels "
                f"({max_batch_pixels}): a batch must hold the largest image."
            )
        self.max_image_pixels, self.max_batch_pixels = max_image_pixels, max_batch_pixels
        if image_spans and spec.tokens_per_image is None and spec.image_counts is None and spec.style != "3-D rotary":
            # A tiled tower's image is no one run of a count the collator knows: Idefics3's and SmolVLM's tiles are
            # runs apart, and LLaVA-NeXT's and OneVision's adjacent runs touch at counts only the images' sizes give.
            raise UsageError(
                "image_spans are given where each image is one run of placeholders of a fixed count, a grid's or "
                "InternVL's views; this model's images (LLaVA-NeXT's, LLaVA-OneVision's, Idefics3's, SmolVLM's and "
                "LFM2-VL's tiles, Mistral 3's rows broken by [IMG_BREAK]) are counted by their size in the processor's "
                "text."
            )
        self.image_spans = image_spans
        self.spec, self.image_processor = spec, image_processor
        self.image_processor_options = dict(image_processor_options or {})
        # InternVL's tiles (GOT-OCR2's crop_to_patches): tokens_per_image placeholders per view, views per image by
        # its shape, checked per pack against the views the image processor makes.
        self.tiled = spec.tokens_per_image is not None and bool(
            self.image_processor_options.get("crop_to_patches", getattr(image_processor, "crop_to_patches", False)))
        # LFM2-VL's own image processor says each image's tiles when asked (SigLIP2's makes one view an image)
        self.tiles_told = spec.downsample_factor is not None and hasattr(image_processor, "return_row_col_info")
        if not video_fps > 0:
            raise UsageError(f"video_fps is {video_fps!r}; a frame rate is a positive number of frames a second.")
        self.video_processor, self.video_fps = video_processor, float(video_fps)
        # The text side is every pack's: checked, padded, labels and restarting positions as for text.
        self.text = PackedCollator(max_len, pad_to="max_len" if max_len else "longest", pad_token_id=pad_token_id)

    def __call__(self, packs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        text = self.text(packs)
        checked = [_vision_pack(pack, number, self.spec, self.tiled) for number, pack in enumerate(packs)]
        input_ids, position_ids = text["input_ids"], text["position_ids"]
        is_image = input_ids == self.spec.image_token_id
        text["labels"][is_image] = IGNORE_INDEX  # a placeholder is never a target
        if self.spec.video_token_id is not None:
            text["labels"][input_ids == self.spec.video_token_id] = IGNORE_INDEX
        batch: dict[str, Any] = {"input_ids": input_ids, "labels": text["labels"]}
        self._check_pixels(checked)  # every image and frame of the batch, by its header, before any is decoded
        images = [pack.images for pack in checked]
        image_tokens: list[int] = []  # per image its placeholders, where the image processor decides them
        if any(images):
            batch |= self._preprocessed(images)
            if self.spec.image_cell is not None:
                cell = self.spec.image_cell
                cells = [int(height) // cell * (int(width) // cell) for height, width in batch["image_sizes"].tolist()]
                _check_image_tokens(checked, cells, self.spec.image_token_id, f"cells of {cell} pixels",
                                    "its size.longest_edge, patch_size and spatial_merge_size")
            if self.spec.image_counts is not None:
                image_tokens = [int(count) for count in batch.pop(self.spec.image_counts)]
                _check_image_tokens(checked, image_tokens, self.spec.image_token_id, "soft tokens",
                                    "its patch_size, max_soft_tokens and pooling_kernel_size")
            if self.tiled:
                image_tokens = [int(count) * self.spec.tokens_per_image for count in batch.pop("num_patches")]
                _check_image_tokens(checked, image_tokens, self.spec.image_token_id,
                                    f"placeholders, {self.spec.tokens_per_image} per view",
                                    "its crop_to_patches, min_patches, max_patches and size")
            if self.spec.downsample_factor is not None:
                _check_image_tokens(checked, batch.pop("features_per_image"), self.spec.image_token_id, "features",
                                    "its tile_size, min_tiles, max_tiles, use_thumbnail, min_image_tokens, "
                                    "max_image_tokens, encoder_patch_size and downsample_factor")
        videos = [pack.videos for pack in checked]
        if any(videos):
            batch |= self._preprocessed_videos(checked)
        if self.spec.style == "3-D rotary":
            grids = batch["image_grid_thw"].numpy() if any(images) else np.zeros((0, 3), dtype=np.int64)
            rotary = self._rotary_positions(checked, grids, input_ids.shape[1], self._video_runs(batch))
            batch["position_ids"] = torch.cat([position_ids[None], torch.from_numpy(rotary)])
        else:
            batch["position_ids"] = position_ids
        if self.spec.style == "image blocks":
            batch[self.spec.token_types] = is_image.long()
        if self.spec.style == "prefix blocks":
            batch["position_ids"] = position_ids + 1  # PaliGemma numbers a sequence's positions from 1
            batch["token_type_ids"] = _suffixes(checked, text["labels"])
        batch["use_cache"] = False
        if self.image_spans:
            if "image_grid_thw" in batch:
                merged = self.spec.merge_size**2
                image_tokens = [int(np.prod(grid)) // merged for grid in batch["image_grid_thw"].numpy()]
            elif not self.tiled and self.spec.image_counts is None:
                image_tokens = [self.spec.tokens_per_image] * sum(len(pack.images) for pack in checked)
            batch["image_spans"] = torch.from_numpy(_image_spans(checked, image_tokens, self.spec.image_token_id))
        return batch

    def _preprocessed(self, images_by_pack: Sequence[Sequence[bytes]]) -> dict[str, Any]:
        """What the image processor makes of the packs' images (encoded, in token order; their pixels checked
        already), decoded one by one."""
        decoded = [
            _opened(image, f"Pack {number}'s image {index}", lambda opened: opened.convert("RGB"))
            for number, images in enumerate(images_by_pack)
            for index, image in enumerate(images)
        ]
        options = self.image_processor_options
        if self.spec.image_cell is not None:
            options = {"patch_size": {"height": self.spec.image_cell, "width": self.spec.image_cell}} | options
        if self.tiles_told:
            options = options | {"return_row_col_info": True}
        out = self.image_processor(images=decoded, return_tensors="pt", **options)
        if "pixel_values_images" in out and "pixel_values" not in out:
            # Video-LLaVA's image processor's old name by default; its model takes them as pixel_values.
            out["pixel_values"] = out.pop("pixel_values_images")
        fields = ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask", "spatial_shapes",
                  "image_position_ids")
        kept = {key: out[key] for key in fields if key in out}
        if self.spec.image_counts is not None:  # each image's placeholders, for the check of each pack's
            kept[self.spec.image_counts] = out[self.spec.image_counts]
        if self.tiled:  # views per image, for the check of each pack's placeholders (not a model input)
            kept["num_patches"] = out["num_patches"]
        elif self.spec.tokens_per_image is not None and len(kept["pixel_values"]) != len(decoded):
            raise UsageError(
                f"The image processor made {len(kept['pixel_values'])} crops of {len(decoded)} images; prepack "
                "counted one per image (turn off crops such as Gemma 3's pan-and-scan)."
            )
        if self.spec.downsample_factor is not None:  # for the check of each pack's placeholders (not a model input)
            kept["features_per_image"] = self._features_per_image(out, len(decoded))
            kept.pop("image_sizes", None)  # the resized sizes it told with the tiles: Lfm2VlProcessor drops them too
        return kept

    def _features_per_image(self, out: Mapping[str, Any], images: int) -> list[int]:
        """LFM2-VL: each image's features as its model makes them (a view's: its patch rows and columns each over
        downsample_factor, floored), its views in order: its tiles, then its thumbnail where it has several tiles and
        the processor makes thumbnails (Lfm2VlImageProcessor's crop_image_to_patches); one view an image otherwise."""
        factor = self.spec.downsample_factor
        features = [int(rows // factor) * int(columns // factor) for rows, columns in out["spatial_shapes"].tolist()]
        views = [1] * images
        if self.tiles_told:
            thumbnail = self.image_processor_options.get("use_thumbnail", self.image_processor.use_thumbnail)
            tiles = [int(rows) * int(columns) for rows, columns in zip(out["image_rows"], out["image_cols"])]
            views = [count + (thumbnail and count > 1) for count in tiles]
        ends = np.cumsum([0, *views])
        return [sum(features[start:end]) for start, end in zip(ends[:-1], ends[1:])]

    def _preprocessed_videos(self, packs: list[_VisionPack]) -> dict[str, Any]:
        """What the video processor makes of the packs' videos (their frames' pixels checked already with the
        batch's images), and Qwen2.5-VL's `second_per_grid_ts`."""
        if self.video_processor is None:
            raise UsageError("Packs with videos need VisionCollator(video_processor=...): transformers' video "
                             "processor of the family (LLaVA-NeXT-Video's and Video-LLaVA's need torchvision), or "
                             "prepack.training.video_frames' FrameVideoProcessor (Qwen-VL, without torchvision).")
        if self.spec.tokens_per_frame is not None:
            _check_frame_tokens(packs, self.spec.tokens_per_frame, self.spec.video_token_id)
        videos = [
            [_opened(frame, f"Pack {number}'s video {video}, frame {index}", lambda opened: opened.convert("RGB"))
             for index, frame in enumerate(frames)]
            for number, pack in enumerate(packs)
            for video, frames in enumerate(pack.videos)
        ]
        if self.spec.tokens_per_frame is not None:
            return {"pixel_values_videos": self._frames_in_one_row(videos)}
        # The frames are the samples, each counted at the rule's size: transformers' Qwen3-VL processor would
        # sample them by default, and its announced default caps a frame's pixels.
        out = self.video_processor(videos=videos, return_tensors="pt", do_sample_frames=False,
                                   cap_pixels_per_frame=False)
        kept = {key: out[key] for key in ("pixel_values_videos", "video_grid_thw")}
        if len(kept["video_grid_thw"]) != len(videos):
            raise UsageError(f"The video processor made {len(kept['video_grid_thw'])} grids of {len(videos)} videos.")
        # A processor that samples frames whatever it is told makes fewer steps than the placeholders were counted
        # for: named here, not later as placeholders without a video.
        step = self.video_processor.temporal_patch_size
        made, counts = kept["video_grid_thw"][:, 0].tolist(), [len(frames) for frames in videos]
        if made != (steps := [-(-count // step) for count in counts]):
            raise UsageError(f"The video processor made {made} temporal steps of the batch's videos of {counts} frames "
                             f"({step} frames a step, the last repeated: {steps}); prepack counted each frame once.")
        if self.spec.tokens_per_second is not None:
            fps = [rate for pack in packs for rate in pack.video_fps or [self.video_fps] * len(pack.videos)]
            # temporal_patch_size / fps, as Qwen2_5_VLProcessor computes it (a float32 tensor there too)
            kept["second_per_grid_ts"] = torch.tensor([step / rate for rate in fps])
        return kept

    def _frames_in_one_row(self, videos: list[list]) -> torch.Tensor:
        """LLaVA-NeXT-Video's `pixel_values_videos` [1, frames, C, H, W]: every frame of the batch's videos in token
        order, as one video of them all. Its model runs each frame through the tower alone, pools it alone and
        scatters the features over the video placeholders in order, so the features are each video's own; and
        videos of any frame counts share the batch, where transformers' [videos, frames, C, H, W] takes one count.
        The video processor takes them in one call, unstacked (`return_tensors=None`: a [frames, C, H, W] per video,
        of any frame counts), without sampling (the frames are the samples)."""
        pixels = self.video_processor(videos=videos, return_tensors=None, do_sample_frames=False)["pixel_values_videos"]
        made, counts = [len(frames) for frames in pixels], [len(frames) for frames in videos]
        if made != counts:
            raise UsageError(f"The video processor made {made} frames of the batch's videos of {counts}; prepack "
                             "counted each frame once.")
        return torch.cat(list(pixels))[None]

    def _video_runs(self, batch: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """Per run of video placeholders its grid (a Qwen3-VL step a one-step video, as get_rope_index splits
        them) and its temporal position scale (float32: tokens_per_second x second_per_grid_ts, or 1)."""
        if "video_grid_thw" not in batch:
            return np.zeros((0, 3), dtype=np.int64), np.zeros(0, np.float32)
        grids = batch["video_grid_thw"].numpy()
        intervals = np.ones(len(grids), np.float32)
        if "second_per_grid_ts" in batch:
            intervals = np.float32(self.spec.tokens_per_second) * batch["second_per_grid_ts"].numpy().astype(np.float32)
        if self.spec.video_steps_apart:
            intervals = np.repeat(intervals, grids[:, 0])
            grids = np.repeat(grids, grids[:, 0], axis=0)
            grids[:, 0] = 1
        return grids, intervals

    def _check_pixels(self, packs: Sequence[_VisionPack]) -> None:
        """Every image and video frame within max_image_pixels and all of them within max_batch_pixels, by their
        headers."""
        batch_pixels = 0
        for number, pack in enumerate(packs):
            named = [(f"Pack {number}'s image {index}", image) for index, image in enumerate(pack.images)]
            named += [(f"Pack {number}'s video {video}, frame {index}", frame)
                      for video, frames in enumerate(pack.videos) for index, frame in enumerate(frames)]
            for name, image in named:
                width, height = _opened(image, name, lambda opened: opened.size)
                if width * height > self.max_image_pixels:
                    raise InputError(
                        f"{name} is {width}x{height} = {width * height:,} pixels, more than "
                        f"max_image_pixels={self.max_image_pixels:,} of VisionCollator: refused before decoding."
                    )
                batch_pixels += width * height
                if batch_pixels > self.max_batch_pixels:
                    raise InputError(
                        f"The batch's images come to {batch_pixels:,} pixels by p{name[1:]}, more "
                        f"than max_batch_pixels={self.max_batch_pixels:,} of VisionCollator: refused before "
                        "decoding; collate fewer packs a batch, or raise max_batch_pixels."
                    )

    def _rotary_positions(
        self, packs: list[_VisionPack], grids: np.ndarray, width: int, video_runs: tuple[np.ndarray, np.ndarray]
    ) -> np.ndarray:
        """[3, B, L]: each sample's own rotary positions; a row's padding tail counts from 0 as a sample.
        `video_runs`: `_video_runs`' grids and temporal scales of the batch's runs of video placeholders."""
        positions = np.zeros((3, len(packs), width), dtype=np.int64)
        video_grids, video_intervals = video_runs
        first_image = first_video = 0
        for row, pack in enumerate(packs):
            for start, end in zip(pack.cu_seqlens[:-1], pack.cu_seqlens[1:]):
                sample = pack.input_ids[start:end]
                count = _image_runs(sample == self.spec.image_token_id, grids[first_image:], self.spec.merge_size)
                videos = {}
                if self.spec.video_token_id is not None:
                    runs = _image_runs(sample == self.spec.video_token_id, video_grids[first_video:],
                                       self.spec.merge_size)
                    videos = dict(video_token_id=self.spec.video_token_id,
                                  video_grids=video_grids[first_video : first_video + runs],
                                  video_intervals=video_intervals[first_video : first_video + runs])
                    first_video += runs
                positions[:, row, start:end] = rotary_3d_positions(
                    sample, grids[first_image : first_image + count], self.spec.image_token_id, self.spec.merge_size,
                    **videos
                )
                first_image += count
            positions[:, row, len(pack.input_ids) :] = np.arange(width - len(pack.input_ids))
        return positions


def _image_spans(packs: list[_VisionPack], image_tokens: list[int], image_token_id: int) -> np.ndarray:
    """[N, 3] (row, start, end) of every image's placeholders, images in the order of `pixel_values`: the packs'
    images in pack order, each pack's in token order. An image takes the next `count` placeholders of its row
    (`image_tokens`: by its grid, its views or the fixed count), which must be one run: adjacent images' runs touch
    in the fixed styles, so a count that only adds up is not enough."""
    counts_of = np.asarray(image_tokens, dtype=np.int64)
    spans, image = [], 0
    for row, pack in enumerate(packs):
        positions = np.flatnonzero(pack.input_ids == image_token_id)
        counts = counts_of[image : image + len(pack.images)]
        image += len(pack.images)
        if counts.sum() != len(positions):
            raise InputError(f"Pack {row} has {len(positions)} image placeholders; its {len(counts)} images make "
                             f"{counts.sum()}: its placeholders and images disagree.")
        starts = positions[np.cumsum(counts) - counts]
        if len(counts) and (broken := np.flatnonzero(positions[np.cumsum(counts) - 1] != starts + counts - 1)).size:
            raise InputError(f"Pack {row}'s image {broken[0]} has {counts[broken[0]]} placeholders, but the pack's next run "
                             "of placeholders is shorter: its placeholders and images disagree.")
        spans.append(np.stack([np.full(len(counts), row), starts, starts + counts], axis=1))
    return np.concatenate(spans).astype(np.int64) if spans else np.zeros((0, 3), dtype=np.int64)


def _image_runs(is_image: np.ndarray, grids: np.ndarray, merge_size: int) -> int:
    """How many of the next images (by their grids) the sample's placeholders hold."""
    placeholders, count = int(is_image.sum()), 0
    while placeholders > 0 and count < len(grids):
        placeholders -= int(np.prod(grids[count])) // merge_size**2
        count += 1
    return count


@dataclass(frozen=True)
class _VisionPack:
    input_ids: np.ndarray
    cu_seqlens: np.ndarray
    images: list[bytes]
    videos: list[list[bytes]] = ()  # each video its encoded frames, in token order
    video_fps: list[float] | None = None  # one frame rate per video, when the pack gives them


def _vision_pack(pack: Mapping[str, Any], number: int, spec: VisionSpec, tiled: bool = False) -> _VisionPack:
    """The pack's tokens, offsets and images (its tokens and offsets already checked by PackedCollator),
    refused where its placeholders and its images disagree."""
    input_ids, cu_seqlens = np.asarray(pack["input_ids"]), np.asarray(pack["cu_seqlens"])
    images = list(pack.get("images") or [])
    placeholders = int((input_ids == spec.image_token_id).sum())
    if spec.tokens_per_image is not None and not tiled and placeholders != spec.tokens_per_image * len(images):
        raise InputError(
            f"Pack {number} has {placeholders} image placeholders for {len(images)} images of "
            f"{spec.tokens_per_image} tokens each."
        )
    if (spec.tokens_per_image is None or tiled) and bool(placeholders) != bool(images):
        raise InputError(f"Pack {number} has {placeholders} image placeholders and {len(images)} images.")
    videos = [list(video) for video in pack.get("videos") or []]
    if videos and spec.video_token_id is None:
        raise UsageError(f"Pack {number} has videos, and prepack batches videos only for {', '.join(VIDEO_RULES)}.")
    video_placeholders = int((input_ids == spec.video_token_id).sum()) if spec.video_token_id is not None else 0
    if bool(video_placeholders) != bool(videos):
        raise InputError(f"Pack {number} has {video_placeholders} video placeholders and {len(videos)} videos.")
    if any(not video for video in videos):
        raise InputError(f"Pack {number} has a video without frames.")
    video_fps = pack.get("video_fps")
    if video_fps is not None:
        video_fps = [float(rate) for rate in video_fps]
        if len(video_fps) != len(videos) or not all(rate > 0 for rate in video_fps):
            raise InputError(f"Pack {number}'s video_fps {video_fps} is not one positive rate per video "
                             f"({len(videos)}).")
    return _VisionPack(input_ids, cu_seqlens, images, videos, video_fps)


def _suffixes(packs: list[_VisionPack], labels: torch.Tensor) -> torch.Tensor:
    """[B, L] PaliGemma's token types: 0 on each sample's prefix (its tokens before its first target, which attend
    to each other both ways), 1 on the rest of the sample and on padding (causal).

    The prefix follows the labels, not the turns: in a chat of several turns it is the first turn's images and
    prompt only (later turns' run causally); with every token a target (`--train-on all`, a text corpus) it is
    the leading images and the first token (the first token is never a target: nothing predicts it).
    """
    types = torch.ones_like(labels)
    for row, pack in enumerate(packs):
        for start, end in zip(pack.cu_seqlens[:-1].tolist(), pack.cu_seqlens[1:].tolist()):
            targets = (labels[row, start:end] != IGNORE_INDEX).nonzero()
            types[row, start : start + (int(targets[0]) if len(targets) else end - start)] = 0
    return types


def _check_image_tokens(packs: list[_VisionPack], per_image: list[int], image_token_id: int, unit: str,
                        settings: str) -> None:
    """Each pack holds as many placeholders as its images take by what the image processor made of them (`per_image`,
    in the batch's order: Mistral 3's cells, InternVL's tiled views, LFM2-VL's features): transformers checks the
    batch's total only, so a pack counted for other sizes would pass its image features to another pack's
    placeholders."""
    first = 0
    for number, pack in enumerate(packs):
        placeholders = int((pack.input_ids == image_token_id).sum())
        made = sum(per_image[first : first + len(pack.images)])
        if placeholders != made:
            raise InputError(
                f"Pack {number} has {placeholders} image placeholders; the image processor made its "
                f"{len(pack.images)} images {made} {unit}. Prepare the images with the processor the collator uses "
                f"({settings})."
            )
        first += len(pack.images)


def _check_frame_tokens(packs: list[_VisionPack], per_frame: int, video_token_id: int) -> None:
    """Every sample's video placeholders end where one of its pack's videos ends (`per_frame` a frame): the model
    scatters the batch's frame features over the placeholders in order, so a count that only adds up per pack
    would hand one sample's frames to its neighbour."""
    for number, pack in enumerate(packs):
        ends = np.cumsum([0, *(len(frames) * per_frame for frames in pack.videos)])
        is_video = pack.input_ids == video_token_id
        counted = np.cumsum([int(is_video[start:end].sum()) for start, end in zip(pack.cu_seqlens[:-1],
                                                                                   pack.cu_seqlens[1:])])
        if counted[-1] != ends[-1]:
            raise InputError(
                f"Pack {number} has {int(counted[-1])} video placeholders for videos totalling {int(ends[-1])} "
                f"({int(ends[-1]) // per_frame} frames, {per_frame} placeholders a frame)."
            )
        astray = np.flatnonzero(~np.isin(counted, ends))
        if astray.size:
            sample = int(astray[0])
            raise InputError(
                f"Pack {number}'s sample {sample} ends after {int(counted[sample])} video placeholders, where none of "
                f"its videos ends ({per_frame} placeholders a frame: videos end at {ends[1:].tolist()}): its "
                "placeholders and videos disagree."
            )


def _opened(image: bytes, name: str, read):
    """`read(opened)` of the encoded image (`name`: "Pack N's image I"), opened lazily (its header only until
    `read` asks for pixels)."""
    try:
        with Image.open(io.BytesIO(image)) as opened:
            return read(opened)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InputError(f"{name} cannot be decoded: {exc}") from None
