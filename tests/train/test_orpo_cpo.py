"""ORPO and CPO (`prepack.training.preference.orpo_loss`, `cpo_loss`, `chosen_nll`, `prompt_logps`) on
test_preference's real pair build, in float64 on its tiny random Llama: from the same packed log-probabilities
as DPO, in the two-sequence layouts and the shared-prompt one, the losses and every gradient equal

- the papers' definitions computed on every sequence run alone (ORPO: Hong et al. 2024, eq. 6-7, the odds
  ratio of each completion's mean log-probability, plus the NLL of the chosen sequence as TRL's ORPOTrainer
  takes it, over prompt and completion; CPO: Xu et al. 2024, eq. 3, the summed log-probabilities, plus the
  NLL of the chosen completion), and
- TRL 1.16's own `ORPOTrainer` / `CPOTrainer` (`trl.experimental`) `get_batch_loss_metrics` on its padded
  batch of the same pairs. CPO's is float64 throughout: equal to 1e-12. ORPO's `odds_ratio_loss` casts the
  log-probabilities to float32 (`.float()`), which sets its bound (1e-6); its forward's average log-probs and
  NLL, before that cast, are float64 and equal to 1e-12.

Letting documents attend across pairs (plain causal rows) moves every one of these numbers.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from prepack.model.packing import enable_packing
from prepack.training.preference import (
    PairLogps, chosen_nll, cpo_loss, model_inputs, orpo_loss, pair_logps, prompt_logps,
)
from transformers.models.llama import modeling_llama

from tests.train.test_shared_prompt import _rms_norm_in_its_dtype
from tests.train.test_preference import BETA, batches, pair_build, pairs_of, small, tiny_llama

CPO_ALPHA = 1.0


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return pair_build(tmp_path_factory.mktemp("orpo_cpo"))


def token_logps(model, ids) -> torch.Tensor:
    """Each token's log-probability (from the second), the document run alone."""
    ids = small(ids)
    logits = model(input_ids=ids[None]).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]


def alone(model, pairs) -> dict[str, torch.Tensor]:
    """Per pair, every sequence run alone: summed completion log-probs and tokens, and the chosen document's
    prompt log-probs (every prompt token but the first) and their count."""
    rows = {name: [] for name in ("chosen", "rejected", "chosen_tokens", "rejected_tokens", "prompt", "prompt_tokens")}
    for (chosen, chosen_labels), (rejected, rejected_labels) in pairs:
        for name, ids, labels in (("chosen", chosen, chosen_labels), ("rejected", rejected, rejected_labels)):
            logp, trained = token_logps(model, ids), torch.as_tensor(labels[1:] != -100)
            rows[name].append((logp * trained).sum())
            rows[f"{name}_tokens"].append(trained.sum())
            if name == "chosen":
                rows["prompt"].append((logp * ~trained).sum())
                rows["prompt_tokens"].append((~trained).sum())
    return {name: torch.stack(values) for name, values in rows.items()}


def paper_orpo(a: dict[str, torch.Tensor]) -> torch.Tensor:
    """ORPO's objective on a batch: the mean NLL per token of prompt + chosen, minus β times the mean log σ of
    the log odds ratio, odds(y) = P(y) / (1 - P(y)) of the mean log-probability P."""
    nll = -(a["chosen"] + a["prompt"]).sum() / (a["chosen_tokens"] + a["prompt_tokens"]).sum()
    p_chosen, p_rejected = (a["chosen"] / a["chosen_tokens"]).exp(), (a["rejected"] / a["rejected_tokens"]).exp()
    log_odds = torch.log(p_chosen / (1 - p_chosen)) - torch.log(p_rejected / (1 - p_rejected))
    return nll - BETA * F.logsigmoid(log_odds).mean()


def paper_cpo(a: dict[str, torch.Tensor]) -> torch.Tensor:
    """CPO's objective: -log σ(β (log π(chosen) - log π(rejected))), mean over pairs, + α NLL per chosen token."""
    nll = -a["chosen"].sum() / a["chosen_tokens"].sum()
    return -F.logsigmoid(BETA * (a["chosen"] - a["rejected"])).mean() + CPO_ALPHA * nll


def packed(model, window) -> tuple[PairLogps, tuple[torch.Tensor, torch.Tensor]]:
    policies, prompts = [], []
    for batch in window:
        logits = model(**model_inputs(batch)).logits
        policies.append(pair_logps(logits, batch))
        prompts.append(prompt_logps(logits, batch))
    return PairLogps(*(torch.cat(f) for f in zip(*policies))), tuple(torch.cat(f) for f in zip(*prompts))


def prepack_orpo(policy, prompt):
    return chosen_nll(policy, prompt) + orpo_loss(policy, BETA).mean()


def prepack_cpo(policy, prompt):
    return cpo_loss(policy, BETA).mean() + CPO_ALPHA * chosen_nll(policy)


LAYOUTS = {"padded": ("padded", {}), "padding_free": ("padding_free", {}), "shared_prompt": ("padded", {"shared_prompt": True})}


@pytest.mark.slow  # two float64 forwards and backwards over the build, per layout: ~5 s
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_orpo_and_cpo_losses_and_gradients_equal_the_papers_unpacked(build, layout, monkeypatch):
    # A shared prompt's gradient sums its completions' before LlamaRMSNorm's float32 rounding, the unpacked
    # runs after it: the norm in its own dtype keeps both float64 (tests/train/test_shared_prompt.py).
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_its_dtype)
    pairs = pairs_of(build)
    window = batches(build, LAYOUTS[layout][0], **LAYOUTS[layout][1])
    for name, ours, paper in (("orpo", prepack_orpo, paper_orpo), ("cpo", prepack_cpo, paper_cpo)):
        alone_model, packed_model = tiny_llama(0), enable_packing(tiny_llama(0))
        expected = paper(alone(alone_model, pairs))
        got = ours(*packed(packed_model, window))
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=name)
        got.backward()
        expected.backward()
        for (parameter, a), b in zip(alone_model.named_parameters(), packed_model.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=f"{name} ({layout}): {parameter}")


def trl_batch(pairs) -> dict[str, torch.Tensor]:
    """TRL's ORPO / CPO batch of `pairs`: each side's prompt + completion ids, mask and labels (-100 on the
    prompt), right-padded (`DPODataCollatorWithPadding`'s form)."""
    batch = {}
    for side, index in (("chosen", 0), ("rejected", 1)):
        ids = [small(pair[index][0]) for pair in pairs]
        labels = [small(pair[index][1]) for pair in pairs]
        batch[f"{side}_input_ids"] = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=0)
        batch[f"{side}_attention_mask"] = torch.nn.utils.rnn.pad_sequence(
            [torch.ones_like(i) for i in ids], batch_first=True, padding_value=0)
        batch[f"{side}_labels"] = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-100)
    return batch


def trl_trainer(kind: str):
    """A stand-in for TRL's ORPOTrainer or CPOTrainer carrying what `get_batch_loss_metrics` reads, with the
    trainer's own methods bound to it."""
    if kind == "orpo":
        from trl.experimental.orpo.orpo_trainer import ORPOTrainer as trainer_class
    else:
        from trl.experimental.cpo.cpo_trainer import CPOTrainer as trainer_class
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)
    trainer = SimpleNamespace(
        is_encoder_decoder=False, padding_value=0, pad_token_id=0, accelerator=accelerator, aux_loss_enabled=False,
        beta=BETA, cpo_alpha=CPO_ALPHA, alpha=0.0, loss_type="sigmoid", label_smoothing=0.0, simpo_gamma=0.5,
        concatenated_inputs=trainer_class.concatenated_inputs, get_batch_logps=trainer_class.get_batch_logps,
    )
    for method in ("concatenated_forward", "odds_ratio_loss", "cpo_loss"):
        if hasattr(trainer_class, method):
            setattr(trainer, method, partial(getattr(trainer_class, method), trainer))
    return trainer_class, trainer


@pytest.mark.slow  # ~5 s
def test_orpo_and_cpo_equal_trls_trainers(build):
    pytest.importorskip("trl.experimental.orpo")
    pairs, window = pairs_of(build), batches(build, "padded")
    batch = trl_batch(pairs)
    # CPO: float64 throughout, loss and gradients.
    trainer_class, trainer = trl_trainer("cpo")
    trl_model, packed_model = tiny_llama(0), enable_packing(tiny_llama(0))
    trl_loss, _ = trainer_class.get_batch_loss_metrics(trainer, trl_model, batch)
    ours = prepack_cpo(*packed(packed_model, window))
    torch.testing.assert_close(ours, trl_loss, rtol=1e-12, atol=1e-12)
    trl_loss.backward()
    ours.backward()
    for (name, a), b in zip(trl_model.named_parameters(), packed_model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=f"cpo: {name}")
    # ORPO: its forward's float64 pieces to 1e-12, its float32 odds ratio (loss and gradients) to float32's precision.
    trainer_class, trainer = trl_trainer("orpo")
    trl_model, packed_model = tiny_llama(0), enable_packing(tiny_llama(0))
    with torch.no_grad():
        chosen, rejected, _, _, nll = trainer.concatenated_forward(trl_model, batch)
    trl_loss, _ = trainer_class.get_batch_loss_metrics(trainer, trl_model, batch)
    policy, prompt = packed(packed_model, window)
    torch.testing.assert_close(policy.chosen.detach() / policy.chosen_tokens, chosen, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(policy.rejected.detach() / policy.rejected_tokens, rejected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chosen_nll(policy, prompt).detach(), nll, rtol=1e-12, atol=1e-12)
    assert trl_loss.dtype == torch.float64  # the NLL's dtype; the odds-ratio term went through float32
    ours = prepack_orpo(policy, prompt)
    torch.testing.assert_close(ours.detach(), trl_loss.detach(), rtol=1e-6, atol=1e-7)
    trl_loss.backward()
    ours.backward()
    for (name, a), b in zip(trl_model.named_parameters(), packed_model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=f"orpo: {name}")


@pytest.mark.slow  # ~3 s
def test_documents_that_see_other_pairs_move_orpo_and_cpo(build):
    """The leak control: the same batches run as plain causal rows (each document seeing those before it)."""
    window = batches(build, "padded")
    with torch.no_grad():
        exact = packed(enable_packing(tiny_llama(0)), window)
        plain, policies, prompts = tiny_llama(0), [], []
        for batch in window:
            logits = plain(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            policies.append(pair_logps(logits, batch))
            prompts.append(prompt_logps(logits, batch))
        leaky = PairLogps(*(torch.cat(f) for f in zip(*policies))), tuple(torch.cat(f) for f in zip(*prompts))
        expected = paper_orpo(alone(tiny_llama(0), pairs_of(build))), paper_cpo(alone(tiny_llama(0), pairs_of(build)))
    for ours, paper, name in ((prepack_orpo, expected[0], "orpo"), (prepack_cpo, expected[1], "cpo")):
        torch.testing.assert_close(ours(*exact), paper, rtol=1e-12, atol=1e-12)
        assert (ours(*leaky) - paper).abs() > 1e-6, name
