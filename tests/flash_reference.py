"""A pure-torch stand-in for flash-attn, so that transformers' real flash-attention path runs on CPU.

`flash_attn_varlen_func` has flash-attn 2's signature and semantics: q/k/v as [tokens, heads, dim],
grouped-query k/v not repeated, causal masks aligned bottom-right, `window_size=(left, right)`
inclusive, `softcap`, `dropout_p`. It has the exact signature because transformers reads it to decide
which options to pass. `flash_attn_func` (q/k/v as [batch, tokens, heads, dim]) takes the same options
by keyword, as transformers passes them, and runs each row as one varlen segment. Unlike the kernels
they take float32/float64, which lets the tests compare to 1e-10. A query token outside every
`cu_seqlens` segment gets NaN, standing for the memory a real kernel leaves unwritten.

`use_flash_reference` installs them through a PRIVATE seam of transformers 5.23,
`modeling_flash_attention_utils._lazy_imports` (where transformers imports flash-attn lazily), and
`enable_flash_attention` then switches a model to "flash_attention_2" without transformers' package
check. Both belong in tests only: prepack itself never patches transformers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers.modeling_flash_attention_utils as flash_utils

__all__ = ["enable_flash_attention", "flash_attn_func", "flash_attn_varlen_func", "use_flash_reference"]


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    if alibi_slopes is not None or block_table is not None or return_attn_probs:
        raise NotImplementedError("the flash-attn stand-in has no alibi, paged cache or returned probabilities")
    segment_q, position_q, length_q = _segments(cu_seqlens_q, q.shape[0])
    segment_k, position_k, length_k = _segments(cu_seqlens_k, k.shape[0])
    # Bottom-right alignment: the last query of a segment sits at its last key.
    diagonal = position_q[:, None] + (length_k[segment_q] - length_q[segment_q])[:, None]
    allowed = segment_q[:, None] == segment_k[None, :]
    left, right = window_size
    if causal:
        right = 0  # as flash-attn does: causal overrides the right window
    if right >= 0:
        allowed &= position_k[None, :] <= diagonal + right
    if left >= 0:
        allowed &= position_k[None, :] >= diagonal - left
    out = _attention(q, k, v, allowed, softmax_scale, softcap, dropout_p)
    covered = segment_q < len(cu_seqlens_q) - 1
    return torch.where(covered[:, None, None], out, torch.nan).contiguous()  # as a kernel returns it


def flash_attn_func(q, k, v, **options):
    """flash-attn's dense function: options as flash_attn_varlen_func's (transformers reads only that
    signature, and passes them by keyword)."""
    batch, length_q, length_k = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * length_q
    cu_k = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * length_k
    out = flash_attn_varlen_func(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, length_q, length_k, **options
    )
    return out.view(batch, length_q, *out.shape[1:])


def _segments(cu_seqlens: torch.Tensor, tokens: int):
    """Per token: its segment (len(cu_seqlens) - 1 when outside all), its index in it; per segment: length."""
    token = torch.arange(tokens, device=cu_seqlens.device)
    segment = torch.searchsorted(cu_seqlens.long(), token, right=True) - 1
    segment = torch.where(token < cu_seqlens[-1], segment, len(cu_seqlens) - 1)
    starts = torch.cat([cu_seqlens[:-1].long(), cu_seqlens[-1:].long()])
    lengths = torch.cat([cu_seqlens.diff().long(), torch.zeros(1, dtype=torch.long, device=cu_seqlens.device)])
    return segment, token - starts[segment], lengths


def _attention(q, k, v, allowed, softmax_scale, softcap, dropout_p):
    """Dense attention over all tokens with an allowed[q, k] mask; rows with nothing allowed give 0."""
    repeats = q.shape[1] // k.shape[1]  # grouped-query attention: each k/v head serves `repeats` q heads
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if dropout_p:
        probabilities = F.dropout(probabilities, p=dropout_p)
    return torch.einsum("hqk,khd->qhd", probabilities, v)


@pytest.fixture
def use_flash_reference(monkeypatch):
    """Make transformers' flash-attention path call the stand-in for the length of a test."""

    def lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        return flash_attn_func, flash_attn_varlen_func, None, flash_utils._pad_input, flash_utils._unpad_input

    monkeypatch.setattr(flash_utils, "_lazy_imports", lazy_imports)
    # Forget any implementation loaded before, so that the next call goes through `lazy_imports`.
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)


def enable_flash_attention(model):
    """Switch a built model to "flash_attention_2" (the setter reaches text and vision sub-configs)."""
    model.config._attn_implementation = "flash_attention_2"
    return model
