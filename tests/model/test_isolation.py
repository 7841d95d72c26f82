"""`enable_packing` keeps packed documents apart: a padded batch of packs from `PackedCollator` gives, per
document, the logits, loss and gradients of the document run alone, on sdpa, eager and transformers' real
flash-attention path (with a pure-torch flash-attn, see `tests/flash_reference.py`), for Llama, Qwen2,
Qwen3, Mistral and Gemma 3 (text and multimodal used text-only), sliding windows included. Negative
controls show each backend leaking without it, so these tests can fail. Then: what it refuses, what it
converts, what it leaves alone, and that a packed batch compiles without a graph break.

All models are tiny and random, built from configs; nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import (
    DynamicCache,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SiglipVisionConfig,
)

from prepack import InputError, IsolationError

from prepack.model import packing
from prepack.model.packing import disable_packing, enable_packing
from prepack.model.isolation import check_isolation, measure_isolation, random_packs
from prepack.training.collate import PackedCollator
from tests.flash_reference import enable_flash_attention, use_flash_reference  # noqa: F401 (a fixture)

VOCAB = 64
MAX_LEN = 24
WINDOW = 6  # small enough that most documents are longer than the window
FLASH = "flash_attention_2"
BACKENDS = ["sdpa", "eager", FLASH]
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma3-multimodal"]
# transformers' eager attention takes its softmax in float32 even in a float64 model, so there float64
# agreement is bounded by float32 rounding (measured: up to 6e-8); sdpa and flash agree to 1e-16.
FLOAT64_TOLERANCE = {"sdpa": 1e-10, FLASH: 1e-10, "eager": 1e-6}
FLOAT32_TOLERANCE = 1e-5
LEAK = 1e-3  # a leak measured here is 0.1-0.4


def tiny_model(family: str, attn: str, dtype: torch.dtype = torch.float64) -> transformers.PreTrainedModel:
    """A 2-layer random model; for the flash path it is built on eager, then switched (see flash_reference)."""
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=64,
    )
    gemma_text = dict(sizes, head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    build = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**sizes)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**sizes)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**sizes, head_dim=8)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**sizes, sliding_window=WINDOW)),
        "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**gemma_text)),
        "gemma3-multimodal": lambda: Gemma3ForConditionalGeneration(
            Gemma3Config(
                text_config=Gemma3TextConfig(**gemma_text),
                vision_config=SiglipVisionConfig(
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    image_size=16,
                    patch_size=4,
                ),
                mm_tokens_per_image=4,
            )
        ),
    }[family]
    torch.manual_seed(0)
    model = build().to(dtype)
    model.set_attn_implementation("eager" if attn == FLASH else attn)
    return enable_flash_attention(model) if attn == FLASH else model


@pytest.fixture(params=BACKENDS)
def attn(request) -> str:
    if request.param == FLASH:
        request.getfixturevalue("use_flash_reference")
    return request.param


@pytest.fixture(scope="module")
def packs() -> list[dict]:
    """Three packs of 1-4 documents, with prompt-like -100 labels, each leaving padding in its row."""
    return random_packs(3, MAX_LEN, VOCAB, seed=1, labels=True)


def padded(packs, **options) -> dict:
    return PackedCollator(MAX_LEN, **options)(packs)


def binary_mask(packs) -> torch.Tensor:
    """1 at every real token, 0 at padding: the mask an ordinary padding collator would add."""
    return padded(packs, layout="indexed_mask")["attention_mask"].clamp(max=1)


# --- isolation, and the leak without it ------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_documents_equal_documents_alone_float64(family, attn, packs):
    model = enable_packing(tiny_model(family, attn))
    result = measure_isolation(model, packs, padded(packs), tolerance=FLOAT64_TOLERANCE[attn])
    assert result.passed, result


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_packed_documents_equal_documents_alone_float32(family, attn, packs):
    model = enable_packing(tiny_model(family, attn, torch.float32))
    result = measure_isolation(model, packs, padded(packs), tolerance=FLOAT32_TOLERANCE)
    assert result.passed, result


@pytest.mark.parametrize("family", FAMILIES)
def test_a_binary_mask_without_enable_packing_leaks(family, attn, packs):
    """In float32: in a float64 model, eager's float32 softmax turns the mask's float64 minimum into -inf,
    and padding rows that a sliding window cuts off from every real token become NaN instead of a leak."""
    batch = padded(packs) | {"attention_mask": binary_mask(packs), "use_cache": False}
    result = measure_isolation(tiny_model(family, attn, torch.float32), packs, batch, tolerance=LEAK, gradients=False)
    assert result.max_logit_diff > LEAK, result


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_use_cache_left_unset_leaks_on_sdpa_and_eager_unless_enable_packing_sets_it(attn, packs):
    model = tiny_model("llama", attn)
    assert model.config.use_cache  # the default that creates a cache, which turns packed detection off
    unset = {key: value for key, value in padded(packs).items() if key != "use_cache"}  # another collator's
    assert measure_isolation(model, packs, unset, tolerance=LEAK, gradients=False).max_logit_diff > LEAK
    result = measure_isolation(enable_packing(model), packs, unset, tolerance=FLOAT64_TOLERANCE[attn])
    assert result.passed, result


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_collated_batch_alone_isolates_a_model_without_enable_packing(attn, packs):
    model = tiny_model("llama", attn)
    assert model.config.use_cache
    result = measure_isolation(model, packs, padded(packs), tolerance=FLOAT64_TOLERANCE[attn])
    assert result.passed, result


@pytest.mark.usefixtures("use_flash_reference")
def test_restarting_position_ids_get_offsets_on_flash(packs):
    """Rows > 1 with position_ids only: transformers runs dense flash attention; enable_packing derives offsets."""
    batch = {key: padded(packs)[key] for key in ("input_ids", "labels", "position_ids")}
    model = tiny_model("gemma3", FLASH)
    assert measure_isolation(model, packs, batch, tolerance=LEAK, gradients=False).max_logit_diff > LEAK
    assert measure_isolation(enable_packing(model), packs, batch, tolerance=1e-10).passed


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_padding_free_layout_is_isolated(family, attn, packs):
    model = enable_packing(tiny_model(family, attn))
    result = measure_isolation(model, packs, padded(packs, layout="padding_free"), tolerance=FLOAT64_TOLERANCE[attn])
    assert result.passed, result


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_an_indexed_mask_is_converted_to_the_native_fields(family, attn, packs):
    model = enable_packing(tiny_model(family, attn)).eval()
    legacy = padded(packs, layout="indexed_mask")
    assert legacy["attention_mask"].max() > 1
    with torch.no_grad():
        native_logits = model(**padded(packs)).logits
        legacy_logits = model(**legacy).logits
    torch.testing.assert_close(legacy_logits, native_logits, rtol=0, atol=1e-12)
    assert measure_isolation(model, packs, legacy, tolerance=FLOAT64_TOLERANCE[attn]).passed


@pytest.mark.usefixtures("use_flash_reference")
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_the_flash_reference_agrees_with_sdpa_on_documents_alone(family, packs):
    """The stand-in kernel (windows, grouped-query heads, causality) is itself right."""
    documents = [torch.arange(length)[None] % VOCAB for length in (1, WINDOW - 1, WINDOW + 1, 3 * WINDOW)]
    sdpa, flash = tiny_model(family, "sdpa").eval(), tiny_model(family, FLASH).eval()
    with torch.no_grad():
        for input_ids in documents:
            torch.testing.assert_close(flash(input_ids).logits, sdpa(input_ids).logits, rtol=0, atol=1e-10)


@pytest.mark.usefixtures("use_flash_reference")
def test_empty_segments_at_the_end_of_the_offsets_are_accepted(packs):
    """A collator may repeat the last offset to keep the tensor's length fixed."""
    batch = padded(packs)
    cu_seq_lens = torch.cat([batch["cu_seq_lens_q"], batch["cu_seq_lens_q"][-1:]])
    batch |= {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens}
    assert measure_isolation(enable_packing(tiny_model("llama", FLASH)), packs, batch, tolerance=1e-10).passed


@pytest.mark.usefixtures("use_flash_reference")
def test_use_cache_true_is_allowed_on_flash_where_offsets_isolate(packs):
    batch = padded(packs) | {"use_cache": True}
    assert measure_isolation(enable_packing(tiny_model("llama", FLASH)), packs, batch, tolerance=1e-10).passed


# --- refusals --------------------------------------------------------------------------------------


CU_KEYS, MAX_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k"), ("max_length_q", "max_length_k")


def _with(key, change):
    return lambda batch: batch | {key: change(batch)}


def _without(key):
    return lambda batch: {name: value for name, value in batch.items() if name != key}


def _offsets(change):
    """The same change to cu_seq_lens_q and _k."""
    return lambda batch: batch | dict.fromkeys(CU_KEYS, change(batch["cu_seq_lens_q"].clone()))


def _set(tensor, index, value):
    tensor[index] = value
    return tensor


def _merge_first_two_segments(batch):
    """Offsets that put two documents in one segment, with max_length kept consistent."""
    merged = torch.cat([batch["cu_seq_lens_q"][:1], batch["cu_seq_lens_q"][2:]])
    return batch | dict.fromkeys(CU_KEYS, merged) | dict.fromkeys(MAX_KEYS, int(merged.diff().max()))


def _first_offset_moved(batch):
    return _set(batch["cu_seq_lens_q"].clone(), 1, int(batch["cu_seq_lens_q"][1]) - 1)


REFUSED = {
    "int64 offsets": (_offsets(lambda cu: cu.long()), "1-D int32"),
    "2-D offsets": (_offsets(lambda cu: cu[None]), "1-D int32"),
    "offsets on another device": (_offsets(lambda cu: cu.to("meta")), "device"),
    "offsets from 1": (_offsets(lambda cu: _set(cu, 0, 1)), "start at 0"),
    "offsets short of B*L": (_offsets(lambda cu: _set(cu, -1, int(cu[-1]) - 1)), "end at the batch's"),
    "decreasing offsets": (_offsets(lambda cu: _set(cu, slice(1, 3), cu[1:3].flip(0))), "never decrease"),
    "q and k differ": (_with("cu_seq_lens_k", _first_offset_moved), "be equal"),
    "max_length too small": (lambda b: b | dict.fromkeys(MAX_KEYS, b["max_length_q"] - 1), "longest segment"),
    "max_length q and k differ": (_with("max_length_k", lambda b: b["max_length_k"] + 1), "max_length_q to"),
    "max_length as a tensor": (_with("max_length_q", lambda b: torch.tensor(b["max_length_q"])), "Python int"),
    "offsets without max_length_k": (_without("max_length_k"), "without max_length_k"),
    "offsets merging two documents": (_merge_first_two_segments, "where position_ids restart"),
    "offsets without position_ids": (_without("position_ids"), "needs position_ids"),
    "binary 2-D mask": (_with("attention_mask", lambda b: torch.ones_like(b["input_ids"])), "binary attention_mask"),
    "past_key_values": (_with("past_key_values", lambda b: DynamicCache()), "past_key_values"),
    "cache": (_with("cache", lambda b: DynamicCache()), "past_key_values"),  # its name from transformers 5.24
}


@pytest.mark.parametrize("attn", ["sdpa", FLASH])
@pytest.mark.parametrize("case", REFUSED)
def test_enable_packing_refuses_a_batch_that_would_leak(case, attn, request, packs):
    if attn == FLASH:
        request.getfixturevalue("use_flash_reference")
    change, message = REFUSED[case]
    model = enable_packing(tiny_model("llama", attn))
    with pytest.raises(IsolationError, match=message):
        model(**change(padded(packs)))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_use_cache_true_with_packed_rows_is_refused_on_sdpa_and_eager(attn, packs):
    model = enable_packing(tiny_model("llama", attn))
    for mode in (model.train, model.eval):
        mode()
        with pytest.raises(IsolationError, match="use_cache=True"):
            model(**padded(packs) | {"use_cache": True})


def test_an_indexed_mask_with_offsets_is_refused(packs):
    model = enable_packing(tiny_model("llama", "sdpa"))
    legacy = padded(packs, layout="indexed_mask")
    with pytest.raises(IsolationError, match="one description"):
        model(**padded(packs), attention_mask=legacy["attention_mask"])


def test_a_4d_mask_is_refused_on_sliding_window_models_only(packs):
    mask = torch.zeros(len(packs), 1, MAX_LEN, MAX_LEN, dtype=torch.float64)
    batch = {"input_ids": padded(packs)["input_ids"], "attention_mask": mask, "use_cache": False}
    with pytest.raises(IsolationError, match="sliding"):
        enable_packing(tiny_model("mistral", "sdpa"))(**batch)
    enable_packing(tiny_model("llama", "sdpa"))(**batch)  # the caller's own mask, applied as given


def test_unknown_attention_implementations_and_old_transformers_are_refused(monkeypatch):
    model = tiny_model("llama", "sdpa")
    enable_packing(model)
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(IsolationError, match=r"'paged\|sdpa'; prepack keeps"):
        model(torch.ones(1, 4, dtype=torch.long))  # switched after enable_packing: refused at the call
    with pytest.raises(IsolationError, match=r"'paged\|sdpa'; prepack keeps"):
        enable_packing(model)
    # prepack.model.packing's own reference: importing some model classes in 5.23 re-creates `transformers`
    # in sys.modules, so this module's `transformers` may be another object.
    monkeypatch.setattr(packing.transformers, "__version__", "4.57.1")
    with pytest.raises(IsolationError, match="transformers 5.0"):
        enable_packing(tiny_model("llama", "sdpa"))


# --- what it leaves alone ---------------------------------------------------------------------------


def test_ordinary_batches_and_generation_are_unchanged():
    """Left-padded generation restarts position ids outside the mask: not packing, not refused."""
    model = tiny_model("llama", "sdpa").eval()
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    options = dict(attention_mask=attention_mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(input_ids, **options), model(input_ids, attention_mask).logits
        enable_packing(model)
        got = model.generate(input_ids, **options), model(input_ids, attention_mask).logits
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])


def test_enable_packing_installs_one_hook_and_disable_packing_removes_it():
    model = tiny_model("llama", "sdpa")
    hooks = model.base_model._forward_pre_hooks
    enable_packing(enable_packing(model))
    assert len(hooks) == 1
    disable_packing(model)
    assert len(hooks) == 0


# --- torch.compile ----------------------------------------------------------------------------------


@pytest.mark.parametrize("attn, dtype", [("sdpa", torch.float32), (FLASH, torch.bfloat16)])
@pytest.mark.slow
def test_a_packed_batch_compiles_without_graph_breaks(attn, dtype, request, packs):
    """The whole forward, enable_packing's hook included, is one graph. (On the flash path the float32
    model is left out: transformers logs a "casting fp32 inputs" warning there, and logging breaks graphs.)"""
    if attn == FLASH:
        request.getfixturevalue("use_flash_reference")
    model = enable_packing(tiny_model("llama", attn, dtype))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(**padded(packs))
    assert explanation.graph_break_count == 0, explanation.break_reasons


# --- check_isolation (the `prepack check-isolation` command) ---------------------------------------


def test_check_isolation_on_a_config_and_on_a_saved_model(tmp_path):
    model = tiny_model("gemma3", "sdpa", torch.float32)
    model.save_pretrained(tmp_path / "saved")
    config = tmp_path / "config.json"
    model.config.to_json_file(config)
    for path in (config, tmp_path / "saved"):
        result = check_isolation(path, "sdpa", dtype="float64", max_len=32)
        assert result.passed and result.max_logit_diff < 1e-10, result
    with pytest.raises(InputError, match="no such model"):
        check_isolation(tmp_path / "missing")
    with pytest.raises(InputError, match="dtype one of"):
        check_isolation(config, "sdpa", dtype="float8")
