"""Which vision-language families `enable_packing` keeps isolated on image+text batches, how, and why not.

The image+text companion of `prepack.model.families` (which covers text-only batches, Gemma 3's included). One
row per vision-language model type: the style of packing (what `prepack.training.vision_collate.VisionCollator` emits for
it), how its vision tower keeps patches inside their image, and one verdict per backend of
`prepack.model.families.BACKENDS`. The rows marked isolated are measured by `tests/model/test_vision.py`:
tiny random models (`prepack.model.tiny_vision_models`) in float64, real photographs, a packed batch of several
samples against each sample run alone through transformers' own path (its own rotary positions), on
logits, loss and gradients, with a leak control that fails. No torch here.

Styles:
- 3-D rotary (Qwen2-VL, Qwen2.5-VL): `position_ids` [4, B, L], text positions restarting per sample (from
  which transformers builds the per-sample mask) over the three rotary rows, restarting per sample too;
- restart (LLaVA): `position_ids` [B, L] restarting per sample, as for text;
- image blocks (Gemma 3): restarting `position_ids` and `token_type_ids` marking image placeholders:
  transformers ANDs the bidirectional image blocks with the per-sample mask.

Every other image-text-to-text model type is refused by name for image batches ("not measured").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prepack.model.families import BACKENDS, NATIVE, Verdict, backend_of

__all__ = ["VISION_FAMILIES", "ImageStyle", "VisionFamily", "image_refusal", "image_style"]

ImageStyle = Literal["3-D rotary", "restart", "image blocks"]

NOT_ON_FLASH = Verdict(
    "refused",
    "not measured with images: on the flash path transformers hands the text's cu_seq_lens_* on to the vision "
    "tower's attention too, and no vision batch was measured there",
)
NOT_ON_FLEX = Verdict("refused", "not measured with images on flex_attention")


@dataclass(frozen=True)
class VisionFamily:
    style: ImageStyle
    vision_tower: str  # how the tower keeps each image's patches to themselves
    verdicts: tuple[Verdict, Verdict, Verdict, Verdict, Verdict]  # per backend, in BACKENDS order


_MEASURED = (NATIVE, NATIVE, NOT_ON_FLASH, NOT_ON_FLASH, NOT_ON_FLEX)
_GRID_TOWER = "one attention segment per image, from image_grid_thw (its windowed blocks within that segment)"

VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_vl": VisionFamily("3-D rotary", _GRID_TOWER, _MEASURED),
    "qwen2_5_vl": VisionFamily("3-D rotary", _GRID_TOWER, _MEASURED),
    "llava": VisionFamily("restart", "one image per row of pixel_values (CLIP)", _MEASURED),
    "gemma3": VisionFamily("image blocks", "one image per row of pixel_values (SigLIP)", _MEASURED),
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
    return (
        f"prepack cannot keep packed image+text samples apart in {model_type} ({model_class}) on {attn}: "
        f"{found.reason}. Load it with attn_implementation='sdpa' (or 'eager'), where prepack isolates it."
    )


def _unmeasured(model_type: str, model_class: str = "") -> str:
    measured = ", ".join(sorted(VISION_FAMILIES))
    named = f" ({model_class})" if model_class else ""
    return (
        f"prepack has not measured packed image+text batches for model type {model_type!r}{named}: its vision "
        f"tower or its positions may let samples see each other. Packed image batches are measured for {measured}; "
        "train this family without packing (one sample per row)."
    )
