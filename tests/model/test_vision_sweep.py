"""The vision sweep: `prepack.model.vision_families` is measured, not claimed, for every image-text-to-text type.

`prepack.model.vision_sweep.measure_family` builds a tiny random model of the family (float64, CPU), runs three
image+text samples alone and packed in one row, and gives the verdict the table must hold. Here it runs for every
family the installed transformers registers on sdpa and eager (slow), for a few families in the fast lane, and for
the styled families on flash (flash-attn 2 and FlashAttention-4 through tests/flash_reference.py's stand-ins) and
flex (uncompiled). The test fails on any row that differs from a fresh measurement, and the sweep itself can fail:
its leak control (positions counting on over the row) is measured as a leak. Regenerate docs/vision-support.md
with `python -m prepack.model.vision_families > docs/vision-support.md`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers

from prepack import enable_packing
from prepack.errors import IsolationError
from prepack.model import families, packing, vision_families, vision_sweep
from prepack.model.families import implementation
from prepack.model.isolation import default_tolerances
from prepack.model.tiny_vision_models import tiny_vision_model
from prepack.model.vision_families import VISION_FAMILIES
from prepack.model.vision_sweep import IMAGE_TEXT_TYPES, check_family, measure_family
from tests.flash_reference import enable_flash_attention, use_flash_reference, use_flex_reference  # noqa: F401

# The fast lane: isolated families (restart; 3-D rotary with deepstack and MoE; 3-D rotary before gated delta rule
# layers; tiled: LLaVA-OneVision's tiles, SmolVLM's split images; NaFlex before short convolutions: LFM2-VL; Gemma
# 4's pooled patches and sliding image blocks; Gemma 3n's timm tower), one transformers has no sdpa for.
FAST = ("llava", "qwen3_vl_moe", "qwen3_5", "blip", "gemma3n", "llava_onevision", "smolvlm", "lfm2_vl", "gemma4")
STYLED = tuple(sorted(name for name, family in VISION_FAMILIES.items() if family.style is not None))
MEASURED_RELEASE = transformers.__version__ == families.MEASURED_VERSION


def agrees(model_type: str, attn: str, switch=None) -> None:
    measured_without_a_package(model_type)
    check = check_family(model_type, attn, switch)
    assert check.agrees, f"{model_type} on {attn}: table {check.table}, measured {check.measured}"


def measured_without_a_package(model_type: str) -> None:
    """A row the sweep measured without a package its tiny model needs (timm, scipy) is not reproduced where the
    package is installed (the sweep builds the model there): skipped there, only that row."""
    family = VISION_FAMILIES.get(model_type)
    for package in ("timm", "scipy"):
        if family is not None and vision_families.needs(package) in family.verdicts and importlib.util.find_spec(package):
            pytest.skip(f"{model_type}: measured without {package}, which is installed here")


@pytest.mark.parametrize("model_type", FAST)
def test_the_table_agrees_with_a_fresh_measurement_fast_lane(model_type):
    agrees(model_type, "sdpa")


@pytest.mark.slow
@pytest.mark.parametrize(
    # the fast lane's families on sdpa are measured by the test above, in every run
    ("model_type", "attn"),
    [(model_type, attn) for model_type in IMAGE_TEXT_TYPES for attn in ("sdpa", "eager")
     if not (attn == "sdpa" and model_type in FAST)],
)
def test_the_table_agrees_with_a_fresh_measurement(model_type, attn):
    if not MEASURED_RELEASE and model_type not in VISION_FAMILIES:
        pytest.fail(f"{model_type}: transformers {transformers.__version__} registers it; run the sweep, add its row")
    agrees(model_type, attn)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["flash", "fa4", "flex"])
@pytest.mark.parametrize("model_type", STYLED)
def test_the_styled_families_on_flash_and_flex(model_type, backend, request):
    """flash and fa4 through the stand-ins of the kernels, flex uncompiled: the model is built on sdpa and
    switched, as tests/model/test_vision.py does."""
    request.getfixturevalue("use_flex_reference" if backend == "flex" else "use_flash_reference")

    def switch(model, attn):
        if attn == "flex_attention":
            model.set_attn_implementation(attn)
        else:
            enable_flash_attention(model, attn)

    agrees(model_type, implementation(backend), switch)


def test_families_without_a_style_are_refused_on_flash_and_flex_as_not_measured():
    for model_type, family in VISION_FAMILIES.items():
        if family.style is None:
            assert family.verdicts[2:] == (vision_families.NOT_SWEPT,) * 3, model_type


def test_every_registered_type_is_in_the_table():
    """On the release the table was measured with; on another, its new types are refused by name
    (test_a_family_the_table_does_not_know_is_refused_by_name)."""
    if not MEASURED_RELEASE:
        pytest.skip(f"transformers {transformers.__version__}: the table was measured with {families.MEASURED_VERSION}")
    missing = set(IMAGE_TEXT_TYPES) - set(VISION_FAMILIES)
    assert not missing and len(IMAGE_TEXT_TYPES) == len(VISION_FAMILIES), missing


@pytest.mark.slow
def test_the_sweep_measures_a_leak(monkeypatch):
    """The leak control: positions counting on over the packed row (not restarting) let LLaVA's samples see
    each other, and the sweep says so, which the table (isolated) does not."""
    restarting = vision_sweep._packed

    def counting_on(model, samples):
        batch = restarting(model, samples)
        return batch | {"position_ids": torch.arange(batch["input_ids"].shape[1])[None]}

    monkeypatch.setattr(vision_sweep, "_packed", counting_on)
    assert measure_family("llava", "sdpa") == vision_families.LEAKS
    assert not check_family("llava", "sdpa").agrees


@pytest.mark.parametrize(
    "model_type",
    ["qwen3_5", *(pytest.param(name, marks=pytest.mark.slow) for name in ("qwen3_5_moe", "qwen4_exp", "lfm2_vl"))],
)
def test_the_sweep_measures_the_sequence_state_segments(model_type, monkeypatch):
    """The leak control of the image batches' sequence-state segments (the 3-D rotary families' gated delta rule,
    LFM2-VL's short convolutions): without them (the layers run the packed row as one sequence) the samples see
    each other, and the sweep says so."""
    monkeypatch.setattr(packing._PackedBatchGuard, "_segment_the_sequence_state", lambda self, kwargs, tokens: None)
    assert measure_family(model_type, "sdpa") == vision_families.LEAKS


@pytest.mark.slow
def test_lfm3_vl_is_measured_again_with_its_decoders_short_convolutions_per_sample(monkeypatch):
    """LFM3-VL's packed samples leak natively (through its decoder's short convolutions): the sweep measures them
    again with those layers run one sample per row, and its verdict is that second measurement's."""
    assert VISION_FAMILIES["lfm3_vl"].verdicts[0] == vision_families.NO_DATA_SIDE_PER_DOCUMENT
    measuring = vision_sweep._isolated_per_document
    calls = []

    def spied(*args):
        calls.append(measuring(*args))
        return calls[-1]

    monkeypatch.setattr(vision_sweep, "_isolated_per_document", spied)
    assert measure_family("lfm3_vl", "sdpa") == vision_families.NO_DATA_SIDE_PER_DOCUMENT
    assert calls == [True]


@pytest.mark.slow
@pytest.mark.parametrize("failure", [RuntimeError("the convolution failed"), IsolationError("no such layers")])
def test_a_per_document_measurement_that_fails_is_reported_as_the_failure(monkeypatch, failure):
    """LFM3-VL's measurement with its short convolutions per sample: a packed forward that fails there (a
    convolution made to raise), or hooks refused (IsolationError), is a failure on the packed batch, not isolation."""
    from transformers.models.lfm3.modeling_lfm3 import Lfm3ShortConv

    installing = vision_sweep.install_decoders_per_document_layers

    def failing(model, model_type):
        if isinstance(failure, IsolationError):
            raise failure
        layers = installing(model, model_type)

        def raising(module, args, kwargs):
            raise failure

        layers.handles += [module.register_forward_pre_hook(raising, with_kwargs=True)
                           for module in model.modules() if isinstance(module, Lfm3ShortConv)]
        return layers

    monkeypatch.setattr(vision_sweep, "install_decoders_per_document_layers", failing)
    assert measure_family("lfm3_vl", "sdpa") == vision_families.fails_packed(
        f"{type(failure).__name__}: {failure}")


def test_the_sweep_catches_a_wrongly_refused_family(monkeypatch):
    """enable_packing refusing a family the table isolates is measured as a refusal, with prepack's own reason,
    not the table's verdict copied back."""

    def refusing(model):
        raise IsolationError("refused for the test")

    monkeypatch.setattr(vision_sweep, "enable_packing", refusing)
    measured = measure_family("llava", "sdpa")
    assert measured == vision_families.fails_packed("IsolationError: refused for the test")
    assert VISION_FAMILIES["llava"].verdicts[0].isolated


def test_a_family_blind_to_its_pixels_is_not_measured(monkeypatch):
    """Isolation measured on images the model does not see would be vacuous: a tower that ignores its pixels
    (LLaVA's, made to see zeros) is refused as not measured."""
    from transformers.models.llava.modeling_llava import LlavaModel

    seeing = LlavaModel.get_image_features
    monkeypatch.setattr(LlavaModel, "get_image_features",
                        lambda self, pixel_values, **kwargs: seeing(self, torch.zeros_like(pixel_values), **kwargs))
    assert measure_family("llava", "sdpa") == vision_families.not_run(
        "ValueError: an image sample's logits do not change with its pixels")


def test_a_family_whose_forward_fails_on_text_alone_is_refused_as_transformers_own_failure():
    """Llama 4's forward (transformers 5.24) reads `image_outputs` off its language model's output, which has
    none: every call fails after its logits, a text-only one too. The sweep says that transformers fails on every
    sample alone, not that it could not form image samples. This fails once transformers returns its output
    (then the sweep measures Llama 4's images, and the row changes)."""
    model = tiny_vision_model("llama4")
    with pytest.raises(AttributeError, match="image_outputs"):
        model(input_ids=torch.tensor([[2, 3, 4, 5]]), use_cache=False)
    failure = "AttributeError: 'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'"
    assert measure_family("llama4", "sdpa") == vision_families.fails_alone(failure)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llama4_packed_images_are_isolated_up_to_the_logits_it_fails_to_return(attn):
    """What Llama 4 would give once transformers returns its output: the logits its language model computes
    (caught on their way out) for the sweep's packed samples equal each sample's alone; its tower runs each tile
    as a row of its own (2-D rotary, pixel shuffle within the tile) and its chunked layers cut chunks by
    position_ids. The control: positions counting on over the row leak."""
    model = tiny_vision_model("llama4", attn)
    caught = []
    model.language_model.register_forward_hook(lambda module, args, output: caught.append(output.logits[0]))

    def logits(batch):
        with torch.no_grad(), pytest.raises(AttributeError, match="image_outputs"):
            model(**batch)
        return caught.pop()

    samples = vision_sweep._samples(model)
    alone = torch.cat([logits(vision_sweep._batch(model, sample.input_ids, sample.pixels)) for sample in samples])
    packed = vision_sweep._packed(model, samples)
    counting_on = packed | {"position_ids": torch.arange(packed["input_ids"].shape[1])[None]}
    tolerance, _ = default_tolerances(torch.float64, attn)
    assert sum(len(sample.pixels.get("pixel_values", ())) for sample in samples) == 3
    assert (logits(packed) - alone).abs().max() <= tolerance
    assert (logits(counting_on) - alone).abs().max() > 1e-2


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
def test_mllamas_text_without_an_image_of_its_own_sees_the_rows_images(attn):
    """Mllama's refusal, pinned to its cause: with each sample's own cross_attention_mask (its processor's rule)
    over its own images, the packed tokens that have an image to attend to equal their sample's alone, and those
    with none (before their sample's first image, in a text-only sample) do not: transformers unmasks a
    cross-attention row masked whole, so they attend to every image of the row. This fails if transformers
    masks them (then the sweep measures Mllama again)."""
    model = tiny_vision_model("mllama", attn)
    samples = vision_sweep._samples(model)
    alone = torch.cat([vision_sweep._logits(model, sample) for sample in samples])
    packed = vision_sweep._packed(model, samples)
    with torch.no_grad():
        differs = (model(**packed).logits[0] - alone).abs().amax(-1)
    imageless = packed["cross_attention_mask"][0].flatten(1).sum(-1) == 0
    tolerance, _ = default_tolerances(torch.float64, attn)
    assert imageless.any() and (~imageless).any()
    assert differs[~imageless].max() <= tolerance
    assert differs[imageless].min() > 10 * tolerance


def test_a_family_the_table_does_not_know_is_refused_by_name(monkeypatch):
    """An image-text-to-text type the vision table lacks (a newer transformers, remote code): its image batches
    are refused by name, with the command that re-measures; enable_packing refuses the model itself first."""
    model = tiny_vision_model("llava")
    monkeypatch.delitem(VISION_FAMILIES, "llava")
    message = vision_families.image_refusal("llava", "LlavaForConditionalGeneration", "sdpa")
    assert "image+text batches for model type 'llava'" in message and families.SWEEP_COMMAND in message
    with pytest.raises(IsolationError, match="model type 'llava'"):
        enable_packing(model)


def test_a_measured_refusal_is_raised_for_an_image_batch():
    """A family without a style: enable_packing raises the table's measured reason for its image batches."""
    reason = VISION_FAMILIES["inkling_mm_model"].verdicts[0].reason
    message = vision_families.image_refusal("inkling_mm_model", "InklingMmForConditionalGeneration", "sdpa")
    assert reason == vision_families.needs("scipy").reason and reason in message
    assert "without packing" in message


def test_vision_support_document_is_current():
    document = Path(__file__).parents[2] / "docs" / "vision-support.md"
    assert document.read_text() == vision_families.markdown()


def test_a_tower_without_flex_is_refused_as_the_towers_not_the_decoders():
    """LFM2-VL's decoder has flex attention in transformers, its SigLIP2 tower has none: the refusal on flex names
    the tower, as the sweep measures it (the model does not build on flex), not the whole family."""
    measured = measure_family("lfm2_vl", "flex_attention")
    assert measured == vision_families.tower_without("flex", "Siglip2VisionModel")
    assert "Siglip2VisionModel" in measured.reason and VISION_FAMILIES["lfm2_vl"].verdicts[-1] == measured
