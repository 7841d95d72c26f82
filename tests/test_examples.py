"""The training examples run as their docstrings say, on a tiny build, and print a finite final loss."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prepack import build
from tests.corpus import corpus_table, write_corpus

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("examples")
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 500, size=rng.integers(5, 120)).tolist() for _ in range(60)]
    labels = [[-100, *doc[1:]] for doc in documents]
    build(write_corpus(root / "corpus.parquet", corpus_table(documents, labels)), root / "packed", max_len=256)
    return root / "packed"


@pytest.mark.parametrize(
    "script", ["train_plain_loop.py", "train_accelerate.py", "train_hf_trainer.py", "train_trl_sft.py"]
)
def test_example_trains_and_prints_a_finite_loss(packed, script, tmp_path):
    # Offline and with a private cache: an example that tried to download anything fails here.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--data", str(packed), "--steps", "3"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = re.findall(r"^final loss (\S+)$", result.stdout, flags=re.MULTILINE)
    assert found, result.stdout[-2000:]
    assert math.isfinite(float(found[-1]))
