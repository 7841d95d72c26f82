"""Video inputs from frames, through an image processor: no torchvision, no video decoder.

transformers' Qwen2-VL and Qwen3-VL video processors need torchvision (their module does not import without
it). `FrameVideoProcessor` makes the same two outputs from a video given as decoded frames of one size:

    video_processor = FrameVideoProcessor(image_processor, image_set.manifest.video_rule)
    out = video_processor(videos=[[frame0, frame1, ...], ...])           # PIL images, RGB
    out["pixel_values_videos"], out["video_grid_thw"]

The video's grid is `prepack.formats.images.VideoRule`'s: the rule the image set recorded (or
`prepack.sources.images.video_processor_rule(processor_directory)[0]`), so a frame is sized by the video
processor's pixel bounds, which a real checkpoint sets apart from its image processor's; every frame is resized
to that grid's size with the image processor's resampling, rescaled and normalised by the image processor
itself (`do_resize=False`), and `temporal_patch_size` consecutive frames (the last repeated to fill the last
step) are laid into one temporal patch as `Qwen2VLVideoProcessor.patchify` lays them
(tests/model/test_video.py compares the layout with transformers' own patchify). The normalisation is the image
processor's (Qwen's image and video processors share theirs), and Pillow resizes where torchvision would: the
pixels are close to the torchvision processor's, not equal; the placeholder count and layout are equal.

LLaVA-NeXT-Video's and Video-LLaVA's videos go through transformers' own LlavaNextVideoVideoProcessor and
VideoLlavaVideoProcessor, which need torchvision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from prepack.errors import InputError, UsageError, optional_imports
from prepack.formats.images import VideoRule

with optional_imports("FrameVideoProcessor"):
    import torch

__all__ = ["FrameVideoProcessor"]


class FrameVideoProcessor:
    """`pixel_values_videos` and `video_grid_thw` of videos given as frames (see the module docstring)."""

    def __init__(self, image_processor, rule: VideoRule):
        if rule.kind not in ("qwen2", "qwen3"):
            raise UsageError(f"FrameVideoProcessor lays out Qwen-VL videos; a {rule.kind} video rule is "
                             "transformers' LlavaNextVideoVideoProcessor's or VideoLlavaVideoProcessor's.")
        self.image_processor, self.rule = image_processor, rule
        self.temporal_patch_size = rule.temporal_patch_size  # as transformers' video processors name it

    @classmethod
    def of(cls, image_processor, kind: Literal["qwen2", "qwen3"], size: dict[str, int]):
        """The processor for `kind`'s rule with the Qwen-VL image processor's patch, merge and temporal sizes and
        the video processor's pixel bounds `size` ({"shortest_edge", "longest_edge"}; never the image
        processor's: a real checkpoint's differ)."""
        rule = VideoRule(kind=kind, patch_size=image_processor.patch_size, merge_size=image_processor.merge_size,
                         temporal_patch_size=image_processor.temporal_patch_size,
                         min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        return cls(image_processor, rule)

    def __call__(self, videos: Sequence[Sequence], return_tensors: str = "pt", do_sample_frames: bool = False,
                 cap_pixels_per_frame: bool = False) -> dict[str, torch.Tensor]:
        """The videos' patches and grids; the options transformers' video processors take are accepted as
        `VisionCollator` passes them (off): this class takes every frame at the rule's size."""
        for option, value in (("do_sample_frames", do_sample_frames), ("cap_pixels_per_frame", cap_pixels_per_frame)):
            if value:
                raise UsageError(f"FrameVideoProcessor was given {option}=True; it neither samples frames nor caps a "
                                 "frame's pixels (the image set counted every frame at its video rule's size).")
        patches, grids = [], []
        for number, frames in enumerate(videos):
            video_patches, grid = self._video(frames, number)
            patches.append(video_patches)
            grids.append(grid)
        return {"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids, dtype=torch.int64)}

    def _video(self, frames: Sequence, number: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
        sizes = {frame.size for frame in frames}
        if len(sizes) != 1:
            raise InputError(f"Video {number} has frames of {len(sizes)} sizes ({sorted(sizes)}); a video's frames "
                             "are of one size.")
        ((width, height),) = sizes
        try:
            t, h, w = self.rule.grid(len(frames), width, height)
        except ValueError as exc:
            raise InputError(f"Video {number} ({len(frames)} frames of {width}x{height}): {exc}.") from None
        patch, step = self.rule.patch_size, self.rule.temporal_patch_size
        resized = [frame.resize((w * patch, h * patch), self.image_processor.resample) for frame in frames]
        out = self.image_processor(images=resized, do_resize=False, return_tensors="pt")
        # Each frame's patches [h*w, C*step*patch*patch] hold the frame `step` times over (an image's temporal
        # patch): keep one copy per frame, then lay `step` frames into each temporal patch.
        single = out["pixel_values"].view(len(frames), h * w, -1, step, patch * patch)[:, :, :, 0]
        order = list(range(len(frames))) + [len(frames) - 1] * (-len(frames) % step)
        steps = single[order].view(t, step, h * w, -1, patch * patch).permute(0, 2, 3, 1, 4)
        return steps.reshape(t * h * w, -1), (t, h, w)

