"""Packed image+text batches of a 3-D rotary family (Qwen2.5-VL) on the real flash-attention kernels (CUDA,
bfloat16): flash_attention_2 when flash-attn 2 is installed, flash_attention_4 when flash-attn-4 is. (Qwen-VL has
no flex_attention in transformers.)

The harness of tests/model/test_vision.py (real photographs, VisionCollator packing four samples into two rows,
each sample alone through transformers' own path) on a tiny random model widened to kernel-friendly head sizes.
Each case first runs the leak control: the collated batch without `enable_packing` carries no `cu_seq_lens_*`, so
transformers runs dense attention over each row, and it must differ by more than the bfloat16 tolerance, so the
comparison is shown able to fail on this very kernel. Then, with `enable_packing`, logits and loss must equal the
samples alone within it. Skipped without CUDA or the kernel's package.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText
from transformers.utils import is_flash_attn_2_available, is_flash_attn_4_available

from prepack.model.isolation import default_tolerances
from prepack.model.packing import enable_packing
from prepack.model.tiny_vision_models import tiny_vision_config
from prepack.training.vision_collate import VisionCollator, VisionSpec
from tests.model.test_vision import compare, packs_of, samples
from tests.vision_inputs import image_processor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]

MODEL_TYPE = "qwen2_5_vl"
# Kernel-friendly sizes: the flash kernels take head dims of 16 and more (the tiny model's are 8). The text
# head's 64 dims give 32 rotary pairs, split over time, height and width.
TEXT_SIZES = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [8, 12, 12]})
VISION_SIZES = dict(hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=256)
TOLERANCE, LOSS_TOLERANCE = default_tolerances(torch.bfloat16, "flash_attention_2")

CASES = [
    pytest.param("flash_attention_2", marks=pytest.mark.skipif(
        not is_flash_attn_2_available(), reason="needs flash-attn 2 (pip install 'prepack-llm[flash]')")),
    pytest.param("flash_attention_4", marks=pytest.mark.skipif(
        not is_flash_attn_4_available(), reason="needs the flash-attn-4 package")),
]


def kernel_vision_model(attn: str):
    config = tiny_vision_config(MODEL_TYPE)
    config.text_config.update(TEXT_SIZES)
    config.vision_config.update(VISION_SIZES)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    return model.to("cuda").eval()


@pytest.mark.parametrize("attn", CASES)
def test_packed_image_batch_stays_apart_on_real_flash_kernels(attn):
    model = kernel_vision_model(attn)
    processor = image_processor(MODEL_TYPE)
    made = samples(model, processor)
    packs = packs_of(made)
    width = max(len(pack["input_ids"]) for pack in packs)
    collator = VisionCollator(VisionSpec.of(model.config), processor, max_len=width + 3, pad_token_id=1)
    batch = collator(packs)
    leaked, _, _ = compare(model, collator, made, batch, gradients=False)
    assert leaked > TOLERANCE, f"the leak control did not leak ({leaked}), so the test could not fail"
    enable_packing(model)
    logit_diff, loss_diff, _ = compare(model, collator, made, batch, gradients=False)
    assert logit_diff < TOLERANCE and loss_diff < LOSS_TOLERANCE, (logit_diff, loss_diff)
