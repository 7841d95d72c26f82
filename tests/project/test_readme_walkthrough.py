"""README.md's walk-through runs as written: its ```bash walkthrough``` and ```python walkthrough``` blocks,
in README order, each command in a shell (the Python blocks as scripts), in one fresh directory that
holds the checkout's examples/, with this venv's `python` and `prepack` first on PATH. Every command
must exit 0, and what they leave must be right: the demo's build of every conversation (chat, assistant turns
trained), a clean verify, and an index build whose rows, as the README's Python loads them, are those of a full build
of the same store."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prepack import build, read_manifest
from tests.corpus import read_build

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```(bash|python) walkthrough\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def walkthrough_steps(readme: str) -> list[tuple[str, str]]:
    """("bash", one command) per command line and ("python", the whole block) per Python block."""
    steps = []
    for language, body in BLOCK.findall(readme):
        if language == "python":
            steps.append(("python", body))
        else:
            steps += [("bash", line) for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return steps


def test_the_walkthrough_blocks_are_found():
    """The markers are in place: the test below runs the demo, inspect, verify --source, tokenize, an
    index build and a load, not an empty list."""
    steps = walkthrough_steps((ROOT / "README.md").read_text(encoding="utf-8"))
    commands = " | ".join(text for _, text in steps)
    for expected in ("examples/chitchat.py", "prepack inspect", "prepack verify", "--source", "prepack tokenize",
                     "--index-only", "PackedDataset("):
        assert expected in commands, commands
    assert steps[-1][0] == "python"


@pytest.mark.slow
def test_the_readme_walkthrough_runs_as_written(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    outputs = []
    for language, text in walkthrough_steps((ROOT / "README.md").read_text(encoding="utf-8")):
        command = ["bash", "-c", text] if language == "bash" else [sys.executable, "-c", text]
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"{text}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        outputs.append((text, result.stdout))

    demo = read_manifest(tmp_path / "packed")
    assert demo.totals.documents == 7168 and demo.options.max_len == 2048 and demo.has_labels
    # The README's first command (examples/chitchat.py): every conversation as chat, assistant turns trained.
    manifest, packs = read_build(tmp_path / "packed")
    assert manifest["options"]["tokenize"]["mode"] == "chat"
    assert sum(len(p["input_ids"]) for p in packs) == manifest["totals"]["tokens"]
    trained = sum(label != -100 for p in packs for label in p["labels"])
    assert 0 < trained < manifest["totals"]["tokens"]  # assistant turns only
    assert "packed into" in next(out for text, out in outputs if text.startswith("python examples/chitchat.py"))
    verified = [out for text, out in outputs if text.startswith("prepack verify")]
    assert verified and all(": no problems (" in out for out in verified)

    # The README's Python printed the index build's packs as loaded; they must be the full build's.
    full = build(tmp_path / "chitchat-store", tmp_path / "full-4k", max_len=4096)
    index = read_manifest(tmp_path / "index-4k")
    assert index.store is not None and index.totals.packs == full.totals.packs
    from prepack import PackedDataset

    loaded, expected = PackedDataset(tmp_path / "index-4k"), PackedDataset(tmp_path / "full-4k")
    assert len(loaded) == len(expected) == full.totals.packs
    for i in range(len(expected)):
        got, want = loaded[i], expected[i]
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want), f"pack {i}"
    first = expected[0]
    printed = (f"{full.totals.packs:,} packs; the first holds {len(first['cu_seqlens']) - 1} documents, "
               f"{len(first['input_ids']):,} tokens")
    assert outputs[-1][1].strip() == printed
