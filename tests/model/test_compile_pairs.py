"""Compile once, for preference pairs: `PackedCollator(max_docs_per_pack=K)` over a `--pairs --max-docs-per-pack K`
build gives batches whose model inputs have shapes and Python values of (batch size, max-len, K) alone, in the
two-sequence layout (a pair is two documents) and in the shared-prompt one (`shared_prompt=True`: rows of
max-len, and the 4-D mask `enable_packing` builds from `shared_prompt_ids` is [B, 1, L, L] whatever the pairs).
Then `torch.compile(model, fullgraph=True, dynamic=False)` traces one forward and one backward graph over 50
steps of real pair packs holding 1 to 3 pairs, and every completion's log-probability equals the uncompiled
model's on the same batch.

What is compiled is the model. `pair_segments` and `reference_logps` ([P, 2], one row a pair) and the pair
losses follow the batch's pair count: they are the loss's, computed after the compiled forward
(docs/model-support.md, "Compiled training").

Graphs are counted as tests/model/test_compile.py counts them (its `GraphCount`, torch's own counters).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from prepack import PackedCollator, PackedDataset, enable_packing
from prepack.errors import UsageError
from prepack.training.preference import PairLogps, dpo_loss, model_inputs, pair_logps
from tests.model.test_compile import GraphCount, assert_one_graph, compiled, fixed_shape
from tests.train.test_preference import BETA, VOCAB, pair_build, small, tiny_llama

pytestmark = pytest.mark.slow  # each test traces a model: seconds of CPU

MAX_LEN, CAP, BATCH, STEPS = 192, 6, 2, 50
FLOAT64 = 1e-10  # the tiny Llama is float64: compiled (AOTAutograd, no code generation) against eager
LEAK = 1e-3
LAYOUTS = {"two-sequence": {}, "shared-prompt": {"shared_prompt": True}}


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> list[dict]:
    """Packs of examples/chitchat_pairs.py's pairs at most CAP documents (3 pairs) a pack."""
    dataset = PackedDataset(pair_build(tmp_path_factory.mktemp("compile_pairs"), 400, MAX_LEN, max_docs_per_pack=CAP))
    out = [dataset[index] for index in range(BATCH * STEPS)]
    assert {len(pack["cu_seqlens"]) - 1 for pack in out} == {2, 4, 6}  # the pair count varies from batch to batch
    return out


def batches(packs: list[dict], collator: PackedCollator) -> list[dict]:
    out = []
    for first in range(0, len(packs), BATCH):
        batch = collator(packs[first : first + BATCH])
        batch["input_ids"], batch["labels"] = small(batch["input_ids"]), small(batch["labels"])  # the tiny vocabulary
        out.append(batch)
    return out


def described(batch: dict) -> tuple:
    """Every shape and Python value of what the model is given."""
    return tuple((key, tuple(v.shape) if isinstance(v, torch.Tensor) else v) for key, v in model_inputs(batch).items())


# --- the batches ------------------------------------------------------------------------------------


def test_fixed_shape_pair_batches_depend_only_on_batch_size_max_len_and_k(packs):
    fixed = batches(packs, PackedCollator(MAX_LEN, max_docs_per_pack=CAP))
    default = batches(packs, PackedCollator(MAX_LEN))
    assert {described(batch) for batch in fixed} == {fixed_shape(BATCH, MAX_LEN, CAP)}
    assert len({described(batch) for batch in default}) > 3
    for a, b in zip(fixed, default):  # the same pairs, the same segments, then segments of no token
        assert torch.equal(a["pair_segments"], b["pair_segments"])
        used = len(b["cu_seq_lens_q"])
        assert torch.equal(a["cu_seq_lens_q"][:used], b["cu_seq_lens_q"])
        assert (a["cu_seq_lens_q"][used:] == BATCH * MAX_LEN).all()


def test_fixed_shape_shared_prompt_batches_depend_only_on_batch_size_and_max_len(packs):
    fixed = batches(packs, PackedCollator(MAX_LEN, shared_prompt=True, max_docs_per_pack=CAP))
    assert {described(batch) for batch in fixed} == {(
        ("input_ids", (BATCH, MAX_LEN)),
        ("labels", (BATCH, MAX_LEN)),
        ("position_ids", (BATCH, MAX_LEN)),
        ("shared_prompt_ids", (BATCH, MAX_LEN)),
        ("shared_prompt_parts", 3),
        ("use_cache", False),
    )}
    default = batches(packs, PackedCollator(MAX_LEN, shared_prompt=True))  # rows of the batch's longest re-laid pack
    assert len({described(batch) for batch in default}) > 3
    pinned = batches(packs, PackedCollator(MAX_LEN, shared_prompt=True, pad_to="max_len"))
    for a, b in zip(fixed, pinned):  # the cap refuses; it changes nothing else
        assert all(torch.equal(a[key], b[key]) for key in b if isinstance(b[key], torch.Tensor))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_pair_pack_over_the_cap_is_refused_never_split(layout, packs):
    two_pairs = next(pack for pack in packs if len(pack["cu_seqlens"]) == 5)  # twice: four pairs, 8 documents
    cu = two_pairs["cu_seqlens"]
    many = {
        "input_ids": np.concatenate([two_pairs["input_ids"]] * 2),
        "labels": np.concatenate([two_pairs["labels"]] * 2),
        "cu_seqlens": np.concatenate([cu, cu[1:] + cu[-1]]),
        "pair_roles": np.tile([0, 1], 4),
    }
    with pytest.raises(UsageError, match="Pack 1 holds 8 documents, more than max_docs_per_pack=6"):
        PackedCollator(2 * MAX_LEN, max_docs_per_pack=CAP, **LAYOUTS[layout])([packs[0], many])


@pytest.mark.parametrize("options", [{"layout": "padding_free"}, {"pad_to": "longest"}])
def test_fixed_shape_shared_prompt_batches_need_rows_of_max_len(options):
    with pytest.raises(UsageError, match="max_docs_per_pack"):
        PackedCollator(MAX_LEN, shared_prompt=True, max_docs_per_pack=CAP, **options)


# --- one graph --------------------------------------------------------------------------------------


def concatenated(parts: list[PairLogps]) -> PairLogps:
    return PairLogps(*(torch.cat(field) for field in zip(*parts)))


# sdpa on both layouts; eager on the shared-prompt one (eager reads the same 4-D mask, and test_compile.py
# measures eager on position ids).
@pytest.mark.parametrize("layout, attn", [("two-sequence", "sdpa"), ("shared-prompt", "sdpa"), ("shared-prompt", "eager")])
def test_one_forward_and_one_backward_graph_over_fifty_steps_of_pairs(layout, attn, packs):
    eager, fast = (enable_packing(tiny_llama(0)).train() for _ in range(2))  # the same seeded weights
    for model in (eager, fast):
        model.set_attn_implementation(attn)
    graphs = GraphCount()
    model = compiled(fast, graphs)
    got, want = [], []
    for batch in batches(packs, PackedCollator(MAX_LEN, max_docs_per_pack=CAP, **LAYOUTS[layout])):
        reference = pair_logps(eager(**model_inputs(batch)).logits, batch)
        policy = pair_logps(model(**model_inputs(batch)).logits, batch)
        dpo_loss(policy, PairLogps(*(f.detach() for f in reference)), BETA).mean().backward()
        dpo_loss(reference, PairLogps(*(f.detach() for f in reference)), BETA).mean().backward()
        got.append(PairLogps(*(f.detach() for f in policy)))
        want.append(PairLogps(*(f.detach() for f in reference)))
    got, want = concatenated(got), concatenated(want)
    worst = max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want))
    print(f"{layout} pairs on {attn}: {STEPS} steps, {len(got.chosen)} pairs, {graphs.forward} forward and "
          f"{graphs.backward} backward graphs, worst completion log-probability difference {worst:.1e}")
    assert_one_graph(graphs)
    for name in PairLogps._fields:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=FLOAT64, msg=name)
    for a, b in zip(fast.parameters(), eager.parameters()):  # 50 steps of gradients, summed
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=FLOAT64)


# --- the controls: a leaking layout moves the log-probabilities; default shared-prompt rows recompile -


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_check_fails_when_the_pairs_see_each_other(layout, packs):
    model = enable_packing(tiny_llama(0)).eval()
    fast = compiled(model, GraphCount())
    batch = batches(packs, PackedCollator(MAX_LEN, max_docs_per_pack=CAP, **LAYOUTS[layout]))[0]
    if layout == "shared-prompt":  # every rejected token (part 2) in its chosen completion's part: it sees it
        ids = batch["shared_prompt_ids"]
        leaking = batch | {"shared_prompt_ids": torch.where(ids % 3 == 2, ids - 1, ids)}
    else:  # one segment a row: the rejected document sees the chosen one before it
        rows = torch.arange(MAX_LEN).expand(BATCH, MAX_LEN)
        leaking = batch | {"position_ids": rows}
    with torch.no_grad():
        want = pair_logps(model(**model_inputs(batch)).logits, batch)
        right = pair_logps(fast(**model_inputs(batch)).logits, batch)
        wrong = pair_logps(fast(**model_inputs(leaking)).logits, batch)
    assert (right.rejected - want.rejected).abs().max() < FLOAT64
    assert (wrong.rejected - want.rejected).abs().max() > LEAK


def test_default_shared_prompt_rows_recompile_per_width(packs):
    """Rows of each batch's longest re-laid pack (the layout's default): a new width, a new graph."""
    model = enable_packing(tiny_llama(0)).eval()
    fast = compiled(model, GraphCount())
    widths = set()
    with torch.no_grad():
        for batch in batches(packs[: 4 * BATCH], PackedCollator(MAX_LEN, shared_prompt=True)):
            fast(**model_inputs(batch))
            widths.add(batch["input_ids"].shape[1])
    assert len(widths) > 1 and counters["stats"]["unique_graphs"] == len(widths), (widths, dict(counters["stats"]))


def test_the_pair_loss_follows_the_pair_count(packs):
    """`pair_logps` compiled on its own: its [P, 2] outputs follow the batch's pairs, so it is traced again for
    each new pair count (the shared-prompt one also reads the count from the ids, a graph break). The model is
    what compiles once; the pair loss runs after it."""
    for layout, options in LAYOUTS.items():
        graphs = GraphCount()
        torch._dynamo.reset()
        counters.clear()
        loss = torch.compile(pair_logps, backend=graphs.backend, dynamic=False)
        pair_counts = set()
        for batch in batches(packs[: 20 * BATCH], PackedCollator(MAX_LEN, max_docs_per_pack=CAP, **options)):
            logits = torch.randn(*batch["labels"].shape, VOCAB, dtype=torch.float64)
            pair_counts.add(len(loss(logits, batch).chosen))
        assert len(pair_counts) > 1 and counters["stats"]["unique_graphs"] >= len(pair_counts), (layout, dict(counters["stats"]))
