"""`prepack.training.preference` on a real preference-pair build (examples/chitchat_pairs.py's pairs): in
float64 on a tiny random Llama, the packed DPO / IPO / SimPO losses and their gradients equal those of
every sequence run alone (plain unpacked DPO), and the DPO loss equals TRL 1.16's DPOTrainer loss
computation (`DPOTrainer._compute_loss`, its collator and fused LM head) on the same pairs. Breaking the
pairing, or letting documents attend across pairs, changes the numbers: the comparison would catch it.

The tiny model has 128 token ids: every token id of the build is taken modulo 128, in the packed batches
and in the unpacked reference alike.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import socket
import sys
import time
from datetime import timedelta
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

import prepack
from prepack import PackedDataset
from prepack.model.packing import enable_packing
from prepack.training.collate import PackedCollator
from prepack.training.loss import loss_weights, weighted_sum
from prepack.training.preference import PairLogps, dpo_loss, ipo_loss, model_inputs, pair_logps, simpo_loss
from tests.demo_inputs import CHATML, chitchat_pairs, gpt2_directory

VOCAB, MAX_LEN, PAIRS, BETA = 128, 256, 12, 0.1
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def pair_build(root: Path, pairs: int = PAIRS, max_len: int = MAX_LEN, **options) -> Path:
    """A pair build under `root` of the first `pairs` pairs of examples/chitchat_pairs.py's, chat with the demo
    tokenizer; `options` go to `prepack.build`."""
    corpus = root / "pairs.jsonl"
    corpus.write_text("".join(json.dumps(pair) + "\n" for pair in chitchat_pairs()[:pairs]))
    tokenizer = gpt2_directory(root / "gpt2", CHATML)
    prepack.build(corpus, root / "packed", max_len=max_len, tokenizer=tokenizer, chat=True, pairs=True, overflow="drop",
                  num_proc=1, **options)  # a few pairs: no worker processes to start
    return root / "packed"


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    return pair_build(tmp_path_factory.mktemp("preference"))


def tiny_llama(seed: int, vocab: int = VOCAB) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float64)


def small(ids):
    """Token ids (or labels, -100 kept) taken into the tiny vocabulary."""
    ids = torch.as_tensor(np.asarray(ids, np.int64))
    return torch.where(ids == -100, ids, ids % VOCAB)


def pairs_of(build: Path) -> list[tuple[tuple, tuple]]:
    """Every pair of the build, in pack order: ((ids, labels) of chosen, of rejected), each document alone."""
    pairs = []
    for pack in PackedDataset(build):
        cu = pack["cu_seqlens"]
        docs = [(pack["input_ids"][cu[j] : cu[j + 1]], pack["labels"][cu[j] : cu[j + 1]]) for j in range(len(cu) - 1)]
        pairs += list(zip(docs[0::2], docs[1::2]))
    return pairs


def batches(build: Path, layout: str, per_batch: int = 2, **collator_options) -> list[dict]:
    dataset = PackedDataset(build)
    collate = PackedCollator.for_dataset(dataset, layout=layout, **collator_options)
    result = []
    for first in range(0, len(dataset), per_batch):
        batch = collate([dataset[i] for i in range(first, min(first + per_batch, len(dataset)))])
        batch["input_ids"], batch["labels"] = small(batch["input_ids"]), small(batch["labels"])
        result.append(batch)
    return result


def alone_logps(model, ids, labels) -> tuple[torch.Tensor, int]:
    """Summed log-probability of a document's trained tokens, the document run alone, and their count."""
    ids, labels = small(ids), small(labels)
    logits = model(input_ids=ids[None]).logits[0, :-1]
    trained = labels[1:] != -100
    logp = torch.log_softmax(logits, -1).gather(1, ids[1:, None].clamp(min=0))[:, 0]
    return (logp * trained).sum(), int(trained.sum())


def unpacked(model, pairs) -> PairLogps:
    rows = [[alone_logps(model, *doc) for doc in pair] for pair in pairs]
    return PairLogps(
        torch.stack([c for (c, _), _ in rows]), torch.stack([r for _, (r, _) in rows]),
        torch.tensor([n for (_, n), _ in rows]), torch.tensor([n for _, (_, n) in rows]),
    )


def packed(model, window: list[dict]) -> PairLogps:
    parts = [pair_logps(model(**model_inputs(batch)).logits, batch) for batch in window]
    return PairLogps(*(torch.cat(field) for field in zip(*parts)))


LOSSES = {
    "dpo": lambda p, r: -F.logsigmoid(BETA * ((p.chosen - r.chosen) - (p.rejected - r.rejected))),
    "ipo": lambda p, r: ((p.chosen - r.chosen) / p.chosen_tokens - (p.rejected - r.rejected) / p.rejected_tokens - 1 / (2 * BETA)) ** 2,
    "simpo": lambda p, r: -F.logsigmoid(2.0 * (p.chosen / p.chosen_tokens - p.rejected / p.rejected_tokens) - 0.5),
}
PREPACK_LOSSES = {
    "dpo": lambda p, r: dpo_loss(p, r, BETA),
    "ipo": lambda p, r: ipo_loss(p, r, BETA),
    "simpo": lambda p, r: simpo_loss(p, 2.0, 0.5),
}


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_the_build_packs_several_pairs_a_pack(build):
    manifest = prepack.formats.shards.read_manifest(build)
    assert manifest.pairs.pairs == PAIRS and manifest.pairs.dropped < PAIRS // 4
    most = max(len(pack["cu_seqlens"]) - 1 for pack in PackedDataset(build)) // 2
    assert manifest.totals.packs < PAIRS - manifest.pairs.dropped and most >= 2  # pairs share packs
    assert len(pairs_of(build)) == PAIRS - manifest.pairs.dropped


@pytest.mark.slow  # four tiny-model forwards and backwards in float64 over the build: ~10-20 s
@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_packed_losses_and_gradients_equal_unpacked(build, layout):
    reference_model = tiny_llama(1)
    with torch.no_grad():
        reference = unpacked(reference_model, pairs_of(build))
        packed_reference = packed(enable_packing(reference_model), batches(build, layout))
    for name in PairLogps._fields:
        torch.testing.assert_close(getattr(packed_reference, name), getattr(reference, name), rtol=1e-12, atol=1e-10)
    alone_model, packed_model = tiny_llama(0), enable_packing(tiny_llama(0))
    alone, together = unpacked(alone_model, pairs_of(build)), packed(packed_model, batches(build, layout))
    for loss in LOSSES:
        expected_loss = LOSSES[loss](alone, reference).mean()
        packed_loss = PREPACK_LOSSES[loss](together, packed_reference).mean()
        torch.testing.assert_close(packed_loss, expected_loss, rtol=1e-12, atol=1e-12, msg=loss)
        expected = torch.autograd.grad(expected_loss, list(alone_model.parameters()), retain_graph=True)
        got = torch.autograd.grad(packed_loss, list(packed_model.parameters()), retain_graph=True)
        for (name, _), a, b in zip(alone_model.named_parameters(), got, expected):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"{loss}: {name}")


@pytest.mark.slow  # ~10 s
def test_broken_pairing_and_leaks_across_pairs_change_the_loss(build):
    model = tiny_llama(0)
    reference = tiny_llama(1)
    with torch.no_grad():
        ref = unpacked(reference, pairs_of(build))
        expected = dpo_loss(unpacked(model, pairs_of(build)), ref, BETA)
        window = batches(build, "padded")
        ref_packed = packed(enable_packing(reference), window)
        torch.testing.assert_close(dpo_loss(packed(enable_packing(model), window), ref_packed, BETA), expected)
        # Pairing broken: each pair's chosen matched with the next pair's rejected.
        shifted = [dict(batch, pair_segments=torch.stack([batch["pair_segments"][:, 0], batch["pair_segments"][:, 1].roll(1)], 1))
                   for batch in window]
        broken = dpo_loss(packed(model, shifted), ref_packed, BETA)
        assert not torch.allclose(broken, expected, rtol=1e-6, atol=1e-9)
        # Leaking: the packs run as plain causal rows, every document seeing the ones before it.
        leaky = [{"input_ids": batch["input_ids"], "labels": batch["labels"], "cu_seq_lens_q": batch["cu_seq_lens_q"],
                  "pair_segments": batch["pair_segments"]} for batch in window]
        plain = tiny_llama(0)
        logps = PairLogps(*(torch.cat(f) for f in zip(*[pair_logps(plain(input_ids=b["input_ids"]).logits, b) for b in leaky])))
        assert not torch.allclose(dpo_loss(logps, ref_packed, BETA), expected, rtol=1e-6, atol=1e-9)


def test_a_batch_of_half_pairs_is_refused(build):
    from prepack.errors import IsolationError

    pack = dict(PackedDataset(build)[0])
    pack["pair_roles"] = pack["pair_roles"][::-1].copy()
    with pytest.raises(IsolationError, match="do not make whole pairs"):
        PackedCollator(MAX_LEN)([pack])


class _Float64Head(torch.nn.Module):
    """What TRL's fused LM head returns (`FusedCausalLMOutput`: per-token log-probabilities of the shifted
    labels, 0 where -100, and the metrics' fields), computed from the model's float64 logits. TRL's own
    kernel (`trl.kernels.chunked_logprob`) works in float32 whatever the model's dtype."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.training = True

    def forward(self, input_ids, attention_mask, labels, fused_lm_head, **kwargs):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits[:, :-1]
        targets = labels[:, 1:]
        trained = targets != -100
        log_probs = torch.log_softmax(logits, -1).gather(2, targets.clamp(min=0)[..., None])[..., 0] * trained
        zeros = torch.zeros_like(log_probs)
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def trl_dpo_loss(model, pairs, reference: PairLogps) -> torch.Tensor:
    """TRL 1.16's DPO loss of `pairs` (documents as (ids, labels)), from `DPOTrainer._compute_loss` on the
    batch of its `DataCollatorForPreference`, with the reference log-probs precomputed."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    examples = []
    for (chosen, labels), (rejected, _) in pairs:
        prompt = int(np.flatnonzero(labels != -100)[0])
        examples.append({"prompt_ids": small(chosen[:prompt]).tolist(), "chosen_ids": small(chosen[prompt:]).tolist(),
                         "rejected_ids": small(rejected[prompt:]).tolist()})
    inputs = DataCollatorForPreference(pad_token_id=0)(examples)
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = reference.chosen, reference.rejected
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = SimpleNamespace(
        model=model, accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=["sigmoid"], loss_weights=[1.0], beta=BETA, use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    return DPOTrainer._compute_loss(trainer, model, inputs, False)


@pytest.mark.slow  # ~10 s
def test_dpo_loss_equals_trls_dpo_trainer(build):
    """In float64 to 1e-12 with TRL's loss code on a float64 LM head; with TRL's own fused LM head (float32
    inside) to float32 precision."""
    pytest.importorskip("trl.trainer.dpo_trainer")
    from trl.trainer.utils import add_fused_lm_head

    pairs = pairs_of(build)
    reference_model = tiny_llama(1)
    with torch.no_grad():
        window = batches(build, "padded")
        reference = packed(enable_packing(reference_model), window)
    model = enable_packing(tiny_llama(0))
    ours = dpo_loss(packed(model, window), reference, BETA).mean()
    ours.backward()
    ours_grads = gradients(model)

    head = _Float64Head(tiny_llama(0))
    trl_loss = trl_dpo_loss(head, pairs, reference)
    trl_loss.backward()
    torch.testing.assert_close(ours, trl_loss, rtol=1e-12, atol=1e-12)
    for name, grad in gradients(head.model).items():
        torch.testing.assert_close(ours_grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)

    fused = tiny_llama(0)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    torch.testing.assert_close(ours, trl_dpo_loss(fused, pairs, reference), rtol=1e-6, atol=1e-7)


# A step's weighting: the first 24 pairs at 512 tokens make packs of 4, 3, 5, 6, 3 and 3 pairs.
STEP_PAIRS, STEP_MAX_LEN = 24, 512
WORLD, RANK_PACKS = 2, [[0, 1], [2, 3]]  # two ranks, two micro-batches of one pack each: 4 + 3 and 5 + 6 pairs


@pytest.fixture(scope="module")
def step_build(tmp_path_factory) -> Path:
    return pair_build(tmp_path_factory.mktemp("step"), pairs=STEP_PAIRS, max_len=STEP_MAX_LEN)


def pairs_per_pack(build: Path) -> list[int]:
    return [(len(pack["cu_seqlens"]) - 1) // 2 for pack in PackedDataset(build)]


def test_pair_weights_give_each_pair_of_a_batch_one(step_build):
    """`loss_weights(batch, "pair")`: 1 per pair, in either layout and in the shared-prompt one, so that a window's
    weights sum to its pairs, and `weighted_sum` over one batch is the mean of its pair losses."""
    assert pairs_per_pack(step_build) == [4, 3, 5, 6, 3, 3]
    for layout, options in (("padded", {}), ("padding_free", {}), ("padded", {"shared_prompt": True})):
        for batch, pairs in zip(batches(step_build, layout, **options), [7, 11, 6], strict=True):
            weights = loss_weights(batch, "pair")
            assert torch.equal(weights, torch.ones(pairs, dtype=torch.float64)), (layout, options)
            losses = torch.rand(pairs, dtype=torch.float64)
            torch.testing.assert_close(weighted_sum(losses, weights, weights.sum()), losses.mean(), rtol=1e-15, atol=0)


def equal_weight_step(build: Path, packs: list[int]) -> tuple[float, dict[str, torch.Tensor]]:
    """One optimizer step's objective and its gradient: the mean DPO loss over every pair of `packs`, each
    pair weighing the same (one batch of them all)."""
    dataset = PackedDataset(build)
    batch = PackedCollator.for_dataset(dataset)([dataset[i] for i in packs])
    batch["input_ids"], batch["labels"] = small(batch["input_ids"]), small(batch["labels"])
    model = enable_packing(tiny_llama(0))
    with torch.no_grad():
        reference = pair_logps(enable_packing(tiny_llama(1))(**model_inputs(batch)).logits, batch)
    loss = dpo_loss(pair_logps(model(**model_inputs(batch)).logits, batch), reference, BETA).mean()
    loss.backward()
    return loss.item(), gradients(model)


def assert_gradients_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12, msg=f"{what}: {name}")


class _Gradients(TrainerCallback):
    """The gradients at the optimizer step, before it changes the weights."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.gradients = gradients(model)


def trl_recipe_step(recipe: dict, build: str, step: list[int], out: str) -> tuple[object, list[int], "_Gradients"]:
    """examples/train_dpo_trl.py's trainer set for one step over the packs `step` (one a micro-batch, accumulation
    2), its ids folded into the tiny vocabulary, unclipped: the trainer, the pairs each micro-batch held (filled
    as it trains) and the callback that records the gradients at the optimizer step."""
    args = argparse.Namespace(data=build, model=None, steps=1, batch_size=1, accumulation=2, lr=1e-3, workers=0,
                              reference=None)
    model, reference = enable_packing(tiny_llama(0)), enable_packing(tiny_llama(1)).eval().requires_grad_(False)
    trainer = recipe["packed_dpo_trainer"](args, model, reference, out)
    trainer.train_dataset = trainer.train_dataset.select(step)
    trainer.args.max_grad_norm = 0  # the gradient as the loss gives it, unclipped
    collate, pairs = trainer.data_collator, []

    def in_tiny_vocabulary(rows):
        batch = collate(rows)
        batch["input_ids"], batch["labels"] = small(batch["input_ids"]), small(batch["labels"])
        pairs.append(len(batch["pair_segments"]))
        return batch

    trainer.data_collator = in_tiny_vocabulary
    recorded = _Gradients()
    trainer.add_callback(recorded)
    return trainer, pairs, recorded


@pytest.mark.slow  # ~5 s: a float64 TRL step of two micro-batches
def test_trl_recipe_under_gradient_accumulation_weighs_every_pair_the_same(step_build, tmp_path, monkeypatch):
    """examples/train_dpo_trl.py's trainer, gradient accumulation 2 over packs of 4 and 6 pairs: the step's
    gradient is that of the mean over its 10 pairs, not the mean of the two micro-batches' means."""
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the recipe's `from tiny_model import ...`
    recipe = runpy.run_path(str(EXAMPLES / "train_dpo_trl.py"))
    step = [0, 3]
    assert [pairs_per_pack(step_build)[i] for i in step] == [4, 6]
    trainer, pairs, recorded = trl_recipe_step(recipe, str(step_build), step, str(tmp_path))
    trainer.train()
    assert sorted(pairs) == [4, 6] and trainer.state.global_step == 1
    assert_gradients_equal(recorded.gradients, equal_weight_step(step_build, step)[1], "TRL, accumulation 2")


def trl_ddp_worker(rank: int, port: int, out: str, build: str) -> None:
    """examples/train_dpo_trl.py's trainer as one of two processes, as torchrun starts them: one step of two
    micro-batches of one pack each, on this rank's share of the four packs."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))  # the recipe's `from tiny_model import ...`
    recipe = runpy.run_path(str(EXAMPLES / "train_dpo_trl.py"))
    step = [pack for packs in RANK_PACKS for pack in packs]
    trainer, pairs, recorded = trl_recipe_step(recipe, build, step, f"{out}/trainer{rank}")
    trainer.train()
    torch.save({"gradients": recorded.gradients, "pairs": pairs, "processes": trainer.accelerator.num_processes,
                "steps": trainer.state.global_step}, f"{out}/trl{rank}.pt")
    del trainer  # its model, DDP's reducer before the process group, both ranks here (tests/train/test_loss.py)
    dist.barrier()
    dist.destroy_process_group()


def ddp_worker(rank: int, store: str, out: str, build: str) -> None:
    """examples/train_dpo_plain_loop.py's step on this rank's two micro-batches, in a DDP model."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    import sys

    sys.path.insert(0, str(EXAMPLES))  # the recipe's `from tiny_model import ...`
    recipe = runpy.run_path(str(EXAMPLES / "train_dpo_plain_loop.py"))
    net = torch.nn.parallel.DistributedDataParallel(enable_packing(tiny_llama(0)))
    reference = enable_packing(tiny_llama(1)).eval().requires_grad_(False)
    window = [batches(Path(build), "padded", per_batch=1)[i] for i in RANK_PACKS[rank]]
    loss, _, pairs = recipe["dpo_step"](net, reference, window, "dpo", BETA)
    torch.save({"gradients": {name.removeprefix("module."): p.grad.clone() for name, p in net.named_parameters()},
                "loss": loss, "pairs": pairs}, f"{out}/rank{rank}.pt")
    # DDP's reducer goes while the group is alive and both ranks are here (tests/train/test_loss.py).
    del net
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # ~20 s: two spawned processes
def test_plain_recipe_on_two_ddp_ranks_with_accumulation_weighs_every_pair_the_same(step_build, tmp_path):
    """examples/train_dpo_plain_loop.py's step on two gloo ranks, two micro-batches each (4 + 3 and 5 + 6
    pairs): every rank's gradient is that of the mean over the step's 18 pairs."""
    join_or_fail(mp.spawn(ddp_worker, args=(str(tmp_path / "store"), str(tmp_path), str(step_build)), nprocs=WORLD, join=False))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    step = [pack for packs in RANK_PACKS for pack in packs]
    expected_loss, expected = equal_weight_step(step_build, step)
    for number, rank in enumerate(ranks):
        assert rank["pairs"] == sum(pairs_per_pack(step_build)[i] for i in step) == 18
        assert rank["loss"] == pytest.approx(expected_loss, rel=1e-12)  # the step's mean, on every rank
        assert_gradients_equal(rank["gradients"], expected, f"rank {number}")


def join_or_fail(workers, seconds: int = 300) -> None:
    deadline = time.monotonic() + seconds  # a collective that never completes fails the test, not the whole run
    while not workers.join(timeout=5):
        if time.monotonic() > deadline:
            for process in workers.processes:
                process.kill()
            pytest.fail(f"the DDP workers did not finish within {seconds} s")


@pytest.mark.slow  # ~30-60 s: two spawned processes, each a TRL trainer
def test_trl_recipe_on_two_ranks_with_accumulation_weighs_every_pair_the_same(step_build, tmp_path):
    """examples/train_dpo_trl.py's trainer on two gloo ranks (Accelerate's), two micro-batches each of packs of
    4, 3, 5 and 6 pairs: every rank's gradient is that of the mean over the step's 18 pairs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    join_or_fail(mp.spawn(trl_ddp_worker, args=(port, str(tmp_path), str(step_build)), nprocs=WORLD, join=False))
    ranks = [torch.load(tmp_path / f"trl{r}.pt") for r in range(WORLD)]
    step = [pack for packs in RANK_PACKS for pack in packs]
    assert sorted(n for rank in ranks for n in rank["pairs"]) == sorted(pairs_per_pack(step_build)[i] for i in step)
    expected = equal_weight_step(step_build, step)[1]
    for number, rank in enumerate(ranks):
        assert rank["processes"] == WORLD and rank["steps"] == 1 and len(rank["pairs"]) == 2
        assert_gradients_equal(rank["gradients"], expected, f"TRL rank {number}")
