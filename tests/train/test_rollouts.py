"""Rollout micro-batches (prepack.training.rollouts): PackedCollator's batch with per-token fields carried through,
and, in float64 on a tiny random Llama, per-sequence log-probabilities and the GRPO/PPO loss of packed micro-batches
equal to each sequence computed alone; a leak across sequences changes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from prepack.building.rollouts import plan_rollouts
from prepack.errors import UsageError
from prepack.formats.shards import IGNORE_INDEX
from prepack.model.packing import enable_packing
from prepack.training.collate import PackedCollator
from prepack.training.preference import sequence_logps
from prepack.training.rollouts import (
    completion_sums,
    policy_loss,
    rollout_micro_batches,
    sequence_sums,
    shared_prompt_lengths,
    shared_prompt_micro_batches,
    token_logps,
    trained,
    unpack_sequences,
)

VOCAB, MAX_LEN, GROUP = 64, 160, 4


def tiny_llama(seed: int, attention: str = "sdpa") -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
                         attn_implementation=attention)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float64)


def grpo_rollouts(groups: int = 6, seed: int = 0) -> list[dict]:
    """`groups` prompts with GROUP completions each: the prompt's labels -100, each completion's advantage its
    reward normalised within the group, and old log-probabilities near (not at) any policy's."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for _ in range(groups):
        prompt = rng.integers(0, VOCAB, rng.integers(3, 12))
        rewards = rng.normal(size=GROUP)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for advantage in advantages:
            completion = rng.integers(0, VOCAB, rng.integers(2, 14))
            ids = np.concatenate([prompt, completion])
            labels = np.where(np.arange(len(ids)) < len(prompt), IGNORE_INDEX, ids)
            rollouts.append({"input_ids": ids, "labels": labels, "advantages": np.full(len(ids), advantage),
                             "old_logps": rng.normal(-4.2, 0.3, len(ids))})
    return rollouts


def alone(model, rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token log-probabilities [n] at the trained labels, 0 elsewhere; trained mask [n]) of one sequence alone."""
    ids = torch.as_tensor(rollout["input_ids"])[None]
    labels = torch.as_tensor(rollout["labels"])[None]
    batch = {"labels": labels}
    return token_logps(model(input_ids=ids).logits, batch)[0], trained(batch)[0]


def grpo_loss_alone(model, rollouts) -> torch.Tensor:
    """GRPO's loss unpacked: the mean over sequences of each one's mean clipped surrogate over its trained tokens."""
    losses = []
    for rollout in rollouts:
        logps, mask = alone(model, rollout)
        batch = {"labels": torch.as_tensor(rollout["labels"])[None]}
        per_token = policy_loss(logps[None], torch.as_tensor(rollout["old_logps"])[None],
                                torch.as_tensor(rollout["advantages"])[None], batch)[0]
        losses.append(per_token.sum() / mask.sum())
    return torch.stack(losses).mean()


def grpo_loss_packed(model, rollouts, plan, collator=None, strip=()) -> tuple[torch.Tensor, torch.Tensor]:
    """(GRPO's loss, per-sequence log-probabilities in the caller's order) over every rank's micro-batches;
    `strip` names batch fields left out of the forward (a leak: the rows run as plain causal rows)."""
    losses, logps_of = [], []
    for rank in range(plan.world_size):
        for micro in rollout_micro_batches(rollouts, plan, rank, collator, token_fields=("advantages", "old_logps")):
            inputs = {key: value for key, value in micro.batch.items() if key not in strip}
            logps = token_logps(model(**inputs).logits, micro.batch)
            per_token = policy_loss(logps, micro.fields["old_logps"], micro.fields["advantages"], micro.batch)
            counts = sequence_sums(trained(micro.batch), micro)
            losses.append(sequence_sums(per_token, micro) / counts)
            logps_of.append(sequence_sums(logps, micro))
    return torch.cat(losses).sum() / len(rollouts), unpack_sequences(plan, logps_of)


COLLATORS = {
    "padding_free": None,
    "padded": PackedCollator(MAX_LEN),
    "fixed_shape": PackedCollator(MAX_LEN, max_docs_per_pack=8),
}


@pytest.mark.slow  # float64 forwards and backwards of a tiny Llama over 24 sequences: seconds a layout
@pytest.mark.parametrize("layout", list(COLLATORS))
def test_packed_log_probabilities_and_grpo_loss_equal_each_sequence_alone(layout):
    rollouts = grpo_rollouts()
    plan = plan_rollouts([len(r["input_ids"]) for r in rollouts], MAX_LEN, world_size=2, max_documents=8,
                         cost="attention", group_sizes=[GROUP] * 6)
    assert plan.micro_batches >= 2  # several sequences a micro-batch, several micro-batches a rank
    model = enable_packing(tiny_llama(0))
    expected_logps = torch.stack([alone(model, rollout)[0].sum() for rollout in rollouts])
    expected = grpo_loss_alone(model, rollouts)
    loss, logps = grpo_loss_packed(model, rollouts, plan, COLLATORS[layout])
    torch.testing.assert_close(logps, expected_logps, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(loss, list(model.parameters()))
    wanted = torch.autograd.grad(expected, list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), got, wanted):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.slow  # ~2 s
def test_a_leak_across_sequences_changes_the_log_probabilities_and_the_loss():
    rollouts = grpo_rollouts(seed=1)
    plan = plan_rollouts([len(r["input_ids"]) for r in rollouts], MAX_LEN, world_size=2, cost="attention")
    model = enable_packing(tiny_llama(0))
    with torch.no_grad():
        expected_logps = torch.stack([alone(model, rollout)[0].sum() for rollout in rollouts])
        expected = grpo_loss_alone(model, rollouts)
        loss, logps = grpo_loss_packed(model, rollouts, plan)
        torch.testing.assert_close(logps, expected_logps, rtol=1e-12, atol=1e-10)
        # Each row as one causal sequence: every sequence sees the ones before it in its micro-batch.
        leaked_loss, leaked = grpo_loss_packed(model, rollouts, plan, strip=("position_ids", "cu_seq_lens_q",
                                                                           "cu_seq_lens_k", "max_length_q", "max_length_k"))
    first = np.concatenate([plan.micro_batch(r, m)[:1] for r in range(2) for m in range(plan.micro_batches)])
    later = np.setdiff1d(np.arange(len(rollouts)), first)
    assert torch.allclose(leaked[first], expected_logps[first], rtol=1e-12, atol=1e-10)  # a row's first sees nothing else
    assert not torch.isclose(leaked[later], expected_logps[later], rtol=1e-6, atol=1e-6).any()
    assert not torch.isclose(leaked_loss, expected, rtol=1e-6, atol=1e-9)
    assert torch.isclose(loss, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", list(COLLATORS))
def test_a_micro_batch_is_the_collators_batch_of_its_pack_with_the_per_token_fields_laid_out_as_its_tokens(layout):
    rollouts = grpo_rollouts(groups=3)
    plan = plan_rollouts([len(r["input_ids"]) for r in rollouts], MAX_LEN, world_size=1, max_documents=8)
    collator = COLLATORS[layout] or PackedCollator(MAX_LEN, layout="padding_free")
    for micro in rollout_micro_batches(rollouts, plan, 0, COLLATORS[layout], token_fields=("advantages", "old_logps")):
        taken = [rollouts[i] for i in micro.sequences]
        pack = {"input_ids": np.concatenate([r["input_ids"] for r in taken]),
                "labels": np.concatenate([r["labels"] for r in taken]),
                "cu_seqlens": np.cumsum([0] + [len(r["input_ids"]) for r in taken])}
        expected = collator([pack])
        assert micro.batch.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(micro.batch[key], value) if torch.is_tensor(value) else micro.batch[key] == value, key
        tokens = len(pack["input_ids"])
        for name in ("advantages", "old_logps"):
            field = micro.fields[name]
            assert field.shape == micro.batch["input_ids"].shape and field.dtype == torch.float64
            assert np.array_equal(field[0, :tokens].numpy(), np.concatenate([r[name] for r in taken]))
            assert not field.flatten()[tokens:].any()  # 0 at padding
        # the sequences are the first segments: their trained tokens, as preference.sequence_logps counts them
        counts = sequence_sums(trained(micro.batch), micro)
        expected_counts = [int((r["labels"][1:] != IGNORE_INDEX).sum()) for r in taken]
        assert counts.tolist() == expected_counts


def test_per_sequence_sums_of_token_log_probabilities_are_preference_sequence_logps():
    rollouts = grpo_rollouts(groups=2)
    plan = plan_rollouts([len(r["input_ids"]) for r in rollouts], MAX_LEN)
    micro = rollout_micro_batches(rollouts, plan, 0, PackedCollator(MAX_LEN))[0]
    logits = torch.randn(*micro.batch["input_ids"].shape, VOCAB, dtype=torch.float64)
    sums, _ = sequence_logps(logits, micro.batch)
    torch.testing.assert_close(sequence_sums(token_logps(logits, micro.batch), micro), sums[: len(micro.sequences)],
                               rtol=1e-14, atol=1e-12)


def test_rollouts_that_do_not_fit_the_plan_or_collator_are_refused_by_name():
    rollouts = grpo_rollouts(groups=2)
    lengths = [len(r["input_ids"]) for r in rollouts]
    plan = plan_rollouts(lengths, MAX_LEN, max_documents=4)
    valued = [dict(r, values=r["advantages"]) for r in rollouts]
    del valued[3]["values"]
    with pytest.raises(UsageError, match="rollout 3 has no 'values'"):
        rollout_micro_batches(valued, plan, 0, token_fields=("values",))
    broken = [dict(r) for r in rollouts]
    broken[5]["advantages"] = broken[5]["advantages"][:-1]
    with pytest.raises(UsageError, match=f"rollout 5: advantages has {lengths[5] - 1} values for {lengths[5]} tokens"):
        rollout_micro_batches(broken, plan, 0, token_fields=("advantages",))
    broken[5] = dict(rollouts[5], labels=rollouts[5]["labels"][1:])
    with pytest.raises(UsageError, match=f"rollout 5: labels has {lengths[5] - 1} values for {lengths[5]} tokens"):
        rollout_micro_batches(broken, plan, 0)
    with pytest.raises(UsageError, match="the plan is of 8 sequences, not of 7 rollouts"):
        rollout_micro_batches(rollouts[:7], plan, 0)
    longer = [dict(r, input_ids=np.append(r["input_ids"], 1), labels=np.append(r["labels"], 1)) for r in rollouts]
    with pytest.raises(UsageError, match="not the .* the plan was made for"):
        rollout_micro_batches(longer, plan, 0)
    with pytest.raises(UsageError, match="fixed shapes hold 2 sequences a micro-batch; plan with max_documents=2"):
        rollout_micro_batches(rollouts, plan, 0, PackedCollator(MAX_LEN, max_docs_per_pack=2))
    with pytest.raises(UsageError, match="max_len=64 is below the plan.s 160"):
        rollout_micro_batches(rollouts, plan, 0, PackedCollator(64))
    with pytest.raises(UsageError, match="padded or padding_free layout"):
        rollout_micro_batches(rollouts, plan, 0, PackedCollator(MAX_LEN, layout="indexed_mask"))
    with pytest.raises(UsageError, match="unpacking takes 2 micro-batches' results with 8 rows in all, got 1 with 3"):
        unpack_sequences(plan, [torch.zeros(3)], rank=0)


def shared_prompt_groups(rollouts: list[dict]) -> list[dict]:
    """`grpo_rollouts` as GRPO groups for the shared-prompt layout: each prompt once, its GROUP completions, and the
    per-token fields of the completions' tokens."""
    groups = []
    for first in range(0, len(rollouts), GROUP):
        members = rollouts[first : first + GROUP]
        prompt = int((members[0]["labels"] == IGNORE_INDEX).sum())
        groups.append({"prompt": members[0]["input_ids"][:prompt],
                       **{name: [m[name][prompt:] for m in members]
                          for name in ("labels", "advantages", "old_logps")},
                       "completions": [m["input_ids"][prompt:] for m in members]})
    return groups


def shared_prompt_grpo(model, groups, plan, leak=False) -> tuple[torch.Tensor, torch.Tensor]:
    """(GRPO's loss, per-completion log-probabilities [groups, GROUP] in the caller's order) over every rank's
    shared-prompt micro-batches; `leak` runs the forward with every completion of a group as one part (each sees the
    siblings before it), while reading the results with the true layout."""
    losses, logps_of = [], torch.zeros(len(groups), GROUP, dtype=torch.float64)
    for rank in range(plan.world_size):
        for micro in shared_prompt_micro_batches(groups, plan, rank, token_fields=("advantages", "old_logps")):
            inputs = dict(micro.batch)
            if leak:
                parts = micro.batch["shared_prompt_parts"]
                ids = micro.batch["shared_prompt_ids"]
                inputs["shared_prompt_ids"] = ids // parts * parts + (ids % parts > 0).long()
            logps = token_logps(model(**inputs).logits, micro.batch)
            per_token = policy_loss(logps, micro.fields["old_logps"], micro.fields["advantages"], micro.batch)
            counts = completion_sums(trained(micro.batch), micro.batch).clamp(min=1)
            losses.append(completion_sums(per_token, micro.batch) / counts)
            logps_of[torch.from_numpy(micro.sequences)] = completion_sums(logps, micro.batch)
    return torch.cat(losses).sum() / (len(groups) * GROUP), logps_of


@pytest.mark.slow  # float64 forwards and backwards of a tiny Llama, two attentions: seconds
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_groups_give_each_completion_its_log_probabilities_and_loss_alone(attention):
    rollouts = grpo_rollouts(seed=2)
    groups = shared_prompt_groups(rollouts)
    plan = plan_rollouts(shared_prompt_lengths(groups), 96, world_size=2, cost="attention")
    assert plan.micro_batches >= 2 and any(len(plan.micro_batch(0, m)) > 1 for m in range(plan.micro_batches))
    model = enable_packing(tiny_llama(0, attention))
    expected_logps = torch.stack([alone(model, rollout)[0].sum() for rollout in rollouts]).view(len(groups), GROUP)
    expected = grpo_loss_alone(model, rollouts)
    loss, logps = shared_prompt_grpo(model, groups, plan)
    # eager's softmax runs in float32 whatever the model's dtype (transformers' eager_attention_forward)
    tolerance = {"sdpa": 1e-10, "eager": 1e-6}[attention]
    torch.testing.assert_close(logps, expected_logps, rtol=0, atol=tolerance)
    torch.testing.assert_close(loss, expected, rtol=0, atol=tolerance)
    got = torch.autograd.grad(loss, list(model.parameters()))
    wanted = torch.autograd.grad(expected, list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), got, wanted):
        # A row of the embeddings' gradient sums terms of opposite signs from every use of its token, each prompt's
        # once here and G times alone: it agrees within 1e-6 of the largest entry (1e-7 seen, as the plain layout's)
        torch.testing.assert_close(a, b, rtol=0, atol=max(1e-6 * float(b.abs().max()), tolerance), msg=name)
    with torch.no_grad():  # the control: a completion that sees its siblings is caught
        leaked_loss, leaked = shared_prompt_grpo(model, groups, plan, leak=True)
    torch.testing.assert_close(leaked[:, 0], expected_logps[:, 0], rtol=0, atol=tolerance)  # the first sees no sibling
    assert not torch.isclose(leaked[:, 1:], expected_logps[:, 1:], rtol=0, atol=100 * tolerance).any()
    assert not torch.isclose(leaked_loss, expected.detach(), rtol=0, atol=100 * tolerance)


def test_shared_prompt_micro_batches_lay_the_completions_fields_out_as_their_tokens():
    groups = shared_prompt_groups(grpo_rollouts(groups=3))
    plan = plan_rollouts(shared_prompt_lengths(groups), MAX_LEN)
    micro = shared_prompt_micro_batches(groups, plan, 0, token_fields=("advantages",))[0]
    expected_ids = np.concatenate([np.concatenate([groups[g]["prompt"], *groups[g]["completions"]])
                                   for g in micro.sequences])
    expected = np.concatenate([np.concatenate([np.zeros(len(groups[g]["prompt"])), *groups[g]["advantages"]])
                               for g in micro.sequences])
    assert micro.batch["input_ids"][0].tolist() == expected_ids.tolist()
    assert np.array_equal(micro.fields["advantages"][0].numpy(), expected)
    with pytest.raises(UsageError, match="plan from shared_prompt_lengths"):
        shared_prompt_micro_batches(groups, plan_rollouts([len(g["prompt"]) for g in groups], MAX_LEN), 0)
    broken = [{**groups[0], "advantages": groups[0]["advantages"][:-1]}, *groups[1:]]
    with pytest.raises(UsageError, match="group 0: advantages must be one array a completion"):
        shared_prompt_micro_batches(broken, plan, 0, token_fields=("advantages",))
