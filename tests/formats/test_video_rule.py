"""The video placeholder rule (`prepack.formats.images.VideoRule`) counts what transformers' Qwen-VL video
processors make of a video's frames.

transformers' video processors need torchvision, which this environment does not have (importing their module
fails), so their counting code is run from transformers' own source text (`tests.video_inputs.transformers_source`):
`get_num_of_video_patches` and the module's `smart_resize`, run on their class defaults. The
processors' texts (Qwen3-VL's timestamps) come from the processor classes, which import without torchvision.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from prepack.formats.images import VideoRule
from tests.video_inputs import transformers_source

# (module, class) of transformers' video processors, by prepack's rule kind.
PROCESSORS = {
    "qwen2": ("transformers.models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor"),
    "qwen3": ("transformers.models.qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor"),
}


def rule_of(kind: str, defaults: SimpleNamespace) -> VideoRule:
    return VideoRule(kind=kind, patch_size=defaults.patch_size, merge_size=defaults.merge_size,
                     temporal_patch_size=defaults.temporal_patch_size, min_pixels=defaults.size["shortest_edge"],
                     max_pixels=defaults.size["longest_edge"])


@pytest.mark.parametrize("kind", PROCESSORS)
@settings(max_examples=60, deadline=None)
@given(frames=st.integers(1, 40), height=st.integers(1, 2000), width=st.integers(1, 2000),
       small=st.booleans())
def test_video_placeholders_are_the_video_processors_count(kind, frames, height, width, small):
    """Frame counts, sizes and (`small`) the tiny towers' bounds: the count is transformers' own, both by
    `get_num_of_video_patches` and by the path the pixels take (`resize`'s smart_resize call with
    cap_pixels_per_frame off, as VisionCollator pins it at the call whatever the class default; then
    `patchify`'s grid, the frames padded by the last to whole temporal steps), and a video transformers refuses
    (too few frames for Qwen3-VL, an extreme aspect ratio) is refused too."""
    source = transformers_source(*PROCESSORS[kind], methods=("get_num_of_video_patches", "smart_resize"))
    defaults = SimpleNamespace(**vars(source.defaults))
    if small:
        defaults.size = {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 8}
        defaults.patch_size = 14
    rule = rule_of(kind, defaults)
    try:
        expected = source.get_num_of_video_patches(defaults, frames, height, width, {}) // defaults.merge_size**2
    except ValueError:
        with pytest.raises(ValueError):
            rule.placeholders(frames, width, height)
        return
    assert rule.placeholders(frames, width, height) == expected
    whole_video = dict(num_frames=frames, temporal_factor=defaults.temporal_patch_size) if kind == "qwen3" else {}
    resized_h, resized_w = source.smart_resize(
        height=height, width=width, factor=defaults.patch_size * defaults.merge_size,
        min_pixels=defaults.size["shortest_edge"], max_pixels=defaults.size["longest_edge"], **whole_video)
    steps = -(-frames // defaults.temporal_patch_size)
    grid = (steps, resized_h // defaults.patch_size, resized_w // defaults.patch_size)
    assert rule.grid(frames, width, height) == grid


@settings(max_examples=40, deadline=None)
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


def test_a_frames_rule_holds_its_own_fields_and_is_written_without_the_others():
    """LLaVA-NeXT-Video's rule: `tokens` a frame, whatever the frame's size; it holds no Qwen-VL field and a Qwen-VL
    rule no `tokens` (each refused), and each is written with its own fields only: a Qwen-VL rule's JSON is that of
    before the frames kind."""
    frames = VideoRule(kind="frames", placeholder="<video>", start="", end="", tokens=144)
    assert frames.placeholders(8, 640, 480) == frames.placeholders(8, 7, 3000) == 8 * 144
    assert frames.text(3, 90, 120, fps=2.0) == "<video>" * 432
    assert frames.model_dump() == {"kind": "frames", "placeholder": "<video>", "start": "", "end": "", "tokens": 144}
    with pytest.raises(ValueError, match="a video without frames"):
        frames.placeholders(0, 90, 120)
    with pytest.raises(ValueError, match="no patch grid"):
        frames.grid(3, 90, 120)
    sizes = dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=1, max_pixels=2**20)
    qwen2 = VideoRule(kind="qwen2", **sizes)
    assert qwen2.model_dump_json() == (
        '{"kind":"qwen2","placeholder":"<|video_pad|>","start":"<|vision_start|>","end":"<|vision_end|>",'
        '"patch_size":14,"merge_size":2,"temporal_patch_size":2,"min_pixels":1,"max_pixels":1048576}')
    with pytest.raises(ValueError, match="a frames video rule has no patch_size"):
        VideoRule(kind="frames", tokens=4, patch_size=14)
    with pytest.raises(ValueError, match="a frames video rule needs tokens"):
        VideoRule(kind="frames")
    with pytest.raises(ValueError, match="a qwen2 video rule has no tokens"):
        VideoRule(kind="qwen2", tokens=4, **sizes)
    with pytest.raises(ValueError, match="a qwen3 video rule needs merge_size"):
        VideoRule(kind="qwen3", **{**sizes, "merge_size": None})
