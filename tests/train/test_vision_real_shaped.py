"""Real-shaped image-chat corpora that prepack's tests were not written against (issue 34's "done when"):
LLaVA-Instruct / ShareGPT shapes from `tests.vision_corpora` (several turns, `<image>` at the start, middle or
end, multi-image rows, rows without images, Hugging Face content items, tiny and very elongated images),
prepared, built with an image cap, and held end to end on Qwen2-VL (the default family):

- every sample's tokens are what transformers' own `Qwen2VLProcessor(text=..., images=...)` gives for the same
  conversation (so every placeholder count is the processor's);
- every sample is in exactly one pack, and no pack holds more images than the cap;
- the logits of each packed batch equal each sample run alone on a tiny random Qwen2-VL in float64, and each
  image's `image_spans` entry is that image's placeholders.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from prepack import enable_packing
from prepack.check.verify import verify_build
from prepack.formats.images import read_image_set
from prepack.model.tiny_vision_models import tiny_vision_model
from prepack.sources.images import prepare_image_chat
from prepack.training.dataset import PackedDataset
from prepack.training.vision_collate import VisionCollator, VisionSpec
from prepack.training.vision_dataset import ImagePackedDataset
from tests.cli import run_prepack
from tests.model.test_vision import TOLERANCE
from tests.vision_corpora import real_shaped_corpus
from tests.vision_inputs import QWEN_IMAGE_TOKENS, processor_directory

MAX_LEN, MAX_IMAGES, ROWS = 512, 4, 40
QWEN_IMAGE = "".join(QWEN_IMAGE_TOKENS)  # what Qwen2-VL's chat template writes for an image
ROLES = {"human": "user", "gpt": "assistant"}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    processor = processor_directory(root / "processor")
    corpus, records = real_shaped_corpus(root / "corpus", rows=ROWS, seed=1)
    summary = prepare_image_chat(corpus, processor, root / "prepared")
    build = root / "build"
    result = run_prepack("build", summary.corpus, "--tokenizer", processor, "--chat", "--max-len", MAX_LEN,
                         "--overflow", "error", "--max-images-per-pack", MAX_IMAGES, "--images", summary.image_set,
                         "--out", build)
    assert result.returncode == 0, result.stderr
    return processor, corpus, records, summary, build


def as_processor_sees_it(record: dict) -> tuple[list[dict], list[str]]:
    """The record as a Qwen2-VL chat (every image its template's `<|vision_start|><|image_pad|><|vision_end|>`)
    and its image paths in order: written here from the record, not by prepack."""
    if "conversations" in record:
        messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
        messages += [{"role": ROLES[turn["from"]], "content": turn["value"].replace("<image>", QWEN_IMAGE)}
                     for turn in record["conversations"]]
    else:
        messages = [{"role": message["role"], "content": message["content"] if isinstance(message["content"], str)
                     else "".join(QWEN_IMAGE if item["type"] == "image" else item["text"] for item in message["content"])}
                    for message in record["messages"]]
    return messages, record["images"]


def sample_tokens(build) -> dict[int, np.ndarray]:
    """Every corpus row's tokens as packed, asserting each row is in exactly one pack, whole."""
    dataset, found = PackedDataset(build), {}
    for index in range(len(dataset)):
        pack, rows = dataset[index], dataset.source_rows(index)
        for row, start, end in zip(rows.tolist(), pack["cu_seqlens"][:-1], pack["cu_seqlens"][1:]):
            assert row not in found, f"row {row} is in two packs"
            found[row] = pack["input_ids"][start:end]
    return found


@pytest.mark.slow
def test_every_sample_is_what_transformers_processor_makes_of_it(real):
    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor, corpus, records, summary, build = real
    class ImageOnlyProcessor(Qwen2VLProcessor):
        """transformers' Qwen2VLProcessor, its `__call__` unchanged, built without a video processor: transformers'
        video processors need torchvision, which this environment does not install, and images need none."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(processor)
    hf = ImageOnlyProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(processor), tokenizer=tokenizer,
                            video_processor=None)
    packed = sample_tokens(build)
    assert sorted(packed) == list(range(ROWS))  # every sample in exactly one pack
    shapes = {"no image": 0, "several images": 0, "image mid-sentence": 0, "several turns": 0}
    for row, record in enumerate(records):
        messages, paths = as_processor_sees_it(record)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        images = [Image.open(corpus.parent / path).convert("RGB") for path in paths]
        expected = hf(text=[text], images=images or None)["input_ids"][0]
        assert packed[row].tolist() == list(expected), f"row {row}"
        shapes["no image"] += not paths
        shapes["several images"] += len(paths) > 1
        shapes["image mid-sentence"] += any(f" {QWEN_IMAGE} " in m["content"] for m in messages)
        shapes["several turns"] += len(messages) > 3
    assert min(shapes.values()) > 0, shapes  # the corpus has every shape it claims


@pytest.mark.slow
def test_the_cap_holds_and_verify_finds_nothing(real):
    processor, corpus, records, summary, build = real
    per_row = read_image_set(summary.image_set).row_images()
    dataset = PackedDataset(build)
    per_pack = [int(per_row[dataset.source_rows(i)].sum()) for i in range(len(dataset))]
    assert max(per_pack) <= MAX_IMAGES and sum(per_pack) == summary.references
    assert verify_build(build, summary.corpus, tokenizer=processor) == []
    checked = run_prepack("verify", build, "--images", summary.image_set)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    report = json.loads(run_prepack("inspect", build, "--images", summary.image_set, "--json").stdout)
    assert report["images"]["images_per_pack_max"] == max(per_pack)


@pytest.mark.slow
def test_packed_logits_equal_each_sample_alone_and_spans_are_its_images(real):
    from tokenizers import Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor, corpus, records, summary, build = real
    vocabulary = Tokenizer.from_file(str(processor / "tokenizer.json"))
    start, image, end = (vocabulary.token_to_id(token) for token in QWEN_IMAGE_TOKENS)
    tokens = {"image_token_id": image, "vision_start_token_id": start, "vision_end_token_id": end}
    model = enable_packing(tiny_vision_model("qwen2_vl", vocab_size=vocabulary.get_vocab_size(), tokens=tokens))
    collator = VisionCollator(VisionSpec.of(model.config), Qwen2VLImageProcessorPil.from_pretrained(processor),
                              max_len=MAX_LEN, pad_token_id=50256, image_spans=True)
    image_set = read_image_set(summary.image_set)
    dataset = ImagePackedDataset(build, summary.image_set)
    worst, samples = 0.0, 0
    for first in range(0, len(dataset), 2):
        packs = [dataset[index] for index in range(first, min(first + 2, len(dataset)))]
        batch = collator(packs)
        spans = batch.pop("image_spans")
        with torch.no_grad():
            logits = model(**batch).logits
        if first == 0:
            first_batch, first_logits = batch, logits
        span = 0
        for row, pack in enumerate(packs):
            rows = dataset.packs.source_rows(first + row)
            for document, (begin, stop) in enumerate(zip(pack["cu_seqlens"][:-1], pack["cu_seqlens"][1:])):
                numbers = image_set.images_of(int(rows[document]))
                ids = torch.from_numpy(pack["input_ids"][begin:stop].astype(np.int64))[None]
                alone = {"input_ids": ids, "use_cache": False, "mm_token_type_ids": (ids == image).int()}
                for number in numbers:  # this sample's images, in order, at its own placeholders
                    r, s, e = spans[span].tolist()
                    assert r == row and begin <= s < e <= stop and e - s == int(image_set.tokens[number])
                    span += 1
                if len(numbers):
                    alone |= collator._preprocessed([[image_set.data(int(n)) for n in numbers]])
                with torch.no_grad():
                    alone_logits = model(**alone).logits
                worst = max(worst, float((logits[row, begin:stop] - alone_logits[0]).abs().max()))
                samples += 1
        assert span == len(spans)
    assert samples == ROWS and worst < TOLERANCE
    # Leak control: the first batch with text positions that never restart lets each sample see those before it
    # in its row, which moves its logits (and so the comparison above would fail).
    assert max(len(dataset[index]["cu_seqlens"]) for index in range(2)) > 2  # a row of several samples
    first_batch["position_ids"] = first_batch["position_ids"].clone()
    first_batch["position_ids"][0] = torch.arange(first_batch["position_ids"].shape[-1])
    with torch.no_grad():
        leaked = model(**first_batch).logits
    assert float((leaked - first_logits).abs().max()) > 1e-3
