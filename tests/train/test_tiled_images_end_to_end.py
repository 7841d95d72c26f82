"""Tiled image families through the whole data path (issue 34's "done when"): `prepare_image_chat` counts each
photograph's placeholders by the family's processor rule, `prepack build` packs the chats, and a batch that
`ImagePackedDataset` and `VisionCollator` make in DataLoader workers gives each sample's logits, loss and
gradients alone, on a tiny random model of the family with the tokenizer's vocabulary (its image token the
tokenizer's). A placeholder count that differs from what the model makes of an image fails the model itself.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from prepack import enable_packing
from prepack.formats.images import read_image_set
from prepack.model.tiny_vision_models import image_processor_for, tiny_vision_config, tiny_vision_model
from prepack.sources.images import prepare_image_chat, processor_rule
from prepack.training.vision_collate import VisionCollator, VisionSpec
from prepack.training.vision_dataset import ImagePackedDataset
from tests.cli import run_prepack
from tests.train.test_vision_end_to_end import assert_equals_each_sample_alone, image_chat_corpus
from tests.vision_inputs import SPLIT_TOKENS, transformers_processor_directory

MAX_LEN = 320
# Per family: processor_config.json as the family's published processors write it (sized for the tiny tower),
# the tokens its tokenizer adds, and the most images a record holds (LLaVA-OneVision's rule counts one).
TILED = {
    "llava_next": ({"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
                   ("<image>",), 2),
    "llava_onevision": ({"num_image_tokens": 16, "vision_aspect_ratio": "anyres_max_9",
                         "vision_feature_select_strategy": "full"}, ("<image>",), 1),
    # 128-pixel tiles of 4x4 patches, pixel-shuffled by 2: 4 placeholders a tile
    "idefics3": ({"image_seq_len": 4}, SPLIT_TOKENS, 2),
    "smolvlm": ({"image_seq_len": 4}, SPLIT_TOKENS, 2),
}


@pytest.fixture(scope="module", params=sorted(TILED))
def prepared(request, tmp_path_factory):
    model_type, root = request.param, tmp_path_factory.mktemp(request.param)
    processor_config, tokens, most_images = TILED[model_type]
    images = image_processor_for(tiny_vision_config(model_type))
    processor = transformers_processor_directory(root / "processor", images, processor_config, tokens)
    summary = prepare_image_chat(image_chat_corpus(root / "corpus", most_images=most_images), processor, root / "prepared")
    build = root / "build"
    result = run_prepack("build", summary.corpus, "--tokenizer", processor, "--chat", "--max-len", MAX_LEN,
                         "--overflow", "error", "--out", build)
    assert result.returncode == 0, result.stderr
    return model_type, processor, summary, build


@pytest.mark.slow
def test_a_tiled_image_chat_corpus_builds_and_a_worker_batch_equals_each_sample_alone(prepared):
    model_type, processor, summary, build = prepared
    image_set = read_image_set(summary.image_set, verify=True)
    _, placeholder_id = processor_rule(processor)
    vocab_size = Tokenizer.from_file(str(processor / "tokenizer.json")).get_vocab_size()
    model = enable_packing(tiny_vision_model(model_type, vocab_size=vocab_size, tokens={"image_token_id": placeholder_id}))
    images = type(image_processor_for(model.config)).from_pretrained(processor)
    collator = VisionCollator(VisionSpec.of(model.config), images, max_len=MAX_LEN, pad_token_id=50256)
    dataset = ImagePackedDataset(build, summary.image_set)
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=collator)))
    assert len(set(image_set.tokens.tolist())) > 1  # the photographs' counts differ with their sizes
    assert all(len(dataset[row]["cu_seqlens"]) > 2 for row in range(2))  # several samples in each pack
    assert int((batch["input_ids"] == placeholder_id).sum()) > 0
    assert_equals_each_sample_alone(model, collator, dataset, image_set, batch)
