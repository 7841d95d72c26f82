"""The shared-prompt layout of preference pairs (`PackedCollator(shared_prompt=True)`,
`prepack.model.shared_prompt`, `prepack.training.shared_prompt`) on test_preference's real pair build: in
float64 on its tiny random Llama, the DPO loss and its gradients equal plain unpacked DPO (each prompt +
completion run alone); on flex_attention (torch's flex uncompiled, `tests.flash_reference`, which has no
backward on a CPU) the log-probabilities and the DPO loss do; a mask, or a flex BlockMask, that lets a rejected
completion see the chosen one fails that comparison; the layout computes fewer positions than the
two-sequence one, by what `inspect` says a prompt stored once saves; varlen backends, sliding-window
families and families isolated by layer or block masks or per document are refused by name.

transformers' LlamaRMSNorm computes in float32 whatever the model's dtype, and so rounds the gradient
through it to float32: the unpacked run sums a prompt token's two gradients (one per document) after that
rounding, the shared layout before it, and the two differ at float32 precision (~4e-9 here). The gradient
test gives the norm its own dtype, so that both are float64 throughout and must agree to 1e-10.
"""

from __future__ import annotations

import pytest
import torch

from prepack import PackedDataset
from prepack.check.report import inspect_build
from torch.nn.attention.flex_attention import create_block_mask, or_masks

from prepack.errors import IsolationError, UsageError
from prepack.model.isolation import default_tolerances
from prepack.model.packing import enable_packing
from prepack.model.shared_prompt import shared_prompt_block_mask, shared_prompt_mask
from prepack.training.collate import PackedCollator
from prepack.training.preference import PairLogps, dpo_loss, model_inputs, pair_logps
from transformers.models.llama import modeling_llama

from tests import flash_reference
from tests.train.test_preference import BETA, MAX_LEN, batches, pair_build, pairs_of, tiny_llama, unpacked

use_flex_reference = flash_reference.use_flex_reference  # the fixture, which pytest finds by this name
FLEX_TOLERANCE, FLEX_LOSS_TOLERANCE = default_tolerances(torch.float64, "flex_attention")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return pair_build(tmp_path_factory.mktemp("shared_prompt"))


def shared(model, window: list[dict], **overrides) -> PairLogps:
    parts = [pair_logps(model(**model_inputs(batch), **overrides).logits, batch) for batch in window]
    return PairLogps(*(torch.cat(field) for field in zip(*parts)))


def flex_llama(seed: int):
    model = tiny_llama(seed)
    model.set_attn_implementation("flex_attention")
    return model


def rejected_sees_chosen(ids: torch.Tensor):
    """A leaking mask_mod: a rejected token (part 2) also sees its pair's chosen completion (part 1)."""

    def mask_mod(batch, head, query, key):
        query_id, key_id = ids[batch, query], ids[batch, key]
        return (query_id // 3 == key_id // 3) & (query_id % 3 == 2) & (key_id % 3 == 1)

    return mask_mod


def _rms_norm_in_its_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_shared_prompt_dpo_loss_and_gradients_equal_unpacked(build, layout, monkeypatch):
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_its_dtype)
    pairs = pairs_of(build)
    window = batches(build, layout, shared_prompt=True)
    with torch.no_grad():
        reference = unpacked(tiny_llama(1), pairs)
        shared_reference = shared(enable_packing(tiny_llama(1)), window)
    for name in PairLogps._fields:
        torch.testing.assert_close(getattr(shared_reference, name), getattr(reference, name), rtol=0, atol=1e-10)
    alone_model, shared_model = tiny_llama(0), enable_packing(tiny_llama(0))
    expected = dpo_loss(unpacked(alone_model, pairs), reference, BETA).mean()
    got = dpo_loss(shared(shared_model, window), shared_reference, BETA).mean()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    expected_grads = torch.autograd.grad(expected, list(alone_model.parameters()))
    got_grads = torch.autograd.grad(got, list(shared_model.parameters()))
    for (name, _), a, b in zip(alone_model.named_parameters(), got_grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)


def test_a_mask_letting_rejected_see_chosen_fails_the_comparison(build):
    model = tiny_llama(0)
    window = batches(build, "padded", shared_prompt=True)
    with torch.no_grad():
        expected = unpacked(model, pairs_of(build))
        results = {}
        for leak in (False, True):
            parts = []
            for batch in window:
                ids = batch["shared_prompt_ids"]
                mask = shared_prompt_mask(ids, torch.float64, 3)
                if leak:  # a rejected token (part 2) also sees its pair's chosen completion (part 1)
                    pair, part = ids // 3, ids % 3
                    sees = (pair[:, :, None] == pair[:, None, :]) & (part[:, :, None] == 2) & (part[:, None, :] == 1)
                    mask = mask.masked_fill(sees[:, None], 0.0)
                logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask,
                               use_cache=False).logits
                parts.append(pair_logps(logits, batch))
            results[leak] = PairLogps(*(torch.cat(field) for field in zip(*parts)))
    torch.testing.assert_close(results[False].rejected, expected.rejected, rtol=0, atol=1e-10)
    assert not torch.allclose(results[True].rejected, expected.rejected, rtol=0, atol=1e-10)
    torch.testing.assert_close(results[True].chosen, expected.chosen, rtol=0, atol=1e-10)  # chosen sees no rejected


@pytest.mark.usefixtures("use_flex_reference")
@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_shared_prompt_on_flex_attention_equals_unpacked(build, layout):
    pairs = pairs_of(build)
    with torch.no_grad():
        reference, expected = unpacked(tiny_llama(1), pairs), unpacked(tiny_llama(0), pairs)
        got = shared(enable_packing(flex_llama(0)), batches(build, layout, shared_prompt=True))
    for name in PairLogps._fields:
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=0, atol=FLEX_TOLERANCE)
    loss, expected_loss = (dpo_loss(logps, reference, BETA).mean() for logps in (got, expected))
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=FLEX_LOSS_TOLERANCE)


@pytest.mark.usefixtures("use_flex_reference")
def test_a_block_mask_letting_rejected_see_chosen_fails_the_flex_comparison(build):
    model = flex_llama(0)
    window = batches(build, "padded", shared_prompt=True)
    with torch.no_grad():
        expected = unpacked(tiny_llama(0), pairs_of(build))
        results = {}
        for leak in (False, True):
            parts = []
            for batch in window:
                ids = batch["shared_prompt_ids"]
                mask = shared_prompt_block_mask(ids, 3)
                if leak:
                    rows, width = ids.shape
                    mask = create_block_mask(or_masks(mask.mask_mod, rejected_sees_chosen(ids)), rows, None, width, width,
                                             device=ids.device)
                logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask,
                               use_cache=False).logits
                parts.append(pair_logps(logits, batch))
            results[leak] = PairLogps(*(torch.cat(field) for field in zip(*parts)))
    torch.testing.assert_close(results[False].rejected, expected.rejected, rtol=0, atol=FLEX_TOLERANCE)
    assert not torch.allclose(results[True].rejected, expected.rejected, rtol=0, atol=FLEX_TOLERANCE)
    torch.testing.assert_close(results[True].chosen, expected.chosen, rtol=0, atol=FLEX_TOLERANCE)


def test_the_shared_layout_computes_each_prompt_once(build):
    dataset = PackedDataset(build)
    packs = [dataset[i] for i in range(len(dataset))]
    two_sequences = PackedCollator.for_dataset(dataset, layout="padding_free")(packs)["input_ids"].numel()
    shared_collate = PackedCollator.for_dataset(dataset, layout="padding_free", shared_prompt=True)
    shared_positions = shared_collate(packs)["input_ids"].numel()
    saves = inspect_build(build).pairs.shared_prompt_saves
    assert saves > 0 and shared_positions == two_sequences - saves


def test_the_default_padded_layout_saves_positions_too(build):
    """Rows padded to the build's max_len would compute as many positions as the two-sequence layout: by default
    the shared layout pads each batch to its longest re-laid pack instead; pad_to="max_len" keeps fixed rows."""
    dataset = PackedDataset(build)
    packs = [dataset[i] for i in range(len(dataset))]
    padded = PackedCollator.for_dataset(dataset)(packs)["input_ids"]
    shared_batch = PackedCollator.for_dataset(dataset, shared_prompt=True)(packs)
    flat = PackedCollator.for_dataset(dataset, layout="padding_free", shared_prompt=True)(packs)["shared_prompt_ids"]
    longest = max(int((ids > 0).sum()) for ids in shared_batch["shared_prompt_ids"])  # pair ids start at 1
    assert shared_batch["input_ids"].shape == (len(packs), longest) and longest < MAX_LEN
    assert shared_batch["input_ids"].numel() < padded.numel() == len(packs) * MAX_LEN
    assert int((shared_batch["shared_prompt_ids"] > 0).sum()) == flat.numel()  # the same tokens, each prompt once
    fixed = PackedCollator.for_dataset(dataset, shared_prompt=True, pad_to="max_len")(packs)["input_ids"]
    assert fixed.shape == (len(packs), MAX_LEN)
    assert PackedCollator(shared_prompt=True)(packs)["input_ids"].shape == shared_batch["input_ids"].shape  # no max_len


def test_stored_reference_reads_the_shared_layout(build):
    from prepack.training.reference import stored_reference

    dataset = PackedDataset(build)
    packs = [dict(dataset[i]) for i in range(len(dataset))]
    for number, pack in enumerate(packs):  # stand-in stored values, distinct per document
        pack["reference_logps"] = -(number * 100.0 + torch.arange(len(pack["cu_seqlens"]) - 1).double()).numpy()
    two_sequences = stored_reference(PackedCollator.for_dataset(dataset)(packs))
    shared_layout = stored_reference(PackedCollator.for_dataset(dataset, shared_prompt=True)(packs))
    for name in PairLogps._fields:
        torch.testing.assert_close(getattr(shared_layout, name), getattr(two_sequences, name), rtol=0, atol=0)


def test_pairs_whose_prompts_differ_are_refused_by_pack_and_pair(build):
    pack = dict(PackedDataset(build)[0])
    cu = pack["cu_seqlens"]
    input_ids = pack["input_ids"].copy()
    input_ids[cu[3]] += 1  # the second pair's rejected document: its first prompt token
    with pytest.raises(UsageError, match="Pack 0, pair 1: .*different tokens"):
        PackedCollator(MAX_LEN, shared_prompt=True)([dict(pack, input_ids=input_ids)])


@pytest.mark.parametrize("attn", ["flash_attention_2", "flash_attention_3", "flash_attention_4"])
def test_varlen_backends_refuse_the_layout_by_name(build, attn):
    model = enable_packing(tiny_llama(0))
    model.config._attn_implementation = attn
    batch = batches(build, "padded", shared_prompt=True)[0]
    with pytest.raises(IsolationError, match=f"shared-prompt layout .*on {attn}"):
        model(**model_inputs(batch))


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_sliding_window_families_refuse_the_layout_by_name(build, attn):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16, attn_implementation=attn)
    model = enable_packing(MistralForCausalLM(config).to(torch.float64))
    with pytest.raises(IsolationError, match="shared-prompt layout on a mistral model with sliding-window layers"):
        model(**model_inputs(batches(build, "padded", shared_prompt=True)[0]))


@pytest.mark.parametrize(
    ("family", "attn", "isolated_by"),
    [
        ("bamba", "sdpa", "per-document sequence-state layers"),
        ("lfm2", "flex_attention", "per-document sequence-state layers"),
        ("opt", "flex_attention", "block mask"),
    ],
)
def test_families_isolated_otherwise_refuse_the_layout_by_name(build, family, attn, isolated_by):
    from prepack.model.tiny_models import tiny_model

    model = enable_packing(tiny_model(family, attn))
    batch = batches(build, "padded", shared_prompt=True)[0]
    batch["input_ids"] %= model.config.vocab_size
    with pytest.raises(IsolationError, match=f"shared-prompt layout on {family}: .*isolated by {isolated_by}"):
        model(**model_inputs(batch))
