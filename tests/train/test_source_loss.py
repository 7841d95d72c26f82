"""A mixture's packs carry each document's source to the batch (`PackedCollator(source_ids=True)`),
and `source_losses` gives each source's loss from a packed batch; the example trains on a mixture and
logs it."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import prepack
from prepack import PackedCollator, PackedDataset
from prepack.errors import UsageError
from prepack.training.source_loss import source_losses
from tests.corpus import mixture_sources, write_mixture

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> PackedDataset:
    root = tmp_path_factory.mktemp("source-loss")
    mixture_sources(root)
    prepack.build(write_mixture(root, tokens=6000), root / "packed", max_len=256)
    return PackedDataset(root / "packed")


@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_the_collator_spreads_each_documents_source_over_its_tokens(mixture, layout):
    packs = [mixture[i] for i in range(3)]
    batch = PackedCollator.for_dataset(mixture, layout=layout, source_ids=True)(packs)
    sources = batch["source_ids"]
    assert sources.shape == batch["input_ids"].shape and sources.dtype == torch.int64
    expected = [np.repeat(p["source_ids"].astype(np.int64), np.diff(p["cu_seqlens"])) for p in packs]
    if layout == "padded":
        for row, want in enumerate(expected):
            assert sources[row, : len(want)].tolist() == want.tolist()
            assert (sources[row, len(want) :] == -1).all()  # padding
    else:
        assert sources[0].tolist() == np.concatenate(expected).tolist()
    assert "source_ids" not in PackedCollator.for_dataset(mixture)(packs)  # only when asked


def test_source_ids_needs_a_mixtures_packs(mixture):
    pack = {key: value for key, value in mixture[0].items() if key != "source_ids"}
    with pytest.raises(UsageError, match="source_ids=True collates the packs of a mixture build"):
        PackedCollator.for_dataset(mixture, source_ids=True)([pack])


def test_source_losses_are_each_sources_token_losses(mixture):
    """Against a loop over every pack's documents, from the packs' own cu_seqlens and source_ids."""
    packs = [mixture[i] for i in range(4)]
    batch = PackedCollator.for_dataset(mixture, source_ids=True)(packs)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(*batch["input_ids"].shape, 700, generator=generator, requires_grad=True)
    sums, counts = source_losses(logits, batch["labels"], batch["source_ids"], 3)
    want_sums, want_counts = [0.0] * 3, [0] * 3
    for row, pack in enumerate(packs):
        cu, labels = pack["cu_seqlens"], pack.get("labels", pack["input_ids"])
        for document, source in enumerate(pack["source_ids"]):
            for token in range(cu[document] + 1, cu[document + 1]):  # a document's first token is never trained
                if labels[token] != -100:
                    want_sums[source] += torch.nn.functional.cross_entropy(logits[row, token - 1], torch.tensor(int(labels[token]))).item()
                    want_counts[source] += 1
    assert counts.tolist() == want_counts and all(want_counts)
    assert sums.tolist() == pytest.approx(want_sums, rel=1e-9)
    # the model's own loss is the token-weighted mean of the sources' losses
    mean = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    assert sums.sum().item() / counts.sum().item() == pytest.approx(mean.item(), rel=1e-6)
    sums.sum().backward()  # the sums carry the logits' gradient
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_source_losses_refuse_a_source_out_of_range(mixture):
    batch = PackedCollator.for_dataset(mixture, source_ids=True)([mixture[0]])
    logits = torch.zeros(*batch["input_ids"].shape, 700)
    with pytest.raises(UsageError, match="outside 0..0"):
        source_losses(logits, batch["labels"], batch["source_ids"].clamp(min=0) + 1, 1)


@pytest.mark.slow
def test_the_example_logs_a_loss_per_source(mixture, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_mixture.py"), "--data", str(mixture.path), "--steps", "4", "--workers", "0"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = dict(re.findall(r"^source (\S+) loss (\S+) over \d+ tokens$", result.stdout, flags=re.MULTILINE))
    assert sorted(found) == ["code", "math", "web"], result.stdout[-2000:]
    assert all(math.isfinite(float(loss)) for loss in found.values())
    assert re.search(r"^final loss \S+$", result.stdout, flags=re.MULTILINE)
