"""Pure-torch stand-ins for flash-attn 2/3, FlashAttention-4 and torch's compiled flex_attention, so that
transformers' real flash-attention and flex-attention paths run on CPU.

`flash_attn_varlen_func` has flash-attn 2's signature and semantics: q/k/v as [tokens, heads, dim],
grouped-query k/v not repeated, causal masks aligned bottom-right, `window_size=(left, right)`
inclusive, `softcap`, `dropout_p`. It has the exact signature because transformers reads it to decide
which options to pass. `flash_attn_func` (q/k/v as [batch, tokens, heads, dim]) takes the same options
by keyword, as transformers passes them, and runs each row as one varlen segment. Unlike the kernels
they take float32/float64, which lets the tests compare to 1e-10. A query token outside every
`cu_seqlens` segment gets NaN, standing for the memory a real kernel leaves unwritten.

`fa4_varlen_func` has FlashAttention-4's signature (`flash_attn.cute.flash_attn_varlen_func`, package
flash-attn-4 4.0.0b36), which differs where transformers looks: no `dropout_p`, `window_size` with None
for "unbounded", attention sinks as `learnable_sink` (one logit per head, an extra softmax column with
no value: gpt-oss), `page_table` for `block_table`. It returns (out, None): FA4 returns (out, lse), and
transformers reads the output only.

`use_flash_reference` installs them through a PRIVATE seam of transformers 5.23-5.24,
`modeling_flash_attention_utils._lazy_imports` (where transformers imports flash-attn, or for
"flash_attention_4" `flash_attn.cute`, lazily), and `enable_flash_attention` then switches a model to
"flash_attention_2" (or `_4`) without transformers' package check. `use_flex_reference` makes
transformers' flex path call torch's `flex_attention` and `create_block_mask` uncompiled (PRIVATE seams:
`integrations.flex_attention.compile_friendly_flex_attention` and `masking_utils.create_block_mask`): the
same function, BlockMask and mask_mod, run by torch's unfused implementation, which takes float64 and
costs no compilation per shape (compiled on CPU, flex rejects float64 and compiles for seconds per
model). Uncompiled, torch still traces each call with dynamo (its "eager" backend, traced again whenever
what it guards on changes) only to run the same operator eagerly; `_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`
(a PRIVATE flag of torch) runs that operator directly, to the same bits (tests/model/test_family_sweep.py
checks it) in much less CPU time. torch's flex has no backward on CPU, compiled or not: flex is measured on
logits and loss.
All of this belongs in tests only: prepack itself never patches transformers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F
import transformers.integrations.flex_attention as flex_integration
import transformers.masking_utils as masking_utils
import transformers.modeling_flash_attention_utils as flash_utils
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

__all__ = [
    "enable_flash_attention",
    "fa4_func",
    "fa4_varlen_func",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "use_flash_reference",
    "use_flex_reference",
]


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
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, window_size, causal, softmax_scale, softcap, dropout_p)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, window_size, causal, softmax_scale, softcap, dropout_p, sink=None):
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
    out = _attention(q, k, v, allowed, softmax_scale, softcap, dropout_p, sink)
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


def fa4_varlen_func(
    q,
    k,
    v,
    qv=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    min_seqlen_k=None,
    seqused_q=None,
    seqused_k=None,
    gather_kv_indices=None,
    page_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    learnable_sink=None,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_scalars=None,
    return_lse=False,
    scheduler_metadata=None,
    seqlen_k_per_split=None,
    disable_scheduler_metadata=False,
    gather_bwd_recompute_p=False,
    gather_bwd_token_chunk=None,
):
    unsupported = (qv, seqused_q, seqused_k, gather_kv_indices, page_table, score_mod, mask_mod, block_sparse_tensors)
    if any(option is not None for option in unsupported) or return_lse:
        raise NotImplementedError("the FA4 stand-in has no qv, seqused, gather, paged cache, mods or returned lse")
    window = tuple(-1 if side is None else side for side in window_size)  # FA4's None is flash-attn 2's -1
    out = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, window, causal, softmax_scale, softcap, 0.0, learnable_sink)
    return out, None


def fa4_func(q, k, v, **options):
    """FA4's dense function, as `flash_attn_func` is flash-attn 2's: each row one varlen segment."""
    batch, length_q, length_k = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * length_q
    cu_k = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * length_k
    out, _ = fa4_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **options)
    return out.view(batch, length_q, *out.shape[1:]), None


def _segments(cu_seqlens: torch.Tensor, tokens: int):
    """Per token: its segment (len(cu_seqlens) - 1 when outside all), its index in it; per segment: length."""
    token = torch.arange(tokens, device=cu_seqlens.device)
    segment = torch.searchsorted(cu_seqlens.long(), token, right=True) - 1
    segment = torch.where(token < cu_seqlens[-1], segment, len(cu_seqlens) - 1)
    starts = torch.cat([cu_seqlens[:-1].long(), cu_seqlens[-1:].long()])
    lengths = torch.cat([cu_seqlens.diff().long(), torch.zeros(1, dtype=torch.long, device=cu_seqlens.device)])
    return segment, token - starts[segment], lengths


def _attention(q, k, v, allowed, softmax_scale, softcap, dropout_p, sink=None):
    """Dense attention over all tokens with an allowed[q, k] mask; rows with nothing allowed give 0.

    `sink` (one logit per head, FA4's learnable_sink) is an extra softmax column with no value: it takes
    probability away from every key, as FA4's kernels fold it into the normaliser."""
    repeats = q.shape[1] // k.shape[1]  # grouped-query attention: each k/v head serves `repeats` q heads
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        sinks = sink.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
        probabilities = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        probabilities = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if dropout_p:
        probabilities = F.dropout(probabilities, p=dropout_p)
    return torch.einsum("hqk,khd->qhd", probabilities, v)


@pytest.fixture
def use_flash_reference(monkeypatch):
    """Make transformers' flash-attention path call the stand-in for the length of a test."""

    def lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        padding = flash_utils._pad_input, flash_utils._unpad_input
        if implementation == "flash_attention_4":
            return fa4_func, fa4_varlen_func, None, *padding  # FA4 has no kv-cache function either
        return flash_attn_func, flash_attn_varlen_func, None, *padding

    monkeypatch.setattr(flash_utils, "_lazy_imports", lazy_imports)
    # Forget any implementation loaded before, so that the next call goes through `lazy_imports`.
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)


@pytest.fixture
def use_flex_reference(monkeypatch):
    """Make transformers' flex path run torch's flex_attention and create_block_mask uncompiled, untraced."""

    def uncompiled_flex_attention(query, key, value, training=False, **options):
        return flex_attention(query, key, value, **options)

    def uncompiled_block_mask(*args, _compile=False, **options):
        return create_block_mask(*args, _compile=False, **options)

    monkeypatch.setattr(flex_integration, "compile_friendly_flex_attention", uncompiled_flex_attention)
    monkeypatch.setattr(masking_utils, "create_block_mask", uncompiled_block_mask)
    monkeypatch.setattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)


def enable_flash_attention(model, implementation: str = "flash_attention_2"):
    """Switch a built model to a flash implementation (the setter reaches text and vision sub-configs)."""
    model.config._attn_implementation = implementation
    return model
