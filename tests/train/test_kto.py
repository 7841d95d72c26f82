"""KTO on packed examples (`prepack.training.preference.kto_loss`): each example laid out as a group of 2 after
its prompt, its completion and its mismatched KL completion (the completion of another example, as TRL's
KTOTrainer pairs them: the batch's completions cycled by one), packed (two-sequence layouts) or with the prompt
once (shared-prompt layout). In float64 on a tiny random Llama the loss and every gradient equal TRL 1.16's
`KTOTrainer._compute_loss` on its own collated batch (`DataCollatorForUnpairedPreference`) of the same examples,
with a float64 LM head standing in for TRL's fused one; TRL's own fused head computes in float32, which bounds
the agreement with it to float32's precision. A KL completion that sees another example's prompt moves the loss.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prepack.model.packing import enable_packing
from prepack.training.collate import PackedCollator
from prepack.training.preference import GroupLogps, group_logps, kto_loss, model_inputs
from tests.train.test_groups import group_pack
from tests.train.test_preference import VOCAB, _Float64Head, gradients, tiny_llama
from tests.train.test_shared_prompt import _rms_norm_in_its_dtype
from prepack.errors import UsageError
from prepack.training.shared_prompt import Group
from prepack.training.unpaired import kl_partners, kto_groups
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama import modeling_llama

BETA, EXAMPLES = 0.1, 10
REFERENCE_SEED = 4  # a reference under which the policy's KL estimate is positive (0.087), not clamped to 0


def examples() -> list[dict]:
    """Ten unpaired examples in the tiny vocabulary, six desirable; each one's KL completion the previous
    example's completion (the first takes the last's), TRL's `add_kl_completion_ids` on a batch of ten."""
    rng = np.random.default_rng(7)
    rows = [{"prompt_ids": rng.integers(0, VOCAB, rng.integers(3, 10)).tolist(),
             "completion_ids": rng.integers(0, VOCAB, rng.integers(2, 8)).tolist(),
             "label": bool(i % 5 < 3)} for i in range(EXAMPLES)]
    for i, row in enumerate(rows):
        row["KL_completion_ids"] = rows[i - 1]["completion_ids"]
    return rows


def test_kl_partners_cycle_each_batch_as_trls_kto_trainer_does():
    """TRL's `add_kl_completion_ids` (its `_prepare_dataset`, mapped in batches of the per-device batch size),
    on completions that name their example."""
    datasets = pytest.importorskip("datasets")
    for count, batch_size in ((10, 10), (10, 4), (9, 3), (8, 2)):
        dataset = datasets.Dataset.from_dict({"completion_ids": [[i] for i in range(count)]}).map(
            lambda examples: {"KL_completion_ids": [examples["completion_ids"][-1]] + examples["completion_ids"][:-1]},
            batched=True, batch_size=batch_size)
        assert kl_partners(count, batch_size=batch_size).tolist() == [ids[0] for ids in dataset["KL_completion_ids"]]
    with pytest.raises(UsageError, match="alone in its batch"):
        kl_partners(9, batch_size=4)


@settings(max_examples=50, deadline=None)
@given(count=st.integers(2, 300), seed=st.integers(0, 2**32 - 1))
def test_seeded_kl_partners_are_one_cycle_and_repeat_from_their_seed(count, seed):
    partners = kl_partners(count, seed=seed)
    assert partners.tolist() == kl_partners(count, seed=seed).tolist()
    assert sorted(partners.tolist()) == list(range(count))  # a permutation
    seen, at = set(), 0
    while at not in seen:  # following partners from 0 visits every example once: one cycle, so none is its own
        seen.add(at)
        at = int(partners[at])
    assert len(seen) == count and at == 0


def test_kto_groups_put_each_partners_completion_after_the_examples_prompt():
    rows = examples()
    groups = kto_groups([r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows], kl_partners(EXAMPLES, batch_size=EXAMPLES))
    for group, row in zip(groups, rows, strict=True):
        assert (list(group.prompt), [list(c) for c in group.completions]) == (
            row["prompt_ids"], [row["completion_ids"], row["KL_completion_ids"]])


def packed_batch(rows: list[dict], kl_prompt_shift: int = 0, **options) -> dict:
    """The examples as groups of 2 (completion, KL completion after the same prompt), five to a pack; with
    `kl_prompt_shift`, each KL completion after another example's prompt (the leak control)."""
    partners = kl_partners(len(rows), batch_size=len(rows))
    groups = [[g] for g in kto_groups([r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows], partners)]
    if kl_prompt_shift:
        groups = [[Group(g.prompt, g.completions[:1]), Group(rows[(i + kl_prompt_shift) % len(rows)]["prompt_ids"], g.completions[1:])]
                  for i, (g,) in enumerate(groups)]
    if kl_prompt_shift:  # two documents with different prompts: laid out as documents, not a shared group
        packs = []
        for start in (0, 5):
            pack = [group_pack([g]) for pair in groups[start : start + 5] for g in pair]
            packs.append({"input_ids": np.concatenate([p["input_ids"] for p in pack]),
                          "labels": np.concatenate([p["labels"] for p in pack]),
                          "cu_seqlens": np.cumsum([0, *(len(p["input_ids"]) for p in pack)]).astype(np.int32),
                          "pair_roles": np.tile(np.array([0, 1], np.uint8), 5)})
        return PackedCollator(256, **options)(packs)
    return PackedCollator(256, **options)([group_pack([g[0] for g in groups[s : s + 5]]) for s in (0, 5)])


def trl_kto_loss(model, rows: list[dict], reference: GroupLogps, gather_kl=lambda kl: kl) -> torch.Tensor:
    """TRL 1.16's KTO loss of `rows` from `KTOTrainer._compute_loss` on its collator's batch, the reference
    log-probabilities given as precomputed; `gather_kl` stands in for `accelerator.gather_for_metrics` of the
    KL estimate (one process: the identity)."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer

    inputs = DataCollatorForUnpairedPreference(pad_token_id=0)(
        [dict(row, ref_logps=float(reference.logps[i, 0]), ref_KL_logps=float(reference.logps[i, 1]))
         for i, row in enumerate(rows)])
    inputs["ref_logps"], inputs["ref_KL_logps"] = reference.logps[:, 0], reference.logps[:, 1]
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=gather_kl)
    trainer = SimpleNamespace(
        model=model, accelerator=accelerator, calculate_KL=True, aux_loss_enabled=False, precompute_ref_logps=True,
        loss_type="kto", beta=BETA, desirable_weight=1.0, undesirable_weight=1.0,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    trainer._compute_kl_logps = partial(KTOTrainer._compute_kl_logps, trainer)
    return KTOTrainer._compute_loss(trainer, model, inputs, False)


LAYOUTS = [{"layout": "padded"}, {"layout": "padding_free"}, {"shared_prompt": True}]


@pytest.mark.parametrize("options", LAYOUTS, ids=str)
def test_a_pack_with_labels_not_one_every_two_documents_is_refused(options):
    """One label too many in a pack and one too few in the next: the batch's total is right, its alignment not."""
    rows = examples()
    groups = kto_groups([r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows], kl_partners(EXAMPLES, batch_size=EXAMPLES))
    packs = [group_pack(groups[:5]), group_pack(groups[5:])]
    labels = [row["label"] for row in rows]
    packs[0]["desirable"], packs[1]["desirable"] = np.array(labels[:6], np.uint8), np.array(labels[6:], np.uint8)
    with pytest.raises(UsageError, match=r"Pack 0: 6 'desirable' labels for 10 documents"):
        PackedCollator(256, **options)(packs)
    packs[0]["desirable"], packs[1]["desirable"] = np.array(labels[:5], np.uint8), np.array(labels[5:], np.uint8)
    assert PackedCollator(256, **options)(packs)["desirable"].tolist() == labels


@pytest.mark.slow  # float64 forwards and backwards, per layout: ~3 s
@pytest.mark.parametrize("options", LAYOUTS, ids=str)
def test_kto_loss_and_gradients_equal_trls_kto_trainer(options, monkeypatch):
    pytest.importorskip("trl.trainer.kto_trainer")
    # A prompt shared by two completions sums its gradient before LlamaRMSNorm's float32 rounding, TRL's two
    # sequences after it: the norm in its own dtype keeps both float64 (tests/train/test_shared_prompt.py).
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_its_dtype)
    rows = examples()
    batch = packed_batch(rows, **options)
    desirable = torch.tensor([row["label"] for row in rows])
    with torch.no_grad():
        reference = group_logps(enable_packing(tiny_llama(REFERENCE_SEED))(**model_inputs(batch)).logits, batch)
    model = enable_packing(tiny_llama(0))
    policy = group_logps(model(**model_inputs(batch)).logits, batch)
    assert (policy.logps[:, 1] - reference.logps[:, 1]).mean() > 0.05  # the KL term is not clamped away
    ours = kto_loss(policy, reference, desirable, BETA).mean()
    ours.backward()
    head = _Float64Head(tiny_llama(0))
    theirs = trl_kto_loss(head, rows, reference)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    expected = gradients(head.model)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.slow  # float64 forwards: ~2 s
def test_kto_loss_reduces_the_kl_estimate_over_ranks_as_trls_kto_trainer_does():
    """Two simulated ranks, each with five of the examples: TRL averages their KL estimates
    (`accelerator.gather_for_metrics(kl).mean()`) before the clamp; kto_loss does with its `kl_reduce` hook."""
    pytest.importorskip("trl.trainer.kto_trainer")
    rows = examples()
    batch = packed_batch(rows)
    desirable = torch.tensor([row["label"] for row in rows])
    with torch.no_grad():
        reference = group_logps(enable_packing(tiny_llama(REFERENCE_SEED))(**model_inputs(batch)).logits, batch)
        policy = group_logps(enable_packing(tiny_llama(0))(**model_inputs(batch)).logits, batch)
        ranks = [slice(0, 5), slice(5, 10)]
        z = [(policy.logps[r, 1] - reference.logps[r, 1]).mean() for r in ranks]
        assert (z[0] - z[1]).abs() > 0.05  # the ranks' estimates differ: a rank's own one gives another loss
        head = _Float64Head(tiny_llama(0))
        for rank, r in enumerate(ranks):
            def both_ranks(kl, rank=rank):  # this rank's estimate in its place among both ranks'
                return torch.stack([kl if i == rank else z[i] for i in range(len(ranks))])

            part = lambda logps: GroupLogps(logps.logps[r], logps.tokens[r])  # noqa: E731
            ours = kto_loss(part(policy), part(reference), desirable[r], BETA, kl_reduce=lambda kl: both_ranks(kl).mean())
            theirs = trl_kto_loss(head, rows[r], part(reference), gather_kl=both_ranks)
            torch.testing.assert_close(ours.mean(), theirs, rtol=1e-12, atol=1e-12)
            alone = kto_loss(part(policy), part(reference), desirable[r], BETA).mean()
            assert (alone - theirs).abs() > 1e-6  # this rank's own estimate is not TRL's


@pytest.mark.slow  # ~3 s
def test_trls_own_fused_head_agrees_to_float32_and_a_kl_leak_fails():
    pytest.importorskip("trl.trainer.kto_trainer")
    from trl.trainer.utils import add_fused_lm_head

    rows = examples()
    batch = packed_batch(rows)
    desirable = torch.tensor([row["label"] for row in rows])
    with torch.no_grad():
        reference = group_logps(enable_packing(tiny_llama(REFERENCE_SEED))(**model_inputs(batch)).logits, batch)
        model = enable_packing(tiny_llama(0))
        ours = kto_loss(group_logps(model(**model_inputs(batch)).logits, batch), reference, desirable, BETA).mean()
        fused = tiny_llama(0)
        add_fused_lm_head(fused, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        torch.testing.assert_close(ours, trl_kto_loss(fused, rows, reference), rtol=1e-6, atol=1e-7)
        exact = trl_kto_loss(_Float64Head(tiny_llama(0)), rows, reference)
        torch.testing.assert_close(ours, exact, rtol=1e-12, atol=1e-12)
        # The leak control: each KL completion after the next example's prompt, the reference likewise.
        leaky = packed_batch(rows, kl_prompt_shift=1)
        leaked_reference = group_logps(enable_packing(tiny_llama(REFERENCE_SEED))(**model_inputs(leaky)).logits, leaky)
        leaked = kto_loss(group_logps(model(**model_inputs(leaky)).logits, leaky), leaked_reference, desirable, BETA).mean()
    assert (leaked - exact).abs() > 1e-6
