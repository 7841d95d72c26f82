"""Builds the export tests write out, made once per test session (per xdist worker): the demo's chat
conversations (labels on the assistant turns) as a full build and as an index build of their store, a mixture
(tests/corpus.py's) in full and as an index build, a preference-pair build and a text build tokenized with EOS."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import prepack
from tests.corpus import MIXTURE, mixture_sources, preference_pairs
from tests.demo_inputs import CHATML, as_chat, chitchat, gpt2_directory


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> dict[str, Path]:
    """name -> build directory: "chat" (full, labels, several shards), "chat-index" (the same packs from its
    store), "mixture" (three sources, one with labels, one a store), "mixture-index" (its sources' stores),
    "pairs" (a preference-pair build, whose packs carry pair_roles) and "text" (chitchat's texts, each
    document ending with GPT-2's EOS and holding no other)."""
    root = tmp_path_factory.mktemp("export-builds")
    tokenizer = gpt2_directory(root / "gpt2", CHATML)
    pq.write_table(pa.table({"messages": [as_chat(turns) for turns in chitchat()[:300]]}), root / "chat.parquet")
    chat = {"tokenizer": tokenizer, "chat": True, "num_proc": 1}
    prepack.build(root / "chat.parquet", root / "chat", max_len=512, shard_size=40_000, **chat)
    prepack.build_store(root / "chat.parquet", root / "chat-store", **chat)
    prepack.build(root / "chat-store", root / "chat-index", max_len=512, shard_size=2_000, index_only=True)
    mixture_sources(root)
    prepack.build_store(root / "web.parquet", root / "web-store")
    prepack.build_store(root / "code.jsonl", root / "code-store")
    (root / "mix.yaml").write_text(MIXTURE.format(tokens=20000, within="false"))
    prepack.build(root / "mix.yaml", root / "mixture", max_len=128)
    (root / "stores.yaml").write_text(MIXTURE.format(tokens=20000, within="false").replace("web.parquet", "web-store").replace("code.jsonl", "code-store"))
    prepack.build(root / "stores.yaml", root / "mixture-index", max_len=128, index_only=True)
    text = {"tokenizer": gpt2_directory(root / "gpt2-eos", None), "num_proc": 1}
    (root / "text.jsonl").write_text("".join(json.dumps({"text": "\n".join(turns)}) + "\n" for turns in chitchat()[:150]))
    prepack.build(root / "text.jsonl", root / "text", max_len=256, **text)
    (root / "pairs").mkdir()
    builds = {name: root / name for name in ("chat", "chat-index", "mixture", "mixture-index", "text")}
    return {**builds, "pairs": preference_pairs(root / "pairs")}
