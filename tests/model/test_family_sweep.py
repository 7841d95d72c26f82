"""The family sweep: `prepack.model.families` is measured, not claimed.

For every causal LM that the installed transformers registers and every backend (sdpa, eager,
transformers' flash-attention path for flash_attention_2 and _4 with the pure-torch stand-ins of flash-attn
and FlashAttention-4, and flex_attention with torch's flex_attention run uncompiled: all in
`tests/flash_reference.py`), a tiny random model (`tests/tiny_models.py`, float64, CPU) gets
`PackedCollator` + `enable_packing`, and:

- a family the table marks isolated must give every document the logits, loss and gradients of the
  document run alone (on flex, logits and loss: torch's flex_attention has no backward on CPU);
- a family marked refused must make `enable_packing` raise `IsolationError` naming the family and the
  backend; and the refusal must be needed: let through (its verdict forced to native), the packed batch
  leaks or fails. The same holds for the masks prepack passes in ("layer masks", "block mask") and for
  the sequence-state layers it runs one document per row ("per document"): without them the family leaks
  or fails, and a per-document family's tiny model has such a layer to run;
- a family whose tiny model cannot be built must be marked refused, with that reason;
- `prepack check-isolation` on the family's config.json gives the same verdict (sdpa and eager), through
  `prepack.model.isolation.check_family`, the check that `prepack check-isolation --sweep` runs on every family.

So the sweep fails on a silent leak, on a foreign exception, and on any verdict that differs from what it
measures. Regenerate docs/model-support.md with `python -m prepack.model.families > docs/model-support.md`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from torch.nn.attention import flex_attention as flex_module

from prepack import IsolationError

from prepack.model import families

from prepack.model import stateful
from prepack.model.packing import enable_packing
from prepack.training.collate import PackedCollator
from prepack.model.isolation import check_family, default_tolerances, measure_isolation
from tests.flash_reference import use_flash_reference, use_flex_reference  # noqa: F401 (fixtures)
from tests.tiny_models import CAUSAL_LM_TYPES, DOCUMENT_VOCAB, tiny_model

pytestmark = pytest.mark.slow

MAX_LEN = 32
DOCUMENTS = ([20, 9], [3, 11, 14])  # per pack; longer than the tiny windows (6) and chunks (8)
def packs(documents=DOCUMENTS) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    made = []
    for lengths in documents:
        input_ids = rng.integers(2, DOCUMENT_VOCAB, size=sum(lengths))
        made.append({"input_ids": input_ids, "cu_seqlens": np.cumsum([0, *lengths]), "labels": input_ids})
    return made


# What transformers answers for a family without the backend, and the table's verdict for it.
UNSUPPORTED = {"sdpa": families.NO_SDPA, "flex": families.NO_FLEX}


@pytest.fixture
def attn(request, backend) -> str:
    stand_in = {"flash": "use_flash_reference", "fa4": "use_flash_reference", "flex": "use_flex_reference"}
    if backend in stand_in:
        request.getfixturevalue(stand_in[backend])
    return families.implementation(backend)


def build(model_type: str, attn: str):
    """The tiny model, or (None, why) when transformers cannot build it on this backend or at all."""
    try:
        return tiny_model(model_type, attn), None
    except Exception as exc:  # any failure to build is a finding the table must state
        return None, exc


@pytest.mark.parametrize("backend", families.BACKENDS)
@pytest.mark.parametrize("model_type", CAUSAL_LM_TYPES)
def test_the_table_states_what_enable_packing_does(model_type, backend, attn, monkeypatch):
    expected = families.verdict(model_type, attn)
    model, failure = build(model_type, attn)
    if model_type not in families.FAMILIES and transformers.__version__ != families.MEASURED_VERSION:
        # a family of another release: refused by name as not measured on it
        assert families.refusal(model_type, "a model class", attn, registered_by=transformers.__version__)
        if model is not None:
            with pytest.raises(IsolationError, match="not measured on this version"):
                enable_packing(model)
        return
    assert model_type in families.FAMILIES, f"{model_type} is not in prepack.model.families: add its measured row"
    if model is None and "does not support an attention implementation" in str(failure):
        # transformers refuses the backend for this family; a model switched to it anyway is refused by prepack
        assert expected == UNSUPPORTED.get(backend), failure
        model, _ = build(model_type, "eager")
        if model is not None:
            model.config._attn_implementation = attn
    if model is None:
        assert not expected.isolated and expected.reason.startswith(("not measured", "transformers has no")), failure
        assert families.refusal(model_type, "a model class", attn), "enable_packing raises this message"
        return
    sample = packs()
    batch = PackedCollator(MAX_LEN)(sample)
    tolerance, loss_tolerance = default_tolerances(torch.float64, attn)  # check-isolation's, in float64
    gradients = backend != "flex"  # torch's flex_attention has no backward on CPU
    chunk = getattr(model.config.get_text_config(), "attention_chunk_size", None)
    if expected.isolated and backend in ("flash", "fa4") and chunk and chunk < MAX_LEN:
        # transformers' flash path runs chunked layers (Llama 4) only on rows that fit in one chunk
        with pytest.raises(IsolationError, match="attention_chunk_size"):
            enable_packing(model)(**batch)
        sample = packs(documents=([5, 3], [2, 4]))
        batch = PackedCollator(chunk)(sample)
    if expected.per_document:
        assert any(type(module).__name__ in stateful.STATEFUL_LAYERS[model_type] for module in model.modules())
    if expected.isolated:
        result = measure_isolation(
            enable_packing(model), sample, batch, tolerance=tolerance, loss_tolerance=loss_tolerance, gradients=gradients
        )
        assert result.passed, result
    else:
        with pytest.raises(IsolationError) as refused:
            enable_packing(model)
        assert f"({type(model).__name__}) on {attn}: {expected.reason}" in str(refused.value)
    needed = expected.how != "native" or expected.per_document  # the refusal, the masks or the layers
    if needed and expected not in (families.NO_SDPA, families.NO_FLASH, families.NO_FLEX):
        # A composite family's causal LM is built from its text config (qwen3_5 → qwen3_5_text), whose row
        # enable_packing reads.
        for family in {model_type, model.config.model_type} & families.FAMILIES.keys():
            row = list(families.FAMILIES[family])
            row[families.BACKENDS.index(backend)] = families.NATIVE
            monkeypatch.setitem(families.FAMILIES, family, tuple(row))
        try:
            model = enable_packing(model)
            let_through = measure_isolation(
                model, sample, batch, tolerance=tolerance, loss_tolerance=loss_tolerance, gradients=False
            )
        except Exception:  # noqa: BLE001 (transformers' own failure on a packed batch is a reason to refuse)
            return
        assert not let_through.passed, f"{model_type} on {attn} isolates without what the table says: {let_through}"


@pytest.mark.parametrize("backend", ["sdpa", "eager"])  # check-isolation runs flash only on CUDA
@pytest.mark.parametrize("model_type", CAUSAL_LM_TYPES)
def test_check_isolation_gives_the_tables_verdict(model_type, backend, attn):
    """`prepack check-isolation --sweep`'s check of one family (check_isolation on its tiny config.json,
    random weights, float64 on a CPU): isolated where the table says so, refused or failing where it refuses."""
    check = check_family(model_type, attn)
    if model_type not in families.FAMILIES and transformers.__version__ != families.MEASURED_VERSION:
        assert check.table == "not measured on this version" and not check.agrees
        return
    assert check.agrees, check
    if check.measured.startswith("no tiny model"):
        assert families.verdict(model_type, attn).reason.startswith("not measured")


def test_flex_run_untraced_gives_the_traced_runs_logits_bit_for_bit(use_flex_reference, monkeypatch):
    """`use_flex_reference`, on which the flex column measures, runs torch's flex operator without the dynamo
    trace ("eager" backend) that torch puts around it uncompiled: the logits are exactly the traced call's."""
    model = enable_packing(tiny_model("gemma2", "flex_attention"))  # sliding windows and a softcap score_mod
    batch = PackedCollator(MAX_LEN)(packs())
    compile_, compiled, logits = torch.compile, [], {}

    def compile_counted(function, **options):
        compiled.append(function)
        return compile_(function, **options)

    monkeypatch.setattr(torch, "compile", compile_counted)
    for untraced in (True, False):
        monkeypatch.setattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", untraced)
        with torch.no_grad():
            logits[untraced] = model(**batch).logits
        if untraced:
            assert compiled == []  # no trace
    assert compiled  # the traced run traced
    assert torch.equal(logits[True], logits[False])
