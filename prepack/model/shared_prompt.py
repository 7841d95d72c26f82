"""The attention of the shared-prompt layout (`prepack.training.shared_prompt`), for sdpa and eager.

`shared_prompt_mask` turns a batch's `shared_prompt_ids` ([B, L]: 3 * pair + part, part 0 prompt, 1 chosen,
2 rejected; 0 a row's padding tail) into the additive 4-D mask [B, 1, L, L] that transformers' sdpa and eager
paths take as given: a token attends to the earlier tokens of its own part and of its pair's prompt, never to
the other completion or another pair. `enable_packing`'s guard builds it from a batch that carries the ids;
varlen kernels (flash attention 2/3/4) and flex_attention's block mask from position_ids cannot express it,
and sliding-window layers would need a mask of their own: those are refused by name.
"""

from __future__ import annotations

from prepack.errors import IsolationError, optional_imports

with optional_imports("enable_packing"):
    import torch

__all__ = ["SHARED_PROMPT_ATTENTION", "require_shared_prompt_support", "shared_prompt_mask"]

SHARED_PROMPT_ATTENTION = ("sdpa", "eager")
_PARTS = 3


def require_shared_prompt_support(attn: str | None, config, how: str | None) -> None:
    """Refuse, by name, a backend or family that the shared-prompt mask cannot keep exact."""
    if attn not in SHARED_PROMPT_ATTENTION:
        raise IsolationError(
            f"The shared-prompt layout (shared_prompt_ids) on {attn}: its varlen kernels take one segment per "
            "sequence, and a completion that sees its pair's prompt but not the other completion is no such "
            "segment. Use sdpa or eager, or collate without shared_prompt (the two-sequence layout)."
        )
    layer_types = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in layer_types or (not layer_types and getattr(config, "sliding_window", None) is not None):
        raise IsolationError(
            f"The shared-prompt layout on a {config.model_type} model with sliding-window layers: one 4-D mask "
            "would be applied to every layer. Collate without shared_prompt (the two-sequence layout)."
        )
    if how is not None or any(kind not in ("full_attention", "attention") for kind in layer_types):
        raise IsolationError(
            f"The shared-prompt layout on {config.model_type}: its layers are isolated by "
            f"{how or 'layers other than full attention'}, not by one causal mask. Collate without shared_prompt."
        )


def shared_prompt_mask(shared_prompt_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, L, L] additive mask in `dtype`: 0 where a query (row) may attend to a key (column), else the
    dtype's minimum (eager adds it to the scores; sdpa takes a float mask the same way)."""
    ids = shared_prompt_ids
    pair, part = ids // _PARTS, ids % _PARTS
    width = ids.shape[-1]
    causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
    same_pair = pair[:, :, None] == pair[:, None, :]
    visible_part = (part[:, None, :] == 0) | (part[:, :, None] == part[:, None, :])
    allowed = causal & same_pair & visible_part
    mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def shared_prompt_kwargs(kwargs: dict, config, attn: str | None, how: str | None, dtype: torch.dtype) -> dict:
    """The forward's keyword arguments with `shared_prompt_ids` replaced by its mask, or IsolationError."""
    kwargs = dict(kwargs)
    ids = kwargs.pop("shared_prompt_ids")
    require_shared_prompt_support(attn, config, how)
    given = [key for key in ("attention_mask", "cu_seq_lens_q", "cu_seq_lens_k") if kwargs.get(key) is not None]
    tokens = kwargs.get("input_ids")
    tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
    if given or kwargs.get("position_ids") is None or ids.shape != tokens.shape[:2]:
        raise IsolationError(
            f"A shared-prompt batch takes position_ids and shared_prompt_ids of its tokens' shape "
            f"{tuple(tokens.shape[:2])} and no other description of its documents (given: {given or 'none'}): "
            "pass PackedCollator(shared_prompt=True)'s batch as it is."
        )
    kwargs["attention_mask"] = shared_prompt_mask(ids.to(tokens.device), dtype)
    return kwargs
