"""Packed image+text batches equal their samples run alone, in float64, for the three styles of packing.

Tiny random vision-language models (`prepack.model.tiny_vision_models`: Qwen2-VL, Qwen2.5-VL and Qwen3-VL
with 3-D rotary positions, LLaVA with plain restarts, Gemma 3 with bidirectional image blocks, Gemma 4 with them on its
sliding layers), real photographs (matplotlib's
sample images) through transformers' own image processors, `VisionCollator` packing four samples (one, two,
none and one image) into two rows, and `enable_packing` on. The reference is each sample alone through
transformers' own path: its own rotary positions (`get_rope_index`), its own masks. Logits, loss and
gradients must agree to float64 rounding; each leak control (positions not restarted, patches attending
across images, Gemma 3's image blocks left out, on flash the text's offsets missing or reaching LLaVA's vision
tower) must not. Every verdict of `prepack.model.vision_families` is run: the isolated ones on their backend
(flash attention 2 and 4 through tests/flash_reference.py's stand-ins of the kernels, flex_attention uncompiled
on logits and loss: torch's flex has no backward on a CPU), the refused ones to their refusal.

LFM2-VL's photographs go through SigLIP2's PIL image processor here (its own processor, counted against
transformers' in tests/building/test_image_chat.py, needs torchvision) (`prepack.model.tiny_vision_models.image_processor_for`), which makes the same NaFlex input for
its SigLIP2 tower (patch rows padded to one length, `pixel_attention_mask`, `spatial_shapes`; one row per image,
where LFM2-VL's processor adds a row per tile, each a row the tower runs alone).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

from prepack import enable_packing
from prepack.errors import InputError, IsolationError
from prepack.model.tiny_models import DOCUMENT_VOCAB
from prepack.model.families import BACKENDS, backend_of, implementation
from prepack.model.isolation import default_tolerances
from prepack.model import packing
from prepack.model.packing import FLASH_ATTENTION
from prepack.model.tiny_vision_models import tiny_vision_config, tiny_vision_model
from prepack.model.vision_families import IMAGE_BLOCKS, VISION_FAMILIES
from prepack.model.vision_sweep import _features_per_image
from prepack.training.collate import segment_fields
from prepack.training.vision_collate import VisionCollator, VisionSpec, rotary_3d_positions
from tests.flash_reference import enable_flash_attention, use_flash_reference, use_flex_reference
from tests.vision_inputs import image_processor, photo_bytes

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "llava", "gemma3",
            "internvl", "mistral3", "glm4v", "glm4v_moe", "paligemma", "llava_next", "llava_next_video", "llava_onevision",
            "idefics3", "smolvlm", "lfm2_vl", "gemma4", "video_llava", "gemma3n")
ROTARY_3D = tuple(name for name in FAMILIES if VISION_FAMILIES[name].style == "3-D rotary")
# Which photographs each sample holds (indices into photo_bytes()); the third is text only.
SAMPLE_IMAGES = ((0,), (1, 2), (), (2,))
TOLERANCE = 1e-9
# transformers computes the loss from logits cast to float32: the loss, and the gradients through it, are
# float32-exact (Gemma 3's gradients, scaled up by its embedding normaliser, show it most).
LOSS_TOLERANCE = 1e-5
# eager's softmax runs in float32 inside a float64 model (measured here: up to 5.3e-8 on logits): prepack's bound.
EAGER_TOLERANCE, _ = default_tolerances(torch.float64, "eager")
# The fixtures that run each flash implementation and flex_attention on a CPU.
STAND_INS = {
    **{attn: use_flash_reference for attn in FLASH_ATTENTION if attn != "flash_attention_3"},
    "flex_attention": use_flex_reference,
}


def image_tokens(model, processor, image: bytes) -> list[int]:
    """The tokens one image stands for in the family's prompt format."""
    config, spec = model.config, VisionSpec.of(model.config)
    if spec.style == "3-D rotary":
        from PIL import Image
        import io

        grid = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")])["image_grid_thw"][0]
        count = int(np.prod(grid)) // spec.merge_size**2
        if config.model_type in ("glm4v", "glm4v_moe"):  # <|begin_of_image|>, <|end_of_image|>
            return [config.image_start_token_id, *[spec.image_token_id] * count, config.image_end_token_id]
        return [config.vision_start_token_id, *[spec.image_token_id] * count, config.vision_end_token_id]
    if spec.image_counts is not None:  # Gemma 4: as many soft tokens as its image processor makes of the image
        from PIL import Image
        import io

        count = int(processor(images=[Image.open(io.BytesIO(image)).convert("RGB")])[spec.image_counts][0])
        return [config.boi_token_id, *[spec.image_token_id] * count, config.eoi_token_id]
    if spec.style == "image blocks":
        return [config.boi_token_index, *[spec.image_token_id] * spec.tokens_per_image, config.eoi_token_index]
    if config.model_type == "gemma3n":  # Gemma3nProcessor's image: its begin and end tokens around its soft tokens
        return [config.boi_token_id, *[spec.image_token_id] * spec.tokens_per_image, config.eoi_token_id]
    if spec.image_cell is not None:  # Mistral 3: rows of placeholders, each closed by a break, the last by the end
        from PIL import Image
        import io

        height, width = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")],
                                  patch_size={"height": spec.image_cell, "width": spec.image_cell})["image_sizes"][0]
        row_end, end = IMAGE_BRACKETS[config.model_type]
        rows = [[spec.image_token_id] * (int(width) // spec.image_cell) + [row_end]] * (int(height) // spec.image_cell)
        return [token for tokens in rows for token in tokens][:-1] + [end]
    if config.model_type in IMAGE_BRACKETS:
        start, end = IMAGE_BRACKETS[config.model_type]
        views = 1  # InternVL tiled: its tiles and a thumbnail, as many as its image processor makes
        if getattr(processor, "crop_to_patches", False):
            from PIL import Image
            import io

            views = int(processor(images=[Image.open(io.BytesIO(image)).convert("RGB")])["num_patches"][0])
        return [start, *[spec.image_token_id] * spec.tokens_per_image * views, end]
    if spec.tokens_per_image is None:  # tiled: as many as the model makes features of the image
        from PIL import Image
        import io

        out = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
        pixels = {key: out[key] for key in ("pixel_values", "image_sizes", "pixel_attention_mask", "spatial_shapes")
                  if key in out}
        return [spec.image_token_id] * _features_per_image(model, pixels, 1)[0]
    return [spec.image_token_id] * spec.tokens_per_image


# The ids that stand for the text around an image's placeholders where the tiny config names none (InternVL's
# `<img>` and `</img>`, Mistral 3's `[IMG_BREAK]` and `[IMG_END]`): above the documents' ids, below the config's
# special ones.
IMAGE_BRACKETS = {"internvl": (DOCUMENT_VOCAB, DOCUMENT_VOCAB + 1), "mistral3": (DOCUMENT_VOCAB, DOCUMENT_VOCAB + 1)}


def samples(model, processor, seed: int = 0) -> list[dict]:
    """Four image+text samples: text, the images' tokens, text; random text ids below the special ids."""
    rng = np.random.default_rng(seed)
    photos = photo_bytes()
    made = []
    for images in SAMPLE_IMAGES:
        tokens = list(rng.integers(2, DOCUMENT_VOCAB, rng.integers(3, 7)))
        for image in images:
            tokens += image_tokens(model, processor, photos[image]) + list(rng.integers(2, DOCUMENT_VOCAB, 3))
        sample = {"input_ids": np.array(tokens, dtype=np.int64), "images": [photos[i] for i in images]}
        if VisionSpec.of(model.config).style == "prefix blocks":  # PaliGemma: a suffix of 4 targets after its prefix
            sample["labels"] = np.where(np.arange(len(tokens)) < len(tokens) - 4, -100, sample["input_ids"])
        made.append(sample)
    return made


def packs_of(made: list[dict]) -> list[dict]:
    """Samples 0+1 in one pack, 2+3 in the other."""
    packs = []
    for group in (made[:2], made[2:]):
        lengths = [len(sample["input_ids"]) for sample in group]
        packs.append(
            {
                "input_ids": np.concatenate([sample["input_ids"] for sample in group]),
                "cu_seqlens": np.append(0, np.cumsum(lengths)),
                "images": [image for sample in group for image in sample["images"]],
            }
        )
        if "labels" in group[0]:
            packs[-1]["labels"] = np.concatenate([sample["labels"] for sample in group])
    return packs


def setup(model_type: str, attn: str = "sdpa"):
    """The family's tiny model on `attn` (flash and flex through tests/flash_reference.py's fixtures), its
    image processor, the four samples and a collator."""
    model = tiny_vision_model(model_type, "eager" if attn == "eager" else "sdpa")
    if attn in FLASH_ATTENTION:
        enable_flash_attention(model, attn)
    elif attn == "flex_attention":
        model.set_attn_implementation(attn)
    processor = image_processor(model_type)
    made = samples(model, processor)
    collator = VisionCollator(VisionSpec.of(model.config), processor, max_len=max(
        len(pack["input_ids"]) for pack in packs_of(made)) + 3, pad_token_id=1)
    return model, processor, made, collator


def alone_pixels(collator: VisionCollator, images: list[bytes]) -> dict:
    """What the model takes of one sample's images, made by the collator's image processor: less the fields the
    collator keeps for its per-pack checks only (InternVL's views, Gemma 4's and LFM2-VL's counts)."""
    return {key: value for key, value in collator._preprocessed([images]).items()
            if key not in ("num_patches", "features_per_image", collator.spec.image_counts)}


def alone_batch(model, collator: VisionCollator, sample: dict, labels: torch.Tensor) -> dict:
    """One sample as transformers takes it unpacked: no position_ids, its own grids and token types."""
    ids = torch.from_numpy(sample["input_ids"])[None]
    batch = {"input_ids": ids, "labels": labels[None], "use_cache": False}
    if sample["images"]:
        batch |= alone_pixels(collator, sample["images"])
    is_image = (ids == collator.spec.image_token_id).long()
    if collator.spec.style == "3-D rotary":
        batch["mm_token_type_ids"] = is_image
    if collator.spec.style == "image blocks":
        batch[collator.spec.token_types] = is_image
    if collator.spec.style == "prefix blocks":  # as PaliGemmaProcessor marks a suffix: from the first target on
        batch["token_type_ids"] = ((labels != -100).cumsum(0) > 0).long()[None]
    return batch


def spans(packs: list[dict]):
    """(row, start, end) of every sample, in sample order."""
    for row, pack in enumerate(packs):
        for start, end in zip(pack["cu_seqlens"][:-1], pack["cu_seqlens"][1:]):
            yield row, int(start), int(end)


def targets(labels: torch.Tensor) -> int:
    return int((labels[..., 1:] != -100).sum())


def run(model, batch: dict, gradients: bool = True):
    """Logits, loss and (unless `gradients` is False: flex_attention has no backward on a CPU) gradients."""
    model.zero_grad()
    batch = {key: value.to(model.device) if torch.is_tensor(value) else value for key, value in batch.items()}
    if not gradients:
        with torch.no_grad():
            out = model(**batch)
        return out.logits, out.loss, {}
    out = model(**batch)
    (out.loss * targets(batch["labels"])).backward()  # the summed loss: gradients add up over samples
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


# Parameter groups by name: the projector (Qwen's merger sits inside its tower), the vision tower, the rest.
PROJECTOR, VISION_TOWER, LANGUAGE_MODEL = "projector", "vision tower", "language model"


def parameter_group(name: str) -> str:
    # Idefics3's projector: connector; Gemma 4's and Gemma 3n's: embed_vision (the image embedder into the text width)
    if "multi_modal_projector" in name or "merger" in name or ".connector." in name or ".embed_vision." in name:
        return PROJECTOR
    towers = (".visual.", ".vision_tower.", ".vision_model.", ".image_tower.", ".video_tower.")  # Video-LLaVA's two
    return VISION_TOWER if any(tower in name for tower in towers) else LANGUAGE_MODEL


def group_differences(grads: dict, alone_grads: dict) -> dict[str, float]:
    """Per parameter group: the largest |packed - alone| gradient over the group's largest alone gradient."""
    differences, largest = {}, {}
    for name, grad in grads.items():
        group = parameter_group(name)
        differences[group] = max(differences.get(group, 0.0), float((grad - alone_grads[name]).abs().max()))
        largest[group] = max(largest.get(group, 0.0), float(alone_grads[name].abs().max()))
    assert all(largest.values()), f"a parameter group has no gradient, so it compares nothing: {largest}"
    return {group: differences[group] / largest[group] for group in differences}


def compare(model, collator, made, batch, gradients: bool = True) -> tuple[float, float, float]:
    """(largest logit difference, loss difference, the worst of the parameter groups' relative gradient
    differences (`group_differences`), 0 without `gradients`) packed vs alone."""
    logit_diff, loss_diff, groups = compare_groups(model, collator, made, batch, gradients)
    return logit_diff, loss_diff, max(groups.values(), default=0.0)


def compare_groups(model, collator, made, batch, gradients: bool = True) -> tuple[float, float, dict[str, float]]:
    """(largest logit difference, loss difference, per parameter group the relative gradient difference)."""
    packs = packs_of(made)
    logits, loss, grads = run(model, batch, gradients)
    logit_diff, alone_losses, alone_grads = 0.0, [], {}
    for sample, (row, start, end) in zip(made, spans(packs)):
        alone_logits, alone_loss, sample_grads = run(
            model, alone_batch(model, collator, sample, batch["labels"][row, start:end]), gradients
        )
        logit_diff = max(logit_diff, float((logits[row, start:end] - alone_logits[0]).abs().max()))
        alone_losses.append((float(alone_loss), targets(batch["labels"][row, start:end])))
        for name, grad in sample_grads.items():
            alone_grads[name] = alone_grads.get(name, 0) + grad
    weighted = sum(value * count for value, count in alone_losses) / sum(count for _, count in alone_losses)
    if not gradients:
        return logit_diff, abs(float(loss) - weighted), {}
    assert grads.keys() == alone_grads.keys(), "a parameter has a gradient packed or alone only"
    return logit_diff, abs(float(loss) - weighted), group_differences(grads, alone_grads)


def verdict_pairs(isolated: bool) -> list[tuple[str, str]]:
    """(model type, attention implementation) of every verdict of the vision table's styled families (those
    VisionCollator batches) that is (not) isolated."""
    return [
        (model_type, implementation(backend))
        for model_type, family in VISION_FAMILIES.items()
        if family.style is not None
        for backend, verdict in zip(BACKENDS, family.verdicts)
        if verdict.isolated == isolated
    ]


def stand_in(request, attn: str) -> None:
    """Run flash and flex through tests/flash_reference.py's stand-ins for the length of the test."""
    if attn in STAND_INS:
        request.getfixturevalue(STAND_INS[attn].__name__)


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "attn"), verdict_pairs(isolated=True))
def test_packed_image_batch_equals_each_sample_alone(model_type, attn, request):
    """Every verdict of the table that says isolated, run; on flex logits and loss (no backward on a CPU).

    On flash, the control first: without enable_packing the batch carries no cu_seq_lens_*, and transformers
    runs dense attention over each row."""
    stand_in(request, attn)
    model, _, made, collator = setup(model_type, attn)
    batch = collator(packs_of(made))
    if attn in FLASH_ATTENTION:
        logit_diff, _, _ = compare(model, collator, made, batch)
        assert logit_diff > 1e-3, f"the leak control did not leak ({logit_diff}), so the test could not fail"
    enable_packing(model)
    assert int((batch["input_ids"] == collator.spec.image_token_id).sum()) > 0
    gradients = attn != "flex_attention"
    logit_diff, loss_diff, groups = compare_groups(model, collator, made, batch, gradients=gradients)
    tolerance = EAGER_TOLERANCE if attn == "eager" else TOLERANCE
    report = f"logits {logit_diff:.1e}, loss {loss_diff:.1e}, gradients " + ", ".join(
        f"{group} {value:.1e}" for group, value in sorted(groups.items()))
    print(f"{model_type} on {attn}: {report}")  # the worst relative difference per parameter group
    if gradients:  # every group is compared: the vision tower's and the projector's gradients too
        assert groups.keys() == {PROJECTOR, VISION_TOWER, LANGUAGE_MODEL}, report
    assert logit_diff < tolerance and loss_diff < LOSS_TOLERANCE, report
    assert all(value < LOSS_TOLERANCE for value in groups.values()), report


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "attn"),
    [*((model_type, "sdpa") for model_type in FAMILIES), ("llava", "flex_attention"), ("gemma3", "flex_attention")],
)
def test_positions_not_restarted_leak(model_type, attn, request):
    """The control: the same batch with positions counting on over each row lets samples see each other."""
    stand_in(request, attn)
    model, _, made, collator = setup(model_type, attn)
    enable_packing(model)
    batch = collator(packs_of(made))
    width = batch["input_ids"].shape[1]
    batch["position_ids"] = torch.arange(width).expand(batch["position_ids"].shape).clone()
    logit_diff, _, _ = compare(model, collator, made, batch, gradients=attn != "flex_attention")
    assert logit_diff > 1e-3


@pytest.mark.slow
@pytest.mark.usefixtures("use_flash_reference")
def test_text_offsets_reaching_llavas_vision_tower_leak():
    """The text's offsets handed to the whole model (as transformers does without enable_packing) reach LLaVA's
    CLIP tower, whose flash attention then runs over the text's segments; enable_packing keeps them out."""
    model, _, made, collator = setup("llava", "flash_attention_2")
    batch = collator(packs_of(made))
    fields = segment_fields((batch["position_ids"].numpy() == 0).cumsum(1))  # a sample starts at position 0
    cu_seq_lens = torch.from_numpy(fields.cu_seq_lens)
    offsets = dict(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=fields.max_length,
                   max_length_k=fields.max_length)
    logit_diff, _, _ = compare(model, collator, made, batch | offsets)
    assert logit_diff > 1e-3
    enable_packing(model)
    logit_diff, _, _ = compare(model, collator, made, batch | offsets)
    assert logit_diff < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"))
@pytest.mark.parametrize("field", ["cu_seqlens", "image_cu_seqlens"])
def test_patches_across_images_leak_and_are_refused(model_type, field):
    """Qwen's tower takes `cu_seqlens` as given, also under the image modality's prefix: one segment over
    every patch lets images see each other. enable_packing refuses a batch that carries either."""
    model, _, made, collator = setup(model_type)
    batch = collator(packs_of(made))
    patches = len(batch["pixel_values"])
    batch[field] = torch.tensor([0, patches], dtype=torch.int32)
    logit_diff, _, groups = compare_groups(model, collator, made, dict(batch))
    assert logit_diff > 1e-3
    assert groups[VISION_TOWER] > 1e-3, groups  # the vision tower's own gradients show the leak too
    enable_packing(model)
    with pytest.raises(IsolationError, match=field):
        model(**batch)


@pytest.mark.slow
def test_lfm2_vl_needs_its_short_convolutions_per_sample(monkeypatch):
    """LFM2-VL's leak control: with the samples withheld from LFM2's short convolutions (they run over the packed
    row), a sample's last tokens reach the next sample's first through them."""
    model, _, made, collator = setup("lfm2_vl")
    enable_packing(model)
    batch = collator(packs_of(made))
    monkeypatch.setattr(packing._PackedBatchGuard, "_segment_the_sequence_state", lambda self, kwargs, tokens: None)
    logit_diff, _, _ = compare(model, collator, made, batch, gradients=False)
    assert logit_diff > 1e-6


@pytest.mark.slow
def test_gemma3_image_blocks_are_needed():
    """Without token_type_ids Gemma 3's images attend causally only: not what the sample alone gets."""
    model, _, made, collator = setup("gemma3")
    batch = collator(packs_of(made))
    del batch["token_type_ids"]
    logit_diff, _, _ = compare(model, collator, made, batch)
    assert logit_diff > 1e-3


@pytest.mark.slow
def test_gemma4_own_sliding_mask_leaks_packed_image_blocks_and_only_prepacks_layer_choice_is_exact(monkeypatch):
    """The leak controls of Gemma 4's layer masks: without enable_packing transformers' own sliding mask reads each
    image block at the positions remapped within each sample, so packed samples differ from each alone (if
    transformers mends it, this fails and the family may be isolated natively). With enable_packing, image blocks on
    every layer (Gemma 3's choice) or on none leak too: only its sliding layers, prepack's choice, give each sample
    as alone."""
    from prepack.model import vision_packing

    model, _, made, collator = setup("gemma4")
    batch = collator(packs_of(made))
    logit_diff, _, groups = compare_groups(model, collator, made, batch)
    assert logit_diff > 1e-3 and groups[VISION_TOWER] > 1e-3, (logit_diff, groups)
    enable_packing(model)
    logit_diff, _, _ = compare(model, collator, made, batch, gradients=False)
    assert logit_diff < TOLERANCE, logit_diff
    for layers in (("full_attention", "sliding_attention"), ()):
        monkeypatch.setattr(vision_packing, "_image_block_layers", lambda *_, layers=layers: layers)
        logit_diff, _, _ = compare(model, collator, made, batch, gradients=False)
        assert logit_diff > 1e-3, (layers, logit_diff)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gemma3", "gemma4"])
def test_image_blocks_of_precomputed_features_equal_each_sample_alone(model_type):
    """transformers builds Gemma 3's and Gemma 4's image blocks from the token types alone, pixels or not: a packed
    batch whose image features come precomputed (mm_encoder_outputs) gets prepack's layer masks as one with
    pixel_values does, not transformers' misplaced blocks."""
    model, _, made, collator = setup(model_type)
    batch = collator(packs_of(made))
    pixels = {key: batch.pop(key) for key in ("pixel_values", "image_position_ids") if key in batch}
    with torch.no_grad():
        features = model.model.get_image_features(**pixels, return_dict=True)
    enable_packing(model)
    batch["mm_encoder_outputs"] = {"image": features}
    logit_diff, loss_diff, _ = compare(model, collator, made, batch, gradients=False)
    assert logit_diff < TOLERANCE and loss_diff < LOSS_TOLERANCE, (logit_diff, loss_diff)


@pytest.mark.slow
def test_gemma3_text_batch_with_its_token_types_all_zero_is_accepted_on_flash(request):
    """VisionCollator gives a text-only batch an all-zero token_type_ids: no image there, so it stays a text batch,
    isolated on flash (Gemma 3's image batches are refused there), each document as alone."""
    stand_in(request, "flash_attention_2")
    model = enable_packing(enable_flash_attention(tiny_vision_model("gemma3", "sdpa"), "flash_attention_2"))
    ids = torch.randint(3, 60, (1, 12))
    types = torch.zeros_like(ids)
    with torch.no_grad():
        logits = model(ids, position_ids=torch.tensor([[*range(5), *range(7)]]), token_type_ids=types,
                       use_cache=False).logits
        for start, end in ((0, 5), (5, 12)):
            alone = model(ids[:, start:end], token_type_ids=types[:, start:end], use_cache=False).logits
            assert float((logits[:, start:end] - alone).abs().max()) < TOLERANCE


def test_gemma4_image_blocks_follow_its_bidirectional_setting():
    """Gemma 4's blocks sit on its sliding layers only, and only with use_bidirectional_attention="vision" (its
    smaller checkpoints attend causally throughout); "all" is refused by name."""
    from prepack.model.vision_packing import _image_block_layers

    config = tiny_vision_config("gemma4").get_text_config()
    assert _image_block_layers(config, "gemma4", IMAGE_BLOCKS["gemma4"]) == ("sliding_attention",)
    assert _image_block_layers(config, "gemma3", IMAGE_BLOCKS["gemma3"]) == ("full_attention", "sliding_attention")
    config.use_bidirectional_attention = None
    assert _image_block_layers(config, "gemma4", IMAGE_BLOCKS["gemma4"]) == ()
    config.use_bidirectional_attention = "all"
    with pytest.raises(IsolationError, match="gemma4 image batch with use_bidirectional_attention='all'"):
        _image_block_layers(config, "gemma4", IMAGE_BLOCKS["gemma4"])


@pytest.mark.parametrize("model_type", ROTARY_3D)
def test_rotary_positions_equal_transformers_get_rope_index(model_type):
    """prepack's numpy positions (computed in DataLoader workers) are transformers' own, sample by sample, for
    every 3-D rotary family; and AutoImageProcessor gives each the Qwen2-VL image processor that prepare-images'
    placeholder rule is keyed on (Qwen3-VL-MoE has no entry of its own: the one of Qwen3-VL, whose processor it
    shares)."""
    if model_type not in ("glm4v", "glm4v_moe"):  # GLM-4V's own, compared with prepare-images' in test_image_chat.py
        shares = [name for name, processor in PROCESSOR_MAPPING_NAMES.items()
                  if processor == PROCESSOR_MAPPING_NAMES[model_type] and name in IMAGE_PROCESSOR_MAPPING_NAMES]
        mapped = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or IMAGE_PROCESSOR_MAPPING_NAMES[shares[0]]
        assert set(mapped.values()) == {"Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil"}, mapped
    model, _, made, collator = setup(model_type)
    for sample in made:
        if not sample["images"]:
            continue
        grids = collator._preprocessed([sample["images"]])["image_grid_thw"]
        ids = torch.from_numpy(sample["input_ids"])[None]
        expected, _ = model.model.get_rope_index(
            ids, mm_token_type_ids=(ids == collator.spec.image_token_id).int(), image_grid_thw=grids
        )
        merge = model.config.vision_config.spatial_merge_size
        got = rotary_3d_positions(sample["input_ids"], grids.numpy(), collator.spec.image_token_id, merge)
        np.testing.assert_array_equal(got, expected[:, 0].numpy())


@pytest.mark.slow
def test_gemma3n_tower_has_no_batch_statistics():
    """Gemma 3n's MobileNetV5 (timm) normalises each image by itself (RMS norms, no BatchNorm): in training mode too,
    a batch of images gives each image the features it gets alone, so packing images into one pixel_values couples
    none of them."""
    tower = tiny_vision_model("gemma3n").model.vision_tower.train()
    assert not [module for module in tower.modules() if isinstance(module, torch.nn.modules.batchnorm._NormBase)]
    pixels = torch.rand(3, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    together = tower(pixel_values=pixels, do_pooling=False).last_hidden_state
    alone = torch.cat([tower(pixel_values=image[None], do_pooling=False).last_hidden_state for image in pixels])
    assert float((together - alone).abs().max()) < TOLERANCE
    assert float((together[1:] - together[:-1]).abs().max()) > 1e-3  # the images' features differ


def test_a_pack_with_placeholders_and_images_that_disagree_is_refused():
    model, _, made, collator = setup("llava")
    pack = packs_of(made)[0]
    with pytest.raises(InputError, match="placeholders"):
        collator([{**pack, "images": pack["images"][:-1]}])


@pytest.mark.slow
def test_rotary_positions_without_the_text_row_leak_and_are_refused():
    """[3, B, L] rotary positions restarting per sample: transformers builds no per-sample mask from them."""
    model, _, made, collator = setup("qwen2_5_vl")
    batch = collator(packs_of(made))
    batch["position_ids"] = batch["position_ids"][1:]
    logit_diff, _, _ = compare(model, collator, made, dict(batch))
    assert logit_diff > 1e-3
    enable_packing(model)
    with pytest.raises(IsolationError, match=r"\[3, B, L\]"):
        model(**batch)


@pytest.mark.parametrize(("model_type", "attn"), [
    pytest.param(*pair, marks=[pytest.mark.slow] if pair[0] == "gemma4" else [])  # Gemma 4's fast lane: the sweep's row
    for pair in verdict_pairs(isolated=False) if pair[0] in ("gemma3", "gemma4")])
def test_gemma_images_run_causally_on_flash_and_are_refused(model_type, attn, request):
    """transformers gives Gemma3ForConditionalGeneration and Gemma4ForConditionalGeneration no flash attention: forced
    onto it, a sample alone runs its images causally, not as the bidirectional blocks sdpa gives them (Gemma 4's on
    its sliding layers). Their packed image batches are refused there with that reason (their text batches are
    isolated on flash, so enable_packing itself accepts the model)."""
    stand_in(request, attn)
    model, _, made, collator = setup(model_type)
    sample = made[0]
    alone = alone_batch(model, collator, sample, torch.from_numpy(sample["input_ids"]))
    sdpa_logits, _, _ = run(model, alone, gradients=False)
    flash_logits, _, _ = run(enable_flash_attention(model, attn), alone, gradients=False)
    assert float((sdpa_logits - flash_logits).abs().max()) > 1e-3
    enable_packing(model)
    reason = VISION_FAMILIES[model_type].verdicts[BACKENDS.index(backend_of(attn))].reason
    refusal = f"{model_type} .*{attn}: {re.escape(reason)}. .*'sdpa' or 'eager' or 'flex_attention'"
    with pytest.raises(IsolationError, match=refusal):
        model(**collator(packs_of(made)))


@pytest.mark.parametrize(
    "model_type",
    [pytest.param(model_type, marks=[pytest.mark.slow] if model_type == "gemma3n" else [])  # gemma3n imports timm
     for model_type, attn in verdict_pairs(isolated=False) if attn == "flex_attention"],
)
def test_qwen_vl_has_no_flex_attention(model_type):
    """The table's flex refusals for Qwen-VL, GLM-4V, LFM2-VL, Video-LLaVA and Gemma 3n (its timm tower): transformers
    has no flex path to
    switch them to."""
    model = tiny_vision_model(model_type)
    with pytest.raises(ValueError, match="does not support an attention implementation through torch's flex"):
        model.set_attn_implementation("flex_attention")


def test_every_refusal_of_the_vision_table_is_run():
    """The tests above run the styled families' refusals: a refusal of another kind needs a test of its own
    (the families without a style are measured by tests/model/test_vision_sweep.py)."""
    gemma3_on_flash = {("gemma3", attn) for attn in FLASH_ATTENTION if attn != "flash_attention_3"}
    qwen_on_flex = {
        (model_type, "flex_attention")
        for model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "glm4v", "lfm2_vl",
                           "video_llava", "gemma3n")
    }
    qwen4_exp_on_flash = {("qwen4_exp", attn) for attn in FLASH_ATTENTION if attn != "flash_attention_3"}
    paligemma_on_flash = {("paligemma", attn) for attn in FLASH_ATTENTION if attn != "flash_attention_3"}
    gemma4_on_flash = {("gemma4", attn) for attn in FLASH_ATTENTION if attn != "flash_attention_3"}
    assert set(verdict_pairs(isolated=False)) == (gemma3_on_flash | gemma4_on_flash | qwen_on_flex | qwen4_exp_on_flash
                                                  | paligemma_on_flash)


@pytest.mark.parametrize("attn", ["flash_attention_2", "flash_attention_4"])
@pytest.mark.usefixtures("use_flash_reference")
def test_qwen4_exp_is_refused_on_flash(attn):
    """Its text is refused on flash (docs/model-support.md: its sparse indexer reads a mask the flash path has
    not), and so are its images: enable_packing refuses the model there, with that reason."""
    from prepack.model.families import QWEN4_EXP_ON_FLASH

    model = enable_flash_attention(tiny_vision_model("qwen4_exp"), attn)
    assert VISION_FAMILIES["qwen4_exp"].verdicts[BACKENDS.index(backend_of(attn))] == QWEN4_EXP_ON_FLASH
    with pytest.raises(IsolationError, match=re.escape(QWEN4_EXP_ON_FLASH.reason)):
        enable_packing(model)


@pytest.mark.parametrize(
    ("model_type", "refusal"),
    [("gemma3", "attention_mask"), ("qwen2_vl", "binary attention_mask"), ("glm4v", "binary attention_mask")],
)
def test_image_batch_with_a_binary_mask_is_refused(model_type, refusal):
    """A packed image batch with a 2-D binary attention_mask: transformers masks with it only, and the samples of a
    row see each other. Gemma 3's image blocks refuse any mask; 3-D rotary rows are refused from the text row of the
    positions, as text rows are."""
    model, _, made, collator = setup(model_type)
    enable_packing(model)
    batch = collator(packs_of(made))
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    with pytest.raises(IsolationError, match=refusal):
        model(**batch)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "paligemma"])
def test_image_batch_with_an_indexed_mask_is_refused_by_name(model_type):
    """An indexed mask rebuilds 2-D positions from 0: neither the 3-D rotary positions nor PaliGemma's, from 1."""
    model, _, made, collator = setup(model_type)
    enable_packing(model)
    batch = collator(packs_of(made))
    rows = batch["position_ids"][0] if batch["position_ids"].ndim == 3 else batch["position_ids"]
    batch["attention_mask"] = (rows == rows.min()).long().cumsum(1)
    with pytest.raises(IsolationError, match="indexed attention_mask"):
        model(**batch)


def test_a_family_without_a_style_is_refused_for_image_batches_with_its_measured_reason():
    """GOT-OCR2 is isolated on text (docs/model-support.md); with images prepack has no data side for it, and the
    vision sweep's eager verdict (its tiny model's logits do not move with its pixels) is the refusal's reason."""
    from prepack.model.tiny_models import tiny_model

    model = enable_packing(tiny_model("got_ocr2", "eager"))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    verdict = VISION_FAMILIES["got_ocr2"].verdicts[BACKENDS.index("eager")]
    assert VISION_FAMILIES["got_ocr2"].style is None and not verdict.isolated
    with pytest.raises(IsolationError, match=f"apart in got_ocr2 .*eager: {re.escape(verdict.reason)}"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), pixel_values=torch.zeros(1, 3, 8, 8))


def test_mistral3_images_the_processor_sizes_otherwise_are_refused():
    """Mistral 3's placeholders follow each image's size: a collator whose image processor resizes them otherwise
    than the packs were counted for (another longest edge) refuses the pack, before transformers would move one
    sample's image features into another's placeholders."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    model, processor, made, collator = setup("mistral3")
    assert collator(packs_of(made))["image_sizes"].shape == (4, 2)
    smaller = PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size=processor.patch_size)
    other = VisionCollator(collator.spec, smaller, pad_token_id=1)
    with pytest.raises(InputError, match="Pack 0 has .* image placeholders; the image processor"):
        other(packs_of(made))


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_paligemma_needs_its_prefix_blocks_and_positions_from_one(attn):
    """The controls of PaliGemma's style: without token_type_ids each prefix runs causally, not both ways as alone;
    with positions from 0 (not the 1 PaliGemma numbers a sample alone from) the logits move beyond float64 rounding."""
    model, _, made, collator = setup("paligemma", attn)
    enable_packing(model)
    batch = collator(packs_of(made))
    assert set(batch["token_type_ids"].unique().tolist()) == {0, 1}  # prefixes and suffixes both there
    tolerance = EAGER_TOLERANCE if attn == "eager" else TOLERANCE
    changes = [{"token_type_ids": torch.ones_like(batch["token_type_ids"])}]
    if attn == "sdpa":  # eager's own float32 softmax hides a difference of this size (EAGER_TOLERANCE)
        changes.append({"position_ids": batch["position_ids"] - 1})
    for changed in changes:
        logit_diff, _, _ = compare(model, collator, made, batch | changed, gradients=False)
        assert logit_diff > tolerance, changed.keys()


@pytest.mark.parametrize("attn", [attn for model_type, attn in verdict_pairs(isolated=False) if model_type == "paligemma"])
def test_paligemma_prefixes_run_causally_on_flash_and_are_refused(attn, request):
    """transformers gives PaliGemmaForConditionalGeneration no flash attention: forced onto it, a sample alone runs its
    prefix causally, not both ways as on sdpa. Its packed image batches are refused there with that reason."""
    stand_in(request, attn)
    model, _, made, collator = setup("paligemma")
    sample, batch = made[0], collator(packs_of(made))
    start, end = next(spans(packs_of(made)))[1:]
    alone = alone_batch(model, collator, sample, batch["labels"][0, start:end])
    sdpa_logits, _, _ = run(model, alone, gradients=False)
    flash_logits, _, _ = run(enable_flash_attention(model, attn), alone, gradients=False)
    assert float((sdpa_logits - flash_logits).abs().max()) > 1e-3
    reason = VISION_FAMILIES["paligemma"].verdicts[BACKENDS.index(backend_of(attn))].reason
    with pytest.raises(IsolationError, match=f"paligemma .*{attn}: {re.escape(reason)}. .*'sdpa' or 'eager'"):
        enable_packing(model)(**batch)  # refused when packing is enabled (no text verdict lets the model through)


def test_paligemma_image_batch_with_a_mask_is_refused():
    """With an attention_mask transformers builds no per-sample mask from the positions, and PaliGemma's prefix
    blocks (one group over every prefix of the row) would join the samples: refused. The control: without
    enable_packing, the samples see each other."""
    model, _, made, collator = setup("paligemma")
    batch = collator(packs_of(made))
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    leaked, _, _ = compare(model, collator, made, dict(batch), gradients=False)
    assert leaked > 1e-3
    enable_packing(model)
    logit_diff, _, _ = compare(model, collator, made, batch | {"attention_mask": None}, gradients=False)
    assert logit_diff < TOLERANCE
    with pytest.raises(IsolationError, match="attention_mask"):
        model(**batch)


def tiled_internvl(attn: str, max_patches: int = 4):
    """InternVL with its images tiled (GOT-OCR2's crop_to_patches, up to `max_patches` tiles and a thumbnail)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    model = tiny_vision_model("internvl", attn)
    side = model.config.vision_config.image_size[0]
    processor = GotOcr2ImageProcessorPil(size={"height": side, "width": side}, crop_to_patches=True,
                                         max_patches=max_patches)
    made = samples(model, processor)
    return model, processor, made, VisionCollator(VisionSpec.of(model.config), processor, pad_token_id=1)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_internvl_tiled_batch_equals_each_sample_alone(attn):
    """Tiled InternVL images (InternVLProcessor's default): each view one row of pixel_values, image_seq_length
    placeholders each; packed equals each sample alone on logits, loss and every parameter group's gradients. The
    control: positions counting on over the row leak."""
    model, _, made, collator = tiled_internvl(attn)
    batch = collator(packs_of(made))
    images = sum(len(sample["images"]) for sample in made)
    assert len(batch["pixel_values"]) > images  # tiles, not one view per image
    enable_packing(model)
    logit_diff, loss_diff, groups = compare_groups(model, collator, made, batch)
    report = f"logits {logit_diff:.1e}, loss {loss_diff:.1e}, gradients {groups}"
    assert groups.keys() == {PROJECTOR, VISION_TOWER, LANGUAGE_MODEL}, report
    tolerance = EAGER_TOLERANCE if attn == "eager" else TOLERANCE
    assert logit_diff < tolerance and loss_diff < LOSS_TOLERANCE, report
    assert all(value < LOSS_TOLERANCE for value in groups.values()), report
    counting = batch | {"position_ids": torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])}
    assert compare(model, collator, made, counting, gradients=False)[0] > 1e-3


def test_internvl_tiles_the_processor_makes_otherwise_are_refused():
    """A collator whose image processor tiles otherwise than the packs were counted for (fewer tiles) refuses the
    pack: transformers checks the batch's total only."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    _, processor, made, collator = tiled_internvl("sdpa")
    fewer = GotOcr2ImageProcessorPil(size=processor.size, crop_to_patches=True, max_patches=2)
    with pytest.raises(InputError, match="Pack 0 has .* image placeholders; the image processor made its"):
        VisionCollator(collator.spec, fewer, pad_token_id=1)(packs_of(made))
