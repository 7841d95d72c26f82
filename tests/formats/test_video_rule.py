"""The video placeholder rule (`prepack.formats.images.VideoRule`) counts what transformers' Qwen-VL video
processors make of a video's frames.

transformers' video processors need torchvision, which this environment does not have (importing their module
fails), so their counting code is run from transformers' own source text: `get_num_of_video_patches` and the
module's `smart_resize`, taken out of the installed file with `ast` and run on their class defaults. The
processors' texts (Qwen3-VL's timestamps) come from the processor classes, which import without torchvision.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from prepack.formats.images import VideoRule

# (module, class) of transformers' video processors, by prepack's rule kind.
PROCESSORS = {
    "qwen2": ("transformers.models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor"),
    "qwen3": ("transformers.models.qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor"),
}


@functools.cache
def transformers_source(module: str, class_name: str) -> SimpleNamespace:
    """The module's `smart_resize`, and of its class the methods and the plain class attributes (its
    defaults), run from the installed file's text without importing it."""
    path = importlib.util.find_spec(module).origin
    with open(path, encoding="utf-8") as file:
        tree = ast.parse(file.read())
    namespace: dict = {"math": math}
    found = SimpleNamespace()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "smart_resize":
            node.decorator_list, node.returns = [], None
            for argument in node.args.args:
                argument.annotation = None
            exec(compile(ast.Module([node], []), path, "exec"), namespace)
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                    value = compile(ast.Expression(item.value), path, "eval")
                    try:  # constants and their arithmetic (`128 * 28 * 28`), nothing named
                        setattr(found, item.targets[0].id, eval(value, {"__builtins__": {}}))
                    except NameError:  # a default that names something (a mean, a resample mode)
                        pass
                if isinstance(item, ast.FunctionDef) and item.name == "get_num_of_video_patches":
                    item.decorator_list = []
                    exec(compile(ast.Module([item], []), path, "exec"), namespace)
    return SimpleNamespace(defaults=found, count=namespace["get_num_of_video_patches"])


def rule_of(kind: str, defaults: SimpleNamespace) -> VideoRule:
    return VideoRule(kind=kind, patch_size=defaults.patch_size, merge_size=defaults.merge_size,
                     temporal_patch_size=defaults.temporal_patch_size, min_pixels=defaults.size["shortest_edge"],
                     max_pixels=defaults.size["longest_edge"])


@pytest.mark.parametrize("kind", PROCESSORS)
@settings(max_examples=200, deadline=None)
@given(frames=st.integers(1, 40), height=st.integers(1, 2000), width=st.integers(1, 2000),
       small=st.booleans())
def test_video_placeholders_are_the_video_processors_count(kind, frames, height, width, small):
    """Frame counts, sizes and (`small`) the tiny towers' bounds: the count is transformers' own, and a video
    transformers refuses (too few frames for Qwen3-VL, an extreme aspect ratio) is refused too."""
    source = transformers_source(*PROCESSORS[kind])
    assert source.defaults.cap_pixels_per_frame is None  # the uncapped count, transformers' default, is prepack's
    defaults = SimpleNamespace(**vars(source.defaults))
    if small:
        defaults.size = {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 8}
        defaults.patch_size = 14
    rule = rule_of(kind, defaults)
    try:
        expected = source.count(defaults, frames, height, width, {}) // defaults.merge_size**2
    except ValueError:
        with pytest.raises(ValueError):
            rule.placeholders(frames, width, height)
        return
    assert rule.placeholders(frames, width, height) == expected


@settings(max_examples=100, deadline=None)
@given(frames=st.integers(1, 40), fps=st.sampled_from([0.5, 1.0, 2.0, 24.0, 29.97]), step=st.integers(1, 4))
def test_qwen3_step_times_are_the_processors(frames, fps, step):
    rule = VideoRule(kind="qwen3", patch_size=16, merge_size=2, temporal_patch_size=step, min_pixels=1,
                     max_pixels=2**30)
    assert rule.step_seconds(frames, fps) == Qwen3VLProcessor._calculate_timestamps(None, list(range(frames)), fps,
                                                                                      step)


def test_the_texts_of_a_video():
    """Qwen2-VL: one run; Qwen3-VL: one run per temporal step, each after its time, as Qwen3VLProcessor writes."""
    sizes = dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 8)
    qwen2, qwen3 = VideoRule(kind="qwen2", **sizes), VideoRule(kind="qwen3", **sizes)
    assert qwen2.grid(5, 56, 84) == (3, 6, 4)
    assert qwen2.text(5, 56, 84, fps=2.0) == "<|vision_start|>" + "<|video_pad|>" * 18 + "<|vision_end|>"
    step = "<|vision_start|>" + "<|video_pad|>" * (qwen3.grid(5, 56, 84)[1] * qwen3.grid(5, 56, 84)[2] // 4)
    assert qwen3.text(5, 56, 84, fps=2.0) == "".join(
        f"<{seconds} seconds>{step}<|vision_end|>" for seconds in ("0.2", "1.2", "2.0"))
