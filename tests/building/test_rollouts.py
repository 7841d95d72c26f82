"""The rollout planner (prepack.building.rollouts): every sequence in exactly one micro-batch, no micro-batch over
its caps, groups whole, the same plan wherever it is computed, and results unpacked to the caller's order."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from prepack.building.balance import imbalance, model_token_cost, pack_costs
from prepack.building.rollouts import plan_rollouts
from prepack.errors import PrepackError, SequenceTooLongError, UsageError


@st.composite
def rollouts(draw):
    lengths = draw(st.lists(st.integers(1, 64), min_size=1, max_size=60))
    grouped = draw(st.booleans())
    sizes = None
    if grouped:
        sizes, left = [], len(lengths)
        while left:
            sizes.append(draw(st.integers(1, min(left, 5))))
            left -= sizes[-1]
    options = {
        "max_len": draw(st.integers(64, 200)),
        "world_size": draw(st.integers(1, 4)),
        "max_documents": draw(st.none() | st.integers(5, 8)),
        "cost": draw(st.sampled_from(["tokens", "attention"])),
        "token_cost": draw(st.sampled_from([0.0, 7.0, 49152.0])),
    }
    return np.array(lengths), sizes, options


def planned(lengths, sizes, options):
    items = len(lengths) if sizes is None else len(sizes)
    try:
        return plan_rollouts(lengths, group_sizes=sizes, **options)
    except SequenceTooLongError:  # a group over max_len: refused by name (test_a_sequence_or_group_over_...)
        assume(False)
    except UsageError as exc:
        # Fewer items than ranks is a refusal of its own. With items a multiple of the ranks, one item in each
        # micro-batch is a plan (every item is within both caps), so a refusal there is the planner's failure.
        assert items % options["world_size"] != 0, f"a plan with one item per micro-batch exists, refused: {exc}"
        assert "micro-batch" in str(exc), exc
        assume(False)


@pytest.mark.slow  # ~2 s of CPU
@settings(max_examples=60, deadline=None)
@given(rollouts())
def test_every_sequence_lies_in_exactly_one_micro_batch_under_both_caps(case):
    lengths, sizes, options = case
    plan = planned(lengths, sizes, options)
    assert sorted(plan.sequences.tolist()) == list(range(len(lengths)))
    assert plan.offsets[0] == 0 and plan.offsets[-1] == len(lengths)
    assert len(plan.offsets) == plan.world_size * plan.micro_batches + 1 == options["world_size"] * plan.micro_batches + 1
    costs = pack_costs(np.ones(len(lengths), np.int64), lengths, options["token_cost"])
    for rank in range(plan.world_size):
        for number in range(plan.micro_batches):
            held = plan.micro_batch(rank, number)
            assert len(held) >= 1 and list(held) == sorted(held)
            assert lengths[held].sum() <= options["max_len"]
            assert options["max_documents"] is None or len(held) <= options["max_documents"]
            assert plan.tokens[rank, number] == lengths[held].sum()
            expected = lengths[held].sum() if options["cost"] == "tokens" else costs[held].sum()
            assert plan.costs[rank, number] == pytest.approx(expected, rel=1e-12)
    if sizes is not None:  # each group whole, in one micro-batch, its sequences one after the other
        number = np.empty(len(lengths), np.int64)
        for k in range(len(plan.offsets) - 1):
            number[plan.sequences[plan.offsets[k] : plan.offsets[k + 1]]] = k
        position = np.argsort(plan.sequences)
        for start, size in zip(np.cumsum([0, *sizes[:-1]]), sizes):
            assert len(set(number[start : start + size])) == 1
            assert np.all(np.diff(position[start : start + size]) == 1)


@pytest.mark.slow  # ~2 s of CPU
@settings(max_examples=40, deadline=None)
@given(rollouts(), st.randoms(use_true_random=False))
def test_the_plan_is_a_function_of_the_inputs_and_unpacking_restores_the_callers_order(case, random):
    lengths, sizes, options = case
    plan = planned(lengths, sizes, options)
    again = plan_rollouts(lengths.astype(np.int32).tolist(), group_sizes=sizes, **options)
    for field in ("sequences", "offsets", "tokens", "costs"):
        assert np.array_equal(getattr(plan, field), getattr(again, field)), field
    assert plan.micro_batches == again.micro_batches
    values = np.array([[random.random(), i] for i in range(len(lengths))])  # one result per sequence, two columns
    results = [values[plan.micro_batch(r, m)] for r in range(plan.world_size) for m in range(plan.micro_batches)]
    assert np.array_equal(plan.unpack(results), values)
    for rank in range(plan.world_size):
        own = [values[plan.micro_batch(rank, m)] for m in range(plan.micro_batches)]
        assert np.array_equal(plan.unpack(own, rank=rank), values[np.sort(plan.rank_sequences(rank))])


@pytest.mark.slow  # two Python processes
def test_ranks_in_separate_processes_compute_the_same_plan():
    code = (
        "import hashlib, numpy as np; from prepack.building.rollouts import plan_rollouts; "
        "lengths = np.random.default_rng(7).integers(1, 4097, 1000); "
        "p = plan_rollouts(lengths, 8192, world_size=4, cost='attention', max_documents=16); "
        "print(hashlib.sha256(p.sequences.tobytes() + p.offsets.tobytes() + p.costs.tobytes()).hexdigest())"
    )
    digests = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=os.environ | {"PYTHONHASHSEED": str(seed)}).stdout
        for seed in (1, 2)
    }
    lengths = np.random.default_rng(7).integers(1, 4097, 1000)
    here = plan_rollouts(lengths, 8192, world_size=4, cost="attention", max_documents=16)
    assert digests == {hashlib.sha256(here.sequences.tobytes() + here.offsets.tobytes() + here.costs.tobytes()).hexdigest() + "\n"}


@pytest.mark.parametrize("cost", ["tokens", "attention"])
def test_four_thousand_rollouts_balance_ranks_and_micro_batches_within_two_percent(cost):
    lengths = np.random.default_rng(0).integers(1, 32769, 4096)
    plan = plan_rollouts(lengths, 65536, world_size=8, cost=cost)
    # per step: each rank's whole step; per micro-batch: micro-batch m of every rank, for ranks that wait at each
    assert imbalance(plan.costs.sum(axis=1)[None]).max_over_mean <= 1.02
    assert imbalance(plan.costs.T).max_over_mean <= 1.02
    assert plan.micro_batches <= -(-(-(-lengths.sum() // 65536)) // 8) + 1  # at most one above the token bound


def test_a_sequence_or_group_over_the_cap_is_refused_by_name():
    with pytest.raises(SequenceTooLongError, match="sequence 2 has 300 tokens, more than a micro-batch's max_len=256"):
        plan_rollouts([10, 20, 300, 5], 256)
    with pytest.raises(SequenceTooLongError, match=r"group 1 \(sequences 2..3\) has 260 tokens"):
        plan_rollouts([10, 20, 130, 130], 256, group_sizes=[2, 2])
    with pytest.raises(UsageError, match="group 0 has 3 sequences, more than max_documents=2"):
        plan_rollouts([1, 1, 1, 1], 256, group_sizes=[3, 1], max_documents=2)
    assert issubclass(SequenceTooLongError, PrepackError)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (([3, 0, 2], 8), "sequence 1 has 0 tokens"),
        (([], 8), "at least one sequence"),
        (([[1, 2]], 8), "1-D sequence of integers"),
        (([1.5], 8), "1-D sequence of integers"),
        (([1, 2], 0), "max_len must be in"),
        (([1, 2], 8, {"world_size": 3}), "2 sequences cannot give each of 3 ranks a micro-batch"),
        (([5, 5, 5], 8, {"world_size": 2}), "3 sequences of 15 tokens found no plan of 1 micro-batches on each of 2 ranks"),
        # 257 tokens do not fit 4 micro-batches of 64, and 6 sequences cannot fill 8 (found by hypothesis)
        (([1, 1, 63, 64, 64, 64], 64, {"world_size": 4}), "6 sequences of 257 tokens need at least 2 micro-batches"),
        (([1, 2], 8, {"cost": "flops"}), "cost must be one of"),
        (([1, 2], 8, {"token_cost": float("nan")}), "token_cost must be finite"),
        (([1, 2], 8, {"max_documents": 0}), "max_documents must be in"),
        (([1, 2], 8, {"group_sizes": [1, 2]}), "group_sizes sum to 3, not to the 2 sequences"),
        (([1, 2], 8, {"group_sizes": [2, 0]}), "positive integers"),
    ],
)
def test_bad_arguments_are_refused_by_name(arguments, message):
    lengths, max_len, *options = arguments
    with pytest.raises(UsageError, match=message):
        plan_rollouts(lengths, max_len, **(options[0] if options else {}))


@pytest.mark.parametrize(
    ("lengths", "max_len", "world_size"),
    [
        ([8, 3, 5, 5, 8, 1], 10, 3),  # M=1 has no room; M=2 (8+1, 8, 5+5 | 5+3 ...) fits
        *[(np.random.default_rng(seed).integers(1, 32769, 16), 32768, 8) for seed in range(40)],  # M=2: one each
    ],
)
def test_a_plan_is_found_where_more_micro_batches_make_room(lengths, max_len, world_size):
    plan = plan_rollouts(lengths, max_len, world_size=world_size)
    assert sorted(plan.sequences.tolist()) == list(range(len(lengths)))
    assert plan.tokens.max() <= max_len and np.all(np.diff(plan.offsets) >= 1)


def test_unpack_refuses_results_that_are_not_the_plans():
    plan = plan_rollouts([3, 4, 5, 6], 8, world_size=2)
    with pytest.raises(UsageError, match=r"unpacking takes 2 micro-batches' results with 2 rows in all, got 1"):
        plan.unpack([np.zeros(2)], rank=0)
    with pytest.raises(UsageError, match="no micro-batch 5 of rank 0"):
        plan.micro_batch(0, 5)


def test_model_token_cost_reads_a_decoders_config():
    # Llama-3-8B's config.json fields (what transformers' LlamaConfig holds), under a multimodal text_config too
    llama = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=None)
    # per layer 2·4096·4096 (q, o) + 2·4096·1024 (k, v) + 3·4096·14336 (gated MLP), over d = 4096
    assert model_token_cost(llama) == (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) / 4096 == 53248
    assert model_token_cost(SimpleNamespace(text_config=llama)) == 53248
    moe = SimpleNamespace(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,  # Qwen3-30B-A3B
                          moe_intermediate_size=768, num_experts_per_tok=8, intermediate_size=6144)
    # its attention is 32 heads x 128 = 4096 wide, twice its hidden size: the token pair costs that width
    assert model_token_cost(moe) == (2 * 2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 3 * 2048 * 768 * 8) / 4096
    with pytest.raises(UsageError, match="has no 'hidden_size'"):
        model_token_cost(object())


def test_model_token_cost_reads_mixture_of_experts_configs_of_transformers():
    transformers = pytest.importorskip("transformers")
    shape = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    attention = 2 * 64 * 4 * 16 + 2 * 64 * 2 * 16  # q, o and k, v of head_dim 16
    dense = transformers.LlamaConfig(**shape, intermediate_size=96)
    assert model_token_cost(dense) == (attention + 3 * 64 * 96) / 64
    # Mixtral's experts are intermediate_size wide (it has no moe_intermediate_size): 2 of them a token
    mixtral = transformers.MixtralConfig(**shape, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)
    assert model_token_cost(mixtral) == (attention + 3 * 64 * 96 * 2) / 64
    # Qwen2-MoE: 3 routed experts of 32 a token, and the shared expert of 80 every token goes through
    qwen = transformers.Qwen2MoeConfig(**shape, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                       num_experts_per_tok=3, shared_expert_intermediate_size=80)
    assert model_token_cost(qwen) == (attention + 3 * 64 * (32 * 3 + 80)) / 64


def test_model_token_cost_reads_deepseeks_latent_attention_shared_experts_and_dense_layers():
    transformers = pytest.importorskip("transformers")
    # DeepSeek-V3's config.json: 128 heads of query-key 128 + 64 (rotary) and value 128, latent ranks 1536 (q) and
    # 512 (kv); 8 routed experts of 2048 a token and 1 shared; its first 3 of 61 layers dense, 18432 wide
    v3 = transformers.DeepseekV3Config()
    assert (v3.hidden_size, v3.num_hidden_layers, v3.first_k_dense_replace, v3.n_shared_experts) == (7168, 61, 3, 1)
    d = 7168
    attention = (d * 1536 + 1536 * 128 * 192) + d * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * d
    width = (3 * 18432 + 58 * 2048 * (8 + 1)) / 61
    assert model_token_cost(v3) == pytest.approx((attention + 3 * d * width) / (128 * (192 + 128) / 2), rel=1e-12)
    # about 30,000 by the formula above: its attention is 20,480 wide (not its hidden size, 7168)
    assert 25_000 < model_token_cost(v3) < 35_000


def test_the_planner_imports_neither_torch_nor_pyarrow_nor_numba():
    # numba is imported by the first kernel that runs (prepack.building.kernels), not by importing the planner
    code = ("import sys, prepack.building.rollouts; "
            "print(sorted(name for name in ('torch', 'pyarrow', 'transformers', 'numba') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
