"""The attention of the shared-prompt layout (`prepack.training.shared_prompt`), for sdpa, eager and flex_attention.

A batch's `shared_prompt_ids` ([B, L]: parts * group + part, part 0 the prompt, k the k-th completion, parts
its `shared_prompt_parts`, 3 for pairs: 1 chosen, 2 rejected; 0 a row's padding tail) say who sees whom, by one
rule (`_sees`): a token attends to the earlier tokens of its own part and of its group's prompt, never to a
sibling completion or another group (padding, group 0, sees the padding before it, so its row stays finite;
its labels are -100). Two forms of that rule, which transformers takes as given:

- `shared_prompt_mask`: the additive 4-D mask [B, 1, L, L], for sdpa and eager;
- `shared_prompt_block_mask`: flex_attention's `BlockMask`, built with `create_block_mask` from a mask_mod
  over the ids; flex skips every block of scores the rule masks whole (another pair's, the other
  completion's), where sdpa and eager compute the whole row and mask it.

`enable_packing`'s guard builds the backend's form from a batch that carries the ids. Varlen kernels (flash
attention 2/3/4) take one segment per sequence, which a completion that sees its pair's prompt and not the
other completion is not; sliding-window layers would need a mask of their own: those are refused by name.
"""

from __future__ import annotations

from prepack.errors import IsolationError, optional_imports
from prepack.training.shared_prompt import group_parts

with optional_imports("enable_packing"):
    import torch
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

__all__ = ["SHARED_PROMPT_ATTENTION", "require_shared_prompt_support", "shared_prompt_block_mask", "shared_prompt_mask"]

SHARED_PROMPT_ATTENTION = ("sdpa", "eager", "flex_attention")


def require_shared_prompt_support(attn: str | None, config, how: str | None) -> None:
    """Refuse, by name, a backend or family that the shared-prompt mask cannot keep exact."""
    if attn not in SHARED_PROMPT_ATTENTION:
        raise IsolationError(
            f"The shared-prompt layout (shared_prompt_ids) on {attn}: its varlen kernels take one segment per "
            "sequence, and a completion that sees its pair's prompt but not the other completion is no such "
            "segment. Use sdpa, eager or flex_attention, or collate without shared_prompt (the two-sequence layout)."
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


def _sees(query_id: torch.Tensor, key_id: torch.Tensor, query: torch.Tensor, key: torch.Tensor, parts: int) -> torch.Tensor:
    """Whether the query token at `query` (its shared_prompt_id `query_id`) may attend to the key at `key`:
    causal, same group, and the key is the group's prompt or in the query's own part (the same id)."""
    return (key <= query) & (query_id // parts == key_id // parts) & ((key_id % parts == 0) | (query_id == key_id))


def shared_prompt_mask(shared_prompt_ids: torch.Tensor, dtype: torch.dtype, parts: int) -> torch.Tensor:
    """[B, 1, L, L] additive mask in `dtype`: 0 where a query (row) may attend to a key (column), else the
    dtype's minimum (eager adds it to the scores; sdpa takes a float mask the same way)."""
    ids = shared_prompt_ids
    index = torch.arange(ids.shape[-1], device=ids.device)
    allowed = _sees(ids[:, :, None], ids[:, None, :], index[:, None], index[None, :], parts)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def shared_prompt_block_mask(shared_prompt_ids: torch.Tensor, parts: int) -> BlockMask:
    """flex_attention's BlockMask [B, 1, L, L] of the same rule, its mask_mod reading the ids.

    Compiled, as transformers builds its own flex masks, except on a CPU, where compiling it costs more than
    evaluating the rule densely once ([B, L, L] booleans, smaller than sdpa's float mask).
    """
    ids = shared_prompt_ids

    def mask_mod(batch, head, query, key):
        return _sees(ids[batch, query], ids[batch, key], query, key, parts)

    batch, width = ids.shape
    return create_block_mask(mask_mod, batch, None, width, width, device=ids.device, _compile=ids.device.type != "cpu")


def shared_prompt_kwargs(kwargs: dict, config, attn: str | None, how: str | None, dtype: torch.dtype) -> dict:
    """The forward's keyword arguments with `shared_prompt_ids` replaced by its mask (a BlockMask on
    flex_attention, a 4-D tensor in `dtype` on sdpa and eager), or IsolationError."""
    kwargs = dict(kwargs)
    parts = group_parts(kwargs)
    ids = kwargs.pop("shared_prompt_ids")
    kwargs.pop("shared_prompt_parts")
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
    ids = ids.to(tokens.device)
    flex = attn == "flex_attention"
    kwargs["attention_mask"] = shared_prompt_block_mask(ids, parts) if flex else shared_prompt_mask(ids, dtype, parts)
    return kwargs
