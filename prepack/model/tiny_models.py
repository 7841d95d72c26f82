"""Tiny random models of every causal LM family the installed transformers registers, built from their
config classes with every size shrunk and every kind of layer kept.

`tiny_config(model_type)` starts from the config class's defaults (the family's flagship shape) and
overrides what makes it large: widths, depths, heads, experts, vocabulary. Per-layer patterns
(`layer_types`, `layers_block_type`, index lists such as `attn_layer_indices`) are cut to one layer of
each distinct kind, in their original order, so a hybrid keeps its attention, state-space, MoE and
dense layers. Sliding windows, attention chunks and scan chunks become shorter than the documents of
the sweep, so that they are exercised. `tiny_model(model_type, attn)` builds it in float64 with seeded
weights, and refuses to build one of more than `MAX_PARAMETERS` (a size the shrinking missed would
otherwise fill the machine's memory). Nothing is downloaded. Where the generic shrinking breaks a
family's own consistency rules, `_FAMILIES` sets the sizes that must agree.

Special token ids (images, audio, ...) are moved to the top of the vocabulary, at or above
`DOCUMENT_VOCAB`: documents drawn below it never hit a multimodal placeholder.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = ["CAUSAL_LM_TYPES", "DOCUMENT_VOCAB", "VOCAB", "WINDOW", "tiny_config", "tiny_model"]

CAUSAL_LM_TYPES = tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
VOCAB = 128
DOCUMENT_VOCAB = 96  # documents use ids below this; special ids live above it
WINDOW = 6  # sliding windows, local attention: shorter than most documents of the sweep
CHUNK = 8  # attention chunks, scan chunks, linear-attention blocks
MAX_LAYERS = 6
MAX_PARAMETERS = 10_000_000

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 8

# Every size attribute we shrink, by name; a value None in the defaults (a feature turned off) stays None.
_SIZES: dict[str, int] = {
    # widths
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "dim": HIDDEN, "embedding_size": HIDDEN,
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "d_inner": 64, "dim_ff": 64, "ffn_hidden_size": 64,
    "decoder_ffn_dim": 64, "encoder_ffn_dim": 64, "feed_forward_size": 64, "intermediate_size_mlp": 64,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "shared_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16, "expert_ffn_hidden_size": 16, "dense_intermediate_size": 64,
    "shared_experts_intermediate_size": 16, "prefix_dense_intermediate_size": 64, "moe_latent_size": 16,
    "word_embed_proj_dim": HIDDEN, "input_embedding_size": HIDDEN, "output_embedding_size": HIDDEN,
    "attention_hidden_size": HIDDEN, "lru_width": HIDDEN, "router_hidden_size": 16, "adapter_in_dim": HIDDEN,
    "adapter_input_size": HIDDEN,
    # heads
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "decoder_attention_heads": HEADS, "encoder_attention_heads": HEADS, "attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "num_kv_heads": KV_HEADS, "num_query_groups": KV_HEADS,
    "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "swa_head_dim": HEAD_DIM, "attention_head_dim": HEAD_DIM, "dim_head": HEAD_DIM,
    "d_head": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_size": HEAD_DIM, "rotary_dim": 4,
    # multi-head latent attention
    "q_lora_rank": 16, "kv_lora_rank": 16, "o_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "qk_head_dim": 16,
    # sparse-attention indexers
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "indexer_n_heads": 2, "indexer_head_dim": 16,
    "indexer_kv_heads": 1, "indexer_budget": 4,
    # experts
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "num_experts_per_token": 2, "top_k_experts": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    # state-space and linear-attention layers
    "mamba_d_state": 8, "ssm_state_size": 8, "state_size": 8, "mamba_n_heads": 4, "mamba_num_heads": 4,
    "n_mamba_heads": 4, "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_headdim": 16, "mamba_d_ssm": 64,
    "mamba_n_groups": 1, "mamba_ngroups": 1, "n_groups": 1, "mamba_dt_rank": 4, "time_step_rank": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_num_heads": 4, "linear_head_dim": 8,
    "mamba_chunk_size": CHUNK, "chunk_size": CHUNK, "block_size": CHUNK,
    # windows and chunked attention
    "sliding_window": WINDOW, "sliding_window_size": WINDOW, "attention_window_size": WINDOW,
    "attention_chunk_size": CHUNK, "local_attention_window_len": WINDOW, "window_size": WINDOW,
    # vocabulary and positions
    "vocab_size": VOCAB, "output_vocab_size": VOCAB, "emb_dim": HIDDEN,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "max_seq_len": 128, "max_target_positions": 128, "max_source_positions": 128,
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8, "ple_embed_dim": 8,
    "pronunciation_vocab_size": 16, "shape_vocab_size": 16, "ngram_vocab_size_base": 16,
    "laurel_rank": 4, "num_centroids": 4, "centroid_intermediate_top_k": 2, "loop_gate_rank": 4,
    "gated_norm_rank": 4, "hc_lowrank": 4, "encoder_hash_byte_group_vocab": 64,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "decoder_layers": 2,
    "encoder_layers": 2, "num_decoder_layers": 2, "num_encoder_layers": 2,
}

# Gemma 3n's vision tower, timm's MobileNetV5 (`mobilenetv5_300m_enc`), cut to one block of each kind its arch strings
# name, in its four stages: an edge residual, universal inverted residuals (depthwise start and middle kernels, and
# none) and multi-query attention (keys and values downsampled 2x, and not). A 64-pixel image leaves 4x4 and 2x2
# feature maps to its fusion adapter (MSFA), which upsamples the smaller, fuses both and pools them to 2x2: 4 tokens.
MOBILENET_V5_BLOCKS = [
    ["er_r1_k3_s2_e2_c8"],
    ["uir_r1_a3_k5_s2_e2_c16", "uir_r1_a5_k0_s1_e2_c16"],
    ["uir_r1_a5_k5_s2_e2_c16", "mqa_r1_k3_h2_v2_s1_d8_c16", "uir_r1_a0_k0_s1_e2_c16"],
    ["uir_r1_a5_k5_s2_e2_c16", "mqa_r1_k3_h2_s1_d8_c16", "uir_r1_a0_k0_s1_e2_c16"],
]

# Families whose defaults need more than the generic shrinking: sizes that must agree with each other.
_FAMILIES: dict[str, dict[str, Any]] = {
    "mamba2": {"num_heads": 4, "head_dim": 16},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_local_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "qwen4_exp_text": {"indexer_budget": 8, "indexer_compress_ratio": 2, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                       "indexer_head_dim": 16},
    "zaya": {"num_experts_per_tok": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # hybrids whose shrunk default pattern loses one of the two kinds of layer
    "lfm2": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},
    "bamba": {"num_hidden_layers": 2, "attn_layer_indices": [1]},
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["mamba", "attention"]},
    "jamba": {"num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "recurrent_gemma": {"num_hidden_layers": 3},
    "zamba2": {"attention_hidden_size": 2 * HIDDEN},
    # serialized with an "mlp" entry after every layer, which the config folds back
    "dory": {"num_hidden_layers": 8, "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp"] * 2,
             "n_input_layers": 1, "n_output_layers": 1},
    # the last layers reuse the keys and values of the last layer of their kind before them
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "intermediate_size": [64] * 4,  # a list per layer, which the generic shrinking (of integers) leaves at 16384
    },
    # MobileNetV5's fusion adapter emits 2048 channels whatever its blocks (timm fixes the width): the tower's
    # hidden_size, which Gemma 3n's image embedder projects to the text width. `tiny_config` decodes the blocks.
    "gemma3n_vision": {"hidden_size": 2048, "model_args": {"block_args": MOBILENET_V5_BLOCKS, "stem_size": 8,
                                                            "msfa_output_resolution": 2}},
    "gemma3n": {"vision_soft_tokens_per_image": 4},
    # its sliding layers' head_dim must be qk_nope_head_dim + qk_rope_head_dim
    "dots3_note_text": {"head_dim": 16, "swa_head_dim": 16},
    # two hybrid layers: the first holds the shared attention block, the second ties its weights to it
    "zamba": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2,
              "attention_hidden_size": 2 * HIDDEN},
}

# Sizes set even where the default is None: the model would derive them from the unshrunk ones.
_DERIVED = ("head_dim", "num_key_value_heads")

# A token id is special if its attribute is named so; pad/bos/eos only need to be inside the vocabulary.
_ORDINARY_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                    "cls_token_id", "mask_token_id", "forced_eos_token_id", "eod_token_id")


def tiny_config(model_type: str) -> transformers.PreTrainedConfig:
    """The family's default config, shrunk (see the module docstring)."""
    config_class = CONFIG_MAPPING[model_type]
    overrides = _shrunk(config_class()) | _FAMILIES.get(model_type, {})
    if model_type == "gemma3n":  # timm builds MobileNetV5 from decoded blocks (without timm: ModuleNotFoundError)
        from timm.models._efficientnet_builder import decode_arch_def

        model_args = overrides["vision_config"]["model_args"]
        overrides["vision_config"]["model_args"] = {**model_args, "block_args": decode_arch_def(model_args["block_args"])}
    return config_class(**overrides)


def tiny_model(model_type: str, attn: str, dtype: torch.dtype = torch.float64) -> transformers.PreTrainedModel:
    """A seeded random model of the family on attention `attn`."""
    config = tiny_config(model_type)
    built_on = attn
    # MoE expert kernels other than the eager loop (grouped_mm) have no float64 on CPU.
    options = dict(attn_implementation=built_on, experts_implementation="eager", dtype=dtype)
    with torch.device("meta"):  # a size the shrinking missed would fill the memory of the machine
        # Copies: timm pops the block types out of the config's MobileNetV5 blocks as it builds them (Gemma 3n).
        counted = AutoModelForCausalLM.from_config(copy.deepcopy(config), **options)
        parameters = sum(p.numel() for p in counted.parameters())
    if parameters > MAX_PARAMETERS:
        raise AssertionError(f"{model_type}: the tiny model has {parameters:,} parameters; a size was not shrunk.")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), **options)
    return model.eval()


def _shrunk(config: transformers.PreTrainedConfig) -> dict[str, Any]:
    """Keyword arguments that rebuild `config` small; sub-configs (text, vision, audio) shrunk as well."""
    defaults = {key: value for key, value in config.to_dict().items() if not key.startswith("_")}
    overrides: dict[str, Any] = {}
    for key, value in defaults.items():
        if key in _SIZES and isinstance(value, int) and not isinstance(value, bool) or key in _DERIVED:
            overrides[key] = _SIZES[key]
    for key, value in vars(config).items():
        if isinstance(value, transformers.PreTrainedConfig):
            overrides[key] = {**value.to_dict(), **_shrunk(value), **_FAMILIES.get(value.model_type, {})}
    if defaults.get("kv_lora_rank"):  # multi-head latent attention projects keys for every head
        overrides["num_key_value_heads"] = HEADS
    overrides |= _layer_pattern(defaults)
    overrides |= _special_tokens(defaults)
    return overrides


def _layer_pattern(defaults: dict[str, Any]) -> dict[str, Any]:
    """Per-layer lists cut to the first layer of each distinct kind (at least 2 layers, at most MAX_LAYERS)."""
    depth_keys = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
    depth_key = next((key for key in depth_keys if key in defaults), None)
    depth = defaults.get(depth_key) if depth_key else None
    per_layer = {
        key: value
        for key, value in defaults.items()
        if isinstance(value, list) and depth and len(value) == depth and key not in ("architectures",)
    }
    indices = {
        key: value
        for key, value in defaults.items()
        if key.endswith(("_layer_indices", "_layer_ids", "_idxs", "layers", "only_layers"))
        and isinstance(value, list)
        and value
        and all(isinstance(index, int) and not isinstance(index, bool) for index in value)
        and depth
        and max(value) < depth
        and key not in per_layer
    }
    overridden = defaults.get("per_layer_config") or {}  # {layer index: that layer's own settings}
    if overridden and depth:
        indices["per_layer_config"] = sorted(int(layer) for layer in overridden)
    if not depth or not (per_layer or indices):
        return {}
    kinds = [
        tuple(_hashable(value[layer]) for value in per_layer.values())
        + tuple(layer in value for value in indices.values())
        for layer in range(depth)
    ]
    kept: list[int] = []
    for layer, kind in enumerate(kinds):
        if kind not in (kinds[index] for index in kept):
            kept.append(layer)
    for layer in range(depth):
        if len(kept) >= 2:
            break
        if layer not in kept:
            kept.append(layer)
    kept = sorted(kept)[:MAX_LAYERS]
    pattern: dict[str, Any] = {depth_key: len(kept)}
    pattern |= {key: [value[layer] for layer in kept] for key, value in per_layer.items()}
    pattern |= {key: [new for new, layer in enumerate(kept) if layer in value] for key, value in indices.items()}
    if overridden:
        settings = {int(layer): _shrunk_settings(value) for layer, value in overridden.items()}
        pattern["per_layer_config"] = {new: settings[layer] for new, layer in enumerate(kept) if layer in settings}
    return pattern


def _shrunk_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """One layer's own settings (a per_layer_config entry), their sizes shrunk as the config's."""
    shrunk = {key: _SIZES.get(key, value) if type(value) is int else value for key, value in settings.items()}
    if "kv_lora_rank" in settings:  # multi-head latent attention projects keys for every head
        shrunk["num_key_value_heads"] = HEADS
    return shrunk


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def _special_tokens(defaults: dict[str, Any]) -> dict[str, Any]:
    tokens: dict[str, Any] = {}
    special = VOCAB - 1
    for key, value in sorted(defaults.items()):
        if not key.endswith(("_token_id", "_token_index")) or isinstance(value, bool):
            continue
        if key in _ORDINARY_TOKENS:
            if isinstance(value, int) and value >= DOCUMENT_VOCAB:
                tokens[key] = 1
            elif isinstance(value, list):
                tokens[key] = [1 if token >= DOCUMENT_VOCAB else token for token in value]
        elif isinstance(value, int):
            tokens[key] = special
            special -= 1
    return tokens
