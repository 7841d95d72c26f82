"""The model the training examples train: the one named by --model, else a tiny random Llama.

The random model is built from a config (nothing is downloaded) with a vocabulary just large enough
for the token ids in the build, so that any build can be fed to it.
"""

from __future__ import annotations

import pyarrow.compute as pc
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from prepack.format import open_shard
from prepack.load import PackedDataset


def load_model(name: str | None, dataset: PackedDataset) -> PreTrainedModel:
    if name:
        return AutoModelForCausalLM.from_pretrained(name)
    config = LlamaConfig(
        vocab_size=largest_token_id(dataset) + 1,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=dataset.manifest.options.max_len,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def largest_token_id(dataset: PackedDataset) -> int:
    """One vectorized pass over the memory-mapped token columns."""
    has_labels = dataset.manifest.has_labels
    return max(pc.max(open_shard(path, has_labels).column("input_ids").values).as_py() for path in dataset.shard_paths)
