"""What the training examples share: their command line, and the model they train (the one named by
--model, else a tiny random Llama).

The random model is built from a config (nothing is downloaded) with a vocabulary just large enough
for the token ids in the build, so that any build can be fed to it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pyarrow.compute as pc
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from prepack.training.dataset import PackedDataset


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The options every example takes, and those `extra` adds; `description` is the example's docstring,
    shown by --help."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a directory written by `prepack build`")
    parser.add_argument("--model", help="a transformers causal LM name or path (default: tiny random Llama)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--checkpoint", help="loops: save the loader's position here, and resume from it")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    if getattr(args, "accumulation", 1) < 1:  # a window of no batch would never fill
        parser.error("--accumulation must be at least 1")
    return args


def trainer_arguments(args: argparse.Namespace, output_dir: str) -> dict:
    """The TrainingArguments fields the Trainer examples share (TRL's configs take them too): --steps steps
    of --batch-size packs, logged every step, nothing saved or reported, the packs' columns kept for
    `PackedCollator`."""
    return dict(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        remove_unused_columns=False,
        dataloader_num_workers=args.workers,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )


def load_model(name: str | None, dataset: PackedDataset) -> PreTrainedModel:
    if name:
        return AutoModelForCausalLM.from_pretrained(name)
    return tiny_llama(largest_token_id(dataset) + 1, dataset.manifest.options.max_len)


def tiny_llama(vocab_size: int, max_len: int) -> LlamaForCausalLM:
    """The tiny random Llama (seed 0) of `vocab_size` token ids and `max_len` positions."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def largest_token_id(dataset: PackedDataset) -> int:
    """One vectorized pass over the memory-mapped token columns."""
    manifest = dataset.manifest
    return max(
        pc.max(manifest.open_shard(path).column("input_ids").values).as_py()
        for path in dataset.shard_paths
    )


def placeholder_tokenizer() -> PreTrainedTokenizerFast:
    """Two tokens and a pad token: TRL's trainers want a tokenizer object, and nothing in these examples
    tokenizes text (the build did)."""
    vocabulary = {"<pad>": 0, "<unk>": 1}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocabulary, unk_token="<unk>")), pad_token="<pad>", unk_token="<unk>"
    )
