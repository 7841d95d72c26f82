"""Short videos made from the sample photographs, and transformers' torchvision-bound video code read from its
source, for the video tests. Nothing downloaded, no video decoder.

A video here is a list of frames of one size, each a crop of a photograph shifted a few pixels further, so that
frames differ as a camera pan's do (`video_frames`), encoded as PNG (`video_bytes`), as prepack stores frames.

transformers' Qwen-VL video processors import torchvision at module level, which prepack's Qwen-VL video path
(`prepack.training.video_frames.FrameVideoProcessor`) does not need; `transformers_source` runs the pieces the tests
compare with (the module's `smart_resize`, a class's plain defaults and named methods) from the installed file's own
text, without importing the module.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import io
import math
from types import SimpleNamespace

from PIL import Image

from tests.vision_inputs import photo_bytes

__all__ = ["QWEN_VIDEO_TOKEN", "VIDEOS", "frame_video_directory", "frame_video_processor", "transformers_source",
           "video_bytes", "video_frames", "video_processor_directory"]

# (photograph, frames, crop width, crop height, shift per frame in pixels): an even and two odd frame counts
# (the last temporal step filled by repeating the last frame), frames of three sizes.
VIDEOS = ((0, 4, 120, 90, 9), (1, 3, 96, 72, 7), (2, 5, 140, 60, 11))


def video_frames(number: int) -> list[Image.Image]:
    """The frames of video `number` of VIDEOS, RGB."""
    photo, frames, width, height, shift = VIDEOS[number]
    with Image.open(io.BytesIO(photo_bytes()[photo])) as image:
        image = image.convert("RGB")
        return [image.crop((index * shift, index * shift // 2, index * shift + width, index * shift // 2 + height))
                for index in range(frames)]


def video_bytes(number: int) -> list[bytes]:
    """The frames of video `number`, PNG-encoded."""
    encoded = []
    for frame in video_frames(number):
        buffer = io.BytesIO()
        frame.save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    return encoded


@functools.cache
def transformers_source(module: str, class_name: str, methods: tuple[str, ...] = ()) -> SimpleNamespace:
    """The module's `smart_resize` (as `smart_resize`), the class's plain defaults (`defaults`: class attributes
    that are constants or their arithmetic) and its `methods` (unbound functions, by name), run from the
    installed file's text without importing the module (`namespace` holds `math` and `torch`)."""
    import torch

    path = importlib.util.find_spec(module).origin
    with open(path, encoding="utf-8") as file:
        tree = ast.parse(file.read())
    namespace: dict = {"math": math, "torch": torch}
    defaults = SimpleNamespace()

    def define(function: ast.FunctionDef) -> None:
        function.decorator_list, function.returns = [], None
        for argument in function.args.args:
            argument.annotation = None  # annotations name torchvision's types
        exec(compile(ast.Module([function], []), path, "exec"), namespace)

    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "smart_resize":
            define(node)
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                    value = compile(ast.Expression(item.value), path, "eval")
                    try:  # constants and their arithmetic (`128 * 28 * 28`), nothing named
                        setattr(defaults, item.targets[0].id, eval(value, {"__builtins__": {}}))
                    except NameError:  # a default that names something (a mean, a resample mode)
                        pass
                if isinstance(item, ast.FunctionDef) and item.name in methods:
                    define(item)
    return SimpleNamespace(defaults=defaults, **{name: namespace[name] for name in methods})


# The video placeholder token of the Qwen-VL processors, added to the test processor's tokenizer.
QWEN_VIDEO_TOKEN = "<|video_pad|>"


def video_processor_directory(directory, kind: str = "qwen2", size: dict[str, int] | None = None):
    """`tests.vision_inputs.processor_directory` with `QWEN_VIDEO_TOKEN` added to its tokenizer and a
    `video_preprocessor_config.json` of transformers' Qwen2-VL (`kind` qwen2) or Qwen3-VL video processor, with
    the tiny towers' patch, merge and temporal sizes and `size` (by default the tiny towers' image bounds), in
    the fields transformers writes (written here, so that the Qwen-VL tests need no torchvision)."""
    import json

    from tokenizers import Tokenizer

    from prepack.model.tiny_vision_models import QWEN_PIXELS
    from tests.vision_inputs import processor_directory

    processor = processor_directory(directory)
    tokenizer = Tokenizer.from_file(str(processor / "tokenizer.json"))
    tokenizer.add_special_tokens([QWEN_VIDEO_TOKEN])
    tokenizer.save(str(processor / "tokenizer.json"))
    config = {"video_processor_type": {"qwen2": "Qwen2VLVideoProcessor", "qwen3": "Qwen3VLVideoProcessor"}[kind],
              "size": dict(size or QWEN_PIXELS), "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
              "do_sample_frames": False}
    (processor / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2))
    return processor


def frame_video_directory(directory, model_type: str, side: int = 56, patch: int = 14, pinpoints=None,
                          video_config=None):
    """A local processor directory of LLaVA-NeXT-Video (`model_type` llava_next_video) or Video-LLaVA (video_llava):
    the demo's GPT-2 tokenizer with `<image>` and `<video>` added, the family's image processor (LLaVA-NeXT's tiles
    of `side` by `pinpoints`, by default the tiny tower's; Video-LLaVA's CLIP crop of `side`), processor_config.json
    (`patch`, the default feature strategy and CLIP's CLS token, as the llava-hf and LanguageBind checkpoints') and a
    `video_preprocessor_config.json` of the family's video processor cropping to `side`, in the fields transformers
    writes (`video_config` replaces it). Returns the directory and the transformers tokenizer."""
    import json

    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.video_llava.image_processing_video_llava import VideoLlavaImageProcessor

    from tests.vision_inputs import family_processor_directory

    sizes = {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}
    if model_type == "llava_next_video":
        pinpoints = pinpoints or [[side, side], [side, 2 * side], [2 * side, side]]
        images, kind = LlavaNextImageProcessorPil(**sizes, image_grid_pinpoints=pinpoints), "LlavaNextVideoVideoProcessor"
    else:
        images, kind = VideoLlavaImageProcessor(**sizes), "VideoLlavaVideoProcessor"
    processor = {"patch_size": patch, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
                 "video_token": "<video>", "image_token": "<image>"}
    directory, tokenizer = family_processor_directory(directory, {"image_token": "<image>", "video_token": "<video>"},
                                                      images, processor)
    config = video_config or {"video_processor_type": kind, **sizes, "do_center_crop": True, "do_sample_frames": False}
    (directory / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2))
    return directory, tokenizer


def frame_video_processor(directory, model_type: str):
    """transformers' own LlavaNextVideoProcessor (or VideoLlavaProcessor) of the directory (its tokenizer, image and
    video processors and processor_config.json): its own counting and expansion of `<image>` and `<video>`."""
    from transformers import LlavaNextVideoProcessor, VideoLlavaProcessor

    family = LlavaNextVideoProcessor if model_type == "llava_next_video" else VideoLlavaProcessor
    return family.from_pretrained(directory)
