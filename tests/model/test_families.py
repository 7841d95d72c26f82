"""`prepack.model.families` and what `enable_packing` does with it: refusals that name the family, the backend,
the reason and what to do instead; unlisted model types refused unless the caller opts in; the masks
prepack passes to gpt-oss on eager; padding that never turns gradients NaN. The whole table is measured
by the slow `tests/model/test_family_sweep.py`; these are the fast, pointed checks.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from prepack import IsolationError

from prepack.model import packing

from prepack.model import families
from prepack.model.packing import disable_packing, enable_packing
from prepack.model.shared_prompt import shared_prompt_mask
from prepack.training.collate import PackedCollator
from prepack.model.isolation import default_tolerances, measure_isolation
from tests.flash_reference import enable_flash_attention
from tests.flash_reference import use_flash_reference, use_flex_reference  # noqa: F401 (fixtures)
from tests.model.test_family_sweep import MAX_LEN, packs
from tests.tiny_models import tiny_config, tiny_model

LEAK = 1e-3


def measure(model, **collator_options):
    sample = packs()
    tolerance, loss_tolerance = default_tolerances(torch.float64, model.config.get_text_config()._attn_implementation)
    batch = PackedCollator(MAX_LEN, **collator_options)(sample)
    return measure_isolation(model, sample, batch, tolerance=tolerance, loss_tolerance=loss_tolerance)


def let_through(monkeypatch, model_type: str):
    """Mark the family native on every backend: enable_packing then adds nothing for it."""
    monkeypatch.setitem(families.FAMILIES, model_type, (families.NATIVE,) * len(families.BACKENDS))


def test_the_table_lists_exactly_the_registered_causal_lms():
    """On the measured release exactly; on another one, a family the table has and the installed release
    lacks is skipped, and one the release registers that the table lacks is refused as not measured on it."""
    registered = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if transformers.__version__ == families.MEASURED_VERSION:
        assert sorted(families.FAMILIES) == sorted(registered)
    for model_type in sorted(registered - families.FAMILIES.keys()):
        message = families.refusal(model_type, "a model class", "sdpa", registered_by=transformers.__version__)
        assert f"{model_type!r} (a model class) on sdpa: not measured on this version" in message


def test_a_family_of_another_release_that_the_table_lacks_is_refused_as_not_measured_on_it(monkeypatch):
    monkeypatch.setattr(packing.transformers, "__version__", "5.99.0")  # the module enable_packing reads
    monkeypatch.delitem(families.FAMILIES, "qwen3")
    with pytest.warns(UserWarning), pytest.raises(IsolationError) as refused:
        enable_packing(tiny_model("qwen3", "sdpa"))
    message = " ".join(str(refused.value).split())
    assert "'qwen3' (Qwen3ForCausalLM) on sdpa: not measured on this version: transformers 5.99.0 registers it" in message
    assert families.MEASURED_WITH in message and families.SWEEP_COMMAND in message


def test_enable_packing_warns_once_on_a_release_the_table_was_not_measured_on(monkeypatch):
    # a release no other test warned about, in the module enable_packing reads
    monkeypatch.setattr(packing.transformers, "__version__", "5.98.0")
    with pytest.warns(UserWarning, match=rf"measured on {families.MEASURED_WITH}; this is transformers 5.98.0") as first:
        enable_packing(tiny_model("qwen3", "sdpa"))
    assert families.SWEEP_COMMAND in str(first[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        enable_packing(tiny_model("qwen3", "sdpa"))


def test_enable_packing_does_not_warn_on_the_measured_release(monkeypatch):
    monkeypatch.setattr(packing.transformers, "__version__", families.MEASURED_VERSION)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enable_packing(tiny_model("qwen3", "sdpa"))


def test_the_support_page_is_generated_from_the_table():
    page = Path(__file__).parents[2] / "docs" / "model-support.md"
    assert page.read_text() == families.markdown(), "run: python -m prepack.model.families > docs/model-support.md"


def test_the_table_imports_neither_torch_nor_transformers():
    code = "import sys, prepack.model.families; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_family_runs_the_same_layers_per_document_on_every_backend_that_isolates_it():
    """enable_packing hooks the layers once, for the backend the model has; a backend switched later (checked
    at each forward) must need the same hooks."""
    for model_type, row in families.FAMILIES.items():
        assert len({found.per_document for found in row if found.isolated}) <= 1, model_type


def test_a_refusal_names_family_backend_reason_and_remedy():
    with pytest.raises(IsolationError) as refused:
        enable_packing(tiny_model("zaya", "sdpa"))
    message = str(refused.value)
    assert "zaya (ZayaForCausalLM) on sdpa" in message
    assert families.ZAYA.reason in message
    assert "Train it without packing" in message


def test_a_refusal_points_to_a_backend_that_isolates_the_family():
    with pytest.raises(IsolationError) as refused:
        enable_packing(tiny_model("nemotron", "flash_attention_2"))
    message = str(refused.value)
    assert f"nemotron (NemotronForCausalLM) on flash_attention_2: {families.FLASH_WITHOUT_OFFSETS.reason}" in message
    assert "attn_implementation='sdpa'" in message


def test_a_backend_switched_after_enable_packing_is_checked_at_the_forward():
    model = enable_packing(tiny_model("nemotron", "sdpa"))
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(IsolationError, match="nemotron .* on flash_attention_2"):
        model(**PackedCollator(MAX_LEN)(packs()))


def test_an_unlisted_model_type_is_refused_unless_the_caller_opts_in(monkeypatch):
    monkeypatch.delitem(families.FAMILIES, "qwen3")
    model = tiny_model("qwen3", "sdpa")
    with pytest.raises(IsolationError, match=r"(not in the table|not measured on this version).*check-isolation.*allow_unlisted=True"):
        enable_packing(model)
    assert measure(enable_packing(model, allow_unlisted=True)).passed


class RemoteLlama(transformers.LlamaForCausalLM):
    """Stands for remote code that reuses a model type of transformers with code of its own."""


def test_remote_code_is_unlisted_even_under_a_listed_model_type():
    model = tiny_model("llama", "sdpa")
    remote = RemoteLlama(model.config)
    with pytest.raises(IsolationError, match=r"'llama \(remote code\)' \(RemoteLlama\)"):
        enable_packing(remote)
    enable_packing(remote, allow_unlisted=True)


@pytest.mark.parametrize("layout", ["padded", "padding_free", "indexed_mask"])
@pytest.mark.slow
def test_gpt_oss_on_eager_is_isolated_by_the_masks_prepack_passes(layout, monkeypatch):
    """gpt-oss builds its masks without position_ids, so transformers alone leaks on eager; prepack passes the
    per-layer-type masks that create_causal_mask / create_sliding_window_causal_mask build from them."""
    assert families.verdict("gpt_oss", "eager") == families.LAYER_MASKS
    result = measure(enable_packing(tiny_model("gpt_oss", "eager")), layout=layout)
    assert result.passed and result.max_grad_diff is not None, result
    let_through(monkeypatch, "gpt_oss")
    assert measure(enable_packing(tiny_model("gpt_oss", "eager"))).max_logit_diff > LEAK


@pytest.mark.slow
def test_padding_never_makes_gradients_nan():
    """Gemma 3n's embedding of its pad id 0 is all zeros, and a normalisation of the padding then divides 0
    by 0: NaN gradients although padding is never trained on. The collator pads with a real token."""
    model = enable_packing(tiny_model("gemma3n_text", "sdpa"))
    assert model.config.pad_token_id == 0 and not model.get_input_embeddings().weight[0].any()
    assert torch.isnan(torch.tensor(measure(model, pad_token_id=0).max_grad_diff))
    result = measure(model)
    assert result.passed and torch.isfinite(torch.tensor(result.max_grad_diff)), result


def test_the_families_people_fine_tune_stay_isolated_on_every_backend():
    named = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma3_text", "gemma4", "llama4", "deepseek_v3"]
    named += ["glm4_moe", "olmo3", "smollm3", "mixtral", "phi3", "granite", "lfm2"]
    refused = {
        (name, backend)
        for name in named
        for backend, found in zip(families.BACKENDS, families.FAMILIES[name])
        if not found.isolated
    }
    assert not refused


@pytest.mark.usefixtures("use_flash_reference")
def test_rows_longer_than_an_attention_chunk_are_refused_on_flash():
    """transformers' flash path cannot apply Llama 4's chunks and raises its own ValueError for longer rows."""
    model = enable_packing(tiny_model("llama4_text", "flash_attention_2"))
    chunk = model.config.get_text_config().attention_chunk_size
    assert chunk < MAX_LEN
    refusal = rf"Rows of {MAX_LEN} tokens .*attention_chunk_size={chunk}.*rows of at most {chunk} tokens \(max_len;"
    with pytest.raises(IsolationError, match=refusal):
        model(**PackedCollator(MAX_LEN)(packs()))


@pytest.mark.usefixtures("use_flash_reference")
def test_the_chunk_refusal_counts_a_padding_free_row_as_the_whole_batch():
    """layout="padding_free" lays every pack of the batch in one row: its width is B·max_len, not max_len."""
    model = enable_packing(tiny_model("llama4_text", "flash_attention_2"))
    chunk = model.config.get_text_config().attention_chunk_size
    sample = packs()
    width = sum(len(pack["input_ids"]) for pack in sample)
    advice = rf"rows of at most {chunk} tokens \(max_len; B·max_len with layout='padding_free'\)"
    refusal = rf"Rows of {width} tokens .*{advice}"
    with pytest.raises(IsolationError, match=refusal):
        model(**PackedCollator(MAX_LEN, layout="padding_free")(sample))


def temperature_tuned_llama4(attn: str, floor_scale: int) -> transformers.PreTrainedModel:
    """Llama 4's text model with its attention temperature tuning starting within a tiny row (real checkpoints:
    floor_scale 8192) and strong enough to show through tiny random weights (attn_scale 1, real ones 0.1); its
    tiny config has NoPE layers and the tuning on. On flash, chunks as long as a row: transformers' flash path
    cannot apply shorter ones (`test_rows_longer_than_an_attention_chunk_are_refused_on_flash`)."""
    config = tiny_config("llama4_text")
    config.floor_scale, config.attn_scale = floor_scale, 1.0
    flash = attn in packing.FLASH_ATTENTION
    if flash:
        config.attention_chunk_size = MAX_LEN
    assert config.attn_temperature_tuning and 0 in config.no_rope_layers
    torch.manual_seed(0)  # flash: built on eager and switched, as tests/tiny_models.py builds it
    options = dict(attn_implementation="eager" if flash else attn, experts_implementation="eager", dtype=torch.float64)
    model = transformers.AutoModelForCausalLM.from_config(config, **options).eval()
    return enable_flash_attention(model, attn) if flash else model


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager", "flash_attention_2"])
def test_llama4s_attention_temperature_follows_each_document(attn, request):
    """Llama 4 scales its NoPE layers' queries by each token's index in the row (transformers takes torch.arange,
    not position_ids), from index floor_scale - 1 on. The control: let through (no enable_packing), a packed row
    beyond the floor scales a later document's queries as they are not alone; enable_packing scales them by their
    position in their document, and every document is exact (logits, loss, gradients)."""
    if attn in packing.FLASH_ATTENTION:
        request.getfixturevalue("use_flash_reference")
    model = temperature_tuned_llama4(attn, floor_scale=8)
    sample = packs()
    tolerance, loss_tolerance = default_tolerances(torch.float64, attn)
    batch = PackedCollator(MAX_LEN)(sample)
    leaking = measure_isolation(model, sample, batch, tolerance=tolerance, loss_tolerance=loss_tolerance,
                                gradients=False)
    assert leaking.max_logit_diff > LEAK, leaking
    exact = measure_isolation(enable_packing(model), sample, batch, tolerance=tolerance, loss_tolerance=loss_tolerance)
    assert exact.passed and exact.max_grad_diff is not None, exact


def test_llama4s_unpacked_batches_keep_transformers_own_temperature():
    """A batch that is not packed (one document per row, or decoding with a cache) keeps the index in the row (plus
    the cached tokens) that transformers scales by; disable_packing gives the layers their own tuning back."""
    model = temperature_tuned_llama4("sdpa", floor_scale=8)
    tokens = torch.from_numpy(packs()[0]["input_ids"][None, :MAX_LEN])

    def logits_in_two_steps(model):
        first = model(tokens[:, :20], use_cache=True)
        return torch.cat([first.logits, model(tokens[:, 20:], cache=first.cache).logits], dim=1)

    with torch.no_grad():
        own, own_in_steps = model(tokens).logits, logits_in_two_steps(model)
        enable_packing(model)
        tuned = [layer.self_attn.attn_temperature_tuning for layer in model.model.layers]
        assert tuned == [bool(rope) for rope in model.config.no_rope_layers]  # off where prepack scales the queries
        assert torch.equal(model(tokens).logits, own)
        assert torch.equal(logits_in_two_steps(model), own_in_steps)
    disable_packing(model)
    assert all(layer.self_attn.attn_temperature_tuning for layer in model.model.layers)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, own)


def gradients_of(model) -> list[torch.Tensor]:
    return [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]


@pytest.mark.slow
def test_llama4s_temperature_under_gradient_checkpointing_follows_the_batch_it_recomputes():
    """Under gradient checkpointing the decoder layers rerun at backward: the temperature of batch A, recomputed
    after batch B's forward (or after a forward that raised midway), is still A's (the scales travel in the
    layers' keyword arguments, which checkpointing keeps)."""
    model = enable_packing(temperature_tuned_llama4("sdpa", floor_scale=8)).train()
    model.activation_checkpointing_enable()
    sample = packs()
    first, second = PackedCollator(MAX_LEN)(sample), PackedCollator(MAX_LEN)(sample[::-1])
    assert not torch.equal(first["position_ids"], second["position_ids"])
    model(**first).loss.backward()
    reference = gradients_of(model)
    model.zero_grad()
    loss = model(**first).loss
    model(**second)
    with pytest.raises(IsolationError):  # a forward that raises after the guard has seen its batch
        model(**second, cache=transformers.DynamicCache(config=model.config))
    loss.backward()
    assert all(torch.equal(got, want) for got, want in zip(gradients_of(model), reference, strict=True))


class _LowRankWrapper(torch.nn.Module):
    """What PEFT's LoRA does to a projection: the original kept as base_layer, a trainable delta added."""

    def __init__(self, base_layer: torch.nn.Linear):
        super().__init__()
        self.base_layer = base_layer
        self.delta = torch.nn.Linear(base_layer.in_features, base_layer.out_features, bias=False, dtype=torch.float64)

    def forward(self, hidden_states):
        return self.base_layer(hidden_states) + self.delta(hidden_states)


@pytest.mark.slow
def test_llama4s_temperature_scales_a_query_projection_wrapped_after_enable_packing():
    """TRL's SFTTrainer(peft_config=...) wraps q_proj after the user's enable_packing: the whole wrapped output
    (base and delta) is scaled, as transformers scales it, and every document is exact."""
    model = temperature_tuned_llama4("sdpa", floor_scale=8)
    enable_packing(model)
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.self_attn.q_proj = _LowRankWrapper(layer.self_attn.q_proj)
    sample = packs()
    tolerance, loss_tolerance = default_tolerances(torch.float64, "sdpa")
    report = measure_isolation(model, sample, PackedCollator(MAX_LEN)(sample), tolerance=tolerance,
                               loss_tolerance=loss_tolerance, gradients=False)
    assert report.passed, report


def test_a_failed_enable_packing_leaves_llama4s_temperature_for_disable_packing_to_undo(monkeypatch):
    """enable_packing raising after it hooked Llama 4's attention layers leaves them for disable_packing to undo."""
    model = temperature_tuned_llama4("sdpa", floor_scale=8)

    def fail(model):
        raise RuntimeError("the tower hook failed")

    monkeypatch.setattr(packing, "_keep_text_offsets_from_the_towers", fail)
    with pytest.raises(RuntimeError, match="the tower hook failed"):
        enable_packing(model)
    disable_packing(model)
    assert all(layer.self_attn.attn_temperature_tuning for layer in model.model.layers)
    assert not any(layer.self_attn._forward_pre_hooks for layer in model.model.layers)


def test_llama4s_shared_prompt_completions_get_their_own_temperature():
    """The shared-prompt layout goes through the same hand-off: a completion after its sibling is scaled by its
    position after the prompt, not its index in the row. A Llama 4 config without chunked layers (they refuse the
    layout); the control: the same mask let through (no enable_packing) scales that completion as it is not alone."""
    tiny = tiny_config("llama4_text")
    settings = {key: value for key, value in tiny.to_dict().items() if key != "layer_types"}
    config = type(tiny)(**settings | {"attention_chunk_size": None, "floor_scale": 4, "attn_scale": 1.0})
    assert set(config.layer_types) == {"full_attention"} and 0 in config.no_rope_layers
    torch.manual_seed(0)
    options = dict(attn_implementation="sdpa", experts_implementation="eager", dtype=torch.float64)
    model = transformers.AutoModelForCausalLM.from_config(config, **options).eval()
    prompt, first, second = torch.arange(2, 7), torch.arange(7, 11), torch.arange(11, 17)
    input_ids = torch.cat([prompt, first, second])[None]
    position_ids = torch.cat([torch.arange(5), torch.arange(5, 9), torch.arange(5, 11)])[None]
    shared_prompt_ids = torch.tensor([0] * 5 + [1] * 4 + [2] * 6)[None]
    mask = shared_prompt_mask(shared_prompt_ids, torch.float64, parts=3)
    with torch.no_grad():
        alone = model(torch.cat([prompt, second])[None]).logits[0, 5:]
        leaking = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask).logits[0, 9:]
        packed = enable_packing(model)(
            input_ids=input_ids, position_ids=position_ids, shared_prompt_ids=shared_prompt_ids, shared_prompt_parts=3
        ).logits[0, 9:]
    tolerance, _ = default_tolerances(torch.float64, "sdpa")
    assert (leaking - alone).abs().max() > 10 * tolerance
    assert (packed - alone).abs().max() <= tolerance


# The families the GPU measurement named (docs/model-support.md): sliding windows (gemma3, mistral) and sinks
# (gpt-oss, on FA4; transformers' flex path raises for sinks on a CPU).
NEW_BACKEND_CASES = [
    *[(family, "flash_attention_4") for family in ("qwen3", "gemma3_text", "mistral", "olmo3", "gpt_oss")],
    *[(family, "flex_attention") for family in ("qwen3", "gemma3_text", "mistral", "olmo3")],
]


@pytest.mark.parametrize(("family", "attn"), NEW_BACKEND_CASES)
@pytest.mark.slow
def test_flash_attention_4_and_flex_attention_keep_packed_documents_apart(family, attn, request):
    """FA4 through a stand-in of flash_attn.cute's interface, flex through torch's flex_attention uncompiled
    (no backward on a CPU: logits and loss). Before they were supported, enable_packing refused both."""
    request.getfixturevalue("use_flex_reference" if attn == "flex_attention" else "use_flash_reference")
    model = enable_packing(tiny_model(family, attn))
    sample = packs()
    tolerance, loss_tolerance = default_tolerances(torch.float64, attn)
    batch = PackedCollator(MAX_LEN)(sample)
    gradients = attn != "flex_attention"
    result = measure_isolation(
        model, sample, batch, tolerance=tolerance, loss_tolerance=loss_tolerance, gradients=gradients
    )
    assert result.passed and (result.max_grad_diff is not None) == gradients, result


@pytest.mark.usefixtures("use_flash_reference")
@pytest.mark.slow
def test_attention_sinks_reach_the_fa4_stand_in():
    """gpt-oss's sinks go to FA4 as learnable_sink (flash-attn 2 has no such option, and transformers drops
    them there): the stand-in must apply them, or the FA4 column would measure a model without sinks."""
    fa4, fa2 = tiny_model("gpt_oss", "flash_attention_4"), tiny_model("gpt_oss", "flash_attention_2")
    input_ids = torch.arange(2, 14)[None]
    assert (fa4(input_ids).logits - fa2(input_ids).logits).abs().max() > LEAK
    eager = tiny_model("gpt_oss", "eager")  # eager applies the sinks
    torch.testing.assert_close(fa4(input_ids).logits, eager(input_ids).logits, rtol=0, atol=1e-10)


@pytest.mark.usefixtures("use_flex_reference")
def test_flex_attention_with_a_cache_is_refused():
    """flex's BlockMask is built from position_ids only without a cache, as sdpa's mask is."""
    model = enable_packing(tiny_model("qwen3", "flex_attention"))
    with pytest.raises(IsolationError, match="use_cache=True on sdpa, eager or flex_attention"):
        model(**{**PackedCollator(MAX_LEN)(packs()), "use_cache": True})
