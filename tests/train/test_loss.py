"""`prepack.training.loss`: with 2-process gloo DDP and k accumulation steps over packed micro-batches, the
accumulated gradients equal those of one big unpacked batch of the same documents, under token-mean
and document-mean weighting; and the weights themselves."""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from prepack.model.packing import enable_packing
from prepack.training.collate import PackedCollator
from prepack.training.loss import loss_weights, weighted_loss

WORLD, ACCUMULATION, BATCH = 2, 3, 2
DOCS_PER_PACK = [2, 1, 3, 1, 1, 2, 2, 1, 1, 3, 2, 1]  # WORLD × ACCUMULATION × BATCH packs


def documents() -> list[tuple[list[int], list[int]]]:
    """(tokens, labels) of each document: prompts masked with -100, one document not trained at all."""
    rng = np.random.default_rng(0)
    docs = []
    for number in range(sum(DOCS_PER_PACK)):
        tokens = rng.integers(0, 60, size=int(rng.integers(2, 24))).tolist()
        prompt = len(tokens) if number == 4 else int(rng.integers(0, len(tokens) - 1))
        docs.append((tokens, [-100] * prompt + tokens[prompt:]))
    return docs


def packs() -> list[dict]:
    docs, result, start = documents(), [], 0
    for count in DOCS_PER_PACK:
        chosen = docs[start : start + count]
        start += count
        result.append({
            "input_ids": np.concatenate([t for t, _ in chosen]),
            "labels": np.concatenate([l for _, l in chosen]),
            "cu_seqlens": np.concatenate([[0], np.cumsum([len(t) for t, _ in chosen])]),
        })
    return result


def model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float64)


def unpacked_gradients(weighting: str) -> dict[str, torch.Tensor]:
    """One padded batch with one document per row, its loss weighted from per-token cross-entropy."""
    docs = documents()
    width = max(len(t) for t, _ in docs)
    input_ids = torch.tensor([t + [0] * (width - len(t)) for t, _ in docs])
    labels = torch.tensor([l + [-100] * (width - len(l)) for _, l in docs])
    attention_mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t, _ in docs])
    net = model()
    logits = net(input_ids=input_ids, attention_mask=attention_mask).logits
    targets = labels[:, 1:]
    trained = targets != -100
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), targets.clamp(min=0), reduction="none") * trained
    if weighting == "token":
        loss = ce.sum() / trained.sum()
    else:
        has = trained.sum(1) > 0
        loss = (ce.sum(1)[has] / trained.sum(1)[has]).mean()
    loss.backward()
    return {name: p.grad.clone() for name, p in net.named_parameters()}


def ddp_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    net = torch.nn.parallel.DistributedDataParallel(enable_packing(model()))
    collate = PackedCollator(max_len=64)
    mine = packs()[rank * ACCUMULATION * BATCH : (rank + 1) * ACCUMULATION * BATCH]
    window = [collate(mine[i * BATCH : (i + 1) * BATCH]) for i in range(ACCUMULATION)]
    result = {}
    for weighting in ("token", "document"):
        net.zero_grad()
        weights = [loss_weights(batch, weighting) for batch in window]
        total = sum(w.sum() for w in weights)
        dist.all_reduce(total)
        for step, (batch, w) in enumerate(zip(window, weights)):
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            sync = step == ACCUMULATION - 1
            with net.no_sync() if not sync else torch.enable_grad():
                logits = net(**inputs).logits
                (weighted_loss(logits, batch["labels"], w, total) * WORLD).backward()
        result[weighting] = {name.removeprefix("module."): p.grad.clone() for name, p in net.named_parameters()}
    torch.save(result, f"{out}/rank{rank}.pt")
    # Free DDP's reducer while the group is alive and both ranks are here: torn down in the other order,
    # gloo now and then waits forever on a peer that has already exited.
    del net
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_accumulated_gradients_equal_one_unpacked_batch(tmp_path):
    workers = mp.spawn(ddp_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 300  # a collective that never completes fails the test, not the whole run
    while not workers.join(timeout=5):
        if time.monotonic() > deadline:
            for process in workers.processes:
                process.kill()
            pytest.fail("the DDP workers did not finish within 300 s")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for weighting in ("token", "document"):
        expected = unpacked_gradients(weighting)
        for rank in ranks:
            assert rank[weighting].keys() == expected.keys()
            for name, grad in expected.items():
                torch.testing.assert_close(rank[weighting][name], grad, rtol=1e-9, atol=1e-12, msg=f"{weighting} {name}")
    # The two weightings differ on these documents, so each comparison checks its own normalizer.
    assert not torch.allclose(ranks[0]["token"]["lm_head.weight"], ranks[0]["document"]["lm_head.weight"])


def test_weights_count_trained_tokens_and_give_each_document_one():
    batch = PackedCollator(max_len=64)(packs()[:4])
    token = loss_weights(batch, "token")
    labels = batch["labels"]
    assert token.sum() == sum(sum(x != -100 for x in l[1:]) for _, l in documents()[:7])
    assert torch.equal(token, (labels != -100).to(torch.float64))
    document = loss_weights(batch, "document")
    trained_docs = sum(any(x != -100 for x in l[1:]) for _, l in documents()[:7])
    assert document.sum().item() == pytest.approx(trained_docs)
    flat = PackedCollator(layout="padding_free")(packs()[:4])
    assert loss_weights(flat, "document").sum().item() == pytest.approx(trained_docs)
    with pytest.raises(ValueError, match="weighting"):
        loss_weights(batch, "row")
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        loss_weights(PackedCollator(max_len=64, layout="indexed_mask")(packs()[:1]), "document")
