"""`VisionCollator(image_spans=True)`: one (row, start, end) per image, in the order of `pixel_values`, covering
exactly that image's placeholder tokens and nothing else (issue 34 item 5), for the 3-D rotary style (Qwen2-VL:
a counted run between start and end tokens), the fixed styles (LLaVA: runs of adjacent images touch; Gemma 3's
image blocks: a fixed run between begin and end tokens) and InternVL's tiles (views per image by its shape); refused
by name where an image is not one run of placeholders."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from prepack.errors import InputError, UsageError
from prepack.training.vision_collate import VisionCollator, VisionSpec
from tests.vision_inputs import image_processor

IMAGE_ID, START_ID, END_ID, PAD_ID = 7, 8, 9, 0
FIXED_TOKENS = 3
# Sizes whose Qwen2-VL placeholder counts differ, so that a span given to the wrong image has the wrong length.
SIZES = ((20, 20), (60, 30), (30, 90), (200, 12), (112, 56))


def png(width: int, height: int, shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 255 - shade, 40)).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def qwen():
    processor = image_processor("qwen2_vl")
    images = [png(w, h, 40 * n) for n, (w, h) in enumerate(SIZES)]
    counts = []
    for image in images:
        grid = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")])["image_grid_thw"][0]
        counts.append(int(np.prod(grid)) // 4)
    assert len(set(counts)) == len(counts)
    return processor, images, counts


# A batch: packs of samples, each sample a list of parts: a text run (its length) or an image (its number).
samples = st.lists(st.one_of(st.integers(1, 4), st.integers(-len(SIZES), -1)), min_size=1, max_size=6)
batches = st.lists(st.lists(samples, min_size=1, max_size=3), min_size=1, max_size=3)


def laid_out(batch, counts, separated: bool):
    """The packs, and the expected span of every image in pack and token order. Qwen-style images are
    `start, placeholders, end`; LLaVA-style (`separated` False) only the placeholders, so adjacent images touch."""
    packs, spans, rng = [], [], np.random.default_rng(0)
    for row, pack in enumerate(batch):
        ids, cu, images = [], [0], []
        for sample in pack:
            ids.append(1)  # a sample's first token (a BOS), never an image
            for part in sample:
                if part > 0:
                    ids += rng.integers(10, 50, part).tolist()
                    continue
                number = -part - 1
                ids += [START_ID] if separated else []
                spans.append((row, len(ids), len(ids) + counts[number]))
                ids += [IMAGE_ID] * counts[number]
                ids += [END_ID] if separated else []
                images.append(number)
            cu.append(len(ids))
        packs.append((np.array(ids), np.array(cu), images))
    return packs, np.array(spans, dtype=np.int64).reshape(-1, 3)


def check(batch, expected, counts_of_batch):
    spans = batch["image_spans"].numpy()
    assert spans.dtype == np.int64 and np.array_equal(spans, expected)
    ids = batch["input_ids"].numpy()
    covered = np.zeros(ids.shape, bool)
    for (row, start, end), count in zip(spans, counts_of_batch):
        assert end - start == count and (ids[row, start:end] == IMAGE_ID).all()  # the image's tokens ...
        assert not covered[row, start:end].any()  # ... no other image's
        covered[row, start:end] = True
    assert np.array_equal(covered, ids == IMAGE_ID)  # every placeholder in exactly one span
    flat = ids.reshape(-1)  # the flattened coordinates: row * L + start
    for row, start, end in spans:
        assert (flat[row * ids.shape[1] + start : row * ids.shape[1] + end] == IMAGE_ID).all()


@settings(max_examples=8, deadline=None)
@given(batches)
def test_qwen_spans_cover_each_images_placeholders_in_pixel_order(qwen, batch):
    processor, images, counts = qwen
    packs, expected = laid_out(batch, counts, separated=True)
    collator = VisionCollator(VisionSpec("3-D rotary", IMAGE_ID, merge_size=2), processor, pad_token_id=PAD_ID,
                              image_spans=True)
    out = collator([{"input_ids": ids, "cu_seqlens": cu, "images": [images[n] for n in numbers]}
                    for ids, cu, numbers in packs])
    in_order = [n for _, _, numbers in packs for n in numbers]
    if in_order:  # pixel_values' order: each grid gives its span's length
        assert [int(g.prod()) // 4 for g in out["image_grid_thw"]] == [counts[n] for n in in_order]
    check(out, expected, [counts[n] for n in in_order])


@pytest.mark.parametrize(
    ("style", "model_type", "separated"),
    [("restart", "llava", False), ("image blocks", "gemma3", True)],  # Gemma 3: begin and end tokens around an image
)
@settings(max_examples=8, deadline=None)
@given(batch=batches, max_len=st.sampled_from([None, 96]))
def test_fixed_count_spans_split_adjacent_images(style, model_type, separated, batch, max_len):
    counts = [FIXED_TOKENS] * len(SIZES)
    packs, expected = laid_out(batch, counts, separated=separated)
    lengths = max(len(ids) for ids, _, _ in packs)
    if max_len is not None and lengths > max_len:
        max_len = None
    token_types = "token_type_ids" if style == "image blocks" else None
    spec = VisionSpec(style, IMAGE_ID, tokens_per_image=FIXED_TOKENS, token_types=token_types)
    collator = VisionCollator(spec, image_processor(model_type),
                              pad_token_id=PAD_ID, max_len=max_len, image_spans=True)
    images = [png(w, h, 40 * n) for n, (w, h) in enumerate(SIZES)]
    out = collator([{"input_ids": ids, "cu_seqlens": cu, "images": [images[n] for n in numbers]}
                    for ids, cu, numbers in packs])
    assert len(out["image_spans"]) == (0 if "pixel_values" not in out else len(out["pixel_values"]))
    check(out, expected, [FIXED_TOKENS] * len(expected))


def test_spans_are_off_by_default_and_empty_without_images():
    collator = VisionCollator(VisionSpec("restart", IMAGE_ID, tokens_per_image=FIXED_TOKENS), image_processor("llava"))
    pack = {"input_ids": np.array([1, 2, 3]), "cu_seqlens": np.array([0, 3])}
    assert "image_spans" not in collator([pack])
    collator.image_spans = True
    assert tuple(collator([pack])["image_spans"].shape) == (0, 3)


def test_a_split_run_of_placeholders_is_refused_by_pack_and_image():
    collator = VisionCollator(VisionSpec("restart", IMAGE_ID, tokens_per_image=2), image_processor("llava"),
                              image_spans=True)
    pack = {"input_ids": np.array([1, IMAGE_ID, 5, IMAGE_ID, 3]), "cu_seqlens": np.array([0, 5]), "images": [png(20, 20, 0)]}
    with pytest.raises(InputError, match="Pack 0's image 0 has 2 placeholders"):
        collator([pack])


def test_a_qwen_pack_with_an_image_its_placeholders_lack_is_refused(qwen):
    processor, images, counts = qwen
    collator = VisionCollator(VisionSpec("3-D rotary", IMAGE_ID, merge_size=2), processor, image_spans=True)
    ids = np.array([1, START_ID, *[IMAGE_ID] * counts[0], END_ID, 5])  # image 1 has no placeholders
    pack = {"input_ids": ids, "cu_seqlens": np.array([0, len(ids)]), "images": images[:2]}
    with pytest.raises(InputError, match=f"Pack 0 has {counts[0]} image placeholders; its 2 images make {counts[0] + counts[1]}"):
        collator([pack])


@pytest.mark.parametrize("model_type", ["llava_next", "llava_onevision", "idefics3", "smolvlm"])
def test_spans_are_refused_up_front_for_tiled_families(model_type):
    """A tiled tower's image is not one run of a known count (Idefics3's and SmolVLM's tiles are runs apart,
    LLaVA-NeXT's and OneVision's adjacent runs touch at a count only the image's size gives): refused at
    construction, not a TypeError in the first batch."""
    from prepack.errors import UsageError
    from prepack.model.tiny_vision_models import tiny_vision_config

    spec = VisionSpec.of(tiny_vision_config(model_type))
    assert spec.tokens_per_image is None
    with pytest.raises(UsageError, match="image_spans"):
        VisionCollator(spec, image_processor(model_type), image_spans=True)
    VisionCollator(spec, image_processor(model_type))  # without spans the family is batched as before


def test_internvl_tiled_spans_count_each_images_views():
    """InternVL tiled: an image's run is tokens_per_image per view its image processor made (tiles and thumbnail),
    so images of other shapes take runs of other lengths."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    processor = GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True, max_patches=4)
    images = [png(28, 28, 0), png(112, 28, 90), png(56, 56, 180)]
    views = [int(processor(images=[Image.open(io.BytesIO(image)).convert("RGB")])["num_patches"][0]) for image in images]
    assert len(set(views)) > 1
    counts = [2 * count for count in views]
    packs, expected = laid_out([[[-1, 2, -2]], [[-3]]], counts, separated=True)
    collator = VisionCollator(VisionSpec("restart", IMAGE_ID, tokens_per_image=2), processor, pad_token_id=PAD_ID,
                              image_spans=True)
    out = collator([{"input_ids": ids, "cu_seqlens": cu, "images": [images[n] for n in numbers]}
                    for ids, cu, numbers in packs])
    check(out, expected, counts)


@pytest.mark.parametrize("spec", [VisionSpec("restart", IMAGE_ID), VisionSpec("restart", IMAGE_ID, image_cell=28)],
                         ids=["tiled", "rows"])
def test_spans_are_refused_where_an_image_is_not_one_run(spec):
    """Tiled towers (LLaVA-NeXT, Idefics3: no fixed count) and Mistral 3's rows broken by [IMG_BREAK]: refused when
    the collator is made, not by a crash on the first batch."""
    tiles = "LLaVA-NeXT's, LLaVA-OneVision's, Idefics3's, SmolVLM's and LFM2-VL's tiles, Mistral 3's"
    with pytest.raises(UsageError, match=f"image_spans .*{tiles}"):
        VisionCollator(spec, image_processor("llava"), image_spans=True)


@pytest.fixture(scope="module")
def gemma4():
    processor = image_processor("gemma4")
    images = [png(w, h, 40 * n) for n, (w, h) in enumerate(SIZES)]
    counts = [int(count) for count in processor(images=[Image.open(io.BytesIO(image)).convert("RGB")
                                                        for image in images])["num_soft_tokens_per_image"]]
    assert len(set(counts)) > 2  # the sizes give different counts
    return processor, images, counts


GEMMA4 = VisionSpec("image blocks", IMAGE_ID, token_types="mm_token_type_ids", image_counts="num_soft_tokens_per_image")


@settings(max_examples=5, deadline=None)
@given(batches)
def test_gemma4_spans_cover_each_images_soft_tokens_in_pixel_order(gemma4, batch):
    """Gemma 4: each image's run of soft tokens, its count by its size (the image processor's), between its begin
    and end tokens; its mm_token_type_ids mark the placeholders."""
    processor, images, counts = gemma4
    packs, expected = laid_out(batch, counts, separated=True)
    out = VisionCollator(GEMMA4, processor, pad_token_id=PAD_ID, image_spans=True)(
        [{"input_ids": ids, "cu_seqlens": cu, "images": [images[n] for n in numbers]} for ids, cu, numbers in packs])
    in_order = [n for _, _, numbers in packs for n in numbers]
    check(out, expected, [counts[n] for n in in_order])
    assert out["mm_token_type_ids"].tolist() == (out["input_ids"] == IMAGE_ID).long().tolist()
    assert "num_soft_tokens_per_image" not in out and ("image_position_ids" in out) == bool(in_order)


def test_a_gemma4_pack_counted_for_other_sizes_is_refused_by_pack(gemma4):
    """Two packs whose images' soft tokens add up over the batch but not per pack (transformers checks the total
    only, and would hand one pack's image features to the other's placeholders)."""
    processor, images, counts = gemma4
    small, large = sorted(range(len(counts)), key=counts.__getitem__)[:: len(counts) - 1]
    packs = [{"input_ids": np.array([1, *[IMAGE_ID] * counts[large]]), "cu_seqlens": np.array([0, counts[large] + 1]),
              "images": [images[small]]},
             {"input_ids": np.array([1, *[IMAGE_ID] * counts[small]]), "cu_seqlens": np.array([0, counts[small] + 1]),
              "images": [images[large]]}]
    with pytest.raises(InputError, match=f"Pack 0 has {counts[large]} image placeholders; the image processor made its "
                                         f"1 images {counts[small]} soft tokens"):
        VisionCollator(GEMMA4, processor, pad_token_id=PAD_ID)(packs)
