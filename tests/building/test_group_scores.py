"""Groups with per-completion scores or ranks (`prepack build --groups --scores-column S --ranks-column R`): each
value is validated as read (file, row, column), stored beside its completion document, checked by every reader and
by `verify`, and handed to the loss by `PackedCollator` as `group_scores` / `group_ranks` [N, G], in the rows of
`group_logps`, in every layout. Also two leftovers of the group build's review: `inspect`'s wording of a G = 2
group build, and `open_shard(pairs=True)`.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

import prepack
from prepack.errors import ArgumentTypeError
from prepack.formats.shards import open_shard, read_manifest
from tests.building.test_groups_build import text_groups
from tests.building.test_pairs import gpt2, write_jsonl  # noqa: F401 (fixtures)


def rendered(build: Path) -> str:
    from prepack.check.report import inspect_build, render

    console = Console(file=io.StringIO(), width=1000)
    console.print(render(inspect_build(build)))
    return console.file.getvalue()


def test_a_group_build_of_two_is_worded_as_pairs_are(tmp_path, gpt2):  # noqa: F811
    """A --groups build of G = 2 holds pairs (`unit_name(2)`): inspect compares it with TRL's DPOTrainer as a
    --pairs build, never as "padded" groups."""
    rows = [{"prompt": r["prompt"], "completions": r["completions"][:2]} for r in text_groups(8)]
    corpus = write_jsonl(tmp_path / "two.jsonl", rows)
    prepack.build(corpus, tmp_path / "out", max_len=256, tokenizer=gpt2, groups=True, overflow="drop", num_proc=1)
    assert read_manifest(tmp_path / "out").options.pairs.group_size == 2
    text = rendered(tmp_path / "out")
    assert "TRL DPOTrainer, random batches of 8 pairs" in text and "padded, random batches" not in text


def test_open_shard_refuses_a_bool_group_size(tmp_path, gpt2):  # noqa: F811
    """`pairs` is the group size: True == 1 would pass an int check and be read as G = 1."""
    corpus = write_jsonl(tmp_path / "g.jsonl", text_groups(4))
    manifest = prepack.build(corpus, tmp_path / "out", max_len=256, tokenizer=gpt2, groups=True, overflow="drop", num_proc=1)
    path = tmp_path / "out" / manifest.shards[0].name
    for size in (True, 1, 2.0):
        with pytest.raises(ArgumentTypeError, match=rf"pairs must be a group size, an int of at least 2, not {size!r}"):
            open_shard(path, True, 256, pairs=size)
    assert open_shard(path, True, 256, pairs=4).num_rows == manifest.shards[0].rows
