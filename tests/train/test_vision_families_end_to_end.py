"""Image-chat corpora of the families given a data side after Qwen-VL (Mistral 3's rows of cells, InternVL's tiles,
Gemma 4's soft tokens by each image's size, Gemma 3n's timm tower, LFM2-VL's NaFlex tiles and thumbnails):
prepared by `prepare_image_chat` from a processor directory that transformers' own processor reads, built by the
CLI, served by ImagePackedDataset, collated by VisionCollator with the directory's image processor, and each pack's
logits equal to its samples run alone in a tiny model with the tokenizer's vocabulary. Every sample lands in exactly
one pack, and its placeholders are the count the processor gives. (Loss, gradients and leak controls are
tests/model/test_vision.py's.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from prepack import enable_packing
from prepack.formats.images import read_image_set
from prepack.model.tiny_vision_models import tiny_vision_model
from prepack.sources.images import prepare_image_chat, processor_rule
from prepack.training.vision_collate import VisionCollator, VisionSpec
from prepack.training.vision_dataset import ImagePackedDataset
from tests.building.test_image_chat import (
    gemma3n_directory, gemma4_directory, internvl_directory, lfm2_vl_directory, mistral3_directory,
)
from tests.cli import run_prepack
from tests.model.test_vision import TOLERANCE, alone_pixels, run
from tests.train.test_vision_end_to_end import image_chat_corpus

MAX_LEN = 256


def mistral3_parts(directory):
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    processor, _ = mistral3_directory(directory)
    return processor, PixtralImageProcessorPil.from_pretrained(processor), "[IMG]"


def internvl_tiled_parts(directory):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    processor, _ = internvl_directory(directory, crop_to_patches=True, max_patches=4)
    return processor, GotOcr2ImageProcessorPil.from_pretrained(processor), "<IMG_CONTEXT>"


def gemma4_parts(directory):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    processor, _ = gemma4_directory(directory)
    return processor, Gemma4ImageProcessorPil.from_pretrained(processor), "<image_soft_token>"


# The model's ids of the tokens the family's config names beside its image placeholder (Gemma 4's video and audio
# placeholders, which its forward masks out of the text: the tiny config's ids are ordinary text in a real vocabulary).
OTHER_TOKENS = {"gemma4": {"video_token_id": "<|video|>", "audio_token_id": "<audio_soft_token>"}}


def gemma3n_parts(directory):
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    processor, _ = gemma3n_directory(directory)
    return processor, SiglipImageProcessorPil.from_pretrained(processor), "<image_soft_token>"


def lfm2_vl_parts(directory):
    """transformers' own Lfm2VlImageProcessor (torchvision) sized for the tiny tower (patches of 16, 2x2 per feature):
    tiles of 4 features, at most 4 of them, and the thumbnail or a small image resized to 4 to 16 features."""
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    processor = lfm2_vl_directory(directory, {"encoder_patch_size": 16, "downsample_factor": 2, "tile_size": 64,
                                              "max_tiles": 4, "min_image_tokens": 4, "max_image_tokens": 16})
    return processor, Lfm2VlImageProcessor.from_pretrained(processor), "<image>"


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "parts"), [("mistral3", mistral3_parts), ("internvl", internvl_tiled_parts),
                                                   ("gemma4", gemma4_parts), ("gemma3n", gemma3n_parts),
                                                   ("lfm2_vl", lfm2_vl_parts)])
def test_a_prepared_corpus_packs_every_sample_once_and_each_equals_itself_alone(tmp_path, model_type, parts):
    every_pack_equals_its_samples_alone(tmp_path, model_type, parts)


def every_pack_equals_its_samples_alone(tmp_path, model_type, parts):
    """The family's processor directory and image processor (`parts`), a corpus prepared and built by the CLI: every
    sample in exactly one pack with its rule's placeholders, and each pack's logits its samples' alone."""
    processor, image_processor, placeholder = parts(tmp_path / "processor")
    corpus = image_chat_corpus(tmp_path / "corpus", rows=10)
    summary = prepare_image_chat(corpus, processor, tmp_path / "prepared")
    result = run_prepack("build", summary.corpus, "--tokenizer", processor, "--chat", "--max-len", MAX_LEN,
                         "--overflow", "error", "--out", tmp_path / "build")
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer.from_file(str(processor / "tokenizer.json"))
    tokens = {"image_token_id": tokenizer.token_to_id(placeholder)} | {
        name: tokenizer.token_to_id(text) for name, text in OTHER_TOKENS.get(model_type, {}).items()}
    model = enable_packing(tiny_vision_model(model_type, vocab_size=tokenizer.get_vocab_size(), tokens=tokens))
    collator = VisionCollator(VisionSpec.of(model.config), image_processor, max_len=MAX_LEN, pad_token_id=50256)
    dataset = ImagePackedDataset(tmp_path / "build", summary.image_set)
    image_set = read_image_set(summary.image_set, verify=True)
    rule, placeholder_id = processor_rule(processor)
    rows = np.concatenate([dataset.packs.source_rows(pack) for pack in range(len(dataset))])
    assert sorted(rows.tolist()) == list(range(summary.documents))  # every sample in exactly one pack
    assert max(len(dataset[number]["cu_seqlens"]) for number in range(len(dataset))) > 3  # packs of several samples
    worst = 0.0
    for first in range(0, len(dataset), 2):
        packs = [dataset[number] for number in range(first, min(first + 2, len(dataset)))]
        logits, _, _ = run(model, collator(packs), gradients=False)
        for row, pack in enumerate(packs):
            for document, (start, end) in enumerate(zip(pack["cu_seqlens"][:-1], pack["cu_seqlens"][1:])):
                numbers = image_set.images_of(int(dataset.packs.source_rows(first + row)[document]))
                ids = torch.from_numpy(pack["input_ids"][start:end].astype(np.int64))
                expected = sum(rule.placeholders(int(image_set.widths[n]), int(image_set.heights[n])) for n in numbers)
                assert int((ids == placeholder_id).sum()) == expected
                alone = {"input_ids": ids[None], "use_cache": False}
                if collator.spec.style == "image blocks":  # as the processor marks them: its placeholders
                    alone[collator.spec.token_types] = (ids == placeholder_id).long()[None]
                if len(numbers):
                    alone |= alone_pixels(collator, [image_set.data(int(n)) for n in numbers])
                alone_logits, _, _ = run(model, alone, gradients=False)
                worst = max(worst, float((logits[row, start:end] - alone_logits[0]).abs().max()))
    assert summary.references > 0 and worst < TOLERANCE, worst
