"""KTO from a packed unpaired build (`prepack build --unpaired`): the build's packs, collated (`desirable` from its
shards), give in float64 on a tiny random Llama the loss and every gradient of TRL 1.16's
`KTOTrainer._compute_loss` on its own collated batch (`DataCollatorForUnpairedPreference`) of the same examples,
tokenized by TRL's rule (`unpaired_examples`), labelled from the corpus rows and paired with the KL completions
of the build's plan (`kl_partners(N, seed=kl_seed)`, as TRL's `KL_completion_ids`). A KL completion that sees
another example's prompt moves the loss. Reference log-probabilities stored by `write_reference_logps` for an
unpaired build are each completion's and KL completion's, run alone.

The tiny model has 128 token ids: every token id of the build is taken modulo 128 on both sides, as
tests/train/test_preference.py does.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.models.llama import modeling_llama

import prepack
from prepack import PackedDataset
from prepack.building.kl_plan import kl_partners
from prepack.model.packing import enable_packing
from prepack.sources.corpus import find_corpus
from prepack.sources.pairs import unpaired_examples
from prepack.sources.tokenize import load_tokenizer
from prepack.training.collate import PackedCollator
from prepack.training.preference import group_logps, kto_loss, model_inputs
from tests.building.test_unpaired import text_rows
from tests.demo_inputs import gpt2_directory
from tests.train.test_kto import BETA, trl_kto_loss
from tests.train.test_preference import VOCAB, _Float64Head, gradients, small, tiny_llama
from tests.train.test_shared_prompt import _rms_norm_in_its_dtype

EXAMPLES, KL_SEED, MAX_LEN = 12, 3, 128
REFERENCE_SEED = 4  # a reference under which the policy's KL estimate is positive, not clamped to 0 (asserted)


@pytest.fixture(scope="module")
def unpaired(tmp_path_factory) -> SimpleNamespace:
    """The build, its corpus rows, and the examples as TRL tokenizes them."""
    root = tmp_path_factory.mktemp("kto-build")
    rows = text_rows(EXAMPLES)
    (root / "kto.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = gpt2_directory(root / "gpt2")
    prepack.build(root / "kto.jsonl", root / "packed", max_len=MAX_LEN, tokenizer=tokenizer, unpaired=True,
                  kl_seed=KL_SEED, overflow="drop", num_proc=1)
    examples = unpaired_examples(find_corpus(root / "kto.jsonl"), load_tokenizer(tokenizer), chat=False)
    return SimpleNamespace(build=root / "packed", rows=rows, examples=examples)


def small_pack(pack: dict) -> dict:
    return {**pack, "input_ids": small(pack["input_ids"]).numpy(), "labels": small(pack["labels"]).numpy()}


def packs_of(build: Path, reference: Path | None = None) -> list[dict]:
    dataset = PackedDataset(build, reference=reference)
    return [small_pack(dataset[i]) for i in range(len(dataset))]


def example_order(packs: list[dict], examples) -> list[int]:
    """The corpus example of each pair of the packs, in order, found by its completion document's tokens."""
    index = {tuple(small(p + c).tolist()): i for i, (p, c) in enumerate(zip(examples.prompts, examples.completions))}
    order = []
    for pack in packs:
        cu = pack["cu_seqlens"]
        order += [index[tuple(pack["input_ids"][cu[j] : cu[j + 1]].tolist())] for j in range(0, len(cu) - 1, 2)]
    return order


def trl_rows(unpaired, order: list[int]) -> list[dict]:
    """TRL's examples in `order`: its prompt and completion ids, its label from the corpus row, and its KL
    completion the planned partner's completion (`KL_completion_ids`)."""
    e, partners = unpaired.examples, kl_partners(EXAMPLES, seed=KL_SEED)
    return [{"prompt_ids": small(e.prompts[i]).tolist(), "completion_ids": small(e.completions[i]).tolist(),
             "KL_completion_ids": small(e.completions[int(partners[i])]).tolist(), "label": unpaired.rows[i]["label"]}
            for i in order]


def kl_leak(pack: dict) -> dict:
    """The pack with each KL completion after the next pair's prompt (of the same pack) instead of its own."""
    cu, ids, labels = pack["cu_seqlens"], pack["input_ids"], pack["labels"]
    documents = [(ids[cu[j] : cu[j + 1]], labels[cu[j] : cu[j + 1]]) for j in range(len(cu) - 1)]
    prompts = [d[0][d[1] == -100] for d in documents[::2]]
    moved = []
    for j, (doc_ids, doc_labels) in enumerate(documents):
        if j % 2:
            completion = doc_ids[doc_labels != -100]
            prompt = prompts[(j // 2 + 1) % len(prompts)]
            doc_ids, doc_labels = np.concatenate([prompt, completion]), np.concatenate([np.full(len(prompt), -100), completion])
        moved.append((doc_ids, doc_labels))
    lengths = [len(d[0]) for d in moved]
    return {**pack, "input_ids": np.concatenate([d[0] for d in moved]), "labels": np.concatenate([d[1] for d in moved]),
            "cu_seqlens": np.cumsum([0, *lengths]).astype(np.int32)}


LAYOUTS = [{"layout": "padded"}, {"layout": "padding_free"}, {"shared_prompt": True}]


@pytest.mark.slow  # float64 forwards and backwards per layout: ~3 s
@pytest.mark.parametrize("options", LAYOUTS, ids=str)
def test_a_packed_kto_builds_loss_and_gradients_equal_trls_kto_trainer(unpaired, options, monkeypatch):
    pytest.importorskip("trl.trainer.kto_trainer")
    # A prompt shared by two completions sums its gradient before LlamaRMSNorm's float32 rounding, TRL's two
    # sequences after it: the norm in its own dtype keeps both float64 (tests/train/test_shared_prompt.py).
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_its_dtype)
    packs = packs_of(unpaired.build)
    assert len(packs) > 1  # several packs, so the batch's order is the build's, not the corpus's
    order = example_order(packs, unpaired.examples)
    assert sorted(order) == list(range(EXAMPLES)) and order != sorted(order)
    collate = PackedCollator(MAX_LEN * len(packs) if options.get("layout") == "padding_free" else MAX_LEN, **options)
    batch = collate(packs)
    assert batch["desirable"].tolist() == [unpaired.rows[i]["label"] for i in order]
    assert "desirable" not in model_inputs(batch)  # a label, not a model input
    with torch.no_grad():
        reference = group_logps(enable_packing(tiny_llama(REFERENCE_SEED))(**model_inputs(batch)).logits, batch)
    model = enable_packing(tiny_llama(0))
    policy = group_logps(model(**model_inputs(batch)).logits, batch)
    assert (policy.logps[:, 1] - reference.logps[:, 1]).mean() > 0.01  # the KL term is not clamped away
    ours = kto_loss(policy, reference, batch["desirable"], BETA).mean()
    ours.backward()
    head = _Float64Head(tiny_llama(0))
    rows = trl_rows(unpaired, order)
    theirs = trl_kto_loss(head, rows, reference)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    expected = gradients(head.model)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)
    # The leak control: each KL completion after another example's prompt, the reference unchanged.
    with torch.no_grad():
        leaky = PackedCollator(MAX_LEN * len(packs), layout="padding_free")([kl_leak(p) for p in packs])
        leaked = kto_loss(group_logps(model(**model_inputs(leaky)).logits, leaky), reference, leaky["desirable"], BETA).mean()
        assert (leaked - theirs).abs() > 1e-6


@pytest.mark.slow  # the reference model run over a 50k-token vocabulary: ~3 s
def test_stored_reference_logps_of_an_unpaired_build_are_each_sequence_run_alone(unpaired, tmp_path):
    from prepack.training.reference import write_reference_logps

    full_vocab = 50_259  # the demo tokenizer's ids, whole: the writer reads the build's labels as they are
    reference = enable_packing(tiny_llama(1, full_vocab)).eval()
    write_reference_logps(unpaired.build, reference, tmp_path / "values", batch_size=1)
    dataset = PackedDataset(unpaired.build, reference=tmp_path / "values")
    batch = PackedCollator.for_dataset(dataset)([dataset[i] for i in range(len(dataset))])
    order = example_order([small_pack(dataset[i]) for i in range(len(dataset))], unpaired.examples)
    partners = kl_partners(EXAMPLES, seed=KL_SEED)
    e = unpaired.examples
    alone = []
    with torch.no_grad():
        for i in order:
            for completion in (e.completions[i], e.completions[int(partners[i])]):
                ids = torch.tensor([e.prompts[i] + completion])
                logp = torch.log_softmax(reference(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
                alone.append(logp[len(e.prompts[i]) - 1 :].sum())
    torch.testing.assert_close(batch["reference_logps"], torch.stack(alone).reshape(-1, 2), rtol=1e-12, atol=1e-10)
