"""Image+text data path, per DataLoader worker: prepack's packed batches against on-the-fly processing.

    python benchmarks/bench_vision_collate.py --samples 400 --repeats 3

The corpus: --samples chats of 0-2 images each, matplotlib's sample photographs (a 512x600 JPEG, a
128x128 PNG, a 542x130 PNG), prepared (`prepare_image_chat`) and built at max_len 2048 with GPT-2's BPE
plus the Qwen image tokens; Qwen2-VL's image processor at its published sizes (56²-28²·1280 pixels,
14-pixel patches merged 2x2). Both methods run in this process (one worker), on the same samples, in the
same groups (the documents of 4 packs a batch), after one warm-up pass:

- `prepack`: `ImagePackedDataset` + `VisionCollator`: each pack's image bytes from the image set, decoded,
  preprocessed by transformers' PIL image processor, 3-D rotary positions computed; tokens come tokenized.
- `on the fly`: what TRL's `DataCollatorForVisionLanguageModeling` does per batch (its own class cannot be
  built here: transformers' Qwen processor needs a video processor, which needs torchvision): the chat
  template rendered and tokenized by transformers' fast tokenizer with the image placeholders expanded
  from the image grid, each image read from its file, decoded and preprocessed by the same image processor,
  the rows padded.

Prints a markdown table: samples/s and images/s per worker (median of --repeats), and the ratio; then
what `prepack inspect --images` reports on the build: image and text tokens, and the padding saved.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MAX_LEN = 2048
PACKS_PER_BATCH = 4
PUBLISHED_PIXELS = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}  # Qwen2-VL's defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from prepack.sources.images import prepare_image_chat
    from prepack.training.vision_collate import VisionCollator, VisionSpec
    from prepack.training.vision_dataset import ImagePackedDataset
    from tests.cli import run_prepack
    from tests.demo_inputs import CHATML
    from tests.train.test_vision_end_to_end import image_chat_corpus
    from tests.vision_inputs import QWEN_IMAGE_TOKENS, processor_directory

    torch.set_num_threads(1)  # one worker's share
    root = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    processor = processor_directory(root / "processor", PUBLISHED_PIXELS)
    corpus = image_chat_corpus(root / "corpus", args.samples)
    summary = prepare_image_chat(corpus, processor, root / "prepared")
    result = run_prepack("build", summary.corpus, "--tokenizer", processor, "--chat", "--max-len", MAX_LEN,
                         "--overflow", "error", "--out", root / "build")
    assert result.returncode == 0, result.stderr
    dataset = ImagePackedDataset(root / "build", summary.image_set)
    image_id = Tokenizer.from_file(str(processor / "tokenizer.json")).token_to_id(QWEN_IMAGE_TOKENS[1])

    class Config:  # what VisionSpec.of reads of a Qwen2.5-VL config
        model_type, image_token_id = "qwen2_5_vl", image_id

        class vision_config:
            spatial_merge_size = 2

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(processor)
    collator = VisionCollator(VisionSpec.of(Config), image_processor, max_len=MAX_LEN, pad_token_id=50256)
    batches = [list(range(i, min(i + PACKS_PER_BATCH, len(dataset)))) for i in range(0, len(dataset), PACKS_PER_BATCH)]

    # The same samples for the on-the-fly path: each pack's corpus rows, as the corpus holds them.
    records = [json.loads(line) for line in corpus.read_text().splitlines()]
    rows = [[int(r) for index in batch for r in dataset.packs.source_rows(index)] for batch in batches]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(processor / "tokenizer.json"), pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML

    def prepack_pass() -> tuple[int, int]:
        samples = images = 0
        for batch in batches:
            out = collator([dataset[index] for index in batch])
            samples += sum(len(dataset.packs.source_rows(index)) for index in batch)
            images += 0 if "image_grid_thw" not in out else len(out["image_grid_thw"])
        return samples, images

    def on_the_fly_pass() -> tuple[int, int]:
        from PIL import Image

        samples = images = 0
        for group in rows:
            texts, pictures = [], []
            for row in group:
                record = records[row]
                paths = record.get("images") or [
                    item["image"] for m in record["messages"] if isinstance(m["content"], list)
                    for item in m["content"] if item["type"] == "image"
                ]
                pictures += [Image.open(corpus.parent / path).convert("RGB") for path in paths]
                messages = [
                    {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                     "".join("<image>" if i["type"] == "image" else i["text"] for i in m["content"])}
                    for m in record["messages"]
                ]
                texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
            # As Qwen's processor does: the images once, then each <image> expanded by its grid, then tokens.
            processed = image_processor(images=pictures, return_tensors="pt") if pictures else {}
            grids = iter(processed["image_grid_thw"].tolist() if pictures else [])
            start, pad, end = QWEN_IMAGE_TOKENS
            expanded = [
                re.sub("<image>", lambda _: start + pad * (int(np.prod(next(grids))) // 4) + end, text) for text in texts
            ]
            batch = tokenizer(expanded, padding=True, return_tensors="pt", add_special_tokens=False) | processed
            assert batch["input_ids"].shape[0] == len(group)
            samples += len(group)
            images += len(pictures)
        return samples, images

    results = {}
    for name, run in (("prepack", prepack_pass), ("on the fly", on_the_fly_pass)):
        run()  # warm-up
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            samples, images = run()
            times.append(time.perf_counter() - began)
        results[name] = (samples, images, statistics.median(times))
    assert results["prepack"][:2] == results["on the fly"][:2], results  # the same samples and images

    from prepack.check.images import image_report
    from prepack.check.report import inspect_build

    report = image_report(root / "build", summary.image_set, inspect_build(root / "build", batch_size=8))
    print(f"{platform.processor() or platform.machine()}, python {platform.python_version()}, torch threads 1, "
          f"{args.samples} samples, {len(dataset)} packs of max_len {MAX_LEN}, {len(batches)} batches")
    print()
    print("| method | samples | images | median s | samples/s | images/s | × on the fly |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = results["on the fly"][2]
    for name, (samples, images, seconds) in results.items():
        print(f"| {name} | {samples} | {images} | {seconds:.3f} | {samples / seconds:,.0f} | {images / seconds:,.0f} "
              f"| {base / seconds:.2f} |")
    print()
    for name, value in report.model_dump().items():
        print(f"- {name.replace('_', ' ')}: {value:,.3f}" if isinstance(value, float) else f"- {name.replace('_', ' ')}: {value:,}")


if __name__ == "__main__":
    main()
