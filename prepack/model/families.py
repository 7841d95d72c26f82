"""Which causal-LM families `enable_packing` keeps isolated, on which attention backend, and why not where not.

One row per model type that transformers registers as a causal LM (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`),
one verdict per backend: sdpa, eager, flash (flash_attention_2 and flash_attention_3, which share
transformers' one flash-attention path), fa4 (flash_attention_4, FlashAttention-4: the same path, with
FA4's options: sinks, no dropout) and flex (flex_attention: a BlockMask that transformers builds from
`position_ids`, as it builds sdpa's mask). The table is measured, not claimed: `tests/model/test_family_sweep.py`
builds a tiny random model of every family, packs documents with `PackedCollator`, and compares every
document with the document run alone (float64, CPU; flash and fa4 through pure-torch stand-ins of the
kernels, flex through torch's own flex_attention run uncompiled, on logits and loss only: torch's flex has
no backward on CPU). It fails when a family marked isolated leaks, and when a family marked refused would
in fact isolate. It runs on the installed transformers, so a new release that changes a family shows up as
a failing test.

A verdict is one of:
- native: transformers keeps documents apart itself, from `position_ids` (sdpa, eager) or
  `cu_seq_lens_*` (flash), as `PackedCollator` emits them (Llama 4 from its attention temperature floor on,
  which tiny rows do not reach: with the per-document query temperature `enable_packing` adds);
- layer masks: the model builds its masks without `position_ids`; prepack passes the per-layer-type
  masks (`{"full_attention": ..., "sliding_attention": ...}`) that transformers' public
  `create_causal_mask` / `create_sliding_window_causal_mask` build from them, which the model takes as given;
- block mask: the same for a model that takes one 4-D mask (no sliding layers);
- per document (`Verdict.per_document`, beside one of the above for its attention layers): the layers that
  carry state along the sequence (Mamba scans, short convolutions, the gated delta rule, linear attention)
  run one document per row, through module hooks (`prepack.model.stateful`, which knows their classes);
- refused: `enable_packing` raises `IsolationError` naming the family, the backend, the reason and what
  to do instead.

A model type not in the table (a newer transformers, remote code) is refused unless the caller passes
`allow_unlisted=True` to `enable_packing` after checking it with `prepack check-isolation`: the families
that leak are the ones with new kinds of layers, and a new family is the likeliest to have one.

`python -m prepack.model.families` prints the table as docs/model-support.md. No torch here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BACKENDS",
    "FAMILIES",
    "MEASURED_VERSION",
    "MEASURED_WITH",
    "SWEEP_COMMAND",
    "Verdict",
    "backend_of",
    "implementation",
    "markdown",
    "refusal",
    "verdict",
]

BACKENDS = ("sdpa", "eager", "flash", "fa4", "flex")
# The transformers attention implementation each backend column stands for (flash: flash_attention_3 too).
_IMPLEMENTATIONS = {
    "sdpa": "sdpa",
    "eager": "eager",
    "flash": "flash_attention_2",
    "fa4": "flash_attention_4",
    "flex": "flex_attention",
}
MEASURED_VERSION = "5.24.0"  # the transformers release the table was measured on; it changes weekly
MEASURED_WITH = f"transformers {MEASURED_VERSION}"
SWEEP_COMMAND = "prepack check-isolation --sweep"  # re-measures the installed transformers' families


@dataclass(frozen=True)
class Verdict:
    """How `enable_packing` keeps a family's documents apart on one backend, or why it refuses."""

    how: Literal["native", "layer masks", "block mask", "refused"]  # how its attention layers are kept apart
    reason: str = ""  # for a refusal: why documents would see each other, or why it was not measured
    per_document: str = ""  # the sequence-state layers that run one document per row, where there are some

    @property
    def isolated(self) -> bool:
        return self.how != "refused"

    @property
    def label(self) -> str:
        """What docs/model-support.md says about it: "native", "per document", "layer masks, per document"."""
        if not self.per_document:
            return self.how
        return "per document" if self.how == "native" else f"{self.how}, per document"


NATIVE = Verdict("native")
LAYER_MASKS = Verdict("layer masks")
BLOCK_MASK = Verdict("block mask")


def _per_document(layers: str, how: Literal["native", "layer masks"] = "native") -> Verdict:
    return Verdict(how, per_document=layers)


# The sequence-state layers that run one document per row, by kind.
GATED_DELTA_RULE = _per_document("gated delta rule layers (causal conv1d + chunked delta rule)")
MAMBA = _per_document("Mamba layers (causal conv1d + selective scan)")
MAMBA2 = _per_document("Mamba-2 layers (causal conv1d + chunked SSM scan)")
SHORT_CONVOLUTIONS = _per_document("short-convolution layers (causal conv1d)")
DELTA_ATTENTION = _per_document("delta attention layers (short convolutions + chunked delta rule)")
LIGHTNING_ATTENTION = _per_document("lightning attention layers (block-wise linear attention)")
RECURRENT_BLOCKS = _per_document("recurrent blocks (causal conv1d + RG-LRU scan)")
# Measured with transformers' torch kernels, which run in float32.
XLSTM_BLOCKS = _per_document("xLSTM blocks (chunked mLSTM)")
# Granite 4 hybrid builds its sdpa/eager masks without position_ids, beside its Mamba-2 layers.
MAMBA2_WITH_LAYER_MASKS = _per_document(MAMBA2.per_document, "layer masks")

# Refusals, by mechanism (measured: each leaks or fails when run packed; see the sweep).
_STATE = (
    "sequence-state layers (Mamba scans, short convolutions, linear attention or recurrences) carry state "
    "from one document into the next"
)


def _state(why_not_per_document: str) -> Verdict:
    return Verdict("refused", f"{_STATE}, and prepack cannot run them one document at a time: {why_not_per_document}")


ZAYA = _state("their projection returns per-token outputs together with a recurrent state delayed by a token")
RWKV = _state("transformers' own torch RWKV kernel fails in backward")
INKLING2 = _state(
    "their short convolutions take extra positional arguments, and transformers' torch path raises on seq_idx"
)

ENCODER = Verdict(
    "refused",
    "an encoder, or the decoder of an encoder-decoder model, registered as a causal LM: its positions or its "
    "attention mask ignore position_ids",
)
POSITIONS = Verdict(
    "refused",
    "its positions (ALiBi, learned absolute positions or relative buckets) are counted from the start of the "
    "row, not taken from position_ids",
)
SPARSE = Verdict(
    "refused",
    "its sparse-attention indexer selects keys over the whole row, from other documents too",
)
FLASH_WITHOUT_OFFSETS = Verdict(
    "refused",
    "its flash-attention path does not pass cu_seq_lens_* on to the kernel, so attention runs over the whole row",
)
NO_SDPA = Verdict("refused", "transformers has no sdpa attention for this family")
NO_FLASH = Verdict("refused", "transformers has no flash attention for this family")
NO_FLEX = Verdict("refused", "transformers has no flex attention for this family")


def _fails(detail: str) -> Verdict:
    return Verdict("refused", f"transformers' own code fails on a packed batch here ({detail})")


def _unmeasured(detail: str) -> Verdict:
    return Verdict("refused", f"not measured: no tiny model of the family could be built from its config ({detail})")


def _unmeasured_without_flex(detail: str) -> tuple[Verdict, Verdict, Verdict, Verdict, Verdict]:
    """The row of a family no tiny model could be built of, which transformers gives no flex attention."""
    return (_unmeasured(detail),) * 4 + (NO_FLEX,)


QWEN4_EXP_ON_FLASH = _fails("its sparse-attention indexer reads an attention mask, which the flash path has not")
DOGE_ON_FLASH = _fails("DogeAttention has no is_causal attribute, which the flash path reads")
FALCON_ON_FLASH = _fails("its flash path adds an attention bias that is None without a mask")
GIT = _fails("GIT's loss expects image tokens (pixel_values) before the text")
HRM_ON_FLASH = Verdict("refused", "transformers has no flash attention for a prefix-LM config (prefix_lm=True)")
MPT = Verdict("refused", "MptForCausalLM does not pass position_ids on to its decoder: it cannot see the documents")
MPT_ON_FLASH = _fails("its flash path reads an attention mask, which a packed batch does not have")
DOGE_ON_FLEX = Verdict(
    "refused",
    "DogeAttention drops the BlockMask that carries flex_attention's per-document mask, and attends with its "
    "dynamic mask alone",
)
SINKS_ON_FLEX = Verdict(
    "refused",
    "not measured: transformers' flex path raises for attention sinks on a CPU, where the sweep runs (on CUDA it "
    "applies them, unmeasured)",
)
XGLM = _fails("XGLM's causal-LM head turns the cache on, and with a cache eager builds no per-document mask")

# (sdpa, eager, flash) per model type, written from a sweep run; tests/model/test_family_sweep.py fails on any row
# that differs from what it measures.
FAMILIES: dict[str, tuple[Verdict, Verdict, Verdict, Verdict, Verdict]] = {
    'afmoe': (LAYER_MASKS, LAYER_MASKS, NATIVE, NATIVE, LAYER_MASKS),
    'apertus': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'apertus1p5_text': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'arcee': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'aria_text': (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'axk1': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'axk2': (SPARSE, SPARSE, SPARSE, SPARSE, NO_FLEX),
    'bailing_hybrid': (DELTA_ATTENTION, DELTA_ATTENTION, DELTA_ATTENTION, DELTA_ATTENTION, NO_FLEX),
    'bamba': (MAMBA2, MAMBA2, MAMBA2, MAMBA2, NO_FLEX),
    'bart': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'beam': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'bert': (ENCODER, ENCODER, NATIVE, NATIVE, ENCODER),
    'bert-generation': (ENCODER, ENCODER, NATIVE, NATIVE, ENCODER),
    'big_bird': (NO_SDPA, ENCODER, ENCODER, ENCODER, NO_FLEX),
    'bigbird_pegasus': (NO_SDPA, ENCODER, ENCODER, ENCODER, NO_FLEX),
    'biogpt': (BLOCK_MASK, BLOCK_MASK, NATIVE, NATIVE, BLOCK_MASK),
    'bitnet': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'blenderbot': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'blenderbot-small': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'bloom': (NO_SDPA, POSITIONS, POSITIONS, POSITIONS, NO_FLEX),
    'blt': _unmeasured_without_flex("BLT's byte patcher and local encoder take sizes the sweep does not shrink consistently"),
    'camembert': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'codegen': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'cohere': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'cohere2': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'cohere2_moe': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'cohere_compass_text': _unmeasured_without_flex(
        'its defaults do not build in transformers either: rope_parameters has no full_attention entry'
    ),
    'cpmant': (NO_SDPA, POSITIONS, POSITIONS, POSITIONS, NO_FLEX),
    'ctrl': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'cwm': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'data2vec-text': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'dbrx': (
        _unmeasured(
            'its defaults do not build in transformers either: DbrxAttentionConfig has no rope_theta'
        ),
    ) * 5,
    'deepseek_v2': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'deepseek_v3': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'deepseek_v32': (SPARSE, SPARSE, SPARSE, SPARSE, NO_FLEX),
    'deepseek_v4': (NO_SDPA, SPARSE, SPARSE, SPARSE, NO_FLEX),
    'diffllama': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'doge': (NATIVE, NATIVE, DOGE_ON_FLASH, DOGE_ON_FLASH, DOGE_ON_FLEX),
    'dory': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'dots1': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'dots3_note': (
        _unmeasured("its vision adapter's widths must match the text model's, which the sweep does not shrink"),
    ) * 5,
    'dots3_note_text': (SPARSE, SPARSE, SPARSE, SPARSE, NO_FLEX),
    'electra': (ENCODER, ENCODER, NATIVE, NATIVE, ENCODER),
    'emu3': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'ernie': (ENCODER, ENCODER, NATIVE, NATIVE, ENCODER),
    'ernie4_5': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'ernie4_5_moe': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'exaone': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'exaone4': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'exaone_moe': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'falcon': (NATIVE, NATIVE, FALCON_ON_FLASH, FALCON_ON_FLASH, NO_FLEX),
    'falcon_h1': (MAMBA2, MAMBA2, MAMBA2, MAMBA2, NO_FLEX),
    'falcon_mamba': (NO_SDPA, MAMBA, NO_FLASH, NO_FLASH, NO_FLEX),
    'flex_olmo': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'flint': (NO_SDPA, NATIVE, NATIVE, NATIVE, SINKS_ON_FLEX),
    'fuyu': (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'gemma': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'gemma2': (NO_SDPA, NATIVE, NATIVE, NATIVE, NATIVE),
    'gemma3': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'gemma3_text': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'gemma3n': (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'gemma3n_text': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'gemma4': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'gemma4_assistant': (
        _unmeasured(
            "a draft model: its defaults do not validate without its target model's settings"
        ),
    ) * 5,
    'gemma4_text': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'gemma4_unified': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'gemma4_unified_assistant': _unmeasured_without_flex(
        "a draft model: its forward needs its target model's shared keys and values"
    ),
    'gemma4_unified_text': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'git': (NO_SDPA, GIT, GIT, GIT, NO_FLEX),
    'glm': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'glm4': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'glm4_moe': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'glm4_moe_lite': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'glm_moe_dsa': (SPARSE, SPARSE, SPARSE, SPARSE, NO_FLEX),
    'got_ocr2': (NO_SDPA, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'gpt-sw3': (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'gpt2': (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'gpt_bigcode': (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'gpt_neo': (NO_SDPA, NATIVE, FLASH_WITHOUT_OFFSETS, FLASH_WITHOUT_OFFSETS, NO_FLEX),
    'gpt_neox': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'gpt_neox_japanese': (NO_SDPA, NATIVE, FLASH_WITHOUT_OFFSETS, FLASH_WITHOUT_OFFSETS, NO_FLEX),
    'gpt_oss': (NO_SDPA, LAYER_MASKS, NATIVE, NATIVE, SINKS_ON_FLEX),
    'gptj': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'granite': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'granite_swa': (NO_SDPA, NATIVE, NATIVE, NATIVE, SINKS_ON_FLEX),
    'granitemoe': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'granitemoe_swa': (NO_SDPA, NATIVE, NATIVE, NATIVE, SINKS_ON_FLEX),
    'granitemoehybrid': (MAMBA2_WITH_LAYER_MASKS, MAMBA2_WITH_LAYER_MASKS, MAMBA2, MAMBA2, MAMBA2_WITH_LAYER_MASKS),
    'granitemoeshared': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'helium': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'hrm_text': (NATIVE, NATIVE, HRM_ON_FLASH, HRM_ON_FLASH, NATIVE),
    'hunyuan_v1_dense': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'hunyuan_v1_moe': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'hy_v3': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'hy_v4': (NO_SDPA, SPARSE, SPARSE, SPARSE, NO_FLEX),
    'hyperclovax': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'inkling2_loop_text': (NO_SDPA, INKLING2, INKLING2, INKLING2, NO_FLEX),
    'inkling2_text': (NO_SDPA, INKLING2, INKLING2, INKLING2, NO_FLEX),
    'inkling_text': (SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS),
    'internlm3': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'iquestcoder': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'jais2': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'jamba': (MAMBA, MAMBA, MAMBA, MAMBA, NO_FLEX),
    'jetmoe': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'kimi_linear': (DELTA_ATTENTION, DELTA_ATTENTION, DELTA_ATTENTION, DELTA_ATTENTION, NO_FLEX),
    'kolibri1': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'laguna': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'lara_mini': (GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, NO_FLEX),
    'lfm2': (SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS),
    'lfm2_moe': (SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS),
    'lfm3': (SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS, SHORT_CONVOLUTIONS),
    'llama': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'llama4': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'llama4_text': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'longcat_flash': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'mamba': (NO_SDPA, MAMBA, NO_FLASH, NO_FLASH, NO_FLEX),
    'mamba2': (NO_SDPA, MAMBA2, NO_FLASH, NO_FLASH, NO_FLEX),
    'marian': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'mbart': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'megatron-bert': (NO_SDPA, ENCODER, ENCODER, ENCODER, NO_FLEX),
    'mellum': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'mimo_v2_flash': (NO_SDPA, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'minicpm3': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'minimax': (LIGHTNING_ATTENTION, LIGHTNING_ATTENTION, LIGHTNING_ATTENTION, LIGHTNING_ATTENTION, LIGHTNING_ATTENTION),
    'minimax_m2': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'minimax_m3_vl_text': (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'ministral': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'ministral3': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'mistral': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'mixtral': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'mllama': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'modernbert-decoder': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'moshi': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'moss_transcribe_diarize': (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'mpt': (NO_SDPA, MPT, MPT_ON_FLASH, MPT_ON_FLASH, NO_FLEX),
    'musicgen': (_unmeasured('its defaults do not build in transformers either: MusicgenConfig has no dropout'),) * 5,
    'musicgen_melody': (
        _unmeasured(
            'its defaults do not build in transformers either: MusicgenMelodyConfig has no dropout'
        ),
    ) * 5,
    'mvp': (NO_SDPA, ENCODER, ENCODER, ENCODER, NO_FLEX),
    'nanochat': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'nemotron': (NATIVE, NATIVE, FLASH_WITHOUT_OFFSETS, FLASH_WITHOUT_OFFSETS, NATIVE),
    'nemotron_h': (MAMBA2, MAMBA2, MAMBA2, MAMBA2, MAMBA2),
    'olmo': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'olmo2': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'olmo3': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'olmo_hybrid': (GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, NO_FLEX),
    'olmoe': (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'openai-gpt': (NO_SDPA, POSITIONS, POSITIONS, POSITIONS, NO_FLEX),
    'opt': (BLOCK_MASK, BLOCK_MASK, NATIVE, NATIVE, BLOCK_MASK),
    'pegasus': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'persimmon': (NATIVE, NATIVE, NATIVE, NATIVE, NO_FLEX),
    'phi': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'phi3': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'phi4_multimodal': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'phimoe': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'plbart': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'prophetnet': (NO_SDPA, ENCODER, ENCODER, ENCODER, NO_FLEX),
    'qwen2': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'qwen2_moe': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'qwen3': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'qwen3_5': (GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, NO_FLEX),
    'qwen3_5_moe': (GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, NO_FLEX),
    'qwen3_5_moe_text': (GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, NO_FLEX),
    'qwen3_5_text': (GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, NO_FLEX),
    'qwen3_moe': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'qwen3_next': (GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, GATED_DELTA_RULE, NO_FLEX),
    'qwen4_exp': (GATED_DELTA_RULE, GATED_DELTA_RULE, QWEN4_EXP_ON_FLASH, QWEN4_EXP_ON_FLASH, NO_FLEX),
    'qwen4_exp_text': (GATED_DELTA_RULE, GATED_DELTA_RULE, QWEN4_EXP_ON_FLASH, QWEN4_EXP_ON_FLASH, NO_FLEX),
    'recurrent_gemma': (RECURRENT_BLOCKS, RECURRENT_BLOCKS, RECURRENT_BLOCKS, RECURRENT_BLOCKS, RECURRENT_BLOCKS),
    'reformer': (
        NO_SDPA,
        *[_unmeasured("its defaults do not build in transformers either: its LM head needs is_decoder=True")] * 3,
        NO_FLEX,
    ),
    'rembert': (NO_SDPA, ENCODER, ENCODER, ENCODER, NO_FLEX),
    'roberta': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'roberta-prelayernorm': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'roc_bert': (ENCODER, ENCODER, NATIVE, NATIVE, ENCODER),
    'roformer': (NO_SDPA, ENCODER, ENCODER, ENCODER, NO_FLEX),
    'rwkv': (NO_SDPA, RWKV, RWKV, RWKV, NO_FLEX),
    'sarvam_mla': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'sarvam_moe': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'seed_oss': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'smollm3': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'solar_open': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'stablelm': (NATIVE, NATIVE, FLASH_WITHOUT_OFFSETS, FLASH_WITHOUT_OFFSETS, NO_FLEX),
    'starcoder2': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'trocr': (NO_SDPA, ENCODER, ENCODER, ENCODER, NO_FLEX),
    'vaultgemma': (NO_SDPA, NATIVE, NATIVE, NATIVE, NATIVE),
    'whisper': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'xglm': (NO_SDPA, XGLM, FLASH_WITHOUT_OFFSETS, FLASH_WITHOUT_OFFSETS, NO_FLEX),
    'xlm': (NO_SDPA, ENCODER, ENCODER, ENCODER, NO_FLEX),
    'xlm-roberta': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'xlm-roberta-xl': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'xlnet': (NO_SDPA, ENCODER, ENCODER, ENCODER, NO_FLEX),
    'xlstm': (NO_SDPA, XLSTM_BLOCKS, NO_FLASH, NO_FLASH, NO_FLEX),
    'xmod': (ENCODER, ENCODER, ENCODER, ENCODER, ENCODER),
    'youtu': (NATIVE, NATIVE, NATIVE, NATIVE, NATIVE),
    'zamba': (MAMBA, MAMBA, MAMBA, MAMBA, NO_FLEX),
    'zamba2': (MAMBA2, MAMBA2, MAMBA2, MAMBA2, MAMBA2),
    'zaya': (ZAYA,) * 5,
}


def backend_of(attn: str) -> str:
    """The table's column for a transformers attention implementation name."""
    if attn == "flash_attention_3":
        return "flash"
    return next((backend for backend, name in _IMPLEMENTATIONS.items() if name == attn), attn)


def implementation(backend: str) -> str:
    """The transformers attention implementation a column of the table was measured with."""
    return _IMPLEMENTATIONS[backend]


def verdict(model_type: str, attn: str) -> Verdict | None:
    """The family's verdict on this attention implementation; None for a model type the table lacks."""
    row = FAMILIES.get(model_type)
    return None if row is None else row[BACKENDS.index(backend_of(attn))]


def refusal(model_type: str, model_class: str, attn: str, *, registered_by: str | None = None) -> str | None:
    """The message `enable_packing` raises for this family and backend, or None where it isolates.

    `registered_by`: the installed transformers version, for a family of transformers' own code (not remote
    code); a family that another release registers and the table lacks was not measured on that release.
    """
    found = verdict(model_type, attn)
    if found is not None and found.isolated:
        return None
    if found is None:
        where = (
            f"not measured on this version: transformers {registered_by} registers it, and prepack's table was "
            f"measured on {MEASURED_WITH}"
            if registered_by not in (None, MEASURED_VERSION)
            else f"it is not in the table of {MEASURED_WITH} (a newer transformers, or remote code)"
        )
        return (
            f"prepack has not measured model type {model_type!r} ({model_class}) on {attn}: {where}, and a family "
            "with a new kind of layer may let packed documents see each other. Check it: prepack check-isolation "
            f"--model DIR --attn {attn} (or every family of this transformers: {SWEEP_COMMAND}); if it reports "
            "isolated, call enable_packing(model, allow_unlisted=True)."
        )
    elsewhere = [backend for backend, other in zip(BACKENDS, FAMILIES[model_type]) if other.isolated]
    instead = (
        f"Load it with attn_implementation={implementation(elsewhere[0])!r}, where prepack isolates it, or train "
        "it without packing (one document per row)."
        if elsewhere
        else "Train it without packing (one document per row)."
    )
    return (
        f"prepack cannot keep packed documents apart in {model_type} ({model_class}) on {attn}: "
        f"{found.reason}. {instead}"
    )


def markdown() -> str:
    """docs/model-support.md: the table, its counts and its legend."""
    counts = {
        backend: sum(row[column].isolated for row in FAMILIES.values()) for column, backend in enumerate(BACKENDS)
    }
    per_document_counts = {
        backend: sum(bool(row[column].per_document) for row in FAMILIES.values())
        for column, backend in enumerate(BACKENDS)
    }
    per_document = {
        model_type: found.per_document for model_type, row in FAMILIES.items() for found in row if found.per_document
    }
    table, legend = verdict_table(["model type"], {model_type: ([], row) for model_type, row in FAMILIES.items()})
    return "\n".join(
        [
            "# Model support",
            "",
            "<!-- Generated by `python -m prepack.model.families > docs/model-support.md`; "
            "tests/model/test_families.py fails when it is out of date. -->",
            "",
            f"Every causal LM that {MEASURED_WITH} registers, on each attention backend: **isolated** (packed",
            "documents give the logits, loss and gradients of each document run alone) or **refused**",
            "(`enable_packing` raises `IsolationError` with the reason and what to do instead). Measured by",
            "`tests/model/test_family_sweep.py` on tiny random models in float64. *flash* is transformers'",
            "flash-attention path for flash_attention_2 and _3, run with a pure-torch flash-attn; *fa4* the same",
            "path for flash_attention_4 (FlashAttention-4), run with a pure-torch stand-in of FA4's interface;",
            "*flex* is flex_attention, run with torch's own flex_attention uncompiled, compared on logits and",
            "loss only (torch's flex has no backward on CPU). A model type missing here (a newer transformers,",
            "remote code) is refused unless `enable_packing(model, allow_unlisted=True)` is passed after",
            "`prepack check-isolation` reports it isolated. On another transformers release, re-measure the",
            "installed one's families with `prepack check-isolation --sweep`.",
            "",
            "| backend | isolated | of which per document | refused |",
            "|---|---:|---:|---:|",
            *(
                f"| {backend} | {counts[backend]} | {per_document_counts[backend]} | {len(FAMILIES) - counts[backend]} |"
                for backend in BACKENDS
            ),
            "",
            "How: *native*: transformers isolates from `position_ids` / `cu_seq_lens_*`; *layer masks*: prepack",
            "passes the per-layer-type masks that transformers' `create_causal_mask` and",
            "`create_sliding_window_causal_mask` build from `position_ids`; *block mask*: the same as one 4-D mask;",
            "*per document*: the layers that carry state along the sequence (listed below) run one document per",
            "row, and attention is isolated natively (or by the masks named beside it). Llama 4 (llama4,",
            "llama4_text) is native as measured, on tiny rows; from its attention temperature floor (`floor_scale`,",
            "8192 in its checkpoints) on, prepack scales its NoPE layers' queries by a token's position in its",
            "document, where transformers takes the index in the row (tests/model/test_families.py measures it).",
            "",
            *table,
            "",
            "Run per document:",
            "",
            *(f"- {model_type}: {layers}" for model_type, layers in sorted(per_document.items())),
            "",
            *legend,
            "",
            "## Compiled training",
            "",
            "Fixed-shape batches (`prepack build --max-docs-per-pack K`, `PackedCollator(max_len, max_docs_per_pack=K)`)",
            "give `torch.compile(model, fullgraph=True, dynamic=False)` one forward and one backward graph for any",
            "number of steps (`tests/model/test_compile.py`, 50 steps of real packs, every document's logits equal to the",
            "document alone uncompiled): measured for llama on sdpa, eager and transformers' flash path (flash_attention_2",
            "and _4, pure-torch stand-ins of the kernels), and for qwen3 and gemma3 (sliding window) on sdpa. Where it does not:",
            "",
            "- *flex*: transformers builds the BlockMask with `create_block_mask(_compile=True)`, which torch 2.13",
            "  answers with a DeprecationWarning that dynamo cannot trace, so `fullgraph=True` raises on every model,",
            "  packed or not. Without `fullgraph` that is one graph break, and the graphs around it are traced once:",
            "  no recompile over the run (forward measured; torch's flex has no backward on a CPU).",
            "- *per document* (the families listed above): their sequence-state layers run one document per row, in",
            "  shapes that follow the batch's documents. With `fullgraph=True` `enable_packing` refuses by name; without",
            "  it the forward runs uncompiled, and isolated.",
            "- *pairs*: with `max_docs_per_pack=K` (a pair is two documents) the two-sequence layout and the shared-prompt",
            "  one (`shared_prompt=True`, rows of max-len; its [B, 1, L, L] mask never follows the pairs) compile once,",
            "  measured on sdpa, and on eager for the shared-prompt mask (`tests/model/test_compile_pairs.py`: 50 steps",
            "  of 1 to 3 pairs a pack, every completion's log-probability equal to the uncompiled model's).",
            "  `pair_segments`, `reference_logps` and the pair losses are [P, 2], one row a pair: compiled, `pair_logps`",
            "  is traced again per pair count. Compile the model; the loss runs after it. The shared-prompt layout is",
            "  refused by name on flash (a completion that sees its pair's prompt but not the other is no varlen segment).",
            "- *images* (`VisionCollator`): `pixel_values` follows the batch's images, and no option fixes it (a padding",
            "  image would need placeholder tokens of its own). Measured on sdpa (`tests/model/test_compile_images.py`):",
            "  LLaVA traces with no graph break, one forward and one backward graph per distinct image count in a batch;",
            "  Qwen2-VL's vision tower derives its shapes from `image_grid_thw`'s values, and `fullgraph=True` raises.",
            "  transformers installs its output-capturing hooks on a model's first call, under a lock dynamo cannot",
            "  enter: run one batch uncompiled first.",
        ]
    ) + "\n"


def verdict_table(
    columns: list[str], rows: dict[str, tuple[list[str], Sequence[Verdict]]]
) -> tuple[list[str], list[str]]:
    """A Markdown table of verdicts, a row a model type in sorted order (its `columns` cells, then a verdict
    per backend), and its legend: each refusal reason once, numbered in order of first use."""
    reasons: dict[str, int] = {}
    lines = [f"| {' | '.join([*columns, *BACKENDS])} |", "|---" * (len(columns) + len(BACKENDS)) + "|"]
    for model_type, (cells, verdicts) in sorted(rows.items()):
        outcomes = [
            f"isolated ({found.label})"
            if found.isolated
            else f"refused [{reasons.setdefault(found.reason, len(reasons) + 1)}]"
            for found in verdicts
        ]
        lines.append(f"| {' | '.join([model_type, *cells, *outcomes])} |")
    legend = ["Refused because:", "", *(f"{number}. {reason}" for reason, number in reasons.items())]
    return lines, legend


if __name__ == "__main__":
    sys.stdout.write(markdown())
