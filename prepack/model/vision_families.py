"""Which vision-language families `enable_packing` keeps isolated on image+text batches, how, and why not.

The image+text companion of `prepack.model.families` (which covers text-only batches, Gemma 3's
included). One row per image-text-to-text model type that transformers registers: the style of packing (what
`prepack.training.vision_collate.VisionCollator` emits for it), how its vision tower keeps patches inside
their image, and one verdict per backend of `prepack.model.families.BACKENDS`. The rows marked isolated
are measured by `tests/model/test_vision.py`: tiny random models (`prepack.model.tiny_vision_models`) in
float64, real photographs, a packed batch of several samples against each sample run alone through
transformers' own path (its own rotary positions, its own masks), on logits, loss and gradients, with
leak controls that fail. Flash attention (2/3 and 4) is measured through pure-torch stand-ins of the kernels'
varlen interfaces (tests/flash_reference.py), flex_attention through torch's own flex_attention uncompiled,
on logits and loss (it has no backward on a CPU). On flash the text's offsets come from the text positions
and reach the decoder only, never the vision tower (`prepack.model.packing`). No torch here.

Styles:
- 3-D rotary (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, GLM-4V, GLM-4V-MoE): `position_ids` [4, B, L], text positions restarting per sample (from
  which transformers builds the per-sample mask) over the three rotary rows, restarting per sample too;
- restart (LLaVA, LLaVA-NeXT, LLaVA-NeXT-Video, Video-LLaVA, LLaVA-OneVision, Idefics3, SmolVLM, InternVL, Mistral 3,
  LFM2-VL, Gemma 3n): `position_ids` [B, L] restarting per sample, as for text (LLaVA-NeXT's and -OneVision's tiles
  with each image's `image_sizes`, Idefics3's and SmolVLM's with `pixel_attention_mask`, Mistral 3's `image_sizes`
  beside its padded `pixel_values`, LLaVA-NeXT-Video's and Video-LLaVA's frames in one row of `pixel_values_videos`,
  LFM2-VL's NaFlex patch rows with `pixel_attention_mask` and `spatial_shapes`; LFM2's short convolutions run per
  sample);
- image blocks (Gemma 3, Gemma 4): restarting `position_ids` and `token_type_ids` (Gemma 4: `mm_token_type_ids`)
  marking image placeholders, from which prepack builds the layer masks (`prepack.model.vision_packing`:
  transformers' own sliding mask misplaces the image blocks of a packed row; Gemma 4's blocks sit on its sliding
  layers only);
- prefix blocks (PaliGemma): `position_ids` restarting at 1 at every sample, as PaliGemma numbers a sample alone
  (transformers' modeling_paligemma.py adds 1 to the positions it builds when given none; the control that
  positions from 0 differ runs on sdpa only, tests/model/test_vision.py) and `token_type_ids` 0 on each sample's prefix (its tokens before its first target), which transformers attends
  both ways, within the sample.

Every other image-text-to-text model type has no style (VisionCollator does not batch it) and is refused for
image batches on every backend, with the reason the vision sweep (`prepack.model.vision_sweep`) measured on sdpa
and eager; a model type the table lacks is refused by name. tests/model/test_vision_sweep.py fails when a row
differs from a fresh measurement. `python -m prepack.model.vision_families` prints the table as
docs/vision-support.md.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from prepack.model.families import (
    BACKENDS,
    GATED_DELTA_RULE,
    LAYER_MASKS,
    MEASURED_WITH,
    NATIVE,
    NO_FLEX,
    NO_SDPA,
    QWEN4_EXP_ON_FLASH,
    SHORT_CONVOLUTIONS,
    SWEEP_COMMAND,
    Verdict,
    backend_of,
    implementation,
    verdict_table,
)

__all__ = ["IMAGE_BLOCKS", "VISION_FAMILIES", "ImageBlocks", "ImageStyle", "VisionFamily", "fails_alone",
           "fails_packed", "image_refusal", "image_style", "markdown", "needs", "not_built", "not_run", "tower_without",
           "VIDEO_RULES"]

ImageStyle = Literal["3-D rotary", "restart", "image blocks", "prefix blocks"]

def _causal_on_flash(blocks: str, model_class: str, held: str) -> Verdict:
    """The refusal of a family whose `blocks` attend both ways, which flash attention cannot hold."""
    return Verdict(
        "refused",
        f"flash attention cannot hold its bidirectional {blocks}: transformers gives {model_class} no flash attention, "
        f"and its flash path runs the {held} causally",
    )


# Measured (tests/model/test_vision.py): on the flash stand-in a sample alone runs its images causally, unlike sdpa.
GEMMA3_IMAGES_ON_FLASH = _causal_on_flash("image blocks", "Gemma3ForConditionalGeneration", "images")
GEMMA4_IMAGES_ON_FLASH = _causal_on_flash("image blocks", "Gemma4ForConditionalGeneration", "images")
# Measured (tests/model/test_vision.py): on the flash stand-in a packed batch differs from its samples alone.
PALIGEMMA_ON_FLASH = _causal_on_flash("prefix blocks", "PaliGemmaForConditionalGeneration", "prefixes")


@dataclass(frozen=True)
class VisionFamily:
    style: ImageStyle | None  # None: VisionCollator does not batch the family (refused on every backend)
    vision_tower: str  # how the tower keeps each image's patches to themselves
    verdicts: tuple[Verdict, Verdict, Verdict, Verdict, Verdict]  # per backend, in BACKENDS order


# The refusals the vision sweep (prepack.model.vision_sweep) measures for a family, by kind.
def not_built(detail: str) -> Verdict:
    return Verdict("refused", f"not measured: could not build a tiny model: {detail}")


def not_run(detail: str) -> Verdict:
    return Verdict("refused", f"not measured: the sweep could not form or run its image samples ({detail})")


def fails_alone(detail: str) -> Verdict:
    return Verdict(
        "refused",
        f"transformers' own forward fails on text alone with the error its tiny model's image samples alone raise "
        f"({detail}): there is no sample alone to hold a packed batch to",
    )


def fails_packed(detail: str) -> Verdict:
    return Verdict("refused", f"transformers' own code fails on a packed image batch ({detail})")


def tower_without(backend: str, tower: str) -> Verdict:
    """A family whose decoder has `backend`'s attention in transformers but whose vision tower (class `tower`) has
    none: the model does not build on it (measured); a decoder on it beside a tower on sdpa is not measured."""
    return Verdict("refused", f"its vision tower ({tower}) has no {backend} attention in transformers; the decoder on "
                              f"{backend} with the tower on sdpa is not measured")


def needs(package: str) -> Verdict:
    """A family whose tiny model needs a package the sweep's environment lacked (where the package is installed,
    the sweep measures the family itself: its tests skip the row there)."""
    return Verdict("refused", f"not measured: its tiny model needs the {package} package, which the sweep ran without")


LEAKS = Verdict("refused", "packed image samples see each other with position_ids restarting at every sample")
# Measured (tests/model/test_vision_sweep.py): the tokens of a packed Mllama row with no image of their own differ.
CROSS_ATTENTION_LEAKS = Verdict(
    "refused",
    "packed image samples see each other with position_ids restarting at every sample and each sample's own "
    "cross_attention_mask: a text token with no image of its own to attend to (before its sample's first image, "
    "or in a text-only sample) attends to every image of the row, as transformers unmasks a cross-attention row "
    "masked whole",
)
NO_DATA_SIDE = Verdict(
    "refused",
    "isolated natively with position_ids restarting at every sample (measured), but prepack has no data side for it "
    "yet: no placeholder rule in prepare-images and no VisionCollator style",
)
NO_DATA_SIDE_PER_DOCUMENT = Verdict(
    "refused",
    "isolated with position_ids restarting at every sample and its decoder's sequence-state layers run one sample "
    "per row as enable_packing runs them (measured; without them the samples leak through those layers), but "
    "prepack has no data side for it yet: no placeholder rule in prepare-images and no VisionCollator style",
)
# The flash and flex columns of a family without a style: the sweep measures those on sdpa and eager.
NOT_SWEPT = Verdict(
    "refused",
    "not measured with images on this backend: prepack has no data side for the family, and the vision sweep "
    "measures such families on sdpa and eager",
)


_MEASURED = (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE)
_MEASURED_NO_FLEX = (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX)
_SPLIT_TOWER = "each image's tiles and whole image on a row of pixel_values (SigLIP, one per pass), padding dropped"
_GRID_TOWER = "one attention segment per image, from image_grid_thw"
_GRID_TOWER_WINDOWED = f"{_GRID_TOWER} (its windowed blocks within that segment)"  # Qwen2.5-VL's tower only
_GRID_TOWER_DEEPSTACK = (
    "one attention segment per image, from image_grid_thw; its deepstack features join the decoder at each "
    "image's own placeholders"
)

VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_vl": VisionFamily("3-D rotary", _GRID_TOWER, _MEASURED_NO_FLEX),
    "qwen2_5_vl": VisionFamily("3-D rotary", _GRID_TOWER_WINDOWED, _MEASURED_NO_FLEX),
    "qwen3_vl": VisionFamily("3-D rotary", _GRID_TOWER_DEEPSTACK, _MEASURED_NO_FLEX),
    "qwen3_vl_moe": VisionFamily("3-D rotary", _GRID_TOWER_DEEPSTACK, _MEASURED),
    # A Qwen-VL tower before a hybrid decoder: its gated delta rule layers run one sample per row.
    "qwen3_5": VisionFamily("3-D rotary", _GRID_TOWER, (GATED_DELTA_RULE,) * 4 + (NO_FLEX,)),
    "qwen3_5_moe": VisionFamily("3-D rotary", _GRID_TOWER, (GATED_DELTA_RULE,) * 4 + (NO_FLEX,)),
    "qwen4_exp": VisionFamily(
        "3-D rotary",
        _GRID_TOWER,
        (GATED_DELTA_RULE, GATED_DELTA_RULE, QWEN4_EXP_ON_FLASH, QWEN4_EXP_ON_FLASH, NO_FLEX),
    ),
    "llava": VisionFamily("restart", "one image per row of pixel_values (CLIP)", _MEASURED),
    "llava_next": VisionFamily(
        "restart", "each image's tiles on a row of pixel_values (CLIP, a tile per pass), cut to its own by image_sizes",
        _MEASURED,
    ),
    "idefics3": VisionFamily("restart", _SPLIT_TOWER, _MEASURED),
    "smolvlm": VisionFamily("restart", _SPLIT_TOWER, _MEASURED),
    "llava_onevision": VisionFamily(
        "restart",
        "each image's tiles on a row of pixel_values (SigLIP, a tile per pass), cut to its own by image_sizes",
        _MEASURED,
    ),
    # Its own sliding mask misplaces the image blocks of packed rows: prepack builds the layer masks.
    "gemma3": VisionFamily(
        "image blocks",
        "one image per row of pixel_values (SigLIP)",
        (LAYER_MASKS, LAYER_MASKS, GEMMA3_IMAGES_ON_FLASH, GEMMA3_IMAGES_ON_FLASH, LAYER_MASKS),
    ),
}


def _swept(sdpa: Verdict, eager: Verdict | None = None) -> VisionFamily:
    """The row of a family without a style: refused on sdpa and eager as the sweep measured it."""
    return VisionFamily(None, "", (sdpa, eager or sdpa, NOT_SWEPT, NOT_SWEPT, NOT_SWEPT))


# Every other image-text-to-text type of transformers, refused for image batches as the vision sweep measured it on
# sdpa and eager (written from a sweep run; tests/model/test_vision_sweep.py fails on a row that differs from it).
VISION_FAMILIES |= {
    'apertus1p5': _swept(
        not_built("StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: WavTokenizer uses no projections around the quantizer, so `codebook_dim` (512) must eq"),
    ),
    'aria': _swept(
        not_run("KeyError: 'Number of patches 16 not found in patch_to_query_dict amongst possible values dict_keys([1225, 4900]).'"),
    ),
    'aya_vision': _swept(NO_DATA_SIDE),
    'blip': _swept(
        NO_SDPA,
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'blip-2': _swept(
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'chameleon': _swept(not_built("AttributeError: 'NoneType' object has no attribute 'get'")),
    'cohere2_vision': _swept(NO_DATA_SIDE),
    'cohere_compass': _swept(not_built("KeyError: 'full_attention'")),
    'cosmos3_edge': _swept(
        not_built("StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: `rope_parameters.mrope_section` must contain three sections whose sum equals half of `"),
    ),
    'cosmos3_omni': _swept(NO_DATA_SIDE),
    'deepseek_ocr2': _swept(not_built("TypeError: 'NoneType' object is not subscriptable")),
    'deepseek_vl': _swept(NO_DATA_SIDE),
    'deepseek_vl_hybrid': _swept(
        not_run("TypeError: DeepseekVLHybridModel.get_image_features() missing 1 required positional argument: 'high_res_pixel_values'"),
    ),
    'diffusion_gemma': _swept(
        not_built("TypeError: empty(): argument 'size' (position 1) must be tuple of ints, but found element of type NoneType at pos 0"),
    ),
    'dots3_note': _swept(
        not_built("StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: vision adapter output width must match the text hidden size"),
    ),
    'emu3': _swept(not_built("AttributeError: 'NoneType' object has no attribute 'get'")),
    'ernie4_5_vl_moe': _swept(NO_DATA_SIDE),
    'evolla': _swept(
        not_built("ValueError: Unrecognized configuration class <class 'transformers.models.evolla.configuration_evolla.EvollaConfig'> for this kind of AutoModel: AutoModelForImageTextToText."),
    ),
    'exaone4_5': _swept(not_run('ZeroDivisionError: integer modulo by zero')),
    'fast_vlm': _swept(
        not_built('AssertionError: fast_vlm: the tiny model has 122,743,232 parameters; a size was not shrunk.'),
    ),
    'florence2': _swept(
        not_built('AssertionError: florence2: the tiny model has 90,587,200 parameters; a size was not shrunk.'),
    ),
    'fuyu': _swept(not_run("AttributeError: 'FuyuConfig' object has no attribute 'vision_config'")),
    'gemma4_unified': _swept(NO_DATA_SIDE),
    'git': _swept(
        NO_SDPA,
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'glm46v': _swept(NO_DATA_SIDE),
    'glm5_next': _swept(
        not_built("StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: index_topk (4) must be divisible by index_kpool (16)."),
    ),
    'glm_ocr': _swept(NO_DATA_SIDE),
    'glmga': _swept(NO_DATA_SIDE),
    'got_ocr2': _swept(NO_SDPA, not_run("ValueError: an image sample's logits do not change with its pixels")),
    'granite4_vision': _swept(not_built("TypeError: object of type 'NoneType' has no len()")),
    'granite_docling': _swept(
        not_built("StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: vision_config.out_hidden_size (1024) must equal text_config.hidden_size (32)."),
    ),
    'hunyuan_vl': _swept(
        fails_packed('ValueError: Expected 3 multimodal RoPE channels, got position_ids with shape (4, 1, 47).'),
    ),
    'hy_v4_vl': _swept(
        not_built("StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: `mrope_section` must have three entries (time, height, width) summing to `qk_rope_head"),
    ),
    'hyperclovax_vision_v2': _swept(not_run('ZeroDivisionError: integer modulo by zero')),
    'idefics': _swept(
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'idefics2': _swept(NO_DATA_SIDE),
    'inkling2': _swept(
        not_built("StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: `vision_config.text_hidden_size` (4608) must match `text_config.hidden_size` (32)."),
    ),
    'inkling2_loop': _swept(
        not_built("StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: `vision_config.text_hidden_size` (2304) must match `text_config.hidden_size` (32)."),
    ),
    'inkling_mm_model': _swept(needs("scipy")),
    'instructblip': _swept(
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'instructblipvideo': _swept(
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'janus': _swept(
        not_built('AssertionError: janus: the tiny model has 114,071,819 parameters; a size was not shrunk.'),
    ),
    'kimi_k25': _swept(
        not_run('RuntimeError: Expected 3D (unbatched) or 4D (batched) input to conv2d, but got input of size: [4, 588]'),
    ),
    'kosmos-2': _swept(
        not_built('AssertionError: kosmos-2: the tiny model has 426,776,832 parameters; a size was not shrunk.'),
    ),
    'kosmos-2.5': _swept(
        not_built('AssertionError: kosmos-2.5: the tiny model has 244,697,280 parameters; a size was not shrunk.'),
    ),
    'lfm3_vl': _swept(NO_DATA_SIDE_PER_DOCUMENT),
    'lighton_ocr': _swept(NO_DATA_SIDE),
    # Its forward reads image_outputs off its language model's output, which has none, whatever the config: no
    # Llama4ForConditionalGeneration call returns. The logits it computes before failing are isolated natively for
    # packed image samples (tests/model/test_vision_sweep.py); a data side waits for a forward that returns.
    'llama4': _swept(fails_alone("AttributeError: 'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'")),
    'minicpm_ocr': _swept(
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'minicpmv4_6': _swept(
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'minicpmv4_7': _swept(
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'minimax_m3_vl': _swept(NO_DATA_SIDE),
    'mistral4': _swept(
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'mistral_large4': _swept(LEAKS),
    'mllama': _swept(CROSS_ATTENTION_LEAKS),
    'molmo2': _swept(
        not_built("StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: `adapter_config.vision_feature_layer` [24, 18] must index the 2 layers of `vision_conf"),
    ),
    'muse_glimmer': _swept(
        not_built('AssertionError: muse_glimmer: the tiny model has 42,190,688 parameters; a size was not shrunk.'),
    ),
    'muse_spark': _swept(
        not_built("StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: `audio_config.out_hidden_size` (8192) must match `text_config.hidden_size` (32): the a"),
    ),
    'nemotron_h_omni': _swept(
        not_built('AssertionError: nemotron_h_omni: the tiny model has 21,759,612 parameters; a size was not shrunk.'),
    ),
    'ovis2': _swept(NO_DATA_SIDE),
    'paddleocr_vl': _swept(not_run('ValueError: not enough values to unpack (expected 5, got 3)')),
    'perception_lm': _swept(not_built("TypeError: 'NoneType' object is not subscriptable")),
    'pi0': _swept(not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)')),
    'pix2struct': _swept(
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'pp_chart2table': _swept(NO_SDPA, not_run("ValueError: an image sample's logits do not change with its pixels")),
    'pp_formulanet': _swept(
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
    'qianfan_ocr': _swept(NO_DATA_SIDE),
    'qwen2_5_omni_thinker': _swept(not_run('ZeroDivisionError: integer modulo by zero')),
    'qwen3_omni_moe_thinker': _swept(
        not_run("TypeError: Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_rope_index() got an unexpected keyword argument 'mm_token_type_ids'"),
    ),
    'shieldgemma2': _swept(not_run('RuntimeError: stride should not be zero')),
    'step3p7': _swept(NO_DATA_SIDE),
    't5gemma2': _swept(not_run("AttributeError: 'T5Gemma2Config' object has no attribute 'vision_config'")),
    'udop': _swept(not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)')),
    'unlimited_ocr': _swept(not_run('ValueError: its vision config (UnlimitedOcrVisionConfig) has no image_size')),
    'video_llama_3': _swept(
        not_run("TypeError: VideoLlama3Model.get_image_features() missing 1 required positional argument: 'image_merge_sizes'"),
    ),
    'vipllava': _swept(not_run('IndexError: tuple index out of range')),
    'vision-encoder-decoder': _swept(
        not_run('ValueError: its config names no image placeholder (image_token_id or image_token_index)'),
    ),
}


# Families given a data side after the sweep (appended: the rows above stay as the sweep wrote them).
VISION_FAMILIES |= {
    "internvl": VisionFamily(
        "restart", "one view per row of pixel_values (InternViT: an image, or its tiles and thumbnail), its patches "
        "pixel-shuffled per view", _MEASURED
    ),
    "mistral3": VisionFamily(
        "restart",
        "each image's patches one attention block, from image_sizes (Pixtral; on flash its own offsets), merged 2x2 "
        "per image",
        _MEASURED,
    ),
    # Its get_rope_index places an image's positions as Qwen2-VL's does (tests/model/test_vision.py compares them).
    "glm4v": VisionFamily("3-D rotary", _GRID_TOWER, _MEASURED_NO_FLEX),
    # GLM-4V's tower, processor and rotary positions before a decoder of MoE layers.
    "glm4v_moe": VisionFamily("3-D rotary", _GRID_TOWER, _MEASURED),
    # LLaVA-NeXT's tiles for images; a video's frames each a pass of the tower, pooled per frame (VIDEO_RULES).
    "llava_next_video": VisionFamily(
        "restart",
        "each image's tiles on a row of pixel_values (CLIP, a tile per pass), cut to its own by image_sizes; each "
        "video frame one pass, pooled on its own",
        _MEASURED,
    ),
    # LLaVA's CLIP images (its image tower); a video's frames each a pass of its video tower (VIDEO_RULES).
    "video_llava": VisionFamily(
        "restart", "one image per row of pixel_values (CLIP); each video frame one pass of its own CLIP tower",
        _MEASURED_NO_FLEX,
    ),
    # Its prefix blocks (block_sequence_ids) span every sample's prefix in a row; transformers' per-sample mask from
    # the restarting positions cuts them at each sample (measured).
    "paligemma": VisionFamily(
        "prefix blocks",
        "one image per row of pixel_values (SigLIP)",
        (NATIVE, NATIVE, PALIGEMMA_ON_FLASH, PALIGEMMA_ON_FLASH, NATIVE),
    ),
    # Its own sliding mask reads each image block at the wrong tokens of a packed row, as Gemma 3's: prepack builds
    # the layer masks, image blocks on the sliding layers only (its full layers run causal).
    "gemma4": VisionFamily(
        "image blocks",
        "one image per row of pixel_values (its patches, padding marked -1 in image_position_ids, pooled per image)",
        (LAYER_MASKS, LAYER_MASKS, GEMMA4_IMAGES_ON_FLASH, GEMMA4_IMAGES_ON_FLASH, LAYER_MASKS),
    ),
    # Its image placeholders attend causally (transformers builds Gemma 3n's masks from the positions alone, no token
    # types), so plain restarts keep its samples apart (measured). Its tower needs timm; it has no batch statistics
    # (RMS norms throughout: each image's features are the same in a batch as alone, in training mode too, measured).
    "gemma3n": VisionFamily(
        "restart",
        "one image per row of pixel_values (MobileNetV5 through timm: convolutions, multi-query attention and RMS "
        "norms within each image)",
        (NATIVE,) * 4 + (tower_without("flex", "TimmWrapperModel"),),
    ),
}


# LFM2-VL: a NaFlex SigLIP2 tower (one image or tile a row of pixel_values, its patches kept to themselves by
# pixel_attention_mask, its positions resized to its own spatial_shapes; measured) before LFM2, whose short
# convolutions enable_packing runs one sample per row as for text (without that the samples leak through them).
VISION_FAMILIES["lfm2_vl"] = VisionFamily(
    "restart",
    "one image or tile per row of pixel_values (SigLIP2 NaFlex), its padding masked by pixel_attention_mask and its "
    "positions resized to its spatial_shapes, pixel-unshuffled 2x2",
    (SHORT_CONVOLUTIONS,) * 4 + (tower_without("flex", "Siglip2VisionModel"),),
)


# The families whose video inputs VisionCollator batches, and the video processor's rule they count placeholders
# by (`prepack.formats.images.VideoRule`): qwen2, one run of placeholders a video (Qwen2VLVideoProcessor);
# qwen3, one run a temporal step, each after its time as text, which transformers' `get_rope_index` positions as
# that many one-step videos (Qwen3VLVideoProcessor); frames, one run a video of a count per frame
# (LlavaNextVideoVideoProcessor: every frame through the CLIP tower on its own, pooled per frame;
# VideoLlavaVideoProcessor: every frame through its video tower on its own, its patches and CLS).
# tests/model/test_video.py measures each against each video sample alone, and holds every family's kind to
# transformers' source (the video processor its auto mapping names, and whether its get_rope_index splits videos
# by step).
VIDEO_RULES: dict[str, Literal["qwen2", "qwen3", "frames"]] = {
    "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3", "qwen3_5": "qwen3",
    "qwen3_5_moe": "qwen3", "qwen4_exp": "qwen3", "llava_next_video": "frames", "video_llava": "frames",
}


@dataclass(frozen=True)
class ImageBlocks:
    """What an "image blocks" family's batches and masks need: the field that types its tokens, the types that make a
    block, the layer types whose blocks attend both ways, and the image processor's output that counts each image's
    placeholders (None: a fixed count, the config's mm_tokens_per_image)."""

    token_types: str
    block_types: tuple[int, ...]
    layers: tuple[str, ...]
    # Gemma 4: blocks only with use_bidirectional_attention="vision" (without it transformers' masks are causal)
    needs_bidirectional_vision: bool = False
    image_counts: str | None = None


# Every "image blocks" family of VISION_FAMILIES has its entry. Gemma 3: token_type_ids, 1 at image placeholders,
# blocks on every layer. Gemma 4: mm_token_type_ids, 1 at image and 2 at video placeholders
# (get_block_sequence_ids_for_mask), blocks on its sliding layers only (its create_masks_for_vision_model keeps the
# full layers causal), each image's placeholders by its size (Gemma4ImageProcessor's num_soft_tokens_per_image).
IMAGE_BLOCKS = {
    "gemma3": ImageBlocks("token_type_ids", (1,), ("full_attention", "sliding_attention")),
    "gemma4": ImageBlocks("mm_token_type_ids", (1, 2), ("sliding_attention",), needs_bidirectional_vision=True,
                          image_counts="num_soft_tokens_per_image"),
}


def image_style(model_type: str) -> ImageStyle:
    """The style VisionCollator batches the family in; IsolationError for a family it does not batch."""
    family = VISION_FAMILIES.get(model_type)
    if family is None or family.style is None:
        from prepack.errors import IsolationError

        raise IsolationError(_unmeasured(model_type) if family is None else image_refusal(model_type, "", "sdpa"))
    return family.style


def image_refusal(model_type: str, model_class: str, attn: str) -> str | None:
    """The message `enable_packing` raises for an image batch of this family and backend, or None."""
    family = VISION_FAMILIES.get(model_type)
    if family is None:
        return _unmeasured(model_type, model_class)
    found = family.verdicts[BACKENDS.index(backend_of(attn))]
    if found.isolated:
        return None
    isolated = [repr(implementation(backend)) for backend, ok in zip(BACKENDS, family.verdicts) if ok.isolated]
    instead = (
        f"Load it with attn_implementation={' or '.join(isolated)}, where prepack isolates it."
        if isolated
        else "Train its image samples without packing (one sample per row)."
    )
    named = f" ({model_class})" if model_class else ""
    return f"prepack cannot keep packed image+text samples apart in {model_type}{named} on {attn}: {found.reason}. {instead}"


def _unmeasured(model_type: str, model_class: str = "") -> str:
    isolated = ", ".join(sorted(name for name, family in VISION_FAMILIES.items() if family.style is not None))
    named = f" ({model_class})" if model_class else ""
    return (
        f"prepack has not measured packed image+text batches for model type {model_type!r}{named}: it is not in "
        f"the vision table of {MEASURED_WITH} (a newer transformers, or remote code), and its vision tower or its "
        f"positions may let samples see each other. Packed image batches are isolated for {isolated}; train this "
        f"family without packing (one sample per row), or re-measure this transformers: {SWEEP_COMMAND}."
    )


def markdown() -> str:
    """docs/vision-support.md: the table and its legend."""
    table, legend = verdict_table(
        ["model type", "style", "vision tower"],
        {
            model_type: ([family.style or "-", family.vision_tower or "-"], family.verdicts)
            for model_type, family in VISION_FAMILIES.items()
        },
    )
    counts = {
        backend: sum(family.verdicts[column].isolated for family in VISION_FAMILIES.values())
        for column, backend in enumerate(BACKENDS)
    }
    return "\n".join(
        [
            "# Vision-language model support (packed image+text batches)",
            "",
            "<!-- Generated by `python -m prepack.model.vision_families > docs/vision-support.md`; "
            "tests/model/test_vision_sweep.py fails when it is out of date. -->",
            "",
            f"Every image-text-to-text model type that {MEASURED_WITH} registers, on each attention backend:",
            "**isolated** (a packed batch gives the logits, loss and gradients of each sample run alone through",
            "transformers' own path) or **refused** (`enable_packing` raises `IsolationError` for an image batch, with",
            "the reason). The table is measured by the vision sweep (`prepack.model.vision_sweep`,",
            "`tests/model/test_vision_sweep.py`, which fails when a row differs from a fresh measurement): a tiny",
            "random model of each family in float64, packed image+text samples against each sample alone. The",
            "isolated families, with the style of batch that `prepack.training.vision_collate.VisionCollator` emits",
            "for them, are measured further by `tests/model/test_vision.py`: real photographs, logits, loss and every",
            "parameter's gradient (language model, projector, vision tower), flash attention through pure-torch",
            "stand-ins of flash-attn 2 and FlashAttention-4, flex_attention on logits and loss (uncompiled on a CPU).",
            "A model type missing here (a newer transformers, remote code) is refused for image batches, by name;",
            f"`{SWEEP_COMMAND}` re-measures the installed release. Text-only batches follow docs/model-support.md.",
            "",
            "| backend | isolated | refused |",
            "|---|---:|---:|",
            *(f"| {backend} | {counts[backend]} | {len(VISION_FAMILIES) - counts[backend]} |" for backend in BACKENDS),
            "",
            *table,
            "",
            *legend,
        ]
    ) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
