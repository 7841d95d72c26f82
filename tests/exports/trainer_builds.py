"""What the trainer-format export tests (Megatron, OLMo-core) share besides the session's builds
(`conftest.builds`): which builds they export, a small labelled build, and Megatron-Bridge's reading of a loss
mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prepack import build
from tests.corpus import corpus_table, write_corpus

KINDS = ("chat", "chat-index", "mixture")  # of `builds`: labels on assistant turns, gathered from a store, a mixture
GPT2_EOS = 50256  # <|endoftext|>, which a text build appends to every document


def labelled_corpus_build(root: Path, labels_of) -> Path:
    """A build of 20 random documents whose labels are `labels_of(document)`."""
    rng = np.random.default_rng(3)
    ids = [rng.integers(1, 500, int(n)).tolist() for n in rng.integers(2, 30, 20)]
    write_corpus(root / "corpus.parquet", corpus_table(ids, [labels_of(doc) for doc in ids]))
    build(root / "corpus.parquet", root / "packed", max_len=64)
    return root / "packed"


def targets_from_next_token_mask(ids: np.ndarray, cu_seqlens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The labels (prepack's terms: -100 where no loss is taken) a next-token loss mask gives, read as
    Megatron-Bridge's packed collate reads it: within document [s, e) position t predicts ids[t + 1] when
    mask[t], for t in [s, e - 1); nothing predicts a document's first token."""
    targets = np.full(len(ids), -100, np.int64)
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        targets[s + 1 : e] = np.where(np.asarray(mask[s : e - 1]) != 0, ids[s + 1 : e], -100)
    return targets


def files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}
