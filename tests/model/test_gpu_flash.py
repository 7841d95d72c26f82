"""The real flash-attn kernels (CUDA, bfloat16) on a tiny random Llama: a packed batch through
`enable_packing` equals its documents run alone, and a binary 2-D mask without it leaks.
Skipped without CUDA or flash-attn 2 (the flash-attn-4 package installs a `flash_attn` namespace too, without
FlashAttention-2: transformers' own check tells them apart)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import is_flash_attn_2_available

from prepack.model.packing import enable_packing
from prepack.model.isolation import measure_isolation, random_packs
from prepack.training.collate import PackedCollator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
    pytest.mark.skipif(
        not is_flash_attn_2_available(), reason="needs flash-attn 2 (pip install 'prepack-llm[flash]')"
    ),
]

MAX_LEN = 256
VOCAB = 512
# bfloat16 has 8 bits of mantissa: the varlen and dense kernels round differently at about 1e-2 here,
# while a leak moves logits by 0.1 or more.
TOLERANCE = 3e-2
LEAK = 1e-1


def tiny_llama():
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        attn_implementation="flash_attention_2",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def test_real_flash_attention_keeps_packed_documents_apart():
    packs = random_packs(4, MAX_LEN, VOCAB, seed=0, labels=True)
    batch = PackedCollator(MAX_LEN)(packs)
    model = tiny_llama()
    mask = PackedCollator(MAX_LEN, layout="indexed_mask")(packs)["attention_mask"].clamp(max=1)
    control = batch | {"attention_mask": mask, "use_cache": False}
    leaky = measure_isolation(model, packs, control, tolerance=LEAK, gradients=False)
    assert leaky.max_logit_diff > LEAK, leaky
    result = measure_isolation(enable_packing(model), packs, batch, tolerance=TOLERANCE)
    assert result.passed, result
