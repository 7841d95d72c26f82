"""prepack's collated batch through `enable_packing` on real CUDA attention kernels, in bfloat16: FlashAttention-4
(when the flash-attn-4 package is installed), torch's flex attention, sdpa and eager.

For each family (full attention, sliding windows, attention sinks) a tiny random model built from its config
runs a packed batch, and each document's logits must equal the document run alone within a bfloat16 tolerance.
Each case first runs a leak control: the same batch with a plain 0/1 `attention_mask` and no `enable_packing`,
which lets the documents of a row attend to each other and must differ by more than that tolerance, so the
comparison is shown able to fail on this very kernel. Skipped without CUDA; a (family, backend) pair that
prepack's table refuses is skipped with the refusal's reason, except the pairs measured isolating on an H200
(shared notes: FA4 on every family here, flex on Qwen3), where a refusal fails.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import is_flash_attn_4_available

from prepack.model.packing import enable_packing
from prepack.training.collate import PackedCollator
from prepack.errors import IsolationError
from prepack.model.isolation import default_tolerances, measure_isolation, random_packs
from tests.tiny_models import DOCUMENT_VOCAB, tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]

MAX_LEN = 128
# Kernel-friendly sizes: FA4 and flex take head dims of 16 and more (tiny_config's are 8). Windows stay
# tiny_config's (6 tokens), shorter than the documents, so that they are exercised.
KERNEL_SIZES = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
FAMILIES = ("qwen3", "llama", "mistral", "gemma3_text", "gpt_oss")  # full, full, sliding, mixed, sinks + sliding
# flex compiles a kernel for each new shape (every document alone is one): two families keep it within minutes.
FLEX_FAMILIES = ("qwen3", "gemma3_text")
UNBUILDABLE = {("sdpa", "gpt_oss")}  # transformers has no sdpa path for GPT-OSS's attention sinks
MEASURED_ISOLATED = {("flash_attention_4", family) for family in FAMILIES} | {("flex_attention", "qwen3")}
TOLERANCE, _ = default_tolerances(torch.bfloat16, "sdpa")

CASES = [
    pytest.param(
        attn, family, id=f"{attn}-{family}",
        marks=[pytest.mark.skipif(not is_flash_attn_4_available(), reason="needs the flash-attn-4 package")]
        if attn == "flash_attention_4" else [],
    )
    for attn in ("flash_attention_4", "flex_attention", "sdpa", "eager")
    for family in (FLEX_FAMILIES if attn == "flex_attention" else FAMILIES)
    if (attn, family) not in UNBUILDABLE
]


def kernel_model(model_type: str, attn: str) -> torch.nn.Module:
    config = tiny_config(model_type)
    config.update(KERNEL_SIZES)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    return model.to("cuda").eval()


@pytest.mark.parametrize(("attn", "family"), CASES)
def test_packed_documents_stay_apart_on_cuda_kernels(attn, family):
    packs = random_packs(3, MAX_LEN, DOCUMENT_VOCAB, seed=0, labels=True)
    batch = PackedCollator(MAX_LEN)(packs)
    model = kernel_model(family, attn)
    binary_mask = PackedCollator(MAX_LEN, layout="indexed_mask")(packs)["attention_mask"].clamp(max=1)
    control = batch | {"attention_mask": binary_mask, "use_cache": False}
    leaky = measure_isolation(model, packs, control, tolerance=TOLERANCE, gradients=False)
    assert leaky.max_logit_diff > TOLERANCE, f"the leak control did not leak, so the test could not fail: {leaky}"
    try:
        enable_packing(model)
    except IsolationError as refused:
        if (attn, family) in MEASURED_ISOLATED:
            raise
        pytest.skip(f"prepack refuses {family} on {attn}: {refused}")
    result = measure_isolation(model, packs, batch, tolerance=TOLERANCE, gradients=False)
    assert result.passed, result
