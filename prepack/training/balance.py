"""The step cost model and the balanced deal of packs to ranks, where the training API has always offered them.

They live in `prepack.building.balance` (numpy and numba, no torch), which the rollout planner of the building
wing (`prepack.building.rollouts`) shares with `PackedSampler(balance="attention")` and `prepack inspect`.
"""

from prepack.building.balance import (
    DEFAULT_TOKEN_COST,
    MAX_TOKEN_COST,
    WINDOW_STEPS,
    Imbalance,
    balanced_order,
    epoch_imbalance,
    epoch_order,
    imbalance,
    model_token_cost,
    pack_costs,
    step_costs,
    validated_token_cost,
)

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
