"""Compiling image batches (`VisionCollator`), measured: what `torch.compile(model, fullgraph=True, dynamic=False)`
does with them, which docs/model-support.md ("Compiled training") and the README state.

- LLaVA (CLIP tower, one image per row of `pixel_values` [N, 3, H, W]) on sdpa traces without a graph break, one
  forward and one backward graph per distinct image count N in a batch, never more: a batch's text is
  [B, max-len] whatever it holds, and N is the only shape that follows the batch. Every logit equals the
  uncompiled model's. (transformers installs its output-capturing hooks on a model's first call, under a lock
  dynamo cannot enter: the model runs once uncompiled first.)
- Qwen2-VL (3-D rotary) cannot be traced whole: its vision tower takes each image's patch grid from
  `image_grid_thw`'s values (`repeat_interleave` over it, `.tolist()`), shapes that depend on data, so
  `fullgraph=True` raises.

Graphs are counted as tests/model/test_compile.py counts them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from prepack import enable_packing
from prepack.model.tiny_models import DOCUMENT_VOCAB
from prepack.model.tiny_vision_models import tiny_vision_model
from prepack.training.vision_collate import VisionCollator, VisionSpec
from tests.model.test_compile import GraphCount, compiled
from tests.model.test_vision import image_tokens
from tests.vision_inputs import image_processor, photo_bytes

pytestmark = pytest.mark.slow  # each test traces a model: seconds of CPU

MAX_LEN = 256
FLOAT32 = 2e-5
LEAK = 1e-3
# Each batch: two packs, the first of two samples (the second text only), the second of one; the photographs
# (indices into photo_bytes()) of each pack's first sample. Image counts 1, 2, 3, 2, 4, 2, 3, 2: four distinct.
BATCHES = (((0,), ()), ((0,), (1,)), ((0, 1), (2,)), ((1,), (0,)), ((2,), (0, 1, 2)), ((0,), (1,)), ((1, 2), (0,)),
           ((0,), (2,)))


def image_batches(family: str, model) -> list[dict]:
    processor, photos, rng = image_processor(family), photo_bytes(), np.random.default_rng(0)

    def sample(images: tuple[int, ...]) -> dict:
        tokens = list(rng.integers(2, DOCUMENT_VOCAB, 4))
        for image in images:
            tokens += image_tokens(model, processor, photos[image]) + list(rng.integers(2, DOCUMENT_VOCAB, 3))
        return {"input_ids": np.array(tokens, dtype=np.int64), "images": [photos[image] for image in images]}

    def pack(samples: list[dict]) -> dict:
        lengths = [len(s["input_ids"]) for s in samples]
        return {"input_ids": np.concatenate([s["input_ids"] for s in samples]), "cu_seqlens": np.append(0, np.cumsum(lengths)),
                "images": [image for s in samples for image in s["images"]]}

    collator = VisionCollator(VisionSpec.of(model.config), processor, max_len=MAX_LEN, pad_token_id=1)
    return [collator([pack([sample(first), sample(())]), pack([sample(second)])]) for first, second in BATCHES]


def test_llava_image_batches_trace_one_graph_per_distinct_image_count():
    model = enable_packing(tiny_vision_model("llava", "sdpa", dtype=torch.float32)).train()
    batches = image_batches("llava", model)
    model(**batches[0])  # installs transformers' output-capturing hooks (see the module docstring)
    graphs = GraphCount()
    fast = compiled(model, graphs)
    worst = 0.0
    for batch in batches:
        logits = fast(**batch).logits
        logits.sum().backward()
        with torch.no_grad():
            worst = max(worst, (logits.detach() - model(**batch).logits).abs().max().item())
    counts = {len(batch["pixel_values"]) for batch in batches}
    print(f"llava on sdpa: {len(batches)} image batches, image counts {sorted(counts)}: {graphs.forward} forward and "
          f"{graphs.backward} backward graphs, worst logit difference {worst:.1e}")
    assert len(counts) == 4 and {batch["input_ids"].shape for batch in batches} == {(2, MAX_LEN)}
    assert counters["stats"]["unique_graphs"] == graphs.forward == graphs.backward == len(counts), dict(counters["stats"])
    assert sum(counters["graph_break"].values()) == 0
    assert worst < FLOAT32


def test_the_llava_check_fails_when_the_samples_see_each_other():
    model = enable_packing(tiny_vision_model("llava", "sdpa", dtype=torch.float32)).eval()
    batch = image_batches("llava", model)[1]
    model(**batch)
    fast = compiled(model, GraphCount())
    rows = torch.arange(MAX_LEN).expand(2, MAX_LEN)  # one sample a row: the text-only sample sees the image one
    with torch.no_grad():
        want = model(**batch).logits
        assert (fast(**batch).logits - want).abs().max() < FLOAT32
        assert (fast(**batch | {"position_ids": rows}).logits - want).abs().max() > LEAK


def test_qwen2_vl_image_batches_cannot_be_traced_whole():
    model = enable_packing(tiny_vision_model("qwen2_vl", "sdpa", dtype=torch.float32)).eval()
    batch = image_batches("qwen2_vl", model)[0]
    model(**batch)
    # In the tower (its attention splits by the grids' lengths), not in enable_packing's guard.
    with torch.no_grad(), pytest.raises(Exception, match=r"(?s)data-dependent.*Caused by: [^\n]*modeling_qwen2_vl\.py"):
        compiled(model, GraphCount())(**batch)
