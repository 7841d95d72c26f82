"""VisionCollator's pixel limits: every image's size is read from its header and checked, per image and per
batch, before any image of the batch is decoded. A one-colour PNG of 88M pixels (under Pillow's bomb
warning) is a few KB on disk; decoded, four of them took gigabytes."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageFile

from prepack.errors import InputError, UsageError
from prepack.training.vision_collate import MAX_BATCH_PIXELS, MAX_IMAGE_PIXELS, VisionCollator, VisionSpec
from tests.vision_inputs import image_processor, photo_bytes

IMAGE_ID = 7
TOKENS_PER_IMAGE = 2


def blank_png(width: int, height: int) -> bytes:
    """A one-colour PNG of width x height pixels: a few KB encoded."""
    encoded = io.BytesIO()
    Image.new("P", (width, height)).save(encoded, "PNG", compress_level=9)
    return encoded.getvalue()


def pack(images: list[bytes]) -> dict:
    """One sample holding `images`, each as its placeholders (LLaVA's style: a fixed count per image)."""
    ids = np.array([1, 2, *[IMAGE_ID] * (TOKENS_PER_IMAGE * len(images)), 3])
    return {"input_ids": ids, "cu_seqlens": np.array([0, len(ids)]), "images": images}


def collator(**limits) -> VisionCollator:
    spec = VisionSpec("restart", IMAGE_ID, tokens_per_image=TOKENS_PER_IMAGE)
    return VisionCollator(spec, image_processor("llava"), pad_token_id=0, **limits)


@pytest.fixture
def decoded(monkeypatch) -> list[tuple[int, int]]:
    """The sizes of the images Pillow decodes, in order; decoding one of over a million pixels fails at once."""
    sizes, load = [], ImageFile.ImageFile.load

    def recorded(image):
        sizes.append(image.size)
        assert image.width * image.height <= 2**20, f"a {image.size} image was decoded"
        return load(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", recorded)
    return sizes


def test_the_default_limits_stay_well_below_pillows_bomb_warning():
    assert MAX_IMAGE_PIXELS <= Image.MAX_IMAGE_PIXELS // 2 and MAX_IMAGE_PIXELS <= MAX_BATCH_PIXELS
    made = collator()
    assert (made.max_image_pixels, made.max_batch_pixels) == (MAX_IMAGE_PIXELS, MAX_BATCH_PIXELS)


def test_an_image_over_the_limit_is_refused_by_name_before_any_image_is_decoded(decoded):
    huge = blank_png(9400, 9400)  # 88.4M pixels: under Pillow's warning and prepare-images' default limit
    assert len(huge) < 20_000
    photos = photo_bytes()
    with pytest.raises(InputError, match=r"Pack 1's image 1 is 9400x9400 = 88,360,000 pixels, more than "
                                         rf"max_image_pixels={MAX_IMAGE_PIXELS:,}"):
        collator()([pack(photos[:1]), pack([photos[1], huge])])
    assert decoded == []  # not even the photographs before it


def test_a_batch_over_its_pixel_budget_is_refused_by_name_before_any_image_is_decoded(decoded):
    side = int(MAX_IMAGE_PIXELS**0.5)  # each image within its own limit
    image = blank_png(side, side)
    over = MAX_BATCH_PIXELS // side**2  # the pack whose image takes the batch over
    with pytest.raises(InputError, match=rf"by pack {over}'s image 0, more than max_batch_pixels={MAX_BATCH_PIXELS:,}"):
        collator()([pack([image]) for _ in range(over + 1)])
    assert decoded == []


def test_the_limits_are_options_and_images_within_them_are_decoded(decoded):
    photos = photo_bytes()
    sizes = [Image.open(io.BytesIO(photo)).size for photo in photos]
    pixels = [width * height for width, height in sizes]
    packs = [pack(photos[:2]), pack(photos[2:])]
    with pytest.raises(InputError, match=rf"Pack 0's image 0 is {sizes[0][0]}x{sizes[0][1]}"):
        collator(max_image_pixels=pixels[0] - 1)(packs)
    with pytest.raises(InputError, match="by pack 1's image 0, more than max_batch_pixels"):
        collator(max_image_pixels=max(pixels), max_batch_pixels=sum(pixels) - 1)(packs)
    assert decoded == []
    batch = collator(max_image_pixels=max(pixels), max_batch_pixels=sum(pixels))(packs)
    assert len(batch["pixel_values"]) == 3
    assert list(dict.fromkeys(decoded)) == sizes  # in order (Pillow reloads an RGB image once more to copy it)


@pytest.mark.parametrize("limits", [{"max_image_pixels": 0}, {"max_image_pixels": 100, "max_batch_pixels": 99}])
def test_limits_that_cannot_hold_an_image_are_refused(limits):
    with pytest.raises(UsageError, match="max_image_pixels"):
        collator(**limits)


def test_an_image_blocks_spec_without_its_token_type_field_is_refused():
    """The field that marks an image-blocks family's placeholders has no default (Gemma 3's and Gemma 4's differ)."""
    with pytest.raises(UsageError, match="needs token_types"):
        VisionCollator(VisionSpec("image blocks", IMAGE_ID, tokens_per_image=TOKENS_PER_IMAGE), None)


def test_an_lfm2_vl_pack_counted_for_other_sizes_is_refused_by_pack(tmp_path):
    """LFM2-VL: each pack's placeholders are its images' features by what Lfm2VlImageProcessor made of them (tiles
    and thumbnail of a large image, the resized image of a small one). Two packs whose images' counts add up over the
    batch but not per pack are refused naming the first: transformers checks the total only, and would hand one
    pack's image features to the other's placeholders. Counted as prepare-images counts, they collate."""
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    from prepack.model.tiny_vision_models import tiny_vision_config
    from prepack.sources.images import processor_rule
    from tests.building.test_image_chat import lfm2_vl_directory

    spec = VisionSpec.of(tiny_vision_config("lfm2_vl"))
    options = {"encoder_patch_size": 16, "downsample_factor": 2, "tile_size": 64, "min_image_tokens": 4,
               "max_image_tokens": 16, "max_tiles": 4}
    directory = lfm2_vl_directory(tmp_path / "processor", options)
    rule, _ = processor_rule(directory)
    images = [blank_png(40, 30), photo_bytes()[0]]
    counts = [rule.placeholders(*Image.open(io.BytesIO(image)).size) for image in images]
    assert counts[0] != counts[1]

    def packs(placeholders: list[int]) -> list[dict]:
        return [{"input_ids": np.array([1, *[spec.image_token_id] * count, 2]), "cu_seqlens": np.array([0, count + 2]),
                 "images": [image]} for count, image in zip(placeholders, images)]

    collate = VisionCollator(spec, Lfm2VlImageProcessor.from_pretrained(directory), pad_token_id=0)
    batch = collate(packs(counts))
    assert len(batch["pixel_values"]) > len(images)  # the photograph's tiles and thumbnail
    assert set(batch) >= {"pixel_values", "pixel_attention_mask", "spatial_shapes"}
    assert not set(batch) & {"image_rows", "image_cols", "image_sizes", "features_per_image"}
    with pytest.raises(InputError, match=f"Pack 0 has {counts[1]} image placeholders; the image processor made its "
                                         f"1 images {counts[0]} features"):
        collate(packs(counts[::-1]))
