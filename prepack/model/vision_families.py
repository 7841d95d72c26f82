"""Which vision-language families `enable_packing` keeps isolated on image+text batches, how, and why not.

The image+text companion of `prepack.model.families` (which covers text-only batches, Gemma 3's
included). One row per vision-language model type: the style of packing (what
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
- 3-D rotary (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): `position_ids` [4, B, L], text positions restarting per sample (from
  which transformers builds the per-sample mask) over the three rotary rows, restarting per sample too;
- restart (LLaVA): `position_ids` [B, L] restarting per sample, as for text;
- image blocks (Gemma 3): restarting `position_ids` and `token_type_ids` marking image placeholders,
  from which prepack builds the layer masks (`prepack.model.vision_packing`: transformers' own sliding
  mask misplaces the image blocks of a packed row).

Every other image-text-to-text model type is refused by name for image batches ("not measured").
`python -m prepack.model.vision_families` prints the table as docs/vision-support.md.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from prepack.model.families import (
    BACKENDS,
    LAYER_MASKS,
    NATIVE,
    NO_FLEX,
    Verdict,
    backend_of,
    implementation,
    verdict_table,
)

__all__ = ["VISION_FAMILIES", "ImageStyle", "VisionFamily", "image_refusal", "image_style", "markdown"]

ImageStyle = Literal["3-D rotary", "restart", "image blocks"]

# Measured (tests/model/test_vision.py): on the flash stand-in a sample alone runs its images causally, unlike sdpa.
GEMMA3_IMAGES_ON_FLASH = Verdict(
    "refused",
    "flash attention cannot hold its bidirectional image blocks: transformers gives Gemma3ForConditionalGeneration "
    "no flash attention, and its flash path runs the images causally",
)


@dataclass(frozen=True)
class VisionFamily:
    style: ImageStyle
    vision_tower: str  # how the tower keeps each image's patches to themselves
    verdicts: tuple[Verdict, Verdict, Verdict, Verdict, Verdict]  # per backend, in BACKENDS order


_MEASURED = (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE)
_MEASURED_NO_FLEX = (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX)
_GRID_TOWER = "one attention segment per image, from image_grid_thw (its windowed blocks within that segment)"
_GRID_TOWER_DEEPSTACK = (
    "one attention segment per image, from image_grid_thw; its deepstack features join the decoder at each "
    "image's own placeholders"
)

VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_vl": VisionFamily("3-D rotary", _GRID_TOWER, _MEASURED_NO_FLEX),
    "qwen2_5_vl": VisionFamily("3-D rotary", _GRID_TOWER, _MEASURED_NO_FLEX),
    "qwen3_vl": VisionFamily("3-D rotary", _GRID_TOWER_DEEPSTACK, _MEASURED_NO_FLEX),
    "llava": VisionFamily("restart", "one image per row of pixel_values (CLIP)", _MEASURED),
    # Its own sliding mask misplaces the image blocks of packed rows: prepack builds the layer masks.
    "gemma3": VisionFamily(
        "image blocks",
        "one image per row of pixel_values (SigLIP)",
        (LAYER_MASKS, LAYER_MASKS, GEMMA3_IMAGES_ON_FLASH, GEMMA3_IMAGES_ON_FLASH, LAYER_MASKS),
    ),
}


def image_style(model_type: str) -> ImageStyle:
    family = VISION_FAMILIES.get(model_type)
    if family is None:
        from prepack.errors import IsolationError

        raise IsolationError(_unmeasured(model_type))
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
    return (
        f"prepack cannot keep packed image+text samples apart in {model_type} ({model_class}) on {attn}: "
        f"{found.reason}. Load it with attn_implementation={' or '.join(isolated)}, where prepack isolates it."
    )


def _unmeasured(model_type: str, model_class: str = "") -> str:
    measured = ", ".join(sorted(VISION_FAMILIES))
    named = f" ({model_class})" if model_class else ""
    return (
        f"prepack has not measured packed image+text batches for model type {model_type!r}{named}: its vision "
        f"tower or its positions may let samples see each other. Packed image batches are measured for {measured}; "
        "train this family without packing (one sample per row)."
    )


def markdown() -> str:
    """docs/vision-support.md: the table and its legend."""
    table, legend = verdict_table(
        ["model type", "style", "vision tower"],
        {model_type: ([family.style, family.vision_tower], family.verdicts) for model_type, family in VISION_FAMILIES.items()},
    )
    return "\n".join(
        [
            "# Vision-language model support (packed image+text batches)",
            "",
            "<!-- Generated by `python -m prepack.model.vision_families > docs/vision-support.md`; "
            "tests/model/test_vision.py fails when it is out of date. -->",
            "",
            "Each family whose packed image+text batches `enable_packing` keeps apart, with the style of batch that",
            "`prepack.training.vision_collate.VisionCollator` emits for it and how its vision tower keeps patches",
            "inside their image.",
            "**isolated**: a packed batch gives the logits, loss and gradients of each sample run alone through",
            "transformers' own path (`tests/model/test_vision.py`: tiny random models in float64, real photographs;",
            "flash attention through pure-torch stand-ins of flash-attn 2 and FlashAttention-4, flex_attention on",
            "logits and loss, uncompiled on a CPU).",
            "Any other vision-language model type is refused for image batches, by name. Text-only batches of these",
            "families follow docs/model-support.md.",
            "",
            *table,
            "",
            *legend,
        ]
    ) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
