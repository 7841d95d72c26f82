"""Tiny random vision-language models, built from their config classes, for the exactness tests of
`prepack.training.vision_collate`: one per style of packing (`prepack.model.vision_families`).

Each starts from `prepack.model.tiny_models.tiny_config` (the family's defaults with text sizes shrunk) and
shrinks the vision tower so that a real photograph becomes a handful of patches: Qwen2-VL's, Qwen2.5-VL's
and Qwen3-VL's towers to 2-4 blocks with 14-pixel patches merged 2x2 (Qwen2.5-VL keeps windowed and
full-attention blocks, so both of its vision attentions are exercised; Qwen3-VL a deepstack layer),
LLaVA's CLIP tower to 28x28 images (4 patches), Gemma 3's SigLIP tower to 32x32 images pooled to 4
tokens, Gemma 4 given a tower (it has none by default) of 4-pixel patches pooled 2x2, Gemma 3n's timm MobileNetV5
to one block of each kind on 64x64 images, 4 tokens (its blocks are `prepack.model.tiny_models.MOBILENET_V5_BLOCKS`,
which the text sweep builds too; building it needs timm). `vocab_size` may be raised to a real tokenizer's. Weights
are seeded; nothing is downloaded.

`image_processor_for(config)` is transformers' PIL image processor (no torchvision) sized for a config's
tower, and `qwen_processor_directory` writes what `prepack prepare-images` and `prepack build --tokenizer`
read for a Qwen-VL model: a text tokenizer's directory with the image tokens added, and that image processor:

    config = tiny_vision_config("qwen2_vl")
    processor = qwen_processor_directory("processor/", "gpt2/", config)   # gpt2/: tokenizer.json, ...
    tokenizer = Tokenizer.from_file("processor/tokenizer.json")
    tokens = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id"),
                      map(tokenizer.token_to_id, QWEN_IMAGE_TOKENS)))
    model = tiny_vision_model("qwen2_vl", vocab_size=tokenizer.get_vocab_size(), tokens=tokens)
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from prepack.errors import UsageError
from prepack.model.tiny_models import HEAD_DIM, HIDDEN, MAX_PARAMETERS, VOCAB, WINDOW, tiny_config
from prepack.model.vision_families import image_style
from prepack.storage.output import staged_directory

__all__ = [
    "IMAGE_SIZE", "QWEN_IMAGE_TOKENS", "QWEN_PIXELS", "VISION_SIZES", "image_processor_for", "qwen_processor_directory",
    "tiny_vision_config", "tiny_vision_model",
]

# The rotary halves of the 8-wide heads split over time, height and width (the defaults give all to time).
MROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [1, 1, 2]}
IMAGE_SIZE = {"llava": 28, "gemma3": 32, "internvl": 56, "mistral3": 112, "gemma3n": 64}  # fixed-size towers: the side of the square image they take
# The most patches of an image SigLIP2's NaFlex processor makes for LFM2-VL's tiny tower (8x8 of 16 pixels: up to
# 16 placeholders after its 2x2 pixel unshuffle).
LFM2_VL_PATCHES = 64
# Qwen's image processor for the tiny towers: between 2 and 8 merged tokens (28x28 pixels each) per image.
QWEN_PIXELS = {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 8}
# The special tokens of a Qwen-VL processor (start, placeholder, end), as `prepack prepare-images` writes them.
QWEN_IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
_QWEN3_VL = {
    "vision_config": {"depth": 2, "hidden_size": HIDDEN, "intermediate_size": 64, "num_heads": 4,
                      "out_hidden_size": HIDDEN, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
    "text_config": {"rope_parameters": MROPE},
}
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
    "qwen3_vl": _QWEN3_VL,
    "qwen3_vl_moe": _QWEN3_VL,  # Qwen3-VL's tower and rotary positions, before a decoder of MoE layers
    "llava": {
        "vision_config": {"image_size": IMAGE_SIZE["llava"], "patch_size": 14, "projection_dim": HIDDEN},
    },
    "gemma3": {
        "vision_config": {"image_size": IMAGE_SIZE["gemma3"], "patch_size": 8},
        "mm_tokens_per_image": 4,
    },
    # InternViT at 4x4 patches, pixel-shuffled 2x2: 4 tokens per image.
    "internvl": {"vision_config": {"image_size": [IMAGE_SIZE["internvl"]] * 2, "patch_size": [14, 14]}},
    # Pixtral up to 8x8 patches, merged 2x2: up to 4 rows of 4 tokens per image, by its shape.
    "mistral3": {"vision_config": {"image_size": IMAGE_SIZE["mistral3"], "patch_size": 14}},
    # Its tiles at 4x4 patches, one global layer, one intermediate layer's features beside the last one's (the
    # projector takes both: twice the tower's width).
    "mllama": {"vision_config": {"image_size": 56, "patch_size": 14, "num_global_layers": 1,
                                 "intermediate_layers_indices": [0], "vision_output_dim": 2 * HIDDEN}},
    # SigLIP at 4x4 patches; its projection to the text width is set at the top (PaliGemma copies it down).
    "paligemma": {"vision_config": {"image_size": 56, "patch_size": 14}, "projection_dim": HIDDEN},
    # MobileNetV5 (timm) reads only model_args; the side its image processor resizes to is recorded beside them.
    "gemma3n": {"vision_config": {"image_size": IMAGE_SIZE["gemma3n"]}},
    # Gemma 4 has no tower by default: one of 4-pixel patches pooled 2x2 (its processor's smallest budget, 70 tokens,
    # is then 280 patches an image, at most 140 a side), and the image blocks on as the larger checkpoints have them.
    "gemma4": {
        "vision_config": {"hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": HEAD_DIM, "patch_size": 4,
                          "pooling_kernel_size": 2, "position_embedding_size": 160},
        "text_config": {"use_bidirectional_attention": "vision"},
    },
    # Its encoder-free embedder likewise: patches of 4 pixels merged 2x2, one token each.
    "gemma4_unified": {
        "vision_config": {"patch_size": 4, "pooling_kernel_size": 2, "mm_embed_dim": HIDDEN, "mm_posemb_size": 80,
                          "output_proj_dims": HIDDEN},
    },
    # Step3p7's default text config leaves sliding_window None, with which its forward raises; its checkpoints set one.
    "step3p7": {"vision_config": {"image_size": 56}, "text_config": {"sliding_window": WINDOW}},
}


def tiny_vision_config(
    model_type: str, vocab_size: int | None = None, tokens: dict[str, int] | None = None
) -> transformers.PreTrainedConfig:
    """The family's tiny config; `tokens` sets special token ids (a real tokenizer's image placeholder)."""
    config = tiny_config(model_type).to_dict() | (tokens or {})
    sizes = VISION_SIZES.get(model_type) or _generic_vision_sizes(config)
    for key, value in sizes.items():  # a sub-config may be None (Gemma 4 has no vision tower by default)
        config[key] = {**(config[key] or {}), **value} if isinstance(value, dict) else value
    if vocab_size is not None:
        config["text_config"]["vocab_size"] = vocab_size
        if "vocab_size_per_layer_input" in config["text_config"]:  # Gemma 4's per-layer embeddings read every id too
            config["text_config"]["vocab_size_per_layer_input"] = vocab_size
    for key in ("model_type", "transformers_version", "architectures"):
        config.pop(key, None)
    return CONFIG_MAPPING[model_type](**config)


# Vision sizes the text shrinking (`tiny_config`) leaves large, by name: the tower's own widths, its image side
# (set from its patch), its position table, and the widths that must be the text model's.
_VISION_WIDTHS = {"embed_dim": HIDDEN, "out_hidden_size": HIDDEN, "projection_dim": HIDDEN,
                  "text_hidden_size": HIDDEN, "num_position_embeddings": 16, "depth": 2, "vision_output_dim": HIDDEN,
                  "projector_input_dim": HIDDEN, "projector_output_dim": HIDDEN}
_PATCHES_PER_SIDE = 4


def _generic_vision_sizes(config: dict[str, Any]) -> dict[str, Any]:
    """The sizes of a family without its own entry in `VISION_SIZES`: its vision tower's widths and image side
    shrunk by name, 3-D rotary sections fitted to the tiny heads (the vision sweep's families)."""
    sizes: dict[str, Any] = {}
    vision = config.get("vision_config")
    if isinstance(vision, dict):
        shrunk = {key: value for key, value in _VISION_WIDTHS.items() if type(vision.get(key)) is int}
        patch = vision.get("patch_size")
        if type(vision.get("image_size")) is int and type(patch) is int:
            side = shrunk["image_size"] = patch * _PATCHES_PER_SIDE
            if config.get("image_grid_pinpoints"):  # LLaVA-NeXT's tiling: resolutions in whole tiles of the side
                sizes["image_grid_pinpoints"] = [[side, side], [side, 2 * side], [2 * side, side]]
        if vision.get("deepstack_visual_indexes"):
            shrunk["deepstack_visual_indexes"] = [0]
        if vision.get("pixel_shuffle_ratio"):  # Llama 4: its adapter's MLP takes the shuffled patches' width
            shrunk["intermediate_size"] = int(HIDDEN / vision["pixel_shuffle_ratio"] ** 2)
        sizes["vision_config"] = shrunk
    text = config.get("text_config")
    text = text if isinstance(text, dict) else config
    rope = text.get("rope_parameters")
    # 3-D rotary positions (Qwen-style towers merge patches; the sections may sit in the defaults or the code)
    merging = isinstance(vision, dict) and vision.get("spatial_merge_size")
    if isinstance(rope, dict) and (rope.get("mrope_section") or merging) and "rope_theta" in rope:
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor")) or 1
        half = int(HEAD_DIM * partial) // 2
        temporal = half // 4
        height = (half - temporal) // 2
        rotary = {**rope, "mrope_section": [temporal, height, half - temporal - height]}
        if text is config:
            sizes["rope_parameters"] = rotary
        else:
            sizes["text_config"] = {"rope_parameters": rotary}
    return sizes


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
    # MoE expert kernels other than the eager loop (grouped_mm) have no float64 on a CPU.
    options = dict(attn_implementation=attn, experts_implementation="eager", dtype=dtype)
    with torch.device("meta"):
        # Copies: timm pops the block types out of the config's MobileNetV5 blocks as it builds them (Gemma 3n).
        counted = AutoModelForImageTextToText.from_config(copy.deepcopy(config), **options)
        parameters = sum(p.numel() for p in counted.parameters())
    limit = MAX_PARAMETERS + 64 * (vocab_size or VOCAB) * HIDDEN  # a real tokenizer's embeddings come on top
    if parameters > limit:
        raise AssertionError(f"{model_type}: the tiny model has {parameters:,} parameters; a size was not shrunk.")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(copy.deepcopy(config), **options).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            # A matrix initialised to zeros (Gemma 3's image projection) would cut the images off: no image
            # features reach the decoder and no gradient reaches the tower, so neither could show a leak.
            if parameter.ndim >= 2 and not parameter.any():
                parameter.normal_(0.0, 0.02)
            # So would a tanh gate initialised shut (Mllama's cross-attention layers, its tiles' embeddings).
            elif name.endswith("gate") and not parameter.any():
                parameter.fill_(1.0)
    return model


def image_processor_for(config: transformers.PreTrainedConfig, qwen_pixels: dict[str, int] = QWEN_PIXELS):
    """transformers' PIL image processor for the tower of `config` (Qwen-VL's from its patch, merge and
    temporal sizes, `qwen_pixels` per image; CLIP's, as LLaVA uses, LLaVA-NeXT's, -OneVision's, Idefics3's and
    SmolVLM's tiling ones, Gemma 3's at the tower's image size, Gemma 4's at its smallest budget, and SigLIP2's
    NaFlex one for LFM2-VL's tower)."""
    vision = config.vision_config
    if config.model_type in ("glm4v", "glm4v_moe"):  # a Qwen2-VL-like grid by GLM-4V's own resize rule
        from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

        return Glm4vImageProcessorPil(size=qwen_pixels, patch_size=vision.patch_size,
                                      merge_size=vision.spatial_merge_size,
                                      temporal_patch_size=vision.temporal_patch_size)
    if image_style(config.model_type) == "3-D rotary":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(size=qwen_pixels, patch_size=vision.patch_size,
                                        merge_size=vision.spatial_merge_size,
                                        temporal_patch_size=vision.temporal_patch_size)
    if config.model_type == "gemma4":  # its smallest budget: 70 soft tokens an image
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        return Gemma4ImageProcessorPil(patch_size=vision.patch_size, max_soft_tokens=70,
                                       pooling_kernel_size=vision.pooling_kernel_size)
    if config.model_type == "lfm2_vl":
        # LFM2-VL's own image processor needs torchvision; SigLIP2's PIL one makes its tower's NaFlex input (patch
        # rows padded to max_num_patches, pixel_attention_mask, spatial_shapes) by SigLIP2's resize rule, untiled.
        from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

        return Siglip2ImageProcessorPil(patch_size=vision.patch_size, max_num_patches=LFM2_VL_PATCHES)
    side = vision.image_size
    if config.model_type == "internvl":  # GOT-OCR2's image processor, untiled (as prepare-images counts it)
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        return GotOcr2ImageProcessorPil(size={"height": side[0], "width": side[1]}, crop_to_patches=False)
    if config.model_type == "mistral3":  # the tower's own patch, as a real preprocessor_config.json has it
        from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

        patch = {"height": vision.patch_size, "width": vision.patch_size}
        return PixtralImageProcessorPil(size={"longest_edge": side}, patch_size=patch)
    if config.model_type in ("paligemma", "gemma3n"):  # SigLIP's, as PaliGemmaProcessor and Gemma3nProcessor use it
        from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

        return SiglipImageProcessorPil(size={"height": side, "width": side})
    if config.model_type in ("llava_next", "llava_next_video"):  # its tiles: the whole image, then its pinpoint tiles
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        return LlavaNextImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                          image_grid_pinpoints=config.image_grid_pinpoints)
    if config.model_type in ("idefics3", "smolvlm"):  # tiles of the tower's side, images first resized to 2 by 2
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        kind = Idefics3ImageProcessorPil if config.model_type == "idefics3" else SmolVLMImageProcessorPil
        return kind(size={"longest_edge": 2 * side}, max_image_size={"longest_edge": side})
    if config.model_type == "llava_onevision":  # its tiles at the tower's side, no crop
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )

        return LlavaOnevisionImageProcessorPil(size={"height": side, "width": side},
                                               image_grid_pinpoints=config.image_grid_pinpoints)
    if config.model_type in ("llava", "video_llava"):
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": side, "width": side})


def qwen_processor_directory(
    directory: str | os.PathLike,
    tokenizer: str | os.PathLike,
    config: transformers.PreTrainedConfig,
    qwen_pixels: dict[str, int] = QWEN_PIXELS,
) -> Path:
    """Write a Qwen-VL processor directory at `directory` (which must not exist; it appears whole or not at
    all): the files of the tokenizer directory `tokenizer`, its `tokenizer.json` with `QWEN_IMAGE_TOKENS`
    added as special tokens, and `image_processor_for(config, qwen_pixels)`'s `preprocessor_config.json`."""
    from tokenizers import Tokenizer

    if image_style(config.model_type) != "3-D rotary":
        raise UsageError(f"qwen_processor_directory takes a Qwen-VL config, not {config.model_type!r}.")
    directory = Path(directory)
    with staged_directory(directory, overwrite=False, overwrite_option=None) as staging:
        shutil.copytree(tokenizer, staging.build, dirs_exist_ok=True)
        text = Tokenizer.from_file(str(staging.build / "tokenizer.json"))
        text.add_special_tokens(list(QWEN_IMAGE_TOKENS))
        text.save(str(staging.build / "tokenizer.json"))
        image_processor_for(config, qwen_pixels).save_pretrained(staging.build)
    return directory
