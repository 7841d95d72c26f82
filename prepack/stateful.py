"""Run the layers that carry state along the sequence one document at a time.

Attention is kept within each document by the mask or the flash offsets (`prepack.attention`). Layers
that carry state from token to token instead — Mamba scans, causal conv1d and short convolutions, the
gated delta rule — read neither: in a packed row the state of one document flows into the next. Their
kernels can take the boundaries (`seq_idx`, `cu_seqlens`), but in transformers 5.24 the path actually
taken decides: the pure-torch fallbacks that run without `mamba_ssm`, `causal_conv1d` or
`flash-linear-attention` ignore them (measured: the documents leak) or raise on them (the gated delta
rule, and the Mamba-2 kernels given `seq_idx`), and with the fused kernels installed the modeling files
hand them to some kernels and not to others (Qwen3.5 and Qwen3-Next give `cu_seq_lens_q` to the delta rule,
nothing their conv1d kernel reads). So prepack does not rely on them. It runs each such layer on the
batch's segments instead:

    [B, L, D] packed rows --gather--> [S, longest, D], one segment per row, right-padded
    --the layer, unchanged--> [S, longest, D] --scatter back--> [B, L, D]

which is exact for a causal layer (a segment's tokens come first in its row, so the padding after them
cannot reach them), batched (one call of the layer), and done through public module hooks: a forward
pre-hook regroups the layer's input and drops the arguments that describe the packed rows (the flash
offsets, `seq_idx`, the recurrent padding mask: none of them applies to one segment per row), and a
forward hook scatters its output back (position_ids, where a layer takes them, are regrouped: each
segment's own positions). The segments (`DocumentSegments`) are handed over by the guard that
`enable_packing` puts on the decoder, once per forward; a batch that is not packed leaves the
layers alone. Gradients flow through the gather and the scatter, which are index copies.

Two tables, for the support table and `enable_packing`'s refusals:
- `PER_DOCUMENT_FAMILIES`: model_type → what runs per document, for every family measured isolated with it
  (tiny random models, float64 and float32, tests/test_stateful_isolation.py);
- `ISOLATED_BACKENDS`: model_type → the backends it was measured isolated on: sdpa, eager and transformers'
  flash-attention path (flash_attention_2, driven on CPU by a pure-torch flash-attn, tests/flash_reference.py),
  or eager alone for the families without attention (Mamba, Mamba-2, Falcon-Mamba), which transformers
  builds on eager only.

Mamba, Mamba-2 and Falcon-Mamba's causal LMs keep position_ids and the offsets to themselves instead of
passing them to the backbone, so for them the guard sits on the causal LM (`module_that_sees_the_documents`).
Cost: the regrouped tensor has S·longest rows instead of B·L, so a batch of many short documents beside
one long one pays for padding (benchmarks/bench_per_document.py measures the whole forward and backward).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import transformers

from prepack.errors import IsolationError

__all__ = [
    "ISOLATED_BACKENDS",
    "PER_DOCUMENT_FAMILIES",
    "DocumentSegments",
    "PerDocumentLayers",
    "install_per_document_layers",
    "module_that_sees_the_documents",
]

_GATED_DELTA_RULE = "gated delta rule layers (causal conv1d + chunked delta rule)"
_MAMBA = "Mamba layers (causal conv1d + selective scan)"
_MAMBA2 = "Mamba-2 layers (causal conv1d + chunked SSM scan)"
_SHORT_CONVOLUTION = "short-convolution layers (causal conv1d)"
_DELTA_ATTENTION = "delta attention layers (short convolutions + chunked delta rule)"

# model_type → (the stateful layer classes of its modeling file, what runs per document).
_STATEFUL_LAYERS: dict[str, tuple[tuple[str, ...], str]] = {
    "bailing_hybrid": (("BailingHybridDeltaAttention",), _DELTA_ATTENTION),
    "bamba": (("BambaMixer",), _MAMBA2),
    "falcon_h1": (("FalconH1Mixer",), "Mamba-2 mixers (causal conv1d + chunked SSM scan), beside attention"),
    "falcon_mamba": (("FalconMambaMixer",), _MAMBA),
    "granitemoehybrid": (("GraniteMoeHybridMambaLayer",), _MAMBA2),
    "jamba": (("JambaMambaMixer",), _MAMBA),
    "kimi_linear": (("KimiLinearDeltaAttention",), _DELTA_ATTENTION),
    "lfm2": (("Lfm2ShortConv",), _SHORT_CONVOLUTION),
    "lfm2_moe": (("Lfm2MoeShortConv",), _SHORT_CONVOLUTION),
    "lfm3": (("Lfm3ShortConv",), _SHORT_CONVOLUTION),
    "mamba": (("MambaMixer",), _MAMBA),
    "mamba2": (("Mamba2Mixer",), _MAMBA2),
    "minimax": (("MiniMaxLightningAttention",), "lightning attention layers (block-wise linear attention)"),
    "nemotron_h": (("NemotronHMamba2Mixer",), _MAMBA2),
    "olmo_hybrid": (("OlmoHybridGatedDeltaNet",), _GATED_DELTA_RULE),
    "qwen3_5": (("Qwen3_5GatedDeltaNet",), _GATED_DELTA_RULE),
    "qwen3_5_moe": (("Qwen3_5MoeGatedDeltaNet",), _GATED_DELTA_RULE),
    "qwen3_5_moe_text": (("Qwen3_5MoeGatedDeltaNet",), _GATED_DELTA_RULE),
    "qwen3_5_text": (("Qwen3_5GatedDeltaNet",), _GATED_DELTA_RULE),
    "qwen3_next": (("Qwen3NextGatedDeltaNet",), _GATED_DELTA_RULE),
    "recurrent_gemma": (("RecurrentGemmaRecurrentBlock",), "recurrent blocks (causal conv1d + RG-LRU scan)"),
    "zamba": (("ZambaMambaMixer",), _MAMBA),
    "zamba2": (("Zamba2MambaMixer",), _MAMBA2),
}

# Families without attention layers, which transformers builds on eager only (it refuses sdpa and flash).
_WITHOUT_ATTENTION = ("falcon_mamba", "mamba", "mamba2")
# Causal LMs that hand their backbone neither position_ids nor the flash offsets (they keep them in **kwargs):
# the guard that finds the documents must sit on the causal LM itself.
_BOUNDARIES_STOP_ABOVE_THE_BACKBONE = ("falcon_mamba", "mamba", "mamba2")

PER_DOCUMENT_FAMILIES: dict[str, str] = {family: phrase for family, (_, phrase) in _STATEFUL_LAYERS.items()}
ISOLATED_BACKENDS: dict[str, tuple[str, ...]] = {
    family: ("eager",) if family in _WITHOUT_ATTENTION else ("sdpa", "eager", "flash_attention_2")
    for family in _STATEFUL_LAYERS
}

# Arguments that describe the packed rows: meaningless for one segment per row, so a regrouped call drops them.
_PACKED_ROW_ARGUMENTS = (
    "attention_mask",  # the recurrent padding mask; a packed batch has no padding inside a segment
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "seq_idx",
    "position_ids",  # regrouped instead: each segment's own positions, from 0
)
_CACHE_ARGUMENTS = ("cache", "cache_params", "past_key_values")


@dataclass
class DocumentSegments:
    """The segments of a packed batch: `cu_seq_lens` offsets over the flattened B·L tokens (documents and
    each row's padding tail, as `PackedCollator` emits them), the longest segment, and the rows' shape."""

    cu_seq_lens: torch.Tensor  # [S + 1] int32, from 0 to B·L, checked by prepack.attention
    max_length: int
    shape: tuple[int, int]  # (B, L)

    @cached_property
    def _slots(self) -> torch.Tensor:
        """[B·L]: where each token goes in the flattened [S, max_length] grouping (segment · longest + position)."""
        offsets = self.cu_seq_lens.long()
        token = torch.arange(self.shape[0] * self.shape[1], device=offsets.device)
        segment = torch.searchsorted(offsets[1:], token, right=True)
        return segment * self.max_length + token - offsets[segment]

    def group(self, packed: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] → [S, max_length, ...], each segment from the start of its own row, zeros after it."""
        flat = packed.flatten(0, 1)
        grouped = flat.new_zeros((len(self.cu_seq_lens) - 1) * self.max_length, *flat.shape[1:])
        return grouped.index_copy(0, self._slots, flat).unflatten(0, (-1, self.max_length))

    def scatter(self, grouped: torch.Tensor) -> torch.Tensor:
        """The inverse of `group`: [S, max_length, ...] → [B, L, ...]."""
        return grouped.flatten(0, 1).index_select(0, self._slots).unflatten(0, self.shape)


@dataclass
class PerDocumentLayers:
    """The hooks on a model's stateful layers. `segments` is set by the decoder's guard at every forward
    (None for a batch that is not packed); a recomputation under gradient checkpointing reads the same."""

    handles: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    segments: DocumentSegments | None = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def module_that_sees_the_documents(model: torch.nn.Module) -> torch.nn.Module:
    """Where the packed batch's position_ids and offsets still arrive: the decoder, or the causal LM itself."""
    return model if model.config.model_type in _BOUNDARIES_STOP_ABOVE_THE_BACKBONE else model.base_model


def install_per_document_layers(model: torch.nn.Module) -> PerDocumentLayers | None:
    """Hook every stateful layer of a family in `PER_DOCUMENT_FAMILIES`; None for a model of another family.

    Raises IsolationError when the model's modeling file does not define the family's layer classes (another
    transformers version may have renamed them): its documents would silently leak. A model of the family
    with no such layer (a config of attention layers only) gets no hook.
    """
    config = model.config
    families = {config.model_type, config.get_text_config().model_type} & _STATEFUL_LAYERS.keys()
    if not families:
        return None
    class_names = {name for family in families for name in _STATEFUL_LAYERS[family][0]}
    modeling_file = sys.modules[type(model).__module__]
    missing = sorted(name for name in class_names if not hasattr(modeling_file, name))
    if missing:
        raise IsolationError(
            f"{type(model).__name__} ({', '.join(sorted(families))}): {modeling_file.__name__} defines no "
            f"{', '.join(missing)}, the layers prepack runs per document, in this transformers "
            f"({transformers.__version__}). Its documents would leak through the layers that carry state "
            "along the sequence: use a transformers version prepack supports, or train without packing."
        )
    layers = PerDocumentLayers()
    for module in model.modules():
        if type(module).__name__ in class_names:
            hook = _RegroupHook(layers)
            layers.handles.append(module.register_forward_pre_hook(hook.before, with_kwargs=True))
            layers.handles.append(module.register_forward_hook(hook.after))
    return layers


class _RegroupHook:
    """Regroups one layer's input by segment before its forward and scatters its output back after."""

    def __init__(self, layers: PerDocumentLayers):
        self.layers = layers
        self.regrouped: list[DocumentSegments | None] = []  # one entry per call in flight (re-entrant safe)

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
        segments = self.layers.segments
        self.regrouped.append(segments)
        if segments is None:
            return None
        hidden_states = args[0] if args else kwargs.pop("hidden_states")
        if tuple(hidden_states.shape[:2]) != segments.shape:
            raise IsolationError(
                f"{type(module).__name__} got hidden states of shape {tuple(hidden_states.shape)} in a packed batch "
                f"of shape {segments.shape}: prepack cannot tell its documents apart."
            )
        if any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
            raise IsolationError(
                f"{type(module).__name__} got a cache in a packed batch: its state would hold one row of mixed "
                "documents. Pass use_cache=False for packed batches."
            )
        kept = {name: value for name, value in kwargs.items() if name not in _PACKED_ROW_ARGUMENTS}
        if "attention_mask" in kwargs:
            kept["attention_mask"] = None  # some layers require the argument
        if kwargs.get("position_ids") is not None:
            kept["position_ids"] = segments.group(kwargs["position_ids"].expand(segments.shape))
        per_token = [name for name, value in kept.items() if name != "position_ids" and _is_per_token(value, segments.shape)]
        if per_token or len(args) > 1:
            raise IsolationError(
                f"{type(module).__name__} takes {', '.join(per_token) or 'positional arguments'} besides its hidden "
                "states; prepack does not know how to split them by document."
            )
        return (segments.group(hidden_states),), kept

    def after(self, module: torch.nn.Module, args: tuple, output):
        segments = self.regrouped.pop()
        if segments is None:
            return None
        if isinstance(output, tuple):
            return (segments.scatter(output[0]), *output[1:])
        return segments.scatter(output)


def _is_per_token(value: Any, shape: tuple[int, int]) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == shape
