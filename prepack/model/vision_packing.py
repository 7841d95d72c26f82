"""What `enable_packing`'s guard does with a packed image+text batch: one that carries `pixel_values`,
`pixel_values_videos` or precomputed image features (`mm_encoder_outputs`), or, for an image-blocks family, whose
token types mark an image block (transformers builds Gemma 3's and Gemma 4's blocks from the types alone).

- The family must be isolated for images on the backend (`prepack.model.vision_families`), else IsolationError
  naming it.
- Fields that transformers' vision towers take as given instead of deriving them from each image's grid
  (`cu_seqlens`, `cu_window_seqlens`, `window_index`, `max_seqlen`, ...: `transformers.vision_utils` pops
  them from the forward's keyword arguments) are refused: one segment over several images' patches lets
  the images attend to each other (measured).
- 3-D rotary (Qwen2-VL, Qwen2.5-VL): packed rows need `position_ids` [4, B, L], the text positions first:
  transformers builds the per-sample mask from that row only, and from a [3, B, L] tensor builds none (on flash
  attention `prepack.model.packing` derives the text's offsets from that row).
- Image blocks (Gemma 3): transformers' own sliding-window mask for a packed row reads each image block at
  the wrong tokens (it applies the block overlay to positions already remapped to within-sample ones;
  transformers 5.24 `create_masks_for_vision_model`, measured: 0.18 on logits), so prepack builds both layer
  masks itself with transformers' `create_causal_mask`, from absolute token indices: (causal OR same
  image block) AND same sample (AND within the window, counted in positions, on sliding layers). On
  flex_attention the same function builds them as BlockMasks. Gemma 4 (`mm_token_type_ids`) likewise, its
  image blocks on the sliding layers only and only with `use_bidirectional_attention="vision"`, as its
  `create_masks_for_vision_model` has them (its own sliding mask misplaces them as Gemma 3's does: tests/model/
  test_vision.py asserts the leak, and that blocks on every layer or on none leak too); "all" is refused. Each
  family's field, block types and layers: `prepack.model.vision_families.IMAGE_BLOCKS`.
- Prefix blocks (PaliGemma): transformers ORs one block over every token typed 0 in the row (each sample's prefix)
  into the causal mask and ANDs the per-sample mask it builds from the restarting positions, which keeps each
  prefix inside its sample (measured); with an attention_mask it builds no per-sample mask (measured: the samples
  see each other), so a packed batch with one is refused (`prepack.model.packing` refuses a binary mask over
  restarting positions for image batches of every style, judging 3-D rotary rows by their text row).
"""

from __future__ import annotations

from typing import Any

from prepack.errors import IsolationError, optional_imports
from prepack.model.vision_families import IMAGE_BLOCKS, VISION_FAMILIES, ImageBlocks, image_refusal

with optional_imports("enable_packing"):
    import torch
    from transformers.masking_utils import create_causal_mask

__all__ = ["VISION_TOWER_OVERRIDES", "checked_image_batch", "image_block_tokens"]

# transformers.vision_utils / utils.generic pop these from the forward's kwargs and use them as given, under
# their own names or prefixed with a modality (`image_cu_seqlens`: `accepts_precomputed_kwargs` strips it).
VISION_TOWER_OVERRIDES = (
    "cu_seqlens", "max_seqlen", "cu_window_seqlens", "window_index", "max_window_seqlen", "merged_shape",
    "interp_indices", "interp_weights", "bilinear_indices", "bilinear_weights",
)
_MODALITY_PREFIXES = ("image_", "video_")


def _overrides_a_tower(key: str) -> bool:
    for prefix in _MODALITY_PREFIXES:
        key = key.removeprefix(prefix)
    return key in VISION_TOWER_OVERRIDES


def checked_image_batch(
    module: torch.nn.Module, kwargs: dict[str, Any], model_type: str, model_class: str, attn: str
) -> dict[str, Any]:
    """The image batch's kwargs, with the image blocks' layer masks built (Gemma 3, Gemma 4); IsolationError where it
    would leak."""
    message = image_refusal(model_type, model_class, attn)
    if message:
        raise IsolationError(message)
    given = [key for key, value in kwargs.items() if value is not None and _overrides_a_tower(key)]
    if given:
        raise IsolationError(
            f"An image batch with {', '.join(given)}: transformers' vision tower takes them as given instead of "
            "deriving each image's segment from its grid, so one segment over several images lets their patches "
            "attend to each other. Drop them; VisionCollator's batch has none."
        )
    style = VISION_FAMILIES[model_type].style
    position_ids = kwargs.get("position_ids")
    if style == "3-D rotary" and position_ids is not None:
        _require_text_positions(position_ids)
    if style != "image blocks":
        return kwargs
    blocks = IMAGE_BLOCKS[model_type]
    if position_ids is not None and kwargs.get(blocks.token_types) is not None:
        if kwargs.get("attention_mask") is not None:
            raise IsolationError(
                f"A packed {model_type} image batch with an attention_mask: pass position_ids and "
                f"{blocks.token_types} only (VisionCollator's batch); prepack builds the masks from them."
            )
        layers = _image_block_layers(module.config.get_text_config(), model_type, blocks)
        is_block = image_block_tokens(kwargs[blocks.token_types], blocks)
        kwargs = {**kwargs, "attention_mask": _image_block_masks(module, position_ids, is_block, layers)}
    return kwargs


def image_block_tokens(token_types: torch.Tensor, blocks: ImageBlocks) -> torch.Tensor:
    """Where `token_types` marks a token of an image block, as transformers' get_block_sequence_ids_for_mask reads
    them."""
    return torch.isin(token_types, torch.tensor(blocks.block_types, device=token_types.device))


def _image_block_layers(config, model_type: str, blocks: ImageBlocks) -> tuple[str, ...]:
    """The layer types whose image blocks attend both ways: the family's (`IMAGE_BLOCKS`), for Gemma 4 only with
    `use_bidirectional_attention="vision"` (without the setting transformers' masks are causal throughout)."""
    if not blocks.needs_bidirectional_vision:
        return blocks.layers
    bidirectional = config.use_bidirectional_attention
    if bidirectional == "all":
        raise IsolationError(
            f"A packed {model_type} image batch with use_bidirectional_attention='all': every token attends both "
            "ways, which prepack has not measured with images. Train it without packing (one sample per row)."
        )
    return blocks.layers if bidirectional == "vision" else ()


def _require_text_positions(position_ids: torch.Tensor) -> None:
    restarts = position_ids.ndim == 3 and bool((position_ids[..., 1:] < position_ids[..., :-1]).any())
    if position_ids.ndim == 3 and position_ids.shape[0] == 3 and restarts:
        raise IsolationError(
            "Packed rows with 3-D rotary position_ids of shape [3, B, L]: transformers builds the per-sample mask "
            "only from a fourth row of text positions put first ([4, B, L]), and attends over the whole row "
            "otherwise. VisionCollator emits that form."
        )


def _image_block_masks(
    module: torch.nn.Module, position_ids: torch.Tensor, is_image: torch.Tensor, blocks: tuple[str, ...]
) -> dict:
    """Both layer masks of a packed row: causal (OR same image block, on the layer types of `blocks`) AND same
    sample (AND within the window, counted in positions, on sliding layers)."""
    config = module.config.get_text_config()
    rows, width = is_image.shape
    positions = position_ids.expand(rows, width)
    starts = torch.ones((rows, width), dtype=torch.bool, device=positions.device)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    sample = starts.cumsum(1)
    new_block = is_image.clone()
    new_block[:, 1:] &= ~is_image[:, :-1] | starts[:, 1:]  # a block never runs on into the next sample
    block = torch.where(is_image, new_block.cumsum(1), -1)

    def same_block(b, h, q, kv):
        return (block[b, q] == block[b, kv]) & (block[b, q] >= 0)

    def same_sample(b, h, q, kv):
        return sample[b, q] == sample[b, kv]

    def same_sample_within_window(b, h, q, kv):
        return same_sample(b, h, q, kv) & (positions[b, kv] > positions[b, q] - config.sliding_window)

    # position_ids left out: transformers would remap the indices the functions above read.
    shape_only = torch.empty((rows, width, 0), dtype=module.dtype, device=positions.device)
    arguments = dict(config=config, inputs_embeds=shape_only, attention_mask=None, cache=None)
    within = {"full_attention": same_sample, "sliding_attention": same_sample_within_window}
    return {
        layer: create_causal_mask(
            **arguments, or_mask_function=same_block if layer in blocks else None, and_mask_function=kept
        )
        for layer, kept in within.items()
    }
