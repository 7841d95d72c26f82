"""`enable_packing` keeps packed documents apart in the hybrid and linear-attention families whose
sequence-state layers it runs one document per row (`prepack.stateful`; the table's "per document" verdicts).

The family sweep (tests/test_family_sweep.py) measures every verdict in float64 on short packs, with the
negative control. This file adds what the sweep does not: float32 (each document within 1e-5 of itself
alone), packs with a document past the gated delta rule's 64-token chunk, documents shorter than a
convolution kernel and ones spanning several Mamba chunks; the other batch layouts; gradient checkpointing;
Granite 4 hybrid's masks; the multimodal Qwen3.5 used text-only; and the refusals of what the hooks cannot
split. Tiny random models from configs: every layer kind kept, Mamba chunks (8) and convolution kernels (3)
shorter than the documents.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from prepack import IsolationError, families, stateful
from prepack.attention import disable_packing, enable_packing
from prepack.collate import PackedCollator
from prepack.format import IGNORE_INDEX
from prepack.isolation import measure_isolation
from tests.flash_reference import enable_flash_attention, use_flash_reference  # noqa: F401 (a fixture)

VOCAB = 64
MAX_LEN = 80
FLASH = "flash_attention_2"
FLOAT32_TOLERANCE = 1e-5
LEAK = 1e-6  # float64 leaks measured without the per-document layers: 1.4e-4 to 0.25

SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=2 * MAX_LEN,
    tie_word_embeddings=False,
    pad_token_id=0,
)
GATED_DELTA_NET = dict(
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    linear_conv_kernel_dim=3,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
MAMBA = dict(
    num_hidden_layers=2,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=3,
    mamba_chunk_size=8,
    mamba_expand=2,
)
DELTA_ATTENTION = dict(  # Kimi-Linear and Bailing-hybrid: multi-head latent attention beside delta attention
    num_hidden_layers=2,
    num_key_value_heads=4,
    head_dim=8,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    linear_head_dim=8,
    linear_num_heads=4,
    linear_conv_kernel_dim=3,
    num_experts=4,
    num_experts_per_token=2,
    moe_intermediate_size=16,
)
SELECTIVE_SCAN = dict(num_hidden_layers=2, state_size=8, conv_kernel=3, time_step_rank=4)
# Mamba layers of Jamba and Zamba; use_mamba_kernels=False: their configs refuse the kernels' absence otherwise.
JAMBA_MAMBA = dict(mamba_d_state=8, mamba_d_conv=3, mamba_dt_rank=4, use_mamba_kernels=False)
CONFIGS = {
    "qwen3_5_text": GATED_DELTA_NET,
    "qwen3_5_moe_text": GATED_DELTA_NET | EXPERTS,
    "qwen3_next": GATED_DELTA_NET | EXPERTS,
    "granitemoehybrid": MAMBA
    | dict(layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32),
    "bamba": MAMBA | dict(attn_layer_indices=[1]),
    "nemotron_h": dict(
        layers_block_type=["linear_attention", "full_attention", "moe", "mlp"],
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=8,
        chunk_size=8,
        conv_kernel=3,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16,
        n_group=1,
        topk_group=1,
    ),
    "falcon_h1": MAMBA | dict(mamba_d_ssm=64),
    "lfm2": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], conv_L_cache=3),
    "lfm2_moe": dict(
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        conv_L_cache=3,
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    ),
    "lfm3": dict(num_hidden_layers=2, conv_L_cache=3, sliding_window=16),
    "jamba": JAMBA_MAMBA
    | dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=4),
    "zamba": JAMBA_MAMBA
    | dict(
        num_hidden_layers=3,
        attn_layer_period=2,
        attn_layer_offset=1,
        attention_hidden_size=64,
        attention_head_dim=16,
        n_mamba_heads=2,
    ),
    "zamba2": dict(
        num_hidden_layers=3,
        layer_types=["mamba", "hybrid", "mamba"],
        hybrid_layer_ids=[1],
        mamba_d_state=8,
        mamba_d_conv=3,
        n_mamba_heads=4,
        mamba_headdim=16,
        chunk_size=8,
        attention_head_dim=16,
        attention_hidden_size=64,
        kv_channels=16,
        num_query_groups=4,
        adapter_rank=4,
        use_mamba_kernels=False,
    ),
    "kimi_linear": DELTA_ATTENTION,
    "bailing_hybrid": DELTA_ATTENTION
    | dict(
        layer_group_size=2,
        first_k_dense_replace=1,
        num_expert_group=1,
        topk_group=1,
        short_conv_kernel_size=3,
        num_nextn_predict_layers=0,
    ),
    "olmo_hybrid": dict(
        num_hidden_layers=2,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=3,
    ),
    "minimax": dict(num_hidden_layers=2, num_local_experts=4, block_size=8),
    "recurrent_gemma": dict(
        num_hidden_layers=3, lru_width=32, attention_window_size=16, conv1d_width=3, num_key_value_heads=1
    ),
    "mamba": SELECTIVE_SCAN,
    "falcon_mamba": SELECTIVE_SCAN,
    "mamba2": dict(
        num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, conv_kernel=3, n_groups=2, chunk_size=8
    ),
    "xlstm": dict(num_hidden_layers=2, num_blocks=2, embedding_dim=32, num_heads=2, chunk_size=8),
    "lara_mini": GATED_DELTA_NET | EXPERTS | dict(layer_types=None, sliding_window=16),
    "inkling_text": dict(
        num_hidden_layers=2,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=8,
        sliding_window_size=16,
        d_rel=4,
        rel_extent=32,
        conv_kernel_size=3,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
    ),
}
CASES = [
    (family, FLASH if backend == "flash" else backend)
    for family in CONFIGS
    for backend, verdict in zip(families.BACKENDS, families.FAMILIES[family])
    if verdict.per_document
]


def tiny_model(family: str, attn: str, dtype: torch.dtype = torch.float64) -> transformers.PreTrainedModel:
    """For the flash path the model is built on eager, then switched (see flash_reference). The experts run
    transformers' eager implementation, which (unlike grouped_mm) takes float64."""
    config = AutoConfig.for_model(family, **SIZES | CONFIGS[family])
    torch.manual_seed(0)
    options = dict(attn_implementation="eager" if attn == FLASH else attn, experts_implementation="eager")
    model = AutoModelForCausalLM.from_config(config, **options).to(dtype)
    return enable_flash_attention(model) if attn == FLASH else model


@pytest.fixture(autouse=True)
def flash_reference_for_flash_cases(request):
    if "attn" in request.fixturenames and request.getfixturevalue("attn") == FLASH:
        request.getfixturevalue("use_flash_reference")


def _pack(lengths: list[int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    tokens = sum(lengths)
    input_ids = rng.integers(1, VOCAB, size=tokens, dtype=np.int32)
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
    # Qwen3.5's composite configs build the text models measured here (and the multimodal test below).
    assert set(CONFIGS) | {"qwen3_5", "qwen3_5_moe"} == per_document


# --- isolation in float32, and the masks Granite 4 hybrid needs beside its Mamba layers ----------------


@pytest.mark.slow
@pytest.mark.parametrize("family, attn", CASES)
def test_packed_documents_equal_documents_alone_float32(family, attn, packs):
    model = enable_packing(tiny_model(family, attn, torch.float32))
    result = measure_isolation(model, packs, padded(packs), tolerance=FLOAT32_TOLERANCE)
    assert result.passed, result


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_granite_hybrid_attention_leaks_without_masks_from_position_ids(attn, packs, monkeypatch):
    """transformers builds Granite 4 hybrid's sdpa/eager mask without position_ids: one causal mask per row.
    Its Mamba layers run per document; without the layer masks its attention still leaks."""
    assert families.verdict("granitemoehybrid", attn).how == "layer masks"
    monkeypatch.setitem(families.FAMILIES, "granitemoehybrid", (families.MAMBA2,) * 3)
    model = enable_packing(tiny_model("granitemoehybrid", attn))
    assert measure_isolation(model, packs, padded(packs), tolerance=LEAK, gradients=False).max_logit_diff > LEAK


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_multimodal_used_text_only_is_isolated(family, packs):
    text = SIZES | GATED_DELTA_NET | (EXPERTS if family == "qwen3_5_moe" else {})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    config = AutoConfig.for_model(family, text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, experts_implementation="eager").to(torch.float64)
    model.set_attn_implementation("sdpa")
    result = measure_isolation(enable_packing(model), packs, padded(packs), tolerance=1e-10)
    assert result.passed, result


# --- the other batch forms, training, and what is left alone ---------------------------------------


@pytest.mark.parametrize("family", ["bamba", "lfm2", "qwen3_next"])
@pytest.mark.parametrize("options", [dict(layout="padding_free"), dict(layout="indexed_mask"), dict(seq_idx=True)])
def test_other_batch_forms_are_isolated(family, options, packs):
    """seq_idx=True made the Mamba families raise in transformers' torch fallback; the guard consumes it."""
    model = enable_packing(tiny_model(family, "sdpa"))
    result = measure_isolation(model, packs, padded(packs, **options), tolerance=1e-10)
    assert result.passed, result


def test_position_ids_alone_are_enough_on_sdpa(packs):
    batch = {key: padded(packs)[key] for key in ("input_ids", "labels", "position_ids")}
    result = measure_isolation(enable_packing(tiny_model("bamba", "sdpa")), packs, batch, tolerance=1e-10)
    assert result.passed, result


@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_5_text"])
def test_gradient_checkpointing_recomputes_the_layers_per_document(family, packs):
    """A recomputation in backward reads the segments of the forward it repeats (reentrant checkpoints run it
    inside backward, after the forward has returned)."""
    model = enable_packing(tiny_model(family, "sdpa")).train()
    batch = padded(packs)

    def gradients():
        model.zero_grad()
        model(**batch).loss.backward()
        return [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]

    expected = gradients()
    model.activation_checkpointing_enable({"use_reentrant": True})
    got = gradients()
    assert len(got) == len(expected)
    for expected_grad, got_grad in zip(expected, got):
        torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=1e-12)


def test_a_batch_that_is_not_packed_is_left_alone():
    model = tiny_model("bamba", "sdpa").eval()
    input_ids = torch.arange(2 * 20).view(2, 20) % VOCAB
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
