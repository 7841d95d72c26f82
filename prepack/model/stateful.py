"""Run the layers that carry state along the sequence one document at a time.

Attention is kept within each document by the mask or the flash offsets (`prepack.model.packing`). Layers that
carry state from token to token instead — Mamba scans, causal conv1d and short convolutions, the gated delta
rule — read neither: in a packed row the state of one document flows into the next. Their kernels can take the
boundaries (`seq_idx`, `cu_seqlens`), but in transformers 5.24 the path actually taken decides: the pure-torch
fallbacks that run without `mamba_ssm`, `causal_conv1d` or `flash-linear-attention` ignore them (measured: the
documents leak) or raise on them (the gated delta rule, and the Mamba-2 kernels given `seq_idx`), and with the
fused kernels installed the modeling files hand them to some kernels and not to others (Qwen3.5 and Qwen3-Next
give `cu_seq_lens_q` to the delta rule, nothing their conv1d kernel reads). So prepack does not rely on them.
It runs each such layer on the batch's segments instead:

    [B, L, D] packed rows --gather--> [segments, longest, D], one segment per row, right-padded
    --the layer, unchanged--> [segments, longest, D] --scatter back--> [B, L, D]

which is exact for a causal layer (a segment's tokens come first in its row, so the padding after them cannot
reach them), batched (one call of the layer per band of similar lengths, see `DocumentSegments`), and done
through public module hooks: a forward pre-hook regroups the layer's input and drops the arguments that
describe the packed rows (the flash offsets, `seq_idx`, the recurrent padding mask: none of them applies to
one segment per row), and a forward hook runs the other bands and scatters the output back (position_ids,
where a layer takes them, are regrouped: each segment's own positions). The segments (`DocumentSegments`) are
handed over by the guard that `enable_packing` puts on the decoder, once per forward; a batch that is not
packed leaves the layers alone. Gradients flow through the gather and the scatter, which are index copies.
Under gradient checkpointing a layer recomputed in backward runs with the segments of the forward it repeats
(`PerDocumentLayers`), whatever forward ran since.

Which families run which layers per document is `prepack.model.families`' table (a verdict's `per_document`);
`STATEFUL_LAYERS` holds what installing the hooks needs: the layer classes of each such family, by name in its
modeling file (a test checks that the two name the same families).

Cost: the bands' padding and one layer call per band (benchmarks/bench_per_document.py measures the whole
forward and backward against the plain packed forward, which leaks).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any, NamedTuple

import numpy as np

from prepack.errors import IsolationError, optional_imports

with optional_imports("enable_packing"):
    import torch
    import transformers
try:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
except ImportError:  # a torch built without torch.distributed, or one that moved this private module: none to find
    CheckpointWrapper = None

__all__ = ["STATEFUL_LAYERS", "DocumentSegments", "PerDocumentLayers", "install_decoders_per_document_layers"]

# model_type → the classes of its modeling file that carry state along the sequence, for every family that
# prepack.model.families marks per document. xLSTM: the whole block (norms, mLSTM layer, feed-forward), since its
# mLSTM layer is not a class of its own when the `xlstm` package is installed.
STATEFUL_LAYERS: dict[str, tuple[str, ...]] = {
    "bailing_hybrid": ("BailingHybridDeltaAttention",),
    "bamba": ("BambaMixer",),
    "falcon_h1": ("FalconH1Mixer",),
    "falcon_mamba": ("FalconMambaMixer",),
    "granitemoehybrid": ("GraniteMoeHybridMambaLayer",),
    "inkling_text": ("InklingShortConvolution",),
    "jamba": ("JambaMambaMixer",),
    "kimi_linear": ("KimiLinearDeltaAttention",),
    "lara_mini": ("LaraMiniGatedDeltaNet",),
    "lfm2": ("Lfm2ShortConv",),
    "lfm2_moe": ("Lfm2MoeShortConv",),
    "lfm3": ("Lfm3ShortConv",),
    "mamba": ("MambaMixer",),
    "mamba2": ("Mamba2Mixer",),
    "minimax": ("MiniMaxLightningAttention",),
    "nemotron_h": ("NemotronHMamba2Mixer",),
    "olmo_hybrid": ("OlmoHybridGatedDeltaNet",),
    "qwen3_5": ("Qwen3_5GatedDeltaNet",),
    "qwen3_5_moe": ("Qwen3_5MoeGatedDeltaNet",),
    "qwen3_5_moe_text": ("Qwen3_5MoeGatedDeltaNet",),
    "qwen3_5_text": ("Qwen3_5GatedDeltaNet",),
    "qwen3_next": ("Qwen3NextGatedDeltaNet",),
    "qwen4_exp": ("Qwen4ExpTextGatedDeltaNet",),
    "qwen4_exp_text": ("Qwen4ExpTextGatedDeltaNet",),
    "recurrent_gemma": ("RecurrentGemmaRecurrentBlock",),
    "xlstm": ("xLSTMBlock",),
    "zamba": ("ZambaMambaMixer",),
    "zamba2": ("Zamba2MambaMixer",),
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
    """The segments of a packed batch — `cu_seq_lens` offsets over the flattened B·L tokens (documents and each
    row's padding tail, as `PackedCollator` emits them) and the rows' shape — regrouped in length bands.

    Segments sorted by length go into bands, a new band starting at the first segment no longer than half the
    band's longest: each band is one call of the layer, [segments in band, longest in band, ...], so the padding
    is less than the band's tokens (one band for all would pay the longest segment for every short one), and
    there are at most log2(longest) + 1 calls. Reading the offsets costs one device sync per forward (and a
graph break under torch.compile: the bands' shapes depend on the batch).
    """

    cu_seq_lens: torch.Tensor  # [S + 1] int32, from 0 to B·L, checked by prepack.model.packing
    shape: tuple[int, int]  # (B, L)

    @cached_property
    def _layout(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per band, [segments, longest] token numbers to gather (B·L: a zero row); per token, its place in the
        bands' outputs laid end to end."""
        offsets = self.cu_seq_lens.cpu().numpy().astype(np.int64)
        starts, lengths = offsets[:-1], np.diff(offsets)
        order = np.argsort(-lengths, kind="stable")
        order = order[lengths[order] > 0]  # a collator may repeat the last offset: empty segments
        tokens = self.shape[0] * self.shape[1]
        gathers, places, done = [], np.empty(tokens, dtype=np.int64), 0
        for band in _length_bands(lengths[order]):
            members = order[band]
            position = np.arange(lengths[members[0]])
            index = starts[members, None] + position
            real = position < lengths[members, None]
            gathers.append(np.where(real, index, tokens))
            places[index[real]] = done + np.flatnonzero(real)
            done += real.size
        device = self.cu_seq_lens.device
        return [torch.from_numpy(gather).to(device) for gather in gathers], torch.from_numpy(places).to(device)

    @property
    def grouped_tokens(self) -> int:
        """The rows the bands hold, padding included (against B·L for the packed rows)."""
        return sum(gather.numel() for gather in self._layout[0])

    @property
    def bands(self) -> int:
        return len(self._layout[0])

    def group(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """[B, L, ...] → per band [segments, longest, ...], each segment from the start of its row, zeros after."""
        flat = packed.flatten(0, 1)
        with_zero_row = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return [with_zero_row[gather] for gather in self._layout[0]]

    def scatter(self, grouped: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of `group`: the bands' outputs → [B, L, ...]."""
        laid_end_to_end = torch.cat([band.flatten(0, 1) for band in grouped])
        return laid_end_to_end.index_select(0, self._layout[1]).unflatten(0, self.shape)


def _length_bands(sorted_lengths: np.ndarray) -> list[slice]:
    """Slices of lengths sorted longest first; a band ends before the first length at most half its first."""
    bands, first = [], 0
    for index, length in enumerate(sorted_lengths):
        if 2 * length <= sorted_lengths[first]:
            bands.append(slice(first, index))
            first = index
    return [*bands, slice(first, len(sorted_lengths))]


class _PerThread(threading.local):
    """Values each thread sets and reads apart (threading.local), which a copy or a pickle of the model (a reference
    model made by `copy.deepcopy`, `torch.save`) starts without: they belong to forwards in progress."""

    def __deepcopy__(self, memo: dict) -> _PerThread:
        return type(self)()

    def __reduce__(self):
        return type(self), ()


@dataclass
class PerDocumentLayers:
    """The hooks on a model's stateful layers. `segments` is set by the decoder's guard at every forward
    (None for a batch that is not packed).

    Under gradient checkpointing the decoder layers recompute in backward, when another forward may have set other
    segments (forward(A), forward(B), backward(A): A's gradients came out wrong, or torch refused a non-reentrant
    recomputation of other shapes). So the guard also calls `keep_segments_through_checkpointing`, which wraps
    the checkpointing function that transformers' `activation_checkpointing_enable` (before or after
    `enable_packing`) gives each module enclosing a hooked layer: the function checkpointed is then a closure that
    sets the segments of the forward that called it, for the call and for its recomputation. Reentrant and
    non-reentrant checkpointing alike; in transformers 5.24 every family of `STATEFUL_LAYERS` checkpoints its
    hooked layers through such modules (tests/model/test_stateful_isolation.py checks each). torch's
    `checkpoint_wrapper` (`apply_activation_checkpointing`: FSDP's and Accelerate's activation checkpointing),
    usually applied after `enable_packing`, is covered the same way: each forward wraps the `checkpoint_fn` of
    every `CheckpointWrapper` under `root` that encloses a hooked layer (one walk of `root`'s modules per forward with
    grad on; the wrappers replace modules at any time, and only a process-wide module-registration hook would tell
    when). torch's `offload_wrapper` recomputes
    nothing. Any other checkpoint around a hooked layer recomputes with the latest forward's segments: right only
    when each forward's backward comes before the next forward. The segments cannot ride in the checkpointed
    keyword arguments, as Llama 4's temperature scales do: several families' decoder layers get no keyword
    arguments."""

    handles: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    # The modules transformers hands a checkpointing function (those with a `gradient_checkpointing` flag) that
    # enclose a hooked layer: their checkpoints recompute it.
    checkpointing: list[torch.nn.Module] = field(default_factory=list)
    # The module the hooks were installed under and its hooked layers: torch's checkpoint wrappers replace modules
    # under it whenever the trainer applies them, so each forward looks for those that enclose a hooked layer.
    root: torch.nn.Module | None = None
    hooked: set[torch.nn.Module] = field(default_factory=set)
    # The checkpoint wrappers whose function is wrapped, for `remove`.
    wrappers: list[CheckpointWrapper] = field(default_factory=list)
    # `segments`, one per thread: nn.DataParallel (HF Trainer's on several GPUs without torchrun) runs its replicas'
    # forwards in threads at once, sharing these hooks, and each must read the segments its own guard set.
    _per_thread: _PerThread = field(default_factory=_PerThread, repr=False)

    @property
    def segments(self) -> DocumentSegments | None:
        return getattr(self._per_thread, "segments", None)

    @segments.setter
    def segments(self, segments: DocumentSegments | None) -> None:
        self._per_thread.segments = segments

    def keep_segments_through_checkpointing(self) -> None:
        """Wrap, once, the checkpointing function of each module of `checkpointing` that has one, and of each
        torch `CheckpointWrapper` under `root` that encloses a hooked layer (it calls its `checkpoint_fn` as
        transformers' layers call theirs: the function to checkpoint, then its arguments). Not where grad is off
        (generation, evaluation): no backward recomputes such a forward, and the next forward with grad wraps in time."""
        if not torch.is_grad_enabled():
            return
        for module in self.checkpointing:
            function = module.__dict__.get(_CHECKPOINTING_FUNCTION)
            if function is not None and not self._wraps(function):
                setattr(module, _CHECKPOINTING_FUNCTION, _CheckpointWithSegments(self, function))
        if self.root is None or CheckpointWrapper is None:
            return
        for module in self.root.modules():
            if (isinstance(module, CheckpointWrapper) and not self._wraps(module.checkpoint_fn)
                    and not self.hooked.isdisjoint(module.modules())):
                module.checkpoint_fn = _CheckpointWithSegments(self, module.checkpoint_fn)
                self.wrappers.append(module)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for module in self.checkpointing:
            function = module.__dict__.get(_CHECKPOINTING_FUNCTION)
            if self._wraps(function):
                setattr(module, _CHECKPOINTING_FUNCTION, function.checkpoint)
        self.checkpointing.clear()
        for wrapper in self.wrappers:
            if self._wraps(wrapper.checkpoint_fn):
                wrapper.checkpoint_fn = wrapper.checkpoint_fn.checkpoint
        self.wrappers.clear()
        self.root, self.hooked = None, set()

    def _wraps(self, function) -> bool:
        return isinstance(function, _CheckpointWithSegments) and function.layers is self


# Set by transformers' `_set_gradient_checkpointing` on every module with a `gradient_checkpointing` flag, and
# called by `GradientCheckpointingLayer` with the function to checkpoint and its positional arguments.
_CHECKPOINTING_FUNCTION = "_gradient_checkpointing_func"


class _CheckpointWithSegments:
    """A module's checkpointing function, wrapped: what it checkpoints runs with the segments of the forward that
    called it, and so does the recomputation in backward (the same closure, run again)."""

    def __init__(self, layers: PerDocumentLayers, checkpoint):
        self.layers, self.checkpoint = layers, checkpoint

    def __call__(self, function, /, *args, **kwargs):  # positional-only: a layer's keyword may be named anything
        return self.checkpoint(partial(self._with_segments, self.layers.segments, function), *args, **kwargs)

    def _with_segments(self, segments: DocumentSegments | None, function, /, *args, **kwargs):
        previous, self.layers.segments = self.layers.segments, segments
        try:
            return function(*args, **kwargs)
        finally:
            self.layers.segments = previous


def install_per_document_layers(model: torch.nn.Module, model_type: str) -> PerDocumentLayers:
    """Hook every stateful layer of `model`, a model of `model_type` (a family of `STATEFUL_LAYERS`).

    Raises IsolationError when the model's modeling file does not define the family's layer classes (another
    transformers version may have renamed them): its documents would silently leak. A model of the family
    with no such layer (a config of attention layers only) gets no hook.
    """
    class_names = STATEFUL_LAYERS[model_type]
    # The modeling files of the model's classes (a user's subclass lives in a file of its own).
    modeling_files = [sys.modules[cls.__module__] for cls in type(model).__mro__ if cls.__module__ in sys.modules]
    missing = sorted(name for name in class_names if not any(hasattr(file, name) for file in modeling_files))
    if missing:
        raise IsolationError(
            f"{type(model).__name__} ({model_type}): its modeling file defines no {', '.join(missing)}, the "
            f"layers prepack runs per document, in this transformers ({transformers.__version__}). Its documents "
            "would leak through the layers that carry state along the sequence: use a transformers version "
            "prepack supports, or train without packing."
        )
    hooked = {module for module in model.modules() if type(module).__name__ in class_names}
    layers = PerDocumentLayers(root=model, hooked=hooked)
    for module in hooked:
        hook = _RegroupHook(layers)
        layers.handles.append(module.register_forward_pre_hook(hook.before, with_kwargs=True))
        layers.handles.append(module.register_forward_hook(hook.after))
    layers.checkpointing = [
        module
        for module in model.modules()
        if hasattr(module, "gradient_checkpointing") and not hooked.isdisjoint(module.modules())
    ]
    return layers


def install_decoders_per_document_layers(model: transformers.PreTrainedModel, model_type: str) -> PerDocumentLayers:
    """The model's per-document hooks; a vision-language family whose decoder is a text family of
    `STATEFUL_LAYERS` (LFM2-VL's LFM2) gets its decoder's, whose modeling file defines the layers."""
    if model_type in STATEFUL_LAYERS:
        return install_per_document_layers(model, model_type)
    text_type = model.config.get_text_config().model_type
    if text_type not in STATEFUL_LAYERS:
        raise IsolationError(
            f"{type(model).__name__} ({model_type}): its decoder ({text_type}) has no sequence-state layers prepack "
            f"knows to run per document in this transformers ({transformers.__version__}), where prepack's table "
            "runs them so. Its documents would leak through them: use a transformers version prepack supports, or "
            "train without packing."
        )
    layers = install_per_document_layers(model.get_decoder(), text_type)
    layers.root = model  # a checkpoint wrapper around the whole language model is outside the decoder
    return layers


class _RegroupHook:
    """Runs one layer per length band of the segments: the pre-hook hands the layer's forward the first band,
    the forward hook runs the others (`module.forward`, so this hook does not see them) and scatters back."""

    def __init__(self, layers: PerDocumentLayers):
        self.layers = layers
        self._per_thread = _PerThread()  # as the segments: DataParallel's replicas share this hook

    @property
    def in_flight(self) -> list[_RegroupedCall | None]:
        """One entry per call in progress in this thread (re-entrant safe)."""
        if not hasattr(self._per_thread, "calls"):
            self._per_thread.calls = []
        return self._per_thread.calls

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
        segments = self.layers.segments
        if segments is None:
            self.in_flight.append(None)
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
        per_token = [name for name, value in kept.items() if _is_per_token(value, segments.shape)]
        if per_token or any(arg is not None for arg in args[1:]):
            raise IsolationError(
                f"{type(module).__name__} takes {', '.join(per_token) or 'positional arguments'} besides its hidden "
                "states; prepack does not know how to split them by document."
            )
        if "attention_mask" in kwargs:
            kept["attention_mask"] = None  # some layers require the argument
        bands = segments.group(hidden_states)
        calls = [dict(kept) for _ in bands]
        if kwargs.get("position_ids") is not None:
            for call, positions in zip(calls, segments.group(kwargs["position_ids"].expand(segments.shape))):
                call["position_ids"] = positions
        self.in_flight.append(_RegroupedCall(segments, bands[1:], args[1:], calls[1:]))
        return (bands[0], *args[1:]), calls[0]

    def after(self, module: torch.nn.Module, args: tuple, output):
        call = self.in_flight.pop()
        if call is None:
            return None
        rest = [module.forward(band, *call.args, **kwargs) for band, kwargs in zip(call.bands, call.kwargs)]
        first = output[0] if isinstance(output, tuple) else output
        hidden_states = call.segments.scatter([first, *(_hidden(band) for band in rest)])
        return (hidden_states, *output[1:]) if isinstance(output, tuple) else hidden_states


class _RegroupedCall(NamedTuple):
    segments: DocumentSegments
    bands: list[torch.Tensor]  # the inputs of the bands after the first
    args: tuple  # the layer's other positional arguments, all None
    kwargs: list[dict[str, Any]]  # their keyword arguments


def _hidden(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _is_per_token(value: Any, shape: tuple[int, int]) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == shape
