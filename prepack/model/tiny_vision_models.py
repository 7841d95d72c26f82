"""Tiny random vision-language models, built from their config classes, for the exactness tests of
`prepack.training.vision_collate`: one per style of packing (`prepack.model.vision_families`).

Each starts from `prepack.model.tiny_models.tiny_config` (the family's defaults with text sizes shrunk) and
shrinks the vision tower so that a real photograph becomes a handful of patches: Qwen2-VL's, Qwen2.5-VL's
and Qwen3-VL's towers to 2-4 blocks with 14-pixel patches merged 2x2 (Qwen2.5-VL keeps windowed and
full-attention blocks, so both of its vision attentions are exercised; Qwen3-VL a deepstack layer),
LLaVA's CLIP tower to 28x28 images (4 patches), Gemma 3's SigLIP tower to 32x32 images pooled to 4
tokens. `vocab_size` may be raised to a real tokenizer's. Weights are seeded; nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from prepack.model.tiny_models import HIDDEN, MAX_PARAMETERS, VOCAB, tiny_config

__all__ = ["IMAGE_SIZE", "VISION_SIZES", "tiny_vision_config", "tiny_vision_model"]

# The rotary halves of the 8-wide heads split over time, height and width (the defaults give all to time).
MROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [1, 1, 2]}
IMAGE_SIZE = {"llava": 28, "gemma3": 32}  # fixed-size towers: the side of the square image they take
# Per family: the vision tower's sizes, and the top-level settings that must agree with them.
VISION_SIZES: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": {
        "vision_config": {"depth": 4, "hidden_size": HIDDEN, "intermediate_size": 64, "num_heads": 4,
                          "out_hidden_size": HIDDEN, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1, 3]},
        "text_config": {"rope_parameters": MROPE},
    },
    "qwen2_vl": {
        "vision_config": {"depth": 2, "embed_dim": HIDDEN, "hidden_size": HIDDEN, "mlp_ratio": 2, "num_heads": 4,
                          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        "text_config": {"rope_parameters": MROPE},
    },
    "qwen3_vl": {
        "vision_config": {"depth": 2, "hidden_size": HIDDEN, "intermediate_size": 64, "num_heads": 4,
                          "out_hidden_size": HIDDEN, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
        "text_config": {"rope_parameters": MROPE},
    },
    "llava": {
        "vision_config": {"image_size": IMAGE_SIZE["llava"], "patch_size": 14, "projection_dim": HIDDEN},
    },
    "gemma3": {
        "vision_config": {"image_size": IMAGE_SIZE["gemma3"], "patch_size": 8},
        "mm_tokens_per_image": 4,
    },
}


def tiny_vision_config(
    model_type: str, vocab_size: int | None = None, tokens: dict[str, int] | None = None
) -> transformers.PreTrainedConfig:
    """The family's tiny config; `tokens` sets special token ids (a real tokenizer's image placeholder)."""
    config = tiny_config(model_type).to_dict() | (tokens or {})
    for key, value in VISION_SIZES[model_type].items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    if vocab_size is not None:
        config["text_config"]["vocab_size"] = vocab_size
    for key in ("model_type", "transformers_version", "architectures"):
        config.pop(key, None)
    return CONFIG_MAPPING[model_type](**config)


def tiny_vision_model(
    model_type: str,
    attn: str = "sdpa",
    *,
    vocab_size: int | None = None,
    tokens: dict[str, int] | None = None,
    dtype: torch.dtype = torch.float64,
) -> transformers.PreTrainedModel:
    """A seeded random vision-language model of the family, in eval mode (see `tiny_vision_config`)."""
    config = tiny_vision_config(model_type, vocab_size, tokens)
    options = dict(attn_implementation=attn, dtype=dtype)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config, **options).parameters())
    limit = MAX_PARAMETERS + 64 * (vocab_size or VOCAB) * HIDDEN  # a real tokenizer's embeddings come on top
    if parameters > limit:
        raise AssertionError(f"{model_type}: the tiny model has {parameters:,} parameters; a size was not shrunk.")
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, **options).eval()
