"""Keep packed documents apart inside a transformers 5.x model, and prove that they are.

`enable_packing(model)` first looks the model's family up in `prepack.model.families`, the table measured by
the family sweep, and refuses a family that would leak on its attention backend (the check is repeated
at every forward, in case the backend was switched). It installs one forward pre-hook on the model's
decoder (`model.base_model`, or the decoder it wraps). For every call it looks at the batch and, where
transformers would let documents attend to each other, either converts the batch to the form
transformers isolates natively or raises `IsolationError`:

- a legacy indexed `attention_mask` (`[1, 1, 2, 2, 2, 0]`, LlamaFactory/NeMo style) becomes
  `position_ids` (+ `cu_seq_lens_*`/`max_length_*` on flash attention) and is dropped: transformers
  would read it as a binary mask;
- on flash attention, restarting `position_ids` without `cu_seq_lens_*` get offsets derived from them:
  with more than one row, transformers would otherwise run dense attention over each row;
- a 2-D binary mask together with packed rows is refused (any 2-D mask turns packing detection off);
- a shared-prompt batch (`shared_prompt_ids`, `prepack.model.shared_prompt`) gets its mask: 4-D on sdpa and
  eager, a BlockMask on flex_attention; varlen kernels and sliding-window or mask-building families are refused
  by name;
- a single 4-D mask on a sliding-window model is refused (it would be applied to the sliding layers too);
- `cu_seq_lens_*`/`max_length_*` are checked before they reach a kernel, where a bad offset is an
  out-of-bounds read: int32, 1-D, on the tokens' device, q equal to k, from 0 to B·L, never
  decreasing (an empty segment is harmless, and lets a collator keep the tensor's length fixed),
  starting a segment exactly where `position_ids` restart, and `max_length_*` Python ints from the
  longest segment to a row's length (a fixed-shape batch pins them to the row length, an upper bound the
  kernels accept);
- for the few families whose forward builds its masks without `position_ids` (the table's "layer
  masks" and "block mask"), the masks transformers' public `create_causal_mask` and
  `create_sliding_window_causal_mask` build from them are passed in, which those models take as given;
- on flash attention (flash_attention_2/3/4), rows longer than `attention_chunk_size` (Llama 4's chunked
  layers) are refused: transformers' flash path cannot apply the chunks and raises for them;
- Llama 4's attention temperature (its NoPE layers' queries scaled from index `floor_scale` - 1 on, 8192 in its
  checkpoints) is taken from each token's `position_ids`, the index in its document: transformers takes the
  index in the row, and a document packed from there on would be scaled as it is not alone. For a packed batch
  the guard hands the layers their scales in their keyword arguments (kept by gradient checkpointing), and they
  scale their current `q_proj` output, as transformers scales the query, in place of their own tuning
  (`_DocumentTemperature`); a batch that is not packed runs transformers' own tuning;
- a cache is refused for packed rows: sdpa, eager and flex_attention only build the per-document mask
  (flex's BlockMask) from `position_ids` when no cache
  exists, so an explicit `use_cache=True` there raises, in train and eval mode alike, and `use_cache`
  left unset (the config default is usually True) is set to False. A cache (`cache`, before
  transformers 5.24 `past_key_values`) with packed rows raises on every backend.

Value checks cost one device sync per forward. Under `torch.compile` they are skipped, since they would
break the graph: a batch in `PackedCollator`'s default layout traces without a graph break. A batch
with a 2-D mask or with restarting position_ids and no offsets must be read to be classified, which
costs one break at the top of the forward.

On the hybrid and linear-attention families (the table's verdicts with `per_document`) it also hooks the
layers that carry state along the sequence (Mamba scans, short convolutions, the gated delta rule, linear
attention; `prepack.model.stateful`), and the guard hands them each packed batch's segments: they run one document
per row (recomputed under gradient checkpointing with the segments of the forward they repeat). There `seq_idx`
is dropped (not needed; transformers' torch fallbacks raise on it), and a cache is refused on every backend.
Mamba, Mamba-2 and Falcon-Mamba's causal LMs keep position_ids from their backbone, so their guard sits on the
causal LM.

An image batch (one with `pixel_values`, `pixel_values_videos` or precomputed `mm_encoder_outputs`, or, for Gemma 3
and Gemma 4, whose token types mark an image block: transformers builds their blocks from the types alone, so
precomputed `inputs_embeds` with them are an image batch too; reading the types costs one break under
`torch.compile`) is held to the vision table
(`prepack.model.vision_families`, docs/vision-support.md) and checked by `prepack.model.vision_packing`: families
never measured with images are refused by name, fields that override a vision tower's per-image segments are
refused, Qwen's 3-D rotary positions need their text row, and Gemma 3's layer masks are built by prepack. On flash
attention the text's `cu_seq_lens_*` are derived as for text (for Qwen from the text row of its [4, B, L]
positions), and a second pre-hook on the vision tower drops them from its call: the vision-language models hand
their keyword arguments to the tower too, whose attention would run over the text's segments (LLaVA's CLIP,
measured) instead of its own.

`prepack.model.isolation` proves it: it runs a packed batch and each of its documents alone, and compares.
"""

from __future__ import annotations

import inspect
import warnings
from functools import cache, partial
from typing import Any

from prepack.model import families
from prepack.errors import IsolationError, optional_imports

with optional_imports("enable_packing"):
    import torch
    import transformers
    from transformers.masking_utils import (
        create_causal_mask,
        create_recurrent_attention_mask,
        create_sliding_window_causal_mask,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from prepack.training.collate import segment_fields
from prepack.model.shared_prompt import shared_prompt_kwargs
from prepack.model.stateful import (
    STATEFUL_LAYERS,
    DocumentSegments,
    PerDocumentLayers,
    install_decoders_per_document_layers,
)
from prepack.model.vision_families import IMAGE_BLOCKS, VISION_FAMILIES, image_refusal
from prepack.model.vision_packing import checked_image_batch, image_block_tokens

__all__ = ["FLASH_ATTENTION", "SUPPORTED_ATTENTION", "disable_packing", "enable_packing"]

SUPPORTED_ATTENTION = (
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "flex_attention",
    "sdpa",
    "eager",
)
# transformers' one flash-attention path (`_flash_attention_forward`), which reads cu_seq_lens_*; flex_attention
# is not on it: it takes a BlockMask that transformers builds from position_ids, as it builds sdpa's mask.
FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
_OFFSET_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_HOOK_ATTRIBUTE = "_prepack_packing_hook"
_TOWER_HOOK_ATTRIBUTE = "_prepack_vision_tower_hooks"
_PER_DOCUMENT_ATTRIBUTE = "_prepack_per_document_layers"
_TEMPERATURE_ATTRIBUTE = "_prepack_document_temperature"
# Causal LMs that hand their backbone neither position_ids nor the flash offsets (transformers 5.24: they keep
# them in **kwargs), so the guard that finds the documents sits on the causal LM itself.
_BOUNDARIES_STOP_ABOVE_THE_BACKBONE = ("falcon_mamba", "mamba", "mamba2")


def enable_packing(
    model: transformers.PreTrainedModel, *, allow_unlisted: bool = False
) -> transformers.PreTrainedModel:
    """Make `model` safe for packed batches on flash_attention_2/3/4, flex_attention, sdpa and eager.

        from torch.utils.data import DataLoader
        from transformers import AutoModelForCausalLM
        from prepack import PackedCollator, PackedDataset, enable_packing

        dataset = PackedDataset("packed/")
        loader = DataLoader(dataset, batch_size=8, collate_fn=PackedCollator(max_len=4096))
        model = AutoModelForCausalLM.from_pretrained("my-model", attn_implementation="sdpa")
        model = enable_packing(model).train()
        for batch in loader:
            model(**batch).loss.backward()  # use_cache=False is set for you

    Raises `IsolationError` for a transformers older than 5.0, an attention implementation other than
    `SUPPORTED_ATTENTION`, a family that `prepack.model.families` refuses on this backend (docs/model-support.md),
    and, at each forward, for a batch that would leak (see the module docstring). A model type the table
    lacks (a newer transformers, remote code) is refused too, unless `allow_unlisted` is True: pass it
    only after `prepack check-isolation` has reported the model isolated. Calling it again replaces the
    hook; `disable_packing` removes it. On a transformers release other than the one the table was measured
    on (`prepack.model.families.MEASURED_WITH`) it warns once per process: `prepack check-isolation --sweep`
    re-measures the installed release's families.
    """
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise IsolationError(
            f"prepack.enable_packing needs transformers 5.0 or newer; this is {transformers.__version__}, whose "
            "attention code handles packed batches differently. Upgrade: pip install 'transformers>=5,<6'."
        )
    _warn_once_on_an_unmeasured_release(transformers.__version__)
    family = _Family.of(model, allow_unlisted)
    verdict = family.require_isolated(model.config.get_text_config()._attn_implementation)
    disable_packing(model)
    decoder = _module_that_sees_the_documents(model)
    per_document = _per_document_layers(model, family, verdict)
    if per_document is not None:  # set as soon as installed, so that disable_packing undoes a failed enable_packing
        setattr(model, _PER_DOCUMENT_ATTRIBUTE, per_document)
    temperature = _DocumentTemperature.install(model)
    if temperature is not None:
        setattr(model, _TEMPERATURE_ATTRIBUTE, temperature)
    guard = _PackedBatchGuard(_positional_parameters(decoder), family, per_document, temperature)
    setattr(model, _HOOK_ATTRIBUTE, decoder.register_forward_pre_hook(guard, with_kwargs=True))
    tower_hooks = _keep_text_offsets_from_the_towers(model)
    if tower_hooks:
        setattr(model, _TOWER_HOOK_ATTRIBUTE, tower_hooks)
    return model


def disable_packing(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """Remove what `enable_packing` installed (nothing happens if it was not)."""
    handle = model.__dict__.pop(_HOOK_ATTRIBUTE, None)
    if handle is not None:
        handle.remove()
    for handle in model.__dict__.pop(_TOWER_HOOK_ATTRIBUTE, ()):
        handle.remove()
    for attribute in (_PER_DOCUMENT_ATTRIBUTE, _TEMPERATURE_ATTRIBUTE):
        layers = model.__dict__.pop(attribute, None)
        if layers is not None:
            layers.remove()
    return model


@cache
def _warn_once_on_an_unmeasured_release(installed: str) -> None:
    if installed != families.MEASURED_VERSION:
        warnings.warn(
            f"prepack's table of model families was measured on {families.MEASURED_WITH}; this is transformers "
            f"{installed}, whose modeling code may treat packed batches differently. Re-measure this release's "
            f"families: {families.SWEEP_COMMAND} (or one model: prepack check-isolation --model DIR).",
            stacklevel=3,
        )


def _require_supported_attention(attn: str | None) -> None:
    if attn not in SUPPORTED_ATTENTION:
        raise IsolationError(
            f"The model's attention implementation is {attn!r}; prepack keeps packed documents apart only on "
            f"{', '.join(SUPPORTED_ATTENTION)}. Load the model with attn_implementation='sdpa' (or a flash one), "
            "or call model.set_attn_implementation('sdpa')."
        )


class _Family:
    """The model's row of `prepack.model.families`, checked against the attention implementation of each call."""

    def __init__(self, model_type: str, model_class: str, checked: bool, registered_by: str | None):
        self.model_type, self.model_class, self.checked = model_type, model_class, checked
        self.registered_by = registered_by  # the transformers version, for a family of its own code

    @classmethod
    def of(cls, model: transformers.PreTrainedModel, allow_unlisted: bool) -> _Family:
        # Remote code may reuse a model type of transformers with layers of its own: not what was measured.
        own_code = type(model).__module__.startswith("transformers.")
        model_type = model.config.model_type if own_code else f"{model.config.model_type} (remote code)"
        if own_code and model_type not in families.FAMILIES:
            # Built from a sub-config (Emu3ForCausalLM's config is an "emu3_text_model"): the registered family
            # whose causal-LM class it is.
            registered = sorted(
                known
                for known, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
                if name == type(model).__name__ and known in families.FAMILIES
            )
            model_type = registered[0] if registered else model_type
        checked = model_type in families.FAMILIES or model_type in VISION_FAMILIES or not allow_unlisted
        return cls(model_type, type(model).__name__, checked, transformers.__version__ if own_code else None)

    def require_isolated(self, attn: str | None) -> families.Verdict | None:
        """The verdict for `attn` (None for an allowed unlisted family); IsolationError where it is refused."""
        _require_supported_attention(attn)
        if not self.checked:
            return None
        if self.model_type not in families.FAMILIES and self.model_type in VISION_FAMILIES:
            # A vision-language family that transformers registers as no causal LM: measured with images only.
            message = image_refusal(self.model_type, self.model_class, attn)
            if message:
                raise IsolationError(message)
            return VISION_FAMILIES[self.model_type].verdicts[families.BACKENDS.index(families.backend_of(attn))]
        message = families.refusal(self.model_type, self.model_class, attn, registered_by=self.registered_by)
        if message:
            raise IsolationError(message)
        return families.verdict(self.model_type, attn)


def _positional_parameters(module: torch.nn.Module) -> tuple[str, ...]:
    parameters = inspect.signature(module.forward).parameters.values()
    return tuple(p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


class _PackedBatchGuard:
    """The forward pre-hook: returns the call's keyword arguments converted, or raises IsolationError."""

    def __init__(
        self,
        positional_parameters: tuple[str, ...],
        family: _Family,
        per_document: PerDocumentLayers | None,
        temperature: _DocumentTemperature | None,
    ):
        self.positional_parameters = positional_parameters
        self.family = family
        self.per_document = per_document  # the model's sequence-state layers, told each batch's segments
        self.temperature = temperature  # Llama 4's tuned NoPE layers, handed each packed batch's query scales

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
        if self.per_document is not None:
            self.per_document.segments = None
            self.per_document.keep_segments_through_checkpointing()  # checkpointing may be enabled at any time
        if len(args) > len(self.positional_parameters):
            return None  # not a call the forward accepts: let it raise its own error
        kwargs = {**dict(zip(self.positional_parameters, args)), **kwargs}
        if self.per_document is not None:
            # The per-document layers replace seq_idx; given to the packed rows, the torch fallbacks raise.
            kwargs.pop("seq_idx", None)
        tokens = kwargs.get("input_ids")
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        if tokens is None:
            return None
        config = module.config.get_text_config()
        attn = config._attn_implementation
        verdict = self.family.require_isolated(attn)
        flash = attn in FLASH_ATTENTION
        if kwargs.get("shared_prompt_ids") is not None:  # PackedCollator(shared_prompt=True): a mask of its own
            how = None if verdict is None or verdict.label == "native" else verdict.label
            how = "per-document sequence-state layers" if self.per_document is not None else how
            kwargs = shared_prompt_kwargs(kwargs, config, attn, how, module.dtype)
            self._position_the_temperature(kwargs)
            return (), _without_cache(kwargs, flash)
        if self.family.checked and _is_image_batch(kwargs, self.family.model_type):
            # Images or videos: the vision table's verdict, the towers' own segments, the family's positions and
            # masks.
            family = self.family
            kwargs = checked_image_batch(module, kwargs, family.model_type, family.model_class, attn)
            style = VISION_FAMILIES[family.model_type].style
            if style == "3-D rotary" and flash:
                kwargs = _with_text_offsets(kwargs, tokens)
            if style != "restart":
                kwargs = _resolve_image_batch_mask(kwargs, config, flash, tokens.shape[:2], style)
                positions = kwargs.get("position_ids")
                if self.per_document is not None and positions is not None:  # Qwen3.5's gated delta rule layers
                    text = {**kwargs, "position_ids": positions[0] if positions.ndim == 3 else positions}
                    self._segment_the_sequence_state(text, tokens)
                return (), _without_cache(kwargs, flash)
        kwargs = _resolve_attention_mask(kwargs, config, flash, tokens.shape[:2])
        # A mask still there describes no packed rows (or is the caller's own 4-D mask): transformers applies it.
        if kwargs.get("attention_mask") is not None or not _is_packed(kwargs, tokens.shape[:2]):
            return (), kwargs
        kwargs = _with_offsets(kwargs, tokens, flash)
        if flash:
            _require_rows_within_a_chunk(config, attn, tokens.shape[1])
        self._position_the_temperature(kwargs)
        if self.per_document is not None:
            self._segment_the_sequence_state(kwargs, tokens)
        if verdict is not None and verdict.how in ("layer masks", "block mask"):
            masks = _masks_from_positions(module, config, kwargs["position_ids"], tokens.shape[:2])
            kwargs["attention_mask"] = masks["full_attention"] if verdict.how == "block mask" else masks
        return (), _without_cache(kwargs, flash)

    def _position_the_temperature(self, kwargs: dict[str, Any]) -> None:
        if self.temperature is not None:
            kwargs[_DocumentTemperature.SCALES_KEY] = self.temperature.scales_of(kwargs["position_ids"])

    def _segment_the_sequence_state(self, kwargs: dict[str, Any], tokens: torch.Tensor) -> None:
        """Tell the per-document layers the batch's documents (from its offsets or its 2-D position_ids)."""
        if torch.compiler.is_compiling():
            raise IsolationError(
                f"{self.family.model_type}: its sequence-state layers run one document per row "
                "(docs/model-support.md), in shapes that follow the batch's documents, which torch.compile cannot "
                "trace as one graph: with fullgraph=False the model's forward runs uncompiled (isolated), as without torch.compile."
            )
        self.per_document.segments = batch_document_segments(kwargs, tokens)


_IMAGE_INPUTS = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")  # a batch of videos has no pixel_values


def _is_image_batch(kwargs: dict[str, Any], model_type: str) -> bool:
    """Whether the batch carries images: pixels, videos or precomputed features, or (an image-blocks family) token
    types that mark a block, from which transformers builds its blocks whatever else is given. The values count, not
    the field: VisionCollator gives a text-only batch the field all zero, a text batch (Gemma 3's isolated on flash)."""
    if any(kwargs.get(key) is not None for key in _IMAGE_INPUTS):
        return True
    family = VISION_FAMILIES.get(model_type)
    if family is None or family.style != "image blocks":
        return False
    blocks = IMAGE_BLOCKS[model_type]
    token_types = kwargs.get(blocks.token_types)
    return token_types is not None and bool(image_block_tokens(token_types, blocks).any())


def _with_offsets(kwargs: dict[str, Any], tokens: torch.Tensor, flash: bool) -> dict[str, Any]:
    """Packed rows' fields: on flash, the offsets derived from `position_ids` unless given; all checked."""
    if flash and all(kwargs.get(key) is None for key in _OFFSET_KEYS):
        kwargs = kwargs | _offsets_from_positions(kwargs["position_ids"], tokens)
    _check_packed_fields(kwargs, tokens)
    return kwargs


def _with_text_offsets(kwargs: dict[str, Any], tokens: torch.Tensor) -> dict[str, Any]:
    """Packed 3-D rotary rows on flash attention: the offsets of their text row (the first of [4, B, L]), as a
    text batch gets them (`_with_offsets`). The vision towers never see them (`_keep_text_offsets_from_the_towers`)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None or position_ids.ndim != 3:
        return kwargs
    text = {**kwargs, "position_ids": position_ids[0]}
    if not _is_packed(text, tokens.shape[:2]):
        return kwargs
    return {**_with_offsets(text, tokens, flash=True), "position_ids": position_ids}


def _keep_text_offsets_from_the_towers(model: transformers.PreTrainedModel) -> list[torch.utils.hooks.RemovableHandle]:
    """Pre-hooks on the vision towers that drop the text's `cu_seq_lens_*`/`max_length_*` (none for a text model):
    the image tower's, and Video-LLaVA's `video_tower` beside it (its `get_encoder(modality="video")` answers the
    image tower; its `get_video_features` hands its keyword arguments on to the video tower).

    The vision-language models hand their forward's keyword arguments on to the tower as well as to the
    decoder: on flash attention the text's offsets make LLaVA's CLIP tower attend over the text's segments
    (measured leaking). transformers 5.24 drops them on the way to Qwen-VL's towers itself
    (`accepts_precomputed_kwargs`); the hook does not rely on that.
    """
    if model.config.model_type not in VISION_FAMILIES:
        return []
    tower = model.get_encoder(modality="image")
    if tower is None or tower is model or tower is model.base_model:  # a text-only model of a vision family's type
        return []
    video_tower = getattr(model.base_model, "video_tower", None)

    def drop_text_offsets(module, args, kwargs):
        return args, {key: value for key, value in kwargs.items() if key not in _OFFSET_KEYS}

    return [each.register_forward_pre_hook(drop_text_offsets, with_kwargs=True)
            for each in (tower, video_tower) if isinstance(each, torch.nn.Module)]


class _DocumentTemperature:
    """Llama 4's attention temperature tuning by each token's position in its document.

    transformers scales a NoPE layer's (no_rope_layers 0) queries by log1p(floor((i + 1) / floor_scale)) *
    attn_scale + 1, i the token's index in the row (torch.arange, plus the cached tokens): in a packed row, the
    index from the first document's start. For a packed batch the decoder's guard computes the scales from
    `position_ids` (`scales_of`) and hands them down in the layers' keyword arguments (`SCALES_KEY`), which gradient
    checkpointing keeps for its recomputation. A pre-hook on every attention layer takes them out (a rotary
    layer's kernel would get them); on a tuned NoPE layer it turns transformers' own tuning off for that call and
    has the layer's current `q_proj` (a wrapper put there after `enable_packing`, as PEFT's LoRA is, included)
    scale its whole output: the query before it is split into heads, with no rotary or qk_norm in between. A
    call without scales (a batch that is not packed) runs transformers' own tuning.
    """

    SCALES_KEY = "_prepack_attn_scales"

    def __init__(self, layers: list[torch.nn.Module], tuned: list[torch.nn.Module]):
        self.tuned = tuned
        self.floor_scale, self.attn_scale = tuned[0].floor_scale, tuned[0].attn_scale
        self.pending: dict[torch.nn.Module, torch.Tensor | None] = {}  # per tuned layer, its call's scales
        self.query_hooks: dict[torch.nn.Module, tuple[torch.nn.Module, Any]] = {}  # per tuned layer: q_proj, handle
        self.handles = [layer.register_forward_pre_hook(self._before_attention, with_kwargs=True) for layer in layers]
        for layer in tuned:
            layer.attn_temperature_tuning = False

    @classmethod
    def install(cls, model: torch.nn.Module) -> _DocumentTemperature | None:
        """Hooks on the attention layers of `model` where some are tuned NoPE layers; None where none is."""
        layers = [
            module
            for module in model.modules()
            if hasattr(module, "attn_temperature_tuning") and isinstance(getattr(module, "q_proj", None), torch.nn.Module)
        ]
        tuned = [layer for layer in layers if layer.attn_temperature_tuning is True and getattr(layer, "use_rope", 1) == 0]
        return cls(layers, tuned) if tuned else None

    def scales_of(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Each token's query scale, [B, L, 1], from its index in its document."""
        positions = position_ids.float() + 1.0
        return (torch.log1p(torch.floor(positions / self.floor_scale)) * self.attn_scale + 1.0)[..., None]

    def remove(self) -> None:
        for handle in [*self.handles, *(handle for _, handle in self.query_hooks.values())]:
            handle.remove()
        self.handles.clear()
        self.query_hooks.clear()
        for layer in self.tuned:
            layer.attn_temperature_tuning = True
        self.pending.clear()

    def _before_attention(self, layer: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
        scales = kwargs.pop(self.SCALES_KEY, None)
        if layer in self.tuned:
            layer.attn_temperature_tuning = scales is None
            self.pending[layer] = scales
            hooked = self.query_hooks.get(layer)
            if hooked is None or hooked[0] is not layer.q_proj:  # first call, or q_proj wrapped since
                if hooked is not None:
                    hooked[1].remove()
                handle = layer.q_proj.register_forward_hook(partial(self._scale_the_query, layer))
                self.query_hooks[layer] = (layer.q_proj, handle)
        return args, kwargs

    def _scale_the_query(self, layer: torch.nn.Module, q_proj: torch.nn.Module, args: tuple, query: torch.Tensor):
        scales = self.pending.pop(layer, None)
        return None if scales is None else (query * scales.to(query.device)).to(query.dtype)


def _per_document_layers(
    model: transformers.PreTrainedModel, family: _Family, verdict: families.Verdict | None
) -> PerDocumentLayers | None:
    """Hooks on the sequence-state layers where the table runs them per document; None where it does not.

    A family's verdicts name the same layers on every backend that isolates it, so a backend switched after
    `enable_packing` (checked at each forward) needs no other hooks. An unlisted model the caller checked
    (`allow_unlisted`, e.g. a subclass of a family in a file of its own) keeps the hooks of the family whose
    model type it has: `prepack check-isolation` measured it with them.
    """
    if verdict is not None:
        return install_decoders_per_document_layers(model, family.model_type) if verdict.per_document else None
    model_type = model.config.model_type
    if model_type in STATEFUL_LAYERS or model.config.get_text_config().model_type in STATEFUL_LAYERS:
        return install_decoders_per_document_layers(model, model_type)
    return None


def _module_that_sees_the_documents(model: transformers.PreTrainedModel) -> torch.nn.Module:
    """Where the packed batch's position_ids and offsets arrive: the decoder, or the causal LM itself."""
    if model.config.model_type in _BOUNDARIES_STOP_ABOVE_THE_BACKBONE:
        return model
    # Where the base model wraps a decoder, the causal-LM head may call that decoder directly (OPT does).
    decoder = getattr(model.base_model, "decoder", None)
    return decoder if isinstance(decoder, torch.nn.Module) else model.base_model


def _require_rows_within_a_chunk(config, attn: str, width: int) -> None:
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None and width > chunk:
        raise IsolationError(
            f"Rows of {width} tokens on {attn} for a model with chunked attention layers (attention_chunk_size="
            f"{chunk}, Llama 4): transformers' flash-attention path cannot apply the chunks, and raises for a row "
            f"longer than one. Pack into rows of at most {chunk} tokens (max_len; B·max_len with "
            "layout='padding_free'), or use sdpa or eager, which apply them."
        )


def _masks_from_positions(module, config, position_ids: torch.Tensor, shape: torch.Size) -> dict[str, Any]:
    """The per-layer-type masks that transformers builds from `position_ids` when a model lets it.

    For families whose forward calls the mask functions without `position_ids` (prepack.model.families' "layer
    masks" and "block mask"): the model takes masks passed in as given. Built by transformers' public
    functions, so they are the masks its other families get; `inputs_embeds` only tells them the shape,
    dtype and device. The sequence-state layers of a hybrid (Granite 4 hybrid's "linear_attention") take
    the 2-D padding mask that `create_recurrent_attention_mask` gives: None, since packed rows have no mask.
    """
    shape_only = torch.empty((*shape, 0), dtype=module.dtype, device=position_ids.device)
    arguments = (config, shape_only, None, None)  # attention_mask, cache: none for packed rows
    masks = {"full_attention": create_causal_mask(*arguments, position_ids=position_ids)}
    if getattr(config, "sliding_window", None):
        masks["sliding_attention"] = create_sliding_window_causal_mask(*arguments, position_ids=position_ids)
    if "linear_attention" in (getattr(config, "layer_types", None) or ()):
        masks["linear_attention"] = create_recurrent_attention_mask(*arguments)
    return masks


def batch_document_segments(kwargs: dict[str, Any], tokens: torch.Tensor) -> DocumentSegments:
    """The checked offsets of the batch, or (sdpa/eager given position_ids only) offsets derived from them."""
    given = kwargs.get("cu_seq_lens_q") is not None
    offsets = kwargs if given else _offsets_from_positions(kwargs["position_ids"], tokens)
    return DocumentSegments(offsets["cu_seq_lens_q"], tuple(tokens.shape[:2]))


def _offsets_from_positions(position_ids: torch.Tensor, tokens: torch.Tensor) -> dict[str, Any]:
    starts = _segment_starts(position_ids, tokens.shape[:2])
    return _offsets_kwargs(segment_fields(starts.cumsum(1).cpu().numpy()), tokens.device)


def _resolve_attention_mask(kwargs: dict[str, Any], config, flash: bool, shape: torch.Size) -> dict[str, Any]:
    """Convert an indexed 2-D mask; refuse a mask that would let packed documents see each other."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor):
        return kwargs  # None, or per-layer-type masks already prepared (generate does that)
    if mask.ndim == 4 and _has_sliding_window(config):
        raise IsolationError(
            "A single 4-D attention_mask on a model with sliding-window layers: transformers applies it to "
            "every layer, so the sliding layers lose their window. Pass position_ids instead of the mask "
            "(PackedCollator's default batch), and transformers builds each layer's mask from them."
        )
    if mask.ndim != 2:
        return kwargs
    if bool((mask > 1).any()):
        return _from_indexed_mask(kwargs, mask, flash, shape)
    packed_fields = [key for key in _OFFSET_KEYS if kwargs.get(key) is not None]
    position_ids = kwargs.get("position_ids")
    starts = None if position_ids is None or mask.shape != shape else _segment_starts(position_ids, shape)
    # Left padding restarts positions too (generate does that); only a restart between two attended tokens packs.
    attended_pairs = mask[:, 1:].bool() & mask[:, :-1].bool()
    restarts_inside_mask = starts is not None and bool((starts[:, 1:] & attended_pairs).any())
    if packed_fields or restarts_inside_mask:
        cause = ", ".join(packed_fields) if packed_fields else "position_ids that restart inside a row"
        raise IsolationError(
            f"A 2-D binary attention_mask together with packed rows ({cause}): transformers then unpads or "
            "masks with the binary mask only, and the documents of a row attend to each other. Drop "
            "attention_mask; PackedCollator's default batch has none (padding is a segment of its own)."
        )
    return kwargs


def _resolve_image_batch_mask(kwargs: dict[str, Any], config, flash: bool, shape: torch.Size, style: str):
    """`_resolve_attention_mask` for an image batch: 3-D rotary rows judged by their first (text) row of positions.

    An indexed mask is refused where its conversion (2-D positions from 0) would lose the family's positions: the
    3-D rotary ones, and PaliGemma's, which count from 1.
    """
    mask = kwargs.get("attention_mask")
    if style in ("3-D rotary", "prefix blocks") and isinstance(mask, torch.Tensor) and mask.ndim == 2:
        if bool((mask > 1).any()):
            kept = "3-D rotary position_ids" if style == "3-D rotary" else "PaliGemma's position_ids (from 1)"
            raise IsolationError(
                f"An indexed attention_mask on a packed {style} image batch: converting it would rebuild 2-D "
                f"positions from 0 and lose the {kept}. Pass VisionCollator's batch (position_ids, no mask)."
            )
    positions = kwargs.get("position_ids")
    if style == "3-D rotary" and isinstance(positions, torch.Tensor) and positions.ndim == 3:
        resolved = _resolve_attention_mask({**kwargs, "position_ids": positions[0]}, config, flash, shape)
        return {**resolved, "position_ids": positions}
    return _resolve_attention_mask(kwargs, config, flash, shape)


def _from_indexed_mask(kwargs: dict[str, Any], mask: torch.Tensor, flash: bool, shape: torch.Size) -> dict[str, Any]:
    """An indexed mask (documents numbered from 1, 0 = padding) as position_ids (+ offsets), mask dropped.

    The mask is authoritative: position_ids given with it are replaced by ones rebuilt from it.
    """
    if mask.shape != shape:
        raise IsolationError(
            f"An indexed attention_mask of shape {tuple(mask.shape)} for tokens of shape {tuple(shape)}."
        )
    given = [key for key in _OFFSET_KEYS if kwargs.get(key) is not None]
    if given:
        raise IsolationError(
            f"Both an indexed attention_mask and {', '.join(given)}: pass one description of the documents."
        )
    fields = segment_fields(mask.cpu().numpy())
    position_ids = torch.from_numpy(fields.position_ids).to(mask.device)
    converted = {**kwargs, "attention_mask": None, "position_ids": position_ids}
    if flash:
        converted |= _offsets_kwargs(fields, mask.device)
    return converted


def _offsets_kwargs(fields, device: torch.device) -> dict[str, Any]:
    cu_seq_lens = torch.from_numpy(fields.cu_seq_lens).to(device)
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": fields.max_length,
        "max_length_k": fields.max_length,
    }


def _has_sliding_window(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return "sliding_attention" in layer_types
    return getattr(config, "sliding_window", None) is not None


def _segment_starts(position_ids: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """[B, L] bool: where a segment starts, as transformers sees it (position not one more than the last).

    None for position ids of another shape (decoding steps, multimodal 3-D positions): not packed rows.
    """
    if position_ids.ndim != 2 or position_ids.shape[1] != shape[1] or position_ids.shape[0] not in (1, shape[0]):
        return None
    positions = position_ids.expand(shape)
    starts = torch.ones(shape, dtype=torch.bool, device=positions.device)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts


def _is_packed(kwargs: dict[str, Any], shape: torch.Size) -> bool:
    if any(kwargs.get(key) is not None for key in _OFFSET_KEYS):
        return True
    position_ids = kwargs.get("position_ids")
    starts = None if position_ids is None else _segment_starts(position_ids, shape)
    if starts is not None and kwargs.get("use_cache") is False and torch.compiler.is_compiling():
        # A collator's rows (no cache): reading whether their positions restart would be a host sync and a
        # graph break, so they are taken as packed; a row whose positions never restart is one segment, exact so.
        return True
    return starts is not None and bool(starts[:, 1:].any())


def _check_packed_fields(kwargs: dict[str, Any], tokens: torch.Tensor) -> None:
    """Everything a packed batch carries must describe the same segments, in the form kernels expect."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None or _segment_starts(position_ids, tokens.shape[:2]) is None:
        shape = None if position_ids is None else tuple(position_ids.shape)
        raise IsolationError(
            f"A packed batch (cu_seq_lens_*) needs position_ids of shape [B, L] restarting at every document; "
            f"got {shape} for tokens of shape {tuple(tokens.shape[:2])}. Without them RoPE positions run on across "
            "documents, and sdpa/eager do not see the documents at all. PackedCollator emits both."
        )
    missing = [key for key in _OFFSET_KEYS if kwargs.get(key) is None]
    if len(missing) == len(_OFFSET_KEYS):
        return  # restarting position_ids alone: sdpa, eager and flex build the per-document mask from them
    if missing:
        raise IsolationError(
            f"A packed batch without {', '.join(missing)}: transformers uses the offsets only when all four of "
            f"{', '.join(_OFFSET_KEYS)} are given, and runs dense attention over each row otherwise."
        )
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        _check_offsets_tensor(key, kwargs[key], tokens.device)
    for key in ("max_length_q", "max_length_k"):
        if type(kwargs[key]) is not int:
            raise IsolationError(
                f"{key} is a {type(kwargs[key]).__name__}, not a Python int: a tensor costs a device sync in every "
                "layer and breaks torch.compile. A default collate turns ints into tensors; use PackedCollator."
            )
    same_shape = kwargs["cu_seq_lens_q"].shape == kwargs["cu_seq_lens_k"].shape
    if kwargs["max_length_q"] != kwargs["max_length_k"] or not same_shape:
        raise IsolationError(
            "Packed self-attention needs cu_seq_lens_q equal to cu_seq_lens_k and max_length_q to max_length_k."
        )
    if torch.compiler.is_compiling():
        return  # reading values would break the graph
    problem = _offsets_problem(kwargs, tokens.shape[:2])
    if problem:
        raise IsolationError(
            f"cu_seq_lens_q/cu_seq_lens_k must {problem}; got {kwargs['cu_seq_lens_q'].tolist()[:20]} "
            f"(first 20 values) for tokens of shape {tuple(tokens.shape[:2])}. A wrong offset is an out-of-bounds "
            "read in a flash-attention kernel, or documents that see each other."
        )


def _check_offsets_tensor(key: str, offsets: Any, device: torch.device) -> None:
    if not isinstance(offsets, torch.Tensor):
        raise IsolationError(f"{key} must be a torch tensor, not {type(offsets).__name__}.")
    if offsets.dtype != torch.int32 or offsets.ndim != 1 or len(offsets) < 2 or offsets.device != device:
        raise IsolationError(
            f"{key} must be a 1-D int32 tensor of at least 2 offsets on the tokens' device ({device}); got "
            f"{offsets.dtype} of shape {tuple(offsets.shape)} on {offsets.device}. flash-attn reads it as int32."
        )


def _offsets_problem(kwargs: dict[str, Any], shape: torch.Size) -> str | None:
    """The first rule the offsets break, or None; all rules are evaluated on the device with one sync."""
    cu_q, cu_k, max_length = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["max_length_q"]
    total = shape[0] * shape[1]
    lengths = cu_q.diff()
    # Segment starts marked at the offsets (clamped: an offset out of range must fail the rules, not crash).
    starts = cu_q[:-1].long().clamp(0, max(total - 1, 0))
    starts_from_offsets = torch.zeros(total, dtype=torch.int32, device=cu_q.device)
    starts_from_offsets.scatter_reduce_(0, starts, (lengths > 0).int(), "amax")
    starts_agree = starts_from_offsets.bool() == _segment_starts(kwargs["position_ids"], shape).flatten()
    rules = {
        "start at 0": cu_q[0] == 0,
        f"end at the batch's {total} tokens": cu_q[-1] == total,
        "never decrease": (lengths >= 0).all(),
        "be equal": cu_q is cu_k or (cu_q == cu_k).all(),
        f"have a longest segment of at most max_length_q/_k ({max_length}), itself at most a row ({shape[1]})": (
            lengths.max() <= max_length
        )
        & (max_length <= shape[1]),
        "start a segment exactly where position_ids restart": starts_agree.all(),
    }
    kept = torch.stack([torch.as_tensor(rule, device=cu_q.device) for rule in rules.values()]).tolist()
    return next((rule for rule, ok in zip(rules, kept) if not ok), None)


def _without_cache(kwargs: dict[str, Any], flash: bool) -> dict[str, Any]:
    # transformers 5.24 renamed `past_key_values` to `cache`; the old name stays an alias until 5.40.
    if any(kwargs.get(name) is not None for name in ("cache", "past_key_values")):
        raise IsolationError(
            "A packed batch with a cache (cache / past_key_values): keys from the cache would join every "
            "document's attention. Packed rows are for training and scoring, not for continuing a cache."
        )
    if kwargs.get("use_cache") and not flash:
        raise IsolationError(
            "A packed batch with use_cache=True on sdpa, eager or flex_attention: transformers builds the per-document mask only "
            "when there is no cache, so the documents would attend to each other. Pass use_cache=False."
        )
    if kwargs.get("use_cache") is None:
        kwargs["use_cache"] = False
    return kwargs
