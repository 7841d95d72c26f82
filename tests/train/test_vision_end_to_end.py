"""An image-chat corpus builds, trains through HF Trainer with the packed collator, and a packed batch from
DataLoader workers equals its samples run alone (issue 25's "done when").

The corpus: chats whose images are matplotlib's sample photographs, by path in content items, by `<image>`
markers with an `images` column, repeated across rows (stored once). The processor: GPT-2's BPE with the
Qwen image tokens added and a Qwen2-VL image processor config (`tests/vision_inputs.py`). The model: a
tiny random Qwen2.5-VL in float64 with the tokenizer's vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from prepack import enable_packing
from prepack.errors import InputError
from prepack.formats.images import read_image_set
from prepack.model.tiny_vision_models import tiny_vision_model
from prepack.sources.images import prepare_image_chat
from prepack.training.vision_collate import VisionCollator, VisionSpec
from prepack.training.dataset import PackedDataset
from prepack.training.vision_dataset import ImagePackedDataset
from tests.cli import WIDE, failure, run_prepack
from tests.model.test_vision import LOSS_TOLERANCE, TOLERANCE, alone_pixels, run, targets
from tests.vision_inputs import PHOTOS, QWEN_IMAGE_TOKENS, SAMPLE_DATA, processor_directory

MAX_LEN = 160


def image_chat_corpus(directory, rows: int = 12, most_images: int = 2) -> object:
    """`rows` chats, 0 to `most_images` images each, written as jsonl with image paths relative to it."""
    (directory / "photos").mkdir(parents=True)
    for name in PHOTOS:
        shutil.copy(SAMPLE_DATA / name, directory / "photos" / name)
    rng = np.random.default_rng(0)
    words = "the a photo of blue pack logo person shows what is in this picture describe it".split()
    records = []
    for row in range(rows):
        images = [f"photos/{PHOTOS[i]}" for i in rng.choice(len(PHOTOS), size=row % (most_images + 1), replace=False)]
        answer = " ".join(rng.choice(words, size=rng.integers(3, 12)))
        if row % 2:  # LLaVA style: <image> markers and an images column
            question = "<image> " * len(images) + "What is this?"
            records.append({"messages": [{"role": "user", "content": question},
                                         {"role": "assistant", "content": answer}], "images": images})
        else:  # Hugging Face content items
            content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": "Describe."}]
            records.append({"messages": [{"role": "user", "content": content},
                                         {"role": "assistant", "content": answer}]})
    corpus = directory / "chats.jsonl"
    corpus.write_text("".join(json.dumps(record) + "\n" for record in records))
    return corpus


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    processor = processor_directory(root / "processor")
    corpus = image_chat_corpus(root / "corpus")
    summary = prepare_image_chat(corpus, processor, root / "prepared")
    build = root / "build"
    result = run_prepack("build", summary.corpus, "--tokenizer", processor, "--chat", "--max-len", MAX_LEN,
                         "--overflow", "error", "--out", build)
    assert result.returncode == 0, result.stderr
    return processor, summary, build


def model_for(processor):
    tokenizer = Tokenizer.from_file(str(processor / "tokenizer.json"))
    start, image, end = (tokenizer.token_to_id(token) for token in QWEN_IMAGE_TOKENS)
    tokens = {"image_token_id": image, "vision_start_token_id": start, "vision_end_token_id": end}
    return tiny_vision_model("qwen2_5_vl", vocab_size=tokenizer.get_vocab_size(), tokens=tokens)


def collator_for(processor, model):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return VisionCollator(VisionSpec.of(model.config), Qwen2VLImageProcessorPil.from_pretrained(processor),
                          max_len=MAX_LEN, pad_token_id=50256)


@pytest.mark.slow
def test_image_chat_corpus_builds_and_a_worker_batch_equals_each_sample_alone(prepared):
    processor, summary, build = prepared
    image_set = read_image_set(summary.image_set, verify=True)
    assert summary.images == len(PHOTOS) and summary.references > summary.images  # each photo stored once
    model = enable_packing(model_for(processor))
    collator = collator_for(processor, model)
    dataset = ImagePackedDataset(build, summary.image_set)
    image_bytes = sum(len(image_set.data(number)) for number in range(image_set.manifest.images))
    assert len(pickle.dumps(dataset)) < image_bytes / 10  # workers get the image set's path, not its bytes
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=collator)
    batch = next(iter(loader))  # decoded and preprocessed in a worker process
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) > 0
    assert all(len(dataset[row]["cu_seqlens"]) > 2 for row in range(2))  # several samples in each pack
    assert_equals_each_sample_alone(model, collator, dataset, image_set, batch)


def assert_equals_each_sample_alone(model, collator, dataset, image_set, batch) -> None:
    """The batch of the dataset's first two packs gives the logits, loss and gradients of each sample alone (its
    images preprocessed alone; Qwen's token types as transformers takes them unpacked)."""
    logits, loss, grads = run(model, batch)
    alone_logits_diff, weighted, alone_grads, counted = 0.0, 0.0, {}, 0
    for row in range(2):
        pack = dataset[row]
        for document, (start, end) in enumerate(zip(pack["cu_seqlens"][:-1], pack["cu_seqlens"][1:])):
            numbers = image_set.images_of(int(dataset.packs.source_rows(row)[document]))
            ids = torch.from_numpy(pack["input_ids"][start:end].astype(np.int64))[None]
            alone = {"input_ids": ids, "labels": batch["labels"][row, start:end][None], "use_cache": False}
            if collator.spec.style == "3-D rotary":
                alone["mm_token_type_ids"] = (ids == collator.spec.image_token_id).int()
            if len(numbers):
                alone |= alone_pixels(collator, [image_set.data(int(n)) for n in numbers])
            alone_logits, alone_loss, sample_grads = run(model, alone)
            alone_logits_diff = max(alone_logits_diff, float((logits[row, start:end] - alone_logits[0]).abs().max()))
            count = targets(alone["labels"])
            weighted, counted = weighted + float(alone_loss) * count, counted + count
            for name, grad in sample_grads.items():
                alone_grads[name] = alone_grads.get(name, 0) + grad
    largest = max(float(grad.abs().max()) for grad in grads.values())
    grad_diff = max(float((grads[name] - alone_grads[name]).abs().max()) for name in grads) / largest
    assert alone_logits_diff < TOLERANCE
    assert abs(float(loss) - weighted / counted) < LOSS_TOLERANCE and grad_diff < LOSS_TOLERANCE


@pytest.mark.slow
def test_image_chat_build_trains_through_hf_trainer(prepared, tmp_path):
    from transformers import Trainer, TrainingArguments

    processor, summary, build = prepared
    model = enable_packing(model_for(processor)).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
        remove_unused_columns=False, report_to=[], use_cpu=True, dataloader_num_workers=1, save_strategy="no",
        logging_steps=1,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=ImagePackedDataset(build, summary.image_set),
                      data_collator=collator_for(processor, model))
    result = trainer.train()
    assert np.isfinite(result.training_loss)
    assert any(not torch.equal(before[name], p) for name, p in model.model.visual.named_parameters(prefix="model.visual"))


@pytest.mark.slow
def test_the_processor_directory_is_what_prepare_images_reads_and_never_replaces_a_directory(prepared, tmp_path):
    from prepack.errors import OutputError
    from prepack.model.tiny_vision_models import qwen_processor_directory, tiny_vision_config
    from prepack.sources.images import processor_rule

    processor, _, _ = prepared
    rule, placeholder_id = processor_rule(processor)
    assert placeholder_id == Tokenizer.from_file(str(processor / "tokenizer.json")).token_to_id(QWEN_IMAGE_TOKENS[1])
    config = tiny_vision_config("qwen2_vl")
    assert (rule.patch_size, rule.merge_size) == (config.vision_config.patch_size, config.vision_config.spatial_merge_size)
    existing = tmp_path / "processor"
    existing.mkdir()
    (existing / "mine.txt").write_text("kept")
    with pytest.raises(OutputError, match="exists"):
        qwen_processor_directory(existing, processor, config)
    assert [path.name for path in tmp_path.iterdir()] == ["processor"]
    assert [path.name for path in existing.iterdir()] == ["mine.txt"]


@pytest.mark.slow
def test_the_throughput_callback_counts_what_the_collator_made_in_a_trainer_run(prepared, tmp_path):
    """UsefulThroughputCallback on Qwen2.5-VL image batches ([4, B, L] position ids): each step's logged
    real and trained tokens and padding fraction are those of the batch the collator made for it."""
    from transformers import Trainer, TrainingArguments

    from prepack.formats.shards import IGNORE_INDEX
    from prepack.training.throughput import UsefulThroughputCallback

    processor, summary, build = prepared
    model = enable_packing(model_for(processor)).train()
    collator, made = collator_for(processor, model), []

    def collate(packs):  # in this process (no workers): the batches in the order the steps take them
        batch = collator(packs)
        real, trained = sum(len(pack["input_ids"]) for pack in packs), int((batch["labels"] != IGNORE_INDEX).sum())
        made.append((batch["input_ids"].numel(), real, trained))
        return batch

    arguments = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
        remove_unused_columns=False, report_to=[], use_cpu=True, dataloader_num_workers=0, save_strategy="no",
        logging_steps=1,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=ImagePackedDataset(build, summary.image_set),
                      data_collator=collate, callbacks=[UsefulThroughputCallback()])
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3 and len(made) >= 3
    total = 0
    for entry, (slots, real, trained) in zip(logs, made):
        total += real
        assert entry["real_tokens"] == total
        assert entry["padding_fraction"] == pytest.approx(1 - real / slots, abs=1e-4)
        # Both rates are of the same seconds, each rounded to 0.1.
        assert 0 < trained < real
        assert entry["trained_tokens_per_second"] == pytest.approx(entry["real_tokens_per_second"] * trained / real, abs=0.1)


@pytest.mark.slow
def test_verify_checks_the_image_set_against_the_build(prepared, tmp_path):
    """Clean: exit 0. A build whose documents were truncated through their images: each such pack named,
    and ImagePackedDataset refuses to serve it."""
    processor, summary, build = prepared
    clean = run_prepack("verify", build, "--images", summary.image_set)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    cut = tmp_path / "cut"
    result = run_prepack("build", summary.corpus, "--tokenizer", processor, "--chat", "--max-len", 12,
                         "--overflow", "truncate", "--out", cut)
    assert result.returncode == 0, result.stderr
    found = run_prepack("verify", cut, "--images", summary.image_set)
    assert found.returncode == 1 and "image placeholder tokens; its documents' images make" in found.stdout
    dataset = ImagePackedDataset(cut, summary.image_set)
    with pytest.raises(InputError, match="images were cut"):
        for index in range(len(dataset)):
            dataset[index]


@pytest.mark.slow
def test_inspect_reports_image_and_text_tokens_and_the_padding_saved(prepared):
    processor, summary, build = prepared
    result = run_prepack("inspect", build, "--images", summary.image_set, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    placeholder = read_image_set(summary.image_set).manifest.placeholder_id
    dataset = PackedDataset(build)
    in_packs = sum(int((dataset[i]["input_ids"] == placeholder).sum()) for i in range(len(dataset)))
    images = report["images"]
    assert images["image_tokens"] == in_packs > 0
    assert images["text_tokens"] == report["build"]["tokens"] - in_packs
    cost = report["build"]["cost"]
    assert images["padding_saved_vs_max_len"] == cost["pad_to_max_len"]["padding_tokens"] - cost["packed"]["padding_tokens"] > 0
    text = run_prepack("inspect", build, "--images", summary.image_set)
    assert text.returncode == 0 and f"image tokens: {in_packs:,}" in text.stdout


@pytest.mark.slow
def test_inspect_with_the_image_set_of_another_corpus_is_a_named_error(prepared, tmp_path):
    processor, summary, build = prepared
    other = prepare_image_chat(image_chat_corpus(tmp_path / "corpus", rows=3), processor, tmp_path / "other")
    message = failure(run_prepack("inspect", build, "--images", other.image_set, env=WIDE))
    assert f"{other.image_set / 'images.json'}, column 'documents': describes 3 corpus rows; the build read 12" in message


@pytest.mark.slow
def test_an_index_build_of_a_store_serves_the_same_packs_and_images(prepared, tmp_path):
    """The images are found by corpus row, which an index build's packs keep: no copy of them anywhere."""
    processor, summary, build = prepared
    store, index = tmp_path / "store", tmp_path / "index"
    made = run_prepack("tokenize", summary.corpus, "--tokenizer", processor, "--chat", "--out", store)
    assert made.returncode == 0, made.stderr
    made = run_prepack("build", store, "--index-only", "--max-len", MAX_LEN, "--overflow", "error", "--out", index)
    assert made.returncode == 0, made.stderr
    full, indexed = ImagePackedDataset(build, summary.image_set), ImagePackedDataset(index, summary.image_set)
    assert len(full) == len(indexed)
    for row in range(len(full)):
        assert full[row]["images"] == indexed[row]["images"]
        np.testing.assert_array_equal(full[row]["input_ids"], indexed[row]["input_ids"])
    # inspect --images reads the index build's packs as it reads the full build's.
    reports = [run_prepack("inspect", path, "--images", summary.image_set, "--json") for path in (build, index)]
    assert [r.returncode for r in reports] == [0, 0], [r.stderr for r in reports]
    full_images, index_images = (json.loads(r.stdout)["images"] for r in reports)
    assert index_images == full_images and index_images["image_tokens"] > 0


@pytest.mark.slow
def test_verify_says_what_it_checked_and_decodes_with_decode(prepared, tmp_path):
    """A clean `verify --images` names its counts and whether it decoded; an image whose header and sha256
    are sound but whose pixels are cut off passes without --decode and is found by row with it."""
    from tests.building.test_image_chat import rewrite_images

    processor, summary, build = prepared
    counts = read_image_set(summary.image_set).manifest
    clean = run_prepack("verify", build, "--images", summary.image_set, env=WIDE)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    said = " ".join(clean.stdout.split())
    assert f"{counts.images:,} images" in said and f"{counts.references:,} references" in said
    assert f"{counts.image_tokens:,} placeholder tokens matched pack by pack" in said
    assert "no image decoded (--decode decodes them)" in said
    decoded = run_prepack("verify", build, "--images", summary.image_set, "--decode", env=WIDE)
    assert decoded.returncode == 0 and "every image decoded" in " ".join(decoded.stdout.split())

    forged = shutil.copytree(summary.image_set, tmp_path / "images")
    image_set = read_image_set(forged)
    number = next(n for n in range(counts.images) if image_set.data(n).startswith(b"\x89PNG"))
    cut = image_set.data(number)[: len(image_set.data(number)) // 2]
    rewrite_images(forged, "data", number, cut)
    rewrite_images(forged, "sha256", number, hashlib.sha256(cut).digest())
    assert run_prepack("verify", build, "--images", forged).returncode == 0  # headers only
    found = run_prepack("verify", build, "--images", forged, "--decode", env=WIDE)
    assert found.returncode == 1
    assert f"problem: {forged / 'images.arrow'}, row {number}, column 'data': the image cannot be decoded" in found.stdout
    alone = run_prepack("verify", build, "--decode", env=WIDE)
    assert "--decode decodes the images of an image set" in failure(alone)
