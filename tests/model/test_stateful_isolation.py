"""`enable_packing` keeps packed documents apart in the hybrid and linear-attention families whose
sequence-state layers it runs one document per row (`prepack.model.stateful`; the table's "per document" verdicts).

The family sweep (tests/model/test_family_sweep.py) measures every verdict in float64 on short packs, with the
negative control. This file adds what the sweep does not: float32 (each document within 1e-5 of itself
alone), packs with a document past the gated delta rule's 64-token chunk, documents shorter than a
convolution kernel and ones spanning several Mamba chunks; the other batch layouts; gradient checkpointing;
Granite 4 hybrid's masks; the multimodal Qwen3.5 used text-only; and the refusals of what the hooks cannot
split. The tiny random models are the sweep's (tests/tiny_models.py): every kind of layer kept, scan chunks
and convolution kernels shorter than most documents.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText

from prepack import IsolationError

from prepack.model import families

from prepack.model import stateful
from prepack.model.packing import disable_packing, enable_packing
from prepack.training.collate import PackedCollator
from prepack.formats.shards import IGNORE_INDEX
from prepack.model.isolation import measure_isolation
from tests.flash_reference import use_flash_reference  # noqa: F401 (a fixture)
from tests.tiny_models import DOCUMENT_VOCAB, tiny_config, tiny_model

MAX_LEN = 80
FLASH = "flash_attention_2"
FLOAT32_TOLERANCE = 1e-5
LEAK = 1e-6  # float64 leaks measured without the per-document layers: 1.4e-4 to 0.25
# Every family the table runs per document, but the multimodal ones, whose causal LMs are their text models
# (the multimodal Qwen3.5 is tested below).
FAMILIES = sorted(set(stateful.STATEFUL_LAYERS) - {"qwen3_5", "qwen3_5_moe", "qwen4_exp"})
CASES = [
    (family, FLASH if backend == "flash" else backend)
    for family in FAMILIES
    for backend, verdict in zip(families.BACKENDS, families.FAMILIES[family])
    if verdict.per_document and backend in ("sdpa", "eager", "flash")  # fa4 and flex: the family sweep
]


@pytest.fixture(autouse=True)
def flash_reference_for_flash_cases(request):
    if "attn" in request.fixturenames and request.getfixturevalue("attn") == FLASH:
        request.getfixturevalue("use_flash_reference")


def _pack(lengths: list[int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    tokens = sum(lengths)
    input_ids = rng.integers(1, DOCUMENT_VOCAB, size=tokens, dtype=np.int32)
    return {
        "input_ids": input_ids,
        "cu_seqlens": np.cumsum([0, *lengths], dtype=np.int32),
        "labels": np.where(rng.random(tokens) < 0.2, IGNORE_INDEX, input_ids).astype(np.int32),
    }


@pytest.fixture(scope="module")
def packs() -> list[dict[str, np.ndarray]]:
    """Three packs, each leaving padding in its row: a document past the gated delta rule's 64-token chunk,
    documents shorter than a convolution kernel, and ones spanning several Mamba chunks."""
    rng = np.random.default_rng(3)
    return [_pack(lengths, rng) for lengths in ([70, 5], [2, 23, 1, 31], [17, 40])]


def padded(packs, **options) -> dict:
    return PackedCollator(MAX_LEN, **options)(packs)


def test_the_hooks_know_the_layers_of_every_family_the_table_runs_per_document():
    per_document = {family for family, row in families.FAMILIES.items() if any(v.per_document for v in row)}
    assert set(stateful.STATEFUL_LAYERS) == per_document


# --- isolation in float32, and the masks Granite 4 hybrid needs beside its Mamba layers ----------------


@pytest.mark.slow
@pytest.mark.parametrize("family, attn", CASES)
def test_packed_documents_equal_documents_alone_float32(family, attn, packs):
    model = enable_packing(tiny_model(family, attn, torch.float32))
    result = measure_isolation(model, packs, padded(packs), tolerance=FLOAT32_TOLERANCE)
    assert result.passed, result


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.slow
def test_granite_hybrid_attention_leaks_without_masks_from_position_ids(attn, packs, monkeypatch):
    """transformers builds Granite 4 hybrid's sdpa/eager mask without position_ids: one causal mask per row.
    Its Mamba layers run per document; without the layer masks its attention still leaks."""
    assert families.verdict("granitemoehybrid", attn).how == "layer masks"
    monkeypatch.setitem(families.FAMILIES, "granitemoehybrid", (families.MAMBA2,) * 3)
    model = enable_packing(tiny_model("granitemoehybrid", attn))
    assert measure_isolation(model, packs, padded(packs), tolerance=LEAK, gradients=False).max_logit_diff > LEAK


def _multimodal_model(family: str):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_config(family), experts_implementation="eager")
    model = model.to(torch.float64)
    model.set_attn_implementation("sdpa")
    return model


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.slow
def test_qwen3_5_multimodal_used_text_only_is_isolated(family, packs):
    result = measure_isolation(enable_packing(_multimodal_model(family)), packs, padded(packs), tolerance=1e-10)
    assert result.passed, result


# --- the other batch forms, training, and what is left alone ---------------------------------------


@pytest.mark.parametrize("family", ["bamba", "lfm2", "qwen3_next"])
@pytest.mark.parametrize("options", [dict(layout="padding_free"), dict(layout="indexed_mask"), dict(seq_idx=True)])
@pytest.mark.slow
def test_other_batch_forms_are_isolated(family, options, packs):
    """seq_idx=True made the Mamba families raise in transformers' torch fallback; the guard consumes it."""
    model = enable_packing(tiny_model(family, "sdpa"))
    result = measure_isolation(model, packs, padded(packs, **options), tolerance=1e-10)
    assert result.passed, result


@pytest.mark.slow
def test_position_ids_alone_are_enough_on_sdpa(packs):
    batch = {key: padded(packs)[key] for key in ("input_ids", "labels", "position_ids")}
    result = measure_isolation(enable_packing(tiny_model("bamba", "sdpa")), packs, batch, tolerance=1e-10)
    assert result.passed, result


def _checkpointing_case(family: str) -> str:
    """The first of sdpa and eager on which the table runs the family per document."""
    verdicts = dict(zip(families.BACKENDS, families.FAMILIES[family]))
    return next(attn for attn in ("sdpa", "eager") if verdicts[attn].per_document)


def _gradients(model, loss) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]


# One family of each kind of sequence state and of checkpointed unit: Mamba-2 mixers (bamba), gated delta rules
# (qwen3_5_text, bailing_hybrid: before the wrapping, the largest error, 0.10), short convolutions (lfm2), lightning
# attention (minimax), a recurrent block (recurrent_gemma), nested checkpointing layers (zamba), and hooks on the
# checkpointed block itself (xlstm). Every family of STATEFUL_LAYERS was measured so when the wrapping was written
# (each wrong, or refused by torch, before it, but xLSTM); `test_every_stateful_layer_is_recomputed_by_a_wrapped_checkpoint`
# holds the others to the same structure at a fraction of the cost.
CHECKPOINTED_FAMILIES = ["bailing_hybrid", "bamba", "lfm2", "minimax", "qwen3_5_text", "recurrent_gemma", "xlstm", "zamba"]


@pytest.mark.parametrize("family", CHECKPOINTED_FAMILIES)
@pytest.mark.slow
def test_gradient_checkpointing_keeps_each_forwards_documents_when_forwards_interleave(family, packs):
    """forward(A), forward(B), backward(A), backward(B), reentrant and not: each recomputation reads the segments
    of the forward it repeats, not the latest forward's (which gave A wrong gradients, or made torch refuse a
    non-reentrant recomputation of other shapes, in every family but xLSTM: its hooks sit on the checkpointed
    block itself, outside the checkpoint)."""
    model = tiny_model(family, _checkpointing_case(family)) if family in FAMILIES else _multimodal_model(family)
    model = enable_packing(model).train()
    batch_a, batch_b = padded(packs), padded(packs[::-1])  # the same shape, other documents in each row
    expected_a = _gradients(model, model(**batch_a).loss)
    expected_b = _gradients(model, model(**batch_b).loss)
    for use_reentrant in (True, False):
        model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
        loss_a, loss_b = model(**batch_a).loss, model(**batch_b).loss
        for expected, loss in ((expected_a, loss_a), (expected_b, loss_b)):
            for expected_grad, got_grad in zip(expected, _gradients(model, loss), strict=True):
                torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["bamba", "lfm2"])
@pytest.mark.slow
def test_torchs_activation_checkpointing_keeps_each_forwards_documents_when_forwards_interleave(family, packs):
    """torch's `apply_activation_checkpointing` (FSDP's and Accelerate's), applied after enable_packing (reentrant
    and not) or before it: forward(A), forward(B), backward(A), backward(B) give each batch's own gradients (A's
    came out wrong before: its recomputation read B's segments), and disable_packing restores the wrappers'
    functions."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper,
    )

    batch_a, batch_b = padded(packs), padded(packs[::-1])  # the same shape, other documents in each row
    cases = [(impl, before) for impl in (CheckpointImpl.REENTRANT, CheckpointImpl.NO_REENTRANT) for before in (False, True)]
    for impl, before_packing in cases:
        model = enable_packing(tiny_model(family, _checkpointing_case(family))).train()
        expected_a = _gradients(model, model(**batch_a).loss)
        expected_b = _gradients(model, model(**batch_b).loss)
        if before_packing:
            disable_packing(model)
        decoder_layers = tuple({type(layer) for layer in model.model.layers})
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda module: isinstance(module, decoder_layers),
        )
        if before_packing:
            enable_packing(model)
        wrappers = [module for module in model.modules() if type(module).__name__ == "CheckpointWrapper"]
        originals = [wrapper.checkpoint_fn for wrapper in wrappers]
        assert wrappers
        loss_a, loss_b = model(**batch_a).loss, model(**batch_b).loss
        for expected, loss in ((expected_a, loss_a), (expected_b, loss_b)):
            for expected_grad, got_grad in zip(expected, _gradients(model, loss), strict=True):
                torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=1e-12)
        disable_packing(model)
        assert [wrapper.checkpoint_fn for wrapper in wrappers] == originals


def test_forwards_in_two_threads_at_once_each_run_their_own_documents(packs):
    """nn.DataParallel runs its replicas' forwards in threads at once, sharing prepack's hooks: each stateful layer
    reads the segments its own thread's guard set. Both threads' guards have set theirs before either's first short
    convolution runs (a barrier there), so one shared value would hand a thread the other's documents."""
    import threading

    model = enable_packing(tiny_model("lfm2", "sdpa")).eval()
    batches = [padded(packs), padded(packs[::-1])]  # the same shape, other documents in each row
    with torch.no_grad():
        expected = [model(**batch).logits for batch in batches]
    barrier = threading.Barrier(2, timeout=60)
    first = next(module for module in model.modules() if type(module).__name__ in stateful.STATEFUL_LAYERS["lfm2"])
    def meet(module, args):
        barrier.wait()

    handle = first.register_forward_pre_hook(meet, prepend=True)
    got, errors = [None, None], []

    def run(index):
        try:
            with torch.no_grad():
                got[index] = model(**batches[index]).logits
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    handle.remove()
    assert not errors, errors
    for index in (0, 1):
        torch.testing.assert_close(got[index], expected[index], rtol=0, atol=1e-12)


def test_a_packed_model_deep_copied_is_packed_alike(packs):
    """A reference model made by copy.deepcopy of a packed one (the DPO and KTO examples' way) carries the hooks and
    runs each document alone as the original does."""
    import copy

    model = enable_packing(tiny_model("lfm2", "sdpa")).eval()
    copied = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(copied(**padded(packs)).logits, model(**padded(packs)).logits, rtol=0, atol=0)
    result = measure_isolation(copied, packs, padded(packs), tolerance=1e-10)
    assert result.passed, result


@pytest.mark.parametrize("family", sorted(stateful.STATEFUL_LAYERS))
@pytest.mark.slow
def test_every_stateful_layer_is_recomputed_by_a_wrapped_checkpoint(family, packs):
    """In every family, each module that transformers checkpoints (a `GradientCheckpointingLayer` whose checkpoint
    holds a hooked layer) runs prepack's wrapped checkpointing function once a packed forward has run, and no
    hooked layer is recomputed by a checkpoint of another kind: the structure the interleaved test above proves
    exact on one family of each kind. The multimodal families are built whole, used text-only."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = tiny_model(family, _checkpointing_case(family)) if family in FAMILIES else _multimodal_model(family)
    model.activation_checkpointing_enable({"use_reentrant": False})
    enable_packing(model).train()
    model(**padded(packs))  # with grad: a forward without has no backward to recompute it, and wraps nothing
    hooked = [module for module in model.modules() if type(module).__name__ in stateful.STATEFUL_LAYERS[family]]
    assert hooked
    for layer in hooked:
        enclosing = [module for module in model.modules()
                     if isinstance(module, GradientCheckpointingLayer) and any(inner is layer for inner in module.modules())]
        assert enclosing, f"{type(layer).__name__} is checkpointed by no transformers layer"
        for module in enclosing:
            assert isinstance(module.__dict__.get("_gradient_checkpointing_func"), stateful._CheckpointWithSegments), type(module)
    # No other checkpointing reaches them: no torch checkpoint_wrapper (FSDP's) in the model.
    assert not any(type(module).__name__ == "CheckpointWrapper" for module in model.modules())


@pytest.mark.slow
def test_checkpointing_enabled_before_packing_or_switched_after_it_keeps_each_forwards_documents(packs):
    """HF Trainer enables checkpointing after the model is built (and packing enabled); a user may do it before.
    The guard wraps each layer's checkpointing function once, whenever it was set, and disable_packing restores it."""
    model = tiny_model("qwen3_5_text", "sdpa").train()
    batch_a, batch_b = padded(packs), padded(packs[::-1])
    expected = _gradients(enable_packing(model), model(**batch_a).loss)
    disable_packing(model)
    model.activation_checkpointing_enable({"use_reentrant": True})
    enable_packing(model)

    def backward_a_after_forward_b():
        loss_a, loss_b = model(**batch_a).loss, model(**batch_b).loss
        for expected_grad, got_grad in zip(expected, _gradients(model, loss_a), strict=True):
            torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=1e-12)

    backward_a_after_forward_b()
    model.activation_checkpointing_enable({"use_reentrant": False})
    backward_a_after_forward_b()
    layer = next(layer for layer in model.model.layers if hasattr(layer, "linear_attn"))  # a gated delta rule's
    transformers_own = layer._gradient_checkpointing_func.checkpoint  # wrapped once, after two forwards
    assert isinstance(transformers_own, partial) and transformers_own.func is torch.utils.checkpoint.checkpoint
    disable_packing(model)
    assert layer._gradient_checkpointing_func is transformers_own


def test_a_batch_that_is_not_packed_is_left_alone():
    model = tiny_model("bamba", "sdpa").eval()
    input_ids = torch.arange(2 * 20).view(2, 20) % DOCUMENT_VOCAB
    with torch.no_grad():
        expected = model(input_ids, use_cache=False).logits
        enable_packing(model)
        assert torch.equal(model(input_ids, use_cache=False).logits, expected)


@pytest.mark.usefixtures("use_flash_reference")
def test_a_cache_in_a_packed_batch_is_refused_on_flash_too(packs):
    """Attention layers keep a cache apart on flash, but a Mamba state would hold a row of mixed documents."""
    model = enable_packing(tiny_model("bamba", FLASH))
    with pytest.raises(IsolationError, match="use_cache=False"):
        model(**padded(packs) | {"use_cache": True})


def test_disable_packing_removes_the_per_document_hooks():
    model = tiny_model("granitemoehybrid", "sdpa")
    mamba = model.model.layers[0].mamba
    enable_packing(enable_packing(model))
    assert len(mamba._forward_pre_hooks) == len(mamba._forward_hooks) == 1
    disable_packing(model)
    assert len(mamba._forward_pre_hooks) == len(mamba._forward_hooks) == 0


def test_a_family_whose_layers_were_renamed_is_refused(monkeypatch):
    """Another transformers may rename a stateful layer: no hook would be installed, and documents would leak."""
    monkeypatch.setitem(stateful.STATEFUL_LAYERS, "bamba", ("BambaMambaMixer",))
    with pytest.raises(IsolationError, match="defines no BambaMambaMixer"):
        enable_packing(tiny_model("bamba", "sdpa"))


@pytest.mark.parametrize("family, attn", [("lfm2", "sdpa"), ("mamba", "eager")])
@pytest.mark.slow
def test_a_subclass_of_a_family_in_another_file_is_isolated_once_checked(family, attn, packs):
    """Unlisted (remote code may reuse a model type), so refused by default; allowed after a check, it keeps
    the per-document layers of its base, found in the base's modeling file (and Mamba's guard on the causal
    LM, which alone sees the documents)."""
    model = tiny_model(family, attn)
    model.__class__ = type("MySubclass", (type(model),), {"__module__": __name__})
    with pytest.raises(IsolationError, match="allow_unlisted=True"):
        enable_packing(model)
    result = measure_isolation(enable_packing(model, allow_unlisted=True), packs, padded(packs), tolerance=1e-10)
    assert result.passed, result


def test_a_per_token_argument_the_layer_would_get_unsplit_is_refused(packs):
    model = enable_packing(tiny_model("bamba", "sdpa"))
    batch = padded(packs)
    with pytest.raises(IsolationError, match="token_scale besides its hidden states"):
        model(**batch, token_scale=torch.ones(*batch["input_ids"].shape, 1))


def test_a_checked_subclass_of_a_vision_family_keeps_its_decoders_per_document_layers():
    """LFM2-VL is not a text family, but its decoder (LFM2) is: a subclass of it in a file of its own, allowed
    after a check, gets the hooks on LFM2's short convolutions, as the listed family does."""
    from prepack.model.tiny_vision_models import tiny_vision_model

    model = tiny_vision_model("lfm2_vl", "sdpa")
    model.__class__ = type("MySubclass", (type(model),), {"__module__": __name__})
    enable_packing(model, allow_unlisted=True)
    convolutions = [module for module in model.modules() if type(module).__name__ == "Lfm2ShortConv"]
    assert convolutions and all(len(module._forward_pre_hooks) == 1 for module in convolutions)


def test_a_vision_family_whose_decoder_has_no_per_document_layers_is_refused_by_name(monkeypatch):
    """A vision family the table runs per document whose decoder's type names no layers (another transformers may
    rename it) is refused by name, not with a bare KeyError."""
    from prepack.model.tiny_vision_models import tiny_vision_model

    monkeypatch.delitem(stateful.STATEFUL_LAYERS, "lfm2")
    with pytest.raises(IsolationError, match="lfm2_vl.*decoder .*lfm2.* no sequence-state layers"):
        enable_packing(tiny_vision_model("lfm2_vl", "sdpa"))
