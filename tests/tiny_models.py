"""The tiny random models of `prepack.model.tiny_models`, with the flash implementations switched in on CPU.

A flash implementation (flash_attention_2/4) is built on eager and switched (`tests/flash_reference.py`):
transformers checks the package when a model is built with it, and the tests run it with a stand-in.
"""

from __future__ import annotations

import torch
import transformers

from prepack.model import tiny_models
from prepack.model.tiny_models import CAUSAL_LM_TYPES, DOCUMENT_VOCAB, VOCAB, WINDOW, tiny_config
from tests.flash_reference import enable_flash_attention

__all__ = ["CAUSAL_LM_TYPES", "DOCUMENT_VOCAB", "VOCAB", "WINDOW", "tiny_config", "tiny_model"]


def tiny_model(model_type: str, attn: str, dtype: torch.dtype = torch.float64) -> transformers.PreTrainedModel:
    """`prepack.model.tiny_models.tiny_model`; a flash implementation builds on eager and switches (flash_reference)."""
    if not attn.startswith("flash_attention"):
        return tiny_models.tiny_model(model_type, attn, dtype)
    return enable_flash_attention(tiny_models.tiny_model(model_type, "eager", dtype), attn)
