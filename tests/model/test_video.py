"""Packed video+image+text batches of the Qwen-VL families equal each sample run alone, in float64.

Tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL (`prepack.model.tiny_vision_models`), short videos made from the
sample photographs (tests/video_inputs.py: crops panning over a photograph, 3 to 5 frames of three sizes), their
pixels from `FrameVideoProcessor` (the image processor per frame, prepack's torchvision-free Qwen-VL video
processor; LLaVA-NeXT-Video's and Video-LLaVA's from transformers' own video processors), `VisionCollator` packing four samples (a video; an image and a video; text
only; a video) into two rows, and `enable_packing` on. The reference is each sample alone through transformers'
own path: its positions from `get_rope_index` (with Qwen2.5-VL's `second_per_grid_ts` at each video's frame rate),
its own mask. Logits, loss and every gradient per parameter group (language model, projector, vision tower) must
agree to float64 rounding; the leak control (positions counting on over each row) must not.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from PIL import Image

from prepack import enable_packing
from prepack.errors import InputError, UsageError
from prepack.formats.images import VideoRule
from prepack.model.tiny_models import DOCUMENT_VOCAB
from prepack.model.tiny_vision_models import tiny_vision_config, tiny_vision_model
from prepack.model.vision_families import VIDEO_RULES
from prepack.training.video_frames import FrameVideoProcessor
from prepack.training.vision_collate import VisionCollator, VisionSpec, rotary_3d_positions
from tests.flash_reference import enable_flash_attention, use_flash_reference, use_flex_reference  # noqa: F401 (fixtures)
from tests.model.test_vision import (
    EAGER_TOLERANCE,
    LANGUAGE_MODEL,
    LOSS_TOLERANCE,
    PROJECTOR,
    TOLERANCE,
    VISION_TOWER,
    group_differences,
    image_tokens,
    run,
    targets,
)
from tests.video_inputs import VIDEOS, transformers_source, video_bytes, video_frames
from tests.vision_inputs import image_processor, photo_bytes

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Per sample: (photographs, videos), indices into photo_bytes() and VIDEOS; the third is text only.
SAMPLES = (((), (0,)), ((1,), (1,)), ((), ()), ((), (2,)))
# Frames per second of each video (different, so that Qwen2.5-VL's temporal positions scale three ways; none
# making tokens_per_second x temporal_patch_size / fps a whole number, so that its float32 truncation is exercised).
VIDEO_FPS = (3.0, 29.97, 0.7)
# Qwen3-VL's rule bounds the pixels of the whole video: a larger budget than one image's, so a step is a few tokens.
QWEN3_VIDEO_SIZE = {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 24}
# Qwen2-VL's bounds one frame, by the video processor's own bounds: not the image processor's (QWEN_PIXELS).
QWEN2_VIDEO_SIZE = {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 4}
MODALITY = {"text": 0, "image": 1, "video": 2}  # transformers' mm_token_type_ids


QWEN_VIDEO_FAMILIES = tuple(name for name, kind in VIDEO_RULES.items() if kind != "frames")
FRAME_FAMILIES = tuple(name for name, kind in VIDEO_RULES.items() if kind == "frames")


def video_processor(model_type: str, processor):
    kind = VIDEO_RULES[model_type]
    if kind == "frames":  # LLaVA-NeXT-Video, Video-LLaVA: transformers' own, cropping to the tower's side
        from transformers import LlavaNextVideoVideoProcessor, VideoLlavaVideoProcessor

        side = tiny_vision_config(model_type).vision_config.image_size
        family = LlavaNextVideoVideoProcessor if model_type == "llava_next_video" else VideoLlavaVideoProcessor
        return family(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return FrameVideoProcessor.of(processor, kind, QWEN3_VIDEO_SIZE if kind == "qwen3" else QWEN2_VIDEO_SIZE)


def video_tokens(model, frames: FrameVideoProcessor, video: int, rng) -> list[int]:
    """The tokens one video stands for in the family's prompt: one run (Qwen2-VL, Qwen2.5-VL; LLaVA-NeXT-Video, a
    frame's pooled patches per frame), or one run per temporal step after its time as text (Qwen3-VL; random text
    ids stand for the `<t seconds>` text)."""
    config, spec = model.config, VisionSpec.of(model.config)
    _, count, width, height, _ = VIDEOS[video]
    if spec.tokens_per_frame is not None:
        return [spec.video_token_id] * (count * spec.tokens_per_frame)
    t, h, w = frames.rule.grid(count, width, height)
    per_step = h * w // frames.rule.merge_size**2
    if frames.rule.kind == "qwen2":
        return [config.vision_start_token_id, *[config.video_token_id] * (t * per_step), config.vision_end_token_id]
    tokens = []
    for _ in range(t):
        tokens += [*rng.integers(2, DOCUMENT_VOCAB, 3), config.vision_start_token_id,
                   *[config.video_token_id] * per_step, config.vision_end_token_id]
    return tokens


def samples(model, processor, frames: FrameVideoProcessor, layout=SAMPLES, seed: int = 0) -> list[dict]:
    """Samples of text, images and videos in `layout`'s order (images first); random text ids between."""
    rng = np.random.default_rng(seed)
    photos = photo_bytes()
    made = []
    for images, videos in layout:
        tokens = list(rng.integers(2, DOCUMENT_VOCAB, rng.integers(3, 7)))
        for image in images:
            tokens += image_tokens(model, processor, photos[image]) + list(rng.integers(2, DOCUMENT_VOCAB, 3))
        for video in videos:
            tokens += video_tokens(model, frames, video, rng) + list(rng.integers(2, DOCUMENT_VOCAB, 3))
        made.append({"input_ids": np.array(tokens, dtype=np.int64), "images": [photos[i] for i in images],
                     "videos": [video_bytes(v) for v in videos], "video_fps": [VIDEO_FPS[v] for v in videos]})
    return made


def packs_of(made: list[dict], rows: tuple[tuple[int, ...], ...]) -> list[dict]:
    packs = []
    for row in rows:
        group = [made[index] for index in row]
        packs.append({
            "input_ids": np.concatenate([sample["input_ids"] for sample in group]),
            "cu_seqlens": np.append(0, np.cumsum([len(sample["input_ids"]) for sample in group])),
            "images": [image for sample in group for image in sample["images"]],
            "videos": [video for sample in group for video in sample["videos"]],
            "video_fps": [rate for sample in group for rate in sample["video_fps"]],
        })
    return packs


def setup(model_type: str, layout=SAMPLES, attn: str = "sdpa"):
    model = tiny_vision_model(model_type, "eager" if attn == "eager" else "sdpa")
    if attn.startswith("flash"):
        enable_flash_attention(model, attn)
    elif attn == "flex_attention":
        model.set_attn_implementation(attn)
    processor = image_processor(model_type)
    frames = video_processor(model_type, processor)
    made = samples(model, processor, frames, layout)
    total = sum(len(sample["input_ids"]) for sample in made)
    collator = VisionCollator(VisionSpec.of(model.config), processor, max_len=total + 3, pad_token_id=1,
                              video_processor=frames)
    return model, collator, made


def alone_batch(collator: VisionCollator, sample: dict, labels: torch.Tensor) -> dict:
    """One sample as transformers takes it unpacked: no position_ids (get_rope_index computes them from its grids,
    its token types and, for Qwen2.5-VL, its second_per_grid_ts)."""
    ids = torch.from_numpy(sample["input_ids"])[None]
    batch = {"input_ids": ids, "labels": labels[None], "use_cache": False}
    if sample["images"]:
        batch |= collator._preprocessed([sample["images"]])
    if sample["videos"]:
        batch |= collator.video_processor(videos=[video_frames_of(video) for video in sample["videos"]],
                                          return_tensors="pt")
        if collator.spec.tokens_per_second is not None:  # as Qwen2_5_VLProcessor computes it
            size = collator.video_processor.temporal_patch_size
            batch["second_per_grid_ts"] = torch.tensor([size / rate for rate in sample["video_fps"]])
    if collator.spec.style == "3-D rotary":
        types = torch.zeros_like(ids)
        types[ids == collator.spec.image_token_id] = MODALITY["image"]
        types[ids == collator.spec.video_token_id] = MODALITY["video"]
        batch["mm_token_type_ids"] = types
    return batch


def video_frames_of(encoded: list[bytes]):
    from PIL import Image
    import io

    return [Image.open(io.BytesIO(frame)).convert("RGB") for frame in encoded]


def compare(model, collator, made, packs, batch, gradients: bool = True) -> tuple[float, float, dict[str, float]]:
    """(largest logit difference, loss difference, per parameter group the relative gradient difference; none
    without `gradients`: flex_attention has no backward on a CPU)."""
    logits, loss, grads = run(model, batch, gradients)
    logit_diff, alone_losses, alone_grads = 0.0, [], {}
    spans = [(row, int(start), int(end)) for row, pack in enumerate(packs)
             for start, end in zip(pack["cu_seqlens"][:-1], pack["cu_seqlens"][1:])]
    order = [index for row in ROWS[len(packs)] for index in row]
    for index, (row, start, end) in zip(order, spans):
        labels = batch["labels"][row, start:end]
        alone_logits, alone_loss, sample_grads = run(model, alone_batch(collator, made[index], labels), gradients)
        logit_diff = max(logit_diff, float((logits[row, start:end] - alone_logits[0]).abs().max()))
        alone_losses.append((float(alone_loss), targets(labels)))
        for name, grad in sample_grads.items():
            alone_grads[name] = alone_grads.get(name, 0) + grad
    weighted = sum(value * count for value, count in alone_losses) / sum(count for _, count in alone_losses)
    assert grads.keys() == alone_grads.keys(), "a parameter has a gradient packed or alone only"
    return logit_diff, abs(float(loss) - weighted), group_differences(grads, alone_grads)


def assert_exact(label: str, logit_diff: float, loss_diff: float, groups: dict[str, float],
                 tolerance: float = TOLERANCE) -> None:
    """Logits within `tolerance`, the loss and every parameter group's gradient (language model, projector and
    vision tower, each compared) within LOSS_TOLERANCE of each sample alone; the worst per group printed."""
    report = f"logits {logit_diff:.1e}, loss {loss_diff:.1e}, gradients " + ", ".join(
        f"{group} {value:.1e}" for group, value in sorted(groups.items()))
    print(f"{label}: {report}")
    assert groups.keys() == {PROJECTOR, VISION_TOWER, LANGUAGE_MODEL}, report
    assert logit_diff < tolerance and loss_diff < LOSS_TOLERANCE, report
    assert all(value < LOSS_TOLERANCE for value in groups.values()), report


# How the four samples go into rows: two rows of two (video + mixed, text + video), or one row of all four.
ROWS = {2: ((0, 1), (2, 3)), 1: ((0, 1, 2, 3),)}


@pytest.mark.slow
@pytest.mark.parametrize("rows", [2, 1], ids=["two rows", "one row"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_packed_video_batch_equals_each_sample_alone(model_type, rows):
    model, collator, made = setup(model_type)
    packs = packs_of(made, ROWS[rows])
    batch = collator(packs)
    assert int((batch["input_ids"] == collator.spec.video_token_id).sum()) > 0
    assert len(batch["video_grid_thw"]) == 3 and len(batch["image_grid_thw"]) == 1
    enable_packing(model)
    assert_exact(f"{model_type} videos, {rows} rows", *compare(model, collator, made, packs, batch))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "attn"),
    [("qwen3_vl_moe", "sdpa"), ("qwen3_5", "sdpa"), ("qwen3_5_moe", "sdpa"), ("qwen4_exp", "sdpa"),
     ("qwen2_5_vl", "eager"), ("qwen2_5_vl", "flash_attention_2"), ("qwen3_vl", "flash_attention_4"),
     *((model_type, attn) for model_type in FRAME_FAMILIES
       for attn in ("eager", "flash_attention_2", "flash_attention_4")),
     ("llava_next_video", "flex_attention")],
)
def test_packed_video_batch_on_other_backends_and_families(model_type, attn, request):
    """Qwen3-VL-MoE (VIDEO_RULES' fourth family) on sdpa, and videos on eager and on flash through
    tests/flash_reference.py's stand-ins (the text's offsets derived by enable_packing, kept from the tower);
    LLaVA-NeXT-Video's and Video-LLaVA's on eager and flash (their sdpa run: `test_frame_video_packed_batch_...`),
    and LLaVA-NeXT-Video's on flex_attention (logits and loss: flex has no backward on a CPU)."""
    if attn.startswith("flash"):
        request.getfixturevalue("use_flash_reference")
    elif attn == "flex_attention":
        request.getfixturevalue("use_flex_reference")
    model, collator, made = setup(model_type, attn=attn)
    packs = packs_of(made, ROWS[2])
    batch = collator(packs)
    if attn.startswith("flash"):  # the control: without enable_packing flash runs dense over each row
        logit_diff, _, _ = compare(model, collator, made, packs, batch)
        assert logit_diff > 1e-3, f"the leak control did not leak ({logit_diff}), so the test could not fail"
    enable_packing(model)
    if attn == "flex_attention":
        logit_diff, loss_diff, _ = compare(model, collator, made, packs, batch, gradients=False)
        assert logit_diff < TOLERANCE and loss_diff < LOSS_TOLERANCE, (logit_diff, loss_diff)
    else:
        assert_exact(f"{model_type} videos on {attn}", *compare(model, collator, made, packs, batch),
                     tolerance=EAGER_TOLERANCE if attn == "eager" else TOLERANCE)


# Videos and text, no image: a batch without pixel_values.
VIDEO_ONLY = (((), (0,)), ((), ()), ((), (2,)), ((), (1,)))


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_a_batch_of_videos_without_images_equals_each_sample_alone(attn, request):
    """A batch whose packs hold videos and no image carries pixel_values_videos only: enable_packing checks it
    as an image batch (on flash the 3-D rotary text row gives the decoder its offsets; measured before that: 0.22
    on logits)."""
    if attn.startswith("flash"):
        request.getfixturevalue("use_flash_reference")
    model, collator, made = setup("qwen2_5_vl", VIDEO_ONLY, attn=attn)
    packs = packs_of(made, ROWS[2])
    batch = collator(packs)
    assert "pixel_values" not in batch and len(batch["video_grid_thw"]) == 3
    enable_packing(model)
    assert_exact(f"qwen2_5_vl videos without images on {attn}", *compare(model, collator, made, packs, batch))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [*FAMILIES, "qwen3_5", *FRAME_FAMILIES])
def test_video_positions_not_restarted_leak(model_type):
    """The control: positions counting on over each row let the samples see each other."""
    model, collator, made = setup(model_type)
    packs = packs_of(made, ROWS[2])
    enable_packing(model)
    batch = collator(packs)
    width = batch["input_ids"].shape[1]
    batch["position_ids"] = torch.arange(width).expand(batch["position_ids"].shape).clone()
    logit_diff, _, _ = compare(model, collator, made, packs, batch)
    assert logit_diff > 1e-3


@pytest.mark.parametrize("model_type", QWEN_VIDEO_FAMILIES)
def test_video_rotary_positions_equal_transformers_get_rope_index(model_type):
    """The collator's rotary rows for a sample with videos (and an image) are transformers' own, sample by sample:
    Qwen2.5-VL's temporal positions scaled by tokens_per_second x second_per_grid_ts at three frame rates,
    Qwen3-VL's steps positioned one by one."""
    model, collator, made = setup(model_type)
    spec = collator.spec
    for sample in made:
        if not sample["videos"]:
            continue
        alone = alone_batch(collator, sample, torch.from_numpy(sample["input_ids"]))
        expected, _ = model.model.get_rope_index(
            alone["input_ids"], mm_token_type_ids=alone["mm_token_type_ids"],
            image_grid_thw=alone.get("image_grid_thw"), video_grid_thw=alone["video_grid_thw"],
            **({"second_per_grid_ts": alone["second_per_grid_ts"]} if "second_per_grid_ts" in alone else {}),
        )
        packed = collator([{**packs_of([sample], ((0,),))[0]}])
        np.testing.assert_array_equal(packed["position_ids"][1:, 0, : len(sample["input_ids"])].numpy(),
                                      expected[:, 0].numpy())
        grids = alone.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.int64)).numpy()
        video_grids, intervals = collator._video_runs(alone)
        got = rotary_3d_positions(sample["input_ids"], grids, spec.image_token_id, spec.merge_size,
                                  video_token_id=spec.video_token_id, video_grids=video_grids,
                                  video_intervals=intervals)
        np.testing.assert_array_equal(got, expected[:, 0].numpy())
    if model_type == "qwen2_5_vl":  # the scale is there, a fraction: a video's second temporal step is not at 1
        scale = np.float32(4) * np.float32(2 / VIDEO_FPS[2])  # float32, as Qwen2.5-VL computes it
        assert spec.tokens_per_second == 4 and collator._video_runs(alone)[1].tolist() == [float(scale)]
        assert scale != int(scale)


def test_the_video_families_are_those_whose_positions_transformers_splits_by_step():
    """VIDEO_RULES' qwen3 families are the ones whose get_rope_index positions each temporal step as a one-step
    video (transformers' source repeats their video grids by their steps), the qwen2 ones (and LLaVA-NeXT-Video,
    which has no rotary grid) do not; and each
    family's rule is that of the video processor transformers maps it to (read from the auto mapping's source, or
    the family's own video processing module, which transformers infers it from: without torchvision the mapping
    itself holds None)."""
    import importlib.util

    with open(importlib.util.find_spec("transformers.models.auto.video_processing_auto").origin) as file:
        mapped = dict(re.findall(r'\("(\w+)", \{"torchvision": "(\w+)"\}\)', file.read()))
    kinds = {"Qwen2VLVideoProcessor": "qwen2", "Qwen3VLVideoProcessor": "qwen3", "LlavaNextVideoVideoProcessor": "frames",
             "VideoLlavaVideoProcessor": "frames"}
    for model_type, kind in VIDEO_RULES.items():
        with open(importlib.util.find_spec(f"transformers.models.{model_type}.modeling_{model_type}").origin) as file:
            splits = "torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)" in file.read()
        assert splits == (kind == "qwen3"), model_type
        if model_type not in mapped:  # inferred by transformers from the family's own video processing module
            own = importlib.util.find_spec(f"transformers.models.{model_type}.video_processing_{model_type}").origin
            with open(own) as file:
                mapped[model_type] = re.search(r"class (\w+)\(BaseVideoProcessor\)", file.read()).group(1)
        assert kinds[mapped[model_type]] == kind, model_type


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_frame_pixels_are_laid_out_as_transformers_patchify(kind):
    """FrameVideoProcessor's temporal patches are transformers' own layout: Qwen2VLVideoProcessor.patchify (run from
    its source) of the frames the image processor resized and normalised, the last frame repeated to fill a step."""
    processor = image_processor("qwen2_vl")
    frames = FrameVideoProcessor.of(processor, kind, QWEN3_VIDEO_SIZE if kind == "qwen3" else QWEN2_VIDEO_SIZE)
    source = transformers_source("transformers.models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor",
                                 methods=("patchify",))
    for video in range(len(VIDEOS)):
        decoded = video_frames(video)
        out = frames(videos=[decoded])
        t, h, w = out["video_grid_thw"][0].tolist()
        _, count, width, height, _ = VIDEOS[video]
        assert (t, h, w) == frames.rule.grid(count, width, height) and t == -(-count // 2)
        resized = [frame.resize((w * 14, h * 14), processor.resample) for frame in decoded]
        normalised = processor(images=resized, do_resize=False, return_tensors="np")
        # the image processor's own normalised pixels, back from its (repeated) patches: one [C, H, W] per frame
        pixels = torch.from_numpy(np.stack([
            frame_pixels(patches, h, w) for patches in np.split(normalised["pixel_values"], len(resized))]))
        expected, grid_t, grid_h, grid_w = source.patchify(None, pixels[None], 14, 2, 2)
        assert (grid_t, grid_h, grid_w) == (t, h, w)
        torch.testing.assert_close(out["pixel_values_videos"], expected[0], rtol=0, atol=0)


def frame_pixels(patches: np.ndarray, h: int, w: int) -> np.ndarray:
    """[C, h*14, w*14] from one image's Qwen patches [h*w, C*2*14*14] (merge 2): the inverse of its patchify."""
    grid = patches.reshape(h // 2, w // 2, 2, 2, 3, 2, 14, 14)[..., 0, :, :]  # one of the temporal copies
    return grid.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, h * 14, w * 14)


def test_a_pack_whose_videos_and_placeholders_disagree_is_refused():
    model, collator, made = setup("qwen2_vl")
    pack = packs_of(made, ROWS[2])[0]
    with pytest.raises(InputError, match="video placeholders and 0 videos"):
        collator([{**pack, "videos": [], "video_fps": []}])
    with pytest.raises(InputError, match=re.escape("video_fps [2.0] is not one positive rate per video (2)")):
        collator([{**pack, "video_fps": [2.0]}])
    with pytest.raises(UsageError, match="video_processor"):
        VisionCollator(collator.spec, collator.image_processor, pad_token_id=1)([pack])


def test_a_video_for_a_family_without_a_video_side_is_refused():
    model = tiny_vision_model("llava")
    collator = VisionCollator(VisionSpec.of(model.config), image_processor("llava"), pad_token_id=1)
    pack = {"input_ids": np.array([5, 6, 7]), "cu_seqlens": np.array([0, 3]), "videos": [video_bytes(0)]}
    with pytest.raises(UsageError, match="videos only for qwen2_vl"):
        collator([pack])


def test_a_video_of_frames_of_two_sizes_is_refused():
    frames = FrameVideoProcessor.of(image_processor("qwen2_vl"), "qwen2", QWEN2_VIDEO_SIZE)
    with pytest.raises(InputError, match="frames of 2 sizes"):
        frames(videos=[[*video_frames(0)[:2], video_frames(1)[0]]])
    one_frame = VideoRule(kind="qwen3", patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=1,
                          max_pixels=2**20)
    with pytest.raises(InputError, match="1 frames, fewer than the temporal patch of 2"):
        FrameVideoProcessor(image_processor("qwen3_vl"), one_frame)(videos=[video_frames(0)[:1]])


def test_video_frames_count_against_the_pixel_limits():
    """A video's frames are checked by their headers with the batch's images, before any is decoded."""
    model, collator, made = setup("qwen2_vl")
    pack = packs_of(made, ((0,),))[0]  # one video: 4 frames of 120x90
    options = dict(pad_token_id=1, video_processor=collator.video_processor)
    batch = VisionCollator(collator.spec, collator.image_processor, **options)([pack])
    assert len(batch["video_grid_thw"]) == 1
    is_video = batch["input_ids"] == collator.spec.video_token_id
    assert is_video.any() and (batch["labels"][is_video] == -100).all()  # a placeholder is never a target
    for limits, message in (({"max_image_pixels": 120 * 90 - 1}, "max_image_pixels"),
                            ({"max_image_pixels": 120 * 90, "max_batch_pixels": 120 * 90 * 3}, "max_batch_pixels")):
        limited = VisionCollator(collator.spec, collator.image_processor, **options, **limits)
        with pytest.raises(InputError, match=message):
            limited([pack])


def test_the_collator_tells_the_video_processor_to_take_the_frames_as_they_are():
    """transformers' Qwen3VLVideoProcessor samples frames by default (do_sample_frames=True) and announces capped
    frame pixels as its coming default: the collator turns both off at the call, as the set counted every frame at
    the rule's size; FrameVideoProcessor, which does neither, refuses to be asked to."""
    model, collator, made = setup("qwen2_vl")
    pack = packs_of(made, ((0,),))[0]
    calls = []

    class Recording(FrameVideoProcessor):
        def __call__(self, videos, **options):
            calls.append(options)
            return super().__call__(videos, **options)

    recording = Recording(collator.image_processor, collator.video_processor.rule)
    VisionCollator(collator.spec, collator.image_processor, pad_token_id=1, video_processor=recording)([pack])
    assert calls == [{"return_tensors": "pt", "do_sample_frames": False, "cap_pixels_per_frame": False}]
    for option in ("do_sample_frames", "cap_pixels_per_frame"):
        with pytest.raises(UsageError, match=f"{option}=True"):
            recording(videos=[video_frames(0)[:2]], **{option: True})


def test_a_batch_over_its_pixels_with_frames_is_refused_before_any_image_is_decoded():
    """The pixel limits count the batch's images and frames at once, by their headers: an image whose body would
    not decode is never reached; a frame that cannot be decoded is named by its video and frame."""
    model, collator, made = setup("qwen2_vl")
    pack = packs_of(made, ((1,),))[0]  # an image and a video
    sizes = [Image.open(io.BytesIO(data)).size for data in [*pack["images"], *pack["videos"][0]]]
    pixels = sum(width * height for width, height in sizes)
    truncated = {**pack, "images": [image[: len(image) // 2] for image in pack["images"]]}  # headers intact
    options = dict(pad_token_id=1, video_processor=collator.video_processor)
    limited = VisionCollator(collator.spec, collator.image_processor, **options,
                             max_image_pixels=max(width * height for width, height in sizes), max_batch_pixels=pixels - 1)
    with pytest.raises(InputError, match="max_batch_pixels"):
        limited([truncated])
    broken = {**pack, "videos": [[*video[:-1], video[-1][: len(video[-1]) // 2]] for video in pack["videos"]]}
    last = len(pack["videos"][0]) - 1
    with pytest.raises(InputError, match=f"Pack 0's video 0, frame {last} cannot be decoded"):
        VisionCollator(collator.spec, collator.image_processor, **options)([broken])


@pytest.mark.parametrize("model_type", FRAME_FAMILIES)
def test_frame_video_packed_batch_equals_each_alone(model_type):
    """LLaVA-NeXT-Video and Video-LLaVA (their must-isolate video test, in the fast lane): videos of 4, 3 and 5
    frames, an image (LLaVA-NeXT's tiles; Video-LLaVA's CLIP image) and a text-only sample, packed two to a row on
    sdpa, give the logits, loss and every gradient (language model, projector, vision tower) of each sample alone,
    where transformers takes each sample's videos as [videos, frames, C, H, W]; the batch's frames share one row of
    pixel_values_videos."""
    model, collator, made = setup(model_type)
    packs = packs_of(made, ROWS[2])
    batch = collator(packs)
    frames = sum(VIDEOS[video][1] for _, videos in SAMPLES for video in videos)
    assert batch["pixel_values_videos"].shape[:2] == (1, frames) and len(batch["pixel_values"]) == 1
    assert int((batch["input_ids"] == collator.spec.video_token_id).sum()) == frames * collator.spec.tokens_per_frame
    enable_packing(model)
    assert_exact(f"{model_type} videos", *compare(model, collator, made, packs, batch))


def test_llava_next_video_placeholders_that_end_between_a_videos_frames_are_refused():
    """A pack whose first sample has a frame's placeholders too few and whose second has them too many adds up, as
    transformers checks it, but would hand the second sample's first frame to the first: refused by sample."""
    model, collator, made = setup("llava_next_video")
    pack = packs_of(made, ROWS[2])[0]
    per_frame = collator.spec.tokens_per_frame
    ids, (start, end) = pack["input_ids"].copy(), pack["cu_seqlens"][1:3]
    first = int(np.flatnonzero(ids[:start] == collator.spec.video_token_id)[0])
    ids[first : first + per_frame] = 2  # the first sample's first frame's placeholders become text
    placeholders = [collator.spec.video_token_id, collator.spec.image_token_id]
    texts = start + np.flatnonzero(~np.isin(ids[start:end], placeholders))[-per_frame:]
    ids[texts] = collator.spec.video_token_id  # as many of the second sample's text tokens become placeholders
    with pytest.raises(InputError, match="Pack 0's sample 0 ends after 12 video placeholders, where none of its "
                                         r"videos ends \(4 placeholders a frame: videos end at \[16, 28\]\)"):
        collator([{**pack, "input_ids": ids}])


def test_frame_video_placeholders_too_few_in_total_are_refused_as_such():
    """A pack whose video placeholders stop at a video's end but fall short of its videos' frames is refused for
    its total (not for where a sample ends, which is at a video's end)."""
    model, collator, made = setup("llava_next_video")
    pack = packs_of(made, ROWS[2])[0]  # sample 0: a video of 4 frames; sample 1: an image and a video of 3
    ids, start = pack["input_ids"].copy(), pack["cu_seqlens"][1]
    ids[start:][ids[start:] == collator.spec.video_token_id] = 2  # sample 1's video placeholders become text
    with pytest.raises(InputError, match=r"Pack 0 has 16 video placeholders for videos totalling 28 \(7 frames, 4 "
                                         r"placeholders a frame\)"):
        collator([{**pack, "input_ids": ids}])


@pytest.mark.usefixtures("use_flash_reference")
def test_text_offsets_handed_to_video_llavas_video_tower_are_dropped():
    """Video-LLaVA runs videos through a tower of their own (`video_tower`, beside `image_tower`). Its
    `get_video_features` hands its keyword arguments on to that tower (as LLaVA's forward does to its one tower);
    on flash, the text's offsets there make the tower attend across the frames: enable_packing keeps them out."""
    model = tiny_vision_model("video_llava", "sdpa")
    enable_flash_attention(model, "flash_attention_2")
    frames = video_processor("video_llava", None)(videos=[video_frames(0)], return_tensors="pt",
                                                  do_sample_frames=False)["pixel_values_videos"]
    features = model.model.get_video_features
    with torch.no_grad():
        alone = features(pixel_values_videos=frames).pooler_output
        count, length = alone.shape[:2]  # frames, and the tower's tokens a frame (CLS and the patches)
        cu_seq_lens = torch.tensor([0, length + 2, count * length])  # a text's segments, across two frames
        offsets = dict(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=count * length - length - 2,
                       max_length_k=count * length - length - 2)
        assert float((features(pixel_values_videos=frames, **offsets).pooler_output - alone).abs().max()) > 1e-3
        enable_packing(model)
        assert float((features(pixel_values_videos=frames, **offsets).pooler_output - alone).abs().max()) < TOLERANCE


def test_the_qwen_frame_video_processor_refuses_a_frames_rule():
    """FrameVideoProcessor lays out Qwen-VL's temporal patches: a frames rule (LLaVA-NeXT-Video's, Video-LLaVA's) is
    transformers' own video processors' to take."""
    frames = VideoRule(kind="frames", placeholder="<video>", start="", end="", tokens=4)
    with pytest.raises(UsageError, match="a frames video rule is transformers' LlavaNextVideoVideoProcessor's"):
        FrameVideoProcessor(image_processor("qwen2_vl"), frames)
