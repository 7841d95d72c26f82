"""Compile once: fixed-shape batches (`PackedCollator(max_docs_per_pack=K)` over a `--max-docs-per-pack K`
build) give `torch.compile(model, fullgraph=True, dynamic=False)` one forward graph and one backward graph for
every step, on sdpa, eager, flex_attention and the flash path, and every document's logits are those of the
document run alone, uncompiled. The default batch recompiles: its offsets follow the document count.

Graphs are counted by torch's own compile hooks: dynamo's `counters` (frames, graph breaks) and AOTAutograd's
forward and backward compilers (`aot_autograd(fw_compiler=..., bw_compiler=...)`), which run once per graph.
The backend is AOTAutograd without inductor's code generation, so that a step costs milliseconds on a CPU;
what it counts is what inductor would be handed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

from prepack import PackedCollator, PackedDataset, build, enable_packing
from prepack.training.loss import loss_weights, weighted_loss
from tests.demo_inputs import chitchat, gpt2_directory
from tests.flash_reference import use_flash_reference  # noqa: F401 (a fixture)
from tests.tiny_models import DOCUMENT_VOCAB, tiny_model

pytestmark = pytest.mark.slow  # each test traces a model: seconds of CPU

MAX_LEN, CAP, BATCH, STEPS = 64, 6, 2, 50
FLOAT64 = 1e-10
FLOAT32 = 2e-5  # compiled against eager float32, a document in the batch against it alone (`-s` prints the worst)
LEAK = 1e-3


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> list[dict]:
    """Packs of real documents: chitchat's lines as text, GPT-2 tokenized, at most CAP a pack; ids folded
    into the tiny models' document vocabulary (the layout is what matters here, not the words)."""
    tmp = tmp_path_factory.mktemp("compile")
    lines = [line for conversation in chitchat()[:300] for line in conversation][: 40 * BATCH * STEPS]
    corpus = tmp / "lines.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    build(corpus, tmp / "packed", max_len=MAX_LEN, tokenizer=gpt2_directory(tmp / "gpt2"), max_docs_per_pack=CAP)
    dataset = PackedDataset(tmp / "packed")
    out = []
    for index in range(BATCH * STEPS):
        pack = dataset[index]
        out.append({"input_ids": np.asarray(pack["input_ids"]) % DOCUMENT_VOCAB, "cu_seqlens": pack["cu_seqlens"]})
    counts = {len(pack["cu_seqlens"]) - 1 for pack in out}
    assert len(counts) >= 3 and max(counts) == CAP  # the document count varies from batch to batch
    return out


def batches(packs: list[dict], collator: PackedCollator) -> list[dict]:
    return [collator(packs[i : i + BATCH]) for i in range(0, len(packs), BATCH)]


class GraphCount:
    """A torch.compile backend (AOTAutograd, graphs run as traced) that counts the graphs it is handed."""

    def __init__(self) -> None:
        self.forward = self.backward = 0

        def forward(graph, inputs):
            self.forward += 1
            return make_boxed_func(graph.forward)

        def backward(graph, inputs):
            self.backward += 1
            return make_boxed_func(graph.forward)

        self.backend = aot_autograd(fw_compiler=forward, bw_compiler=backward)


def compiled(model, graphs: GraphCount, fullgraph: bool = True):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, backend=graphs.backend, fullgraph=fullgraph, dynamic=False)


def check_every_document(model, batch: dict, logits: torch.Tensor) -> float:
    """The largest difference between a document's logits in the compiled batch and alone, uncompiled,
    over every document of `batch` (padding tails included: they are segments of their own)."""
    cu = batch["cu_seq_lens_q"].tolist()
    flat_ids, flat_logits = batch["input_ids"].reshape(-1), logits.reshape(-1, logits.shape[-1])
    worst = 0.0
    with torch.no_grad():
        for start, end in zip(cu[:-1], cu[1:]):
            if end > start:
                alone = model(input_ids=flat_ids[start:end][None], use_cache=False).logits[0]
                worst = max(worst, (flat_logits[start:end] - alone).abs().max().item())
    return worst


def train(model, batches: list[dict], *, step_loss=None, optimizer=True) -> tuple[list[float], list[torch.Tensor]]:
    """`STEPS` optimizer steps of prepack's token-weighted loss: the losses, and the last step's gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step_loss = step_loss or (lambda batch, weights, total: weighted_loss(model(**batch).logits, batch, weights, total))
    losses = []
    for batch in batches:
        weights = loss_weights(batch, "token")
        loss = step_loss(batch, weights, weights.sum())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in model.parameters()]


def assert_one_graph(graphs: GraphCount, backward: bool = True) -> None:
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert graphs.forward == 1 and graphs.backward == (1 if backward else 0), (graphs.forward, graphs.backward)


# --- the batches ------------------------------------------------------------------------------------


def fixed_shape(batch_size: int, max_len: int, cap: int) -> tuple:
    """Every shape and Python value a fixed-shape padding-free batch gives the model, in the collator's order:
    (batch size, max-len, K) alone decide them."""
    return (
        ("input_ids", (batch_size, max_len)),
        ("labels", (batch_size, max_len)),
        ("use_cache", False),
        ("position_ids", (batch_size, max_len)),
        ("cu_seq_lens_q", (batch_size * (cap + 1) + 1,)),
        ("cu_seq_lens_k", (batch_size * (cap + 1) + 1,)),
        ("max_length_q", max_len),
        ("max_length_k", max_len),
    )


def test_fixed_shape_batches_depend_only_on_batch_size_max_len_and_k(packs):
    fixed = batches(packs, PackedCollator(MAX_LEN, max_docs_per_pack=CAP))
    shapes = {tuple((key, tuple(v.shape) if isinstance(v, torch.Tensor) else v) for key, v in b.items()) for b in fixed}
    assert shapes == {fixed_shape(BATCH, MAX_LEN, CAP)}
    default = batches(packs, PackedCollator(MAX_LEN))
    assert len({len(b["cu_seq_lens_q"]) for b in default}) > 3 and len({b["max_length_q"] for b in default}) > 1
    for a, b in zip(fixed, default):  # the same segments, then segments of no token up to the fixed count
        used = len(b["cu_seq_lens_q"])
        assert torch.equal(a["cu_seq_lens_q"][:used], b["cu_seq_lens_q"])
        assert (a["cu_seq_lens_q"][used:] == BATCH * MAX_LEN).all()
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(a[key], b[key])


def test_a_pack_over_the_cap_is_refused_never_split(packs):
    many = {"input_ids": np.arange(8), "cu_seqlens": np.arange(9)}  # 8 documents of one token
    with pytest.raises(Exception, match="holds 8 documents, more than max_docs_per_pack=6"):
        PackedCollator(MAX_LEN, max_docs_per_pack=CAP)([packs[0], many])


@pytest.mark.parametrize(
    "options",
    [{"layout": "padding_free"}, {"layout": "indexed_mask"}, {"pad_to": "longest"}, {"max_docs_per_pack": 0}],
)
def test_fixed_shapes_need_rows_of_max_len_in_the_padded_layout(options):
    with pytest.raises(Exception, match="max_docs_per_pack"):
        PackedCollator(MAX_LEN, **{"max_docs_per_pack": CAP, **options})


def test_for_dataset_takes_the_cap_from_the_build(packs, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"input_ids": [1, 2, 3][: 1 + i % 3]}) + "\n" for i in range(40)))
    build(corpus, tmp_path / "capped", max_len=16, max_docs_per_pack=4)
    build(corpus, tmp_path / "plain", max_len=16)
    assert PackedCollator.for_dataset(PackedDataset(tmp_path / "capped"), fixed_shape=True).max_docs_per_pack == 4
    assert PackedCollator.for_dataset(tmp_path / "capped").max_docs_per_pack is None
    with pytest.raises(Exception, match="--max-docs-per-pack"):
        PackedCollator.for_dataset(tmp_path / "plain", fixed_shape=True)


# --- one graph --------------------------------------------------------------------------------------

FIXED = PackedCollator(MAX_LEN, max_docs_per_pack=CAP)


def run_compiled(model, packs: list[dict], backward: bool = True, fullgraph: bool = True) -> tuple[GraphCount, float]:
    """Every batch through the compiled model (and its loss backward): the graphs counted, and the largest
    difference between a document's logits there and alone, uncompiled."""
    graphs, worst = GraphCount(), 0.0
    fast = compiled(model, graphs, fullgraph)
    for batch in batches(packs, FIXED):
        with torch.set_grad_enabled(backward):
            logits = fast(**batch).logits
        if backward:
            weights = loss_weights(batch, "token")
            weighted_loss(logits, batch, weights, weights.sum()).backward()
        worst = max(worst, check_every_document(model, batch, logits.detach()))
    print(f"{model.config.model_type} on {model.config._attn_implementation}: {len(packs) // BATCH} steps, "
          f"{graphs.forward} forward and {graphs.backward} backward graphs, worst logit difference {worst:.1e}")
    return graphs, worst


# sdpa and eager on llama; on sdpa, norms on the heads (qwen3) and sliding windows (gemma3_text) too.
@pytest.mark.parametrize("family, attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa"), ("gemma3_text", "sdpa")])
def test_one_forward_and_one_backward_graph_over_fifty_steps(family, attn, packs):
    model = enable_packing(tiny_model(family, attn, torch.float32)).train()
    graphs, worst = run_compiled(model, packs)
    assert_one_graph(graphs)
    assert worst < FLOAT32


@pytest.mark.parametrize("attn", ["flash_attention_2", "flash_attention_4"])
def test_the_flash_path_compiles_once(attn, packs, use_flash_reference):
    # float64: in float32, transformers' flash path logs a "casting fp32 inputs" warning, and logging breaks
    # the graph (the real kernels take half precision, where it logs nothing).
    model = enable_packing(tiny_model("llama", attn, torch.float64)).train()
    # A model loaded with a flash implementation has its kernels imported by transformers at load time, before
    # any compile (transformers' own note: "for fullgraph, this needs to be called before compile"); the
    # stand-in switches a built model, so it imports them here as loading would.
    lazy_import_flash_attention(attn)
    graphs, worst = run_compiled(model, packs)
    assert_one_graph(graphs)
    assert worst < FLOAT64


def test_flex_attention_breaks_once_at_its_block_mask_and_never_recompiles(packs):
    # transformers 5.24 builds flex's BlockMask with create_block_mask(_compile=True), which torch 2.13 answers
    # with a DeprecationWarning that dynamo cannot trace: fullgraph=True raises there on every model, packed or
    # not (docs/model-support.md, "Compiled training"). Without fullgraph the warning is a graph break, and the
    # graphs on either side of it are traced once. torch's flex has no backward on a CPU: the forward alone, in
    # float32 (compiled flex takes no float64 there).
    model = enable_packing(tiny_model("llama", "flex_attention", torch.float32)).eval()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="warn"):
        run_compiled(model, packs[:BATCH], backward=False)
    graphs, worst = run_compiled(model, packs[:BATCH], backward=False, fullgraph=False)
    after_one_step = (graphs.forward, dict(counters["stats"]), sum(counters["graph_break"].values()))
    graphs, worst = run_compiled(model, packs, backward=False, fullgraph=False)
    assert (graphs.forward, dict(counters["stats"]), sum(counters["graph_break"].values())) == after_one_step
    assert after_one_step[2] >= 1 and worst < FLOAT32


def test_a_family_with_per_document_layers_is_refused_by_name_with_fullgraph(packs):
    # Its sequence-state layers run one document per row (prepack.model.stateful): shapes that follow the batch.
    model = enable_packing(tiny_model("lfm2", "sdpa", torch.float32)).train()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="lfm2: its sequence-state layers run one document per row"):
        run_compiled(model, packs[:BATCH])
    graphs, worst = run_compiled(model, packs[: 4 * BATCH], fullgraph=False)  # the guard's frame runs uncompiled
    assert worst < FLOAT32


# --- the controls: wrong boundaries move the logits; a default batch recompiles ----------------------


def test_the_check_fails_when_the_boundaries_are_wrong(packs, use_flash_reference):
    sdpa = enable_packing(tiny_model("llama", "sdpa", torch.float32)).eval()
    flash = enable_packing(tiny_model("llama", "flash_attention_2", torch.float64)).eval()
    lazy_import_flash_attention("flash_attention_2")
    batch = batches(packs, FIXED)[0]
    assert len(batch["cu_seq_lens_q"].unique()) > 3  # several documents in a row: something to leak
    rows = torch.arange(MAX_LEN).expand(BATCH, MAX_LEN)
    one_segment_a_row = torch.full_like(batch["cu_seq_lens_q"], BATCH * MAX_LEN)
    one_segment_a_row[: BATCH + 1] = torch.arange(0, BATCH * MAX_LEN + 1, MAX_LEN, dtype=torch.int32)
    wrong = {
        sdpa: batch | {"position_ids": rows},  # sdpa reads the documents from the positions
        flash: batch | {"position_ids": rows, "cu_seq_lens_q": one_segment_a_row, "cu_seq_lens_k": one_segment_a_row},
    }
    for model, leaking in wrong.items():
        fast = compiled(model, GraphCount())
        with torch.no_grad():
            assert check_every_document(model, batch, fast(**batch).logits) < FLOAT32
            assert check_every_document(model, batch, fast(**leaking).logits) > LEAK


def test_the_default_batch_recompiles_until_dynamo_gives_up(packs):
    model = enable_packing(tiny_model("llama", "sdpa", torch.float32)).eval()
    fast = compiled(model, GraphCount())
    with torch.no_grad(), pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        for batch in batches(packs, PackedCollator(MAX_LEN)):
            fast(**batch)


# --- training ---------------------------------------------------------------------------------------


def test_a_compiled_training_step_equals_the_uncompiled_one_over_fifty_steps(packs):
    eager = enable_packing(tiny_model("llama", "sdpa", torch.float32)).train()
    fast = enable_packing(tiny_model("llama", "sdpa", torch.float32)).train()  # the same seeded weights
    graphs = GraphCount()
    model = compiled(fast, graphs)
    step = torch.compile(
        lambda batch, weights, total: weighted_loss(model(**batch).logits, batch, weights, total),
        backend=graphs.backend, fullgraph=True, dynamic=False,
    )
    fixed = batches(packs, FIXED)
    want_losses, want_gradients = train(eager, fixed)
    got_losses, got_gradients = train(fast, fixed, step_loss=step)
    assert graphs.forward == 1 and graphs.backward == 1
    loss_difference = max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses))
    gradient_difference = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got_gradients, want_gradients))
    print(f"compiled step against eager over {STEPS} steps: losses {loss_difference:.1e}, last gradients {gradient_difference:.1e} (relative)")
    assert np.allclose(got_losses, want_losses, rtol=1e-5, atol=0)
    for got, want in zip(got_gradients, want_gradients):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)


def test_hf_trainer_with_torch_compile_traces_one_graph(packs, tmp_path):
    from transformers import Trainer, TrainingArguments

    model = enable_packing(tiny_model("llama", "sdpa", torch.float32)).train()
    arguments = TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, torch_compile=True,
        torch_compile_backend="aot_eager", dataloader_drop_last=True, remove_unused_columns=False,
        report_to=[], use_cpu=True, save_strategy="no", logging_steps=10, learning_rate=1e-3,
    )
    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(model=model, args=arguments, train_dataset=packs, data_collator=FIXED)
    trainer.train()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert trainer.state.global_step == STEPS
