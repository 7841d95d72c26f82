"""Real builds the trainer-format export tests (Megatron, OLMo-core) write out, each built once per test
process: a chitchat chat build with assistant labels, an index build over a labelled document store, and
a mixture (one source with labels, one without, one a store). Also: what prepack trains on in each pack,
from `PackedDataset` and `PackedCollator`."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from prepack import build, build_store
from prepack.training.collate import PackedCollator
from prepack.training.dataset import PackedDataset
from tests.corpus import corpus_table, mixture_sources, write_corpus, write_mixture
from tests.demo_inputs import CHATML, as_chat, chitchat, gpt2_directory

KINDS = ("chat", "index", "mixture")
GPT2_EOS = 50256  # <|endoftext|>, which a text build appends to every document


@lru_cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="prepack-trainer-exports-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@lru_cache
def real_build(kind: str) -> Path:
    """The build of `kind` (one of KINDS, or "text": chitchat texts tokenized with EOS), made on first use."""
    root = _root() / kind
    root.mkdir()
    if kind == "chat":  # conversations longer than 256 tokens are split into pieces
        tokenizer = gpt2_directory(root / "gpt2-chat", CHATML)
        corpus = root / "chat.jsonl"
        corpus.write_text("".join(json.dumps({"messages": as_chat(turns)}) + "\n" for turns in chitchat()[:200]))
        build(corpus, root / "packed", max_len=256, tokenizer=tokenizer, chat=True, num_proc=1)
    elif kind == "text":
        tokenizer = gpt2_directory(root / "gpt2", None)
        corpus = root / "text.jsonl"
        corpus.write_text("".join(json.dumps({"text": "\n".join(turns)}) + "\n" for turns in chitchat()[:150]))
        build(corpus, root / "packed", max_len=256, tokenizer=tokenizer, num_proc=1)
    elif kind == "index":
        rng = np.random.default_rng(5)
        ids = [rng.integers(1, 1000, int(n)).tolist() for n in rng.integers(1, 41, 150)]
        labels = [[-100 if rng.random() < 0.3 else t for t in doc] for doc in ids]
        write_corpus(root / "corpus.parquet", corpus_table(ids, labels))
        build_store(root / "corpus.parquet", root / "store", shard_size=512)
        build(root / "store", root / "packed", max_len=32, index_only=True, shard_size=256)
    else:
        mixture_sources(root)
        build(write_mixture(root), root / "packed", max_len=128)
    return root / "packed"


def labelled_corpus_build(root: Path, labels_of) -> Path:
    """A build of 20 random documents whose labels are `labels_of(document)`."""
    rng = np.random.default_rng(3)
    ids = [rng.integers(1, 500, int(n)).tolist() for n in rng.integers(2, 30, 20)]
    write_corpus(root / "corpus.parquet", corpus_table(ids, [labels_of(doc) for doc in ids]))
    build(root / "corpus.parquet", root / "packed", max_len=64)
    return root / "packed"


class Expected:
    """Pack p of a build as prepack trains on it: `ids(p)`, `cu_seqlens(p)`, `targets(p)` (the collator's
    labels: -100 where no loss is taken, at each document's first token too) and `source_ids(p)`."""

    def __init__(self, directory: Path):
        self.rows = PackedDataset(directory)
        self.manifest = self.rows.manifest
        self.collate = PackedCollator(self.manifest.options.max_len, source_ids=self.manifest.mixture is not None)

    def __len__(self) -> int:
        return len(self.rows)

    def ids(self, p: int) -> np.ndarray:
        return self.rows[p]["input_ids"]

    def cu_seqlens(self, p: int) -> np.ndarray:
        return self.rows[p]["cu_seqlens"]

    def source_ids(self, p: int) -> np.ndarray:
        return self.rows[p]["source_ids"]

    def targets(self, p: int) -> np.ndarray:
        row = self.rows[p]
        return self.collate([row])["labels"][0, : len(row["input_ids"])].numpy()


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
