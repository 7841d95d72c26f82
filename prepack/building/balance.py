"""Which packs train together: the cost model of a step and the assignment that evens it out.

In synchronous data parallel every step waits for its slowest rank, and packs of equal token count
cost different amounts: attention grows with the square of each document's length. A pack's cost is

    cost = Σ over its documents of l²  +  token_cost × its tokens

in units of one attention token pair (up to a constant). Training FLOPs of a decoder with N
(non-embedding) parameters, L layers and attention width w (heads × head_dim, which is the hidden size
d in most models): the linear layers cost 6·N per token; causal attention scores and values cost 4·w
FLOPs per token pair per layer forward, ×3 with the backward pass, over l²/2 pairs: 6·L·w·l². Dividing
by 6·L·w, `token_cost = N / (L·w)`, which is about 12·d for the usual N ≈ 12·L·d² and w = d.
`DEFAULT_TOKEN_COST` is 12 × 4096 = 49,152, a 7–8B model (Llama-3-8B: N ≈ 7.0e9, L = 32, w = d = 4096
gives 53,000); 0 balances attention alone. Pass your model's value: `model_token_cost(config)` reads it
from a transformers config.
`token_cost` must be finite and at most `MAX_TOKEN_COST` (1e15, far above any model's N / (L·w), and
low enough that every sum of costs stays finite in float64): a NaN or infinite cost would order
nothing and turn every figure of `prepack inspect` into NaN.

`balanced_order` regroups an order of packs, only within windows of `WINDOW_STEPS` consecutive steps,
so that dealt round-robin to R ranks in micro-batches of B (as `PackedSampler` deals), every step's
ranks carry costs as equal as possible: the window's packs sorted by cost, cut into consecutive groups
of B·R (packs of similar cost), each group one step, spread over the ranks longest-processing-time
first in B rounds (each round's heaviest pack to the lightest rank so far, one pack per rank a round). The window's steps are then put in a seeded
random order, so no order by length appears, even within a window.

This module is numpy and numba only (numba imported by the first of its kernels that runs): `prepack inspect`
and the rollout planner (`prepack.building.rollouts`) use it without torch, and so does
`PackedSampler(balance="attention")` of the training API.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from prepack.building.kernels import kernel
from prepack.errors import UsageError

__all__ = [
    "DEFAULT_TOKEN_COST",
    "MAX_TOKEN_COST",
    "WINDOW_STEPS",
    "Imbalance",
    "balanced_order",
    "epoch_imbalance",
    "epoch_order",
    "imbalance",
    "model_token_cost",
    "pack_costs",
    "step_costs",
    "validated_token_cost",
]

DEFAULT_TOKEN_COST = 12 * 4096  # N / (L·w) of a 7-8B decoder, w = d there (module docstring)
MAX_TOKEN_COST = 1e15  # costs of packs up to 2**31 tokens, summed over any epoch, stay finite (docstring)
WINDOW_STEPS = 64  # packs move only within this many consecutive steps


def validated_token_cost(token_cost: object) -> float:
    """`token_cost` as a float, or UsageError (a ValueError) unless it is a real number in
    [0, MAX_TOKEN_COST] (no NaN, no infinity, no bool)."""
    if isinstance(token_cost, bool) or not isinstance(token_cost, (int, float, np.integer, np.floating)):
        raise UsageError(f"token_cost must be a number, not {token_cost!r}")
    if not 0 <= token_cost <= MAX_TOKEN_COST:  # False for NaN too
        raise UsageError(f"token_cost must be finite, in [0, {MAX_TOKEN_COST:g}], got {token_cost!r}")
    return float(token_cost)


def model_token_cost(config: object) -> float:
    """`token_cost` = N / (L·w) of a decoder from its transformers config (or its `text_config`), averaged
    over its layers. Per layer, the attention projections: q and o of heads × head_dim, k and v of key-value
    heads × head_dim, each by the hidden size d; with multi-head latent attention (DeepSeek-V2/V3: a
    `kv_lora_rank`), q through its low rank `q_lora_rank` where there is one, k and v through `kv_lora_rank`
    (+ the shared rotary key), o from heads × `v_head_dim`. Then a gated MLP of three d × width matrices: in a
    mixture of experts a token goes through `num_experts_per_tok` routed experts, each `moe_intermediate_size`
    wide (Qwen-MoE, DeepSeek) or, without it, `intermediate_size` (Mixtral), and shared experts of
    `shared_expert_intermediate_size` (Qwen2-MoE) or `n_shared_experts` × `moe_intermediate_size` (DeepSeek);
    DeepSeek's first `first_k_dense_replace` layers are dense, `intermediate_size` wide. w is heads × head_dim
    (DeepSeek: heads × the mean of the query-key and value head dims). Reads attributes only, so needs no torch."""
    config = getattr(config, "text_config", None) or config
    try:
        d, heads = int(config.hidden_size), int(config.num_attention_heads)
        if getattr(config, "kv_lora_rank", None):  # multi-head latent attention
            nope, rope, v = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim), int(config.v_head_dim)
            kv_rank, q_rank = int(config.kv_lora_rank), int(getattr(config, "q_lora_rank", None) or 0)
            query = d * q_rank + q_rank * heads * (nope + rope) if q_rank else d * heads * (nope + rope)
            # k and v down to the latent (+ the shared rotary key), up per head; o from the values
            attention = query + d * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * d
            width_of_attention = heads * (nope + rope + v) / 2
        else:
            head_dim = int(getattr(config, "head_dim", None) or d // heads)
            kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
            attention = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim
            width_of_attention = heads * head_dim
        experts = getattr(config, "num_experts_per_tok", None)
        expert = getattr(config, "moe_intermediate_size", None) if experts else None
        width = int(expert or config.intermediate_size) * int(experts or 1)
        width += int(getattr(config, "shared_expert_intermediate_size", None) or 0)
        width += int(getattr(config, "n_shared_experts", None) or 0) * int(expert or 0)
        dense = int(getattr(config, "first_k_dense_replace", None) or 0) if experts else 0
        if dense:  # the mean MLP width over the layers, the first `dense` of them dense
            layers = int(config.num_hidden_layers)
            width = (dense * int(config.intermediate_size) + (layers - dense) * width) / layers
    except AttributeError as exc:
        raise UsageError(f"model_token_cost reads a decoder's config, and this one has no {exc.name!r}") from None
    return validated_token_cost((attention + 3 * d * width) / width_of_attention)


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's order of all packs before any balancing: a permutation drawn from (seed, epoch)."""
    if not shuffle:
        return np.arange(size)
    return np.random.default_rng([seed, epoch]).permutation(size)


def pack_costs(documents: np.ndarray, lengths: np.ndarray, token_cost: float) -> np.ndarray:
    """float64 cost of each pack (module docstring): `documents` its number of documents (at least 1),
    `lengths` every document's length in pack order (`np.diff` of each pack's `cu_seqlens`)."""
    token_cost = validated_token_cost(token_cost)
    if len(documents) == 0:
        return np.empty(0, np.float64)
    if np.min(documents) < 1 or np.sum(documents) != len(lengths):
        raise UsageError("every pack needs at least one document, and the lengths must be theirs")
    return _pack_costs(np.asarray(documents), np.asarray(lengths), token_cost)


@kernel(cache=True)
def _pack_costs(documents, lengths, token_cost):
    # One pass, no temporaries (at 10M packs, numpy's would be GBs); Σ l² <= max_len² < 2**53 is exact.
    costs = np.empty(len(documents), np.float64)
    document = 0
    for pack in range(len(documents)):
        total = 0.0
        for _ in range(documents[pack]):
            length = float(lengths[document])
            total += length * (length + token_cost)
            document += 1
        costs[pack] = total
    return costs


def balanced_order(
    order: np.ndarray, costs: np.ndarray, world_size: int, batch_size: int, seed: list[int]
) -> np.ndarray:
    """`order` (a multiple of `world_size` long) with its packs regrouped within windows of
    `WINDOW_STEPS` steps so that each step's ranks get equal costs when position i goes to rank
    i % world_size and each rank's consecutive `batch_size` indices form a step (module docstring).

    Step s is positions [s·B·R, (s + 1)·B·R); a last step with fewer packs gives each rank as many.
    `seed` draws the order of the steps within each window; the result is a function of the inputs.
    """
    if world_size < 1 or batch_size < 1:
        raise UsageError(f"world_size and batch_size must be at least 1, got {world_size} and {batch_size}")
    if len(order) % world_size:
        raise UsageError(f"{len(order)} packs cannot be dealt evenly to {world_size} ranks")
    order = np.ascontiguousarray(order, dtype=np.int64)
    full_steps = len(order) // (world_size * batch_size)
    # Each window's full steps in a random order: sort random keys within each window.
    keys = np.random.default_rng(seed).random(full_steps)
    step_order = np.lexsort((keys, np.arange(full_steps) // WINDOW_STEPS)) % WINDOW_STEPS
    return _balance_windows(order, np.ascontiguousarray(costs, dtype=np.float64), world_size, batch_size, step_order)


@kernel(cache=True)
def _balance_windows(order, costs, world_size, batch_size, step_order):
    step_packs = world_size * batch_size
    window_packs = WINDOW_STEPS * step_packs
    balanced = np.empty_like(order)
    loads = np.empty(world_size, np.float64)
    steps_before = 0  # full steps of the earlier windows
    for window_start in range(0, len(order), window_packs):
        window = order[window_start : window_start + window_packs]
        heaviest_first = window[np.argsort(-costs[window], kind="mergesort")]
        full_steps = len(window) // step_packs
        for group_start in range(0, len(window), step_packs):
            group = heaviest_first[group_start : group_start + step_packs]
            per_rank = len(group) // world_size
            group_number = group_start // step_packs
            # A partial step (the epoch's last) stays last; full ones take the window's drawn order.
            step = step_order[steps_before + group_number] if group_number < full_steps else group_number
            step_start = window_start + step * step_packs
            loads[:] = 0.0
            # Round j gives every rank its j-th pack: the round's heaviest to the lightest rank so far.
            for round_number in range(per_rank):
                lightest_first = np.argsort(loads, kind="mergesort")
                for i in range(world_size):
                    pack = group[round_number * world_size + i]
                    rank = lightest_first[i]
                    balanced[step_start + round_number * world_size + rank] = pack
                    loads[rank] += costs[pack]
        steps_before += full_steps
    return balanced


def step_costs(order: np.ndarray, costs: np.ndarray, world_size: int, batch_size: int) -> np.ndarray:
    """[steps, world_size] cost of each rank's micro-batch in each full step of `order` dealt round-robin."""
    steps = len(order) // (world_size * batch_size)
    dealt = costs[order[: steps * world_size * batch_size]]
    return dealt.reshape(steps, batch_size, world_size).sum(axis=1)


class Imbalance(NamedTuple):
    """How unequal the ranks' work is, over the steps of an epoch."""

    max_over_mean: float  # mean over steps of (slowest rank's cost / mean rank cost); 1 is perfect
    waiting_share: float  # share of step time lost to waiting: Σ(max − mean) / Σ max over steps


def imbalance(per_step: np.ndarray) -> Imbalance:
    """`Imbalance` of `step_costs`' output, step time taken proportional to the slowest rank's cost."""
    if len(per_step) == 0:
        return Imbalance(1.0, 0.0)
    slowest, mean = per_step.max(axis=1), per_step.mean(axis=1)
    return Imbalance(float((slowest / mean).mean()), float(1 - mean.sum() / slowest.sum()))


def epoch_imbalance(
    costs: np.ndarray, world_size: int, batch_size: int, seed: int, epoch: int = 0
) -> tuple[Imbalance, Imbalance]:
    """(unbalanced, balanced) `Imbalance` of the steps `PackedSampler(drop_last=True)` deals in `epoch`:
    its shuffled order, and the same order as `balance="attention"` regroups it."""
    order = epoch_order(len(costs), seed, epoch)
    order = order[: len(order) - len(order) % world_size]
    balanced = balanced_order(order, costs, world_size, batch_size, [seed, epoch, 0])
    return (
        imbalance(step_costs(order, costs, world_size, batch_size)),
        imbalance(step_costs(balanced, costs, world_size, batch_size)),
    )
