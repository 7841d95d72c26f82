"""The `prepack` command's help, as a terminal 80 columns wide shows it, and what the command imports
before it does anything."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import typer.main

from prepack.cli import app
from tests.cli import run_prepack

COMMANDS = sorted(typer.main.get_command(app).commands)
HEAVY = ("torch", "pandas", "ray", "datasets", "transformers")


def _help(*command: str) -> str:
    result = run_prepack(*command, "--help", env={"COLUMNS": "80"}, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _params(command: str):
    return typer.main.get_command(app).commands[command].params


@pytest.mark.parametrize("command", COMMANDS)
def test_help_at_80_columns_shows_every_bracket_and_every_option_name_whole(command):
    text = _help(command)
    assert max(map(len, text.splitlines())) <= 80
    bracketed = [word for param in _params(command) for word in re.findall(r"\S*\[[^\]\s]*\]\S*", param.help or "")]
    for word in bracketed:  # e.g. "prepack-llm[s3])."
        assert word in text, f"{word!r} is not whole in the help of {command}:\n{text}"
    for param in _params(command):
        for name in [*param.opts, *param.secondary_opts]:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w…-])", text), f"{name} is cut in:\n{text}"
    assert "<bool>" not in text  # a flag takes no value
    assert not re.search(r"\w-\n", text), f"a word broken at its hyphen:\n{text}"


def test_the_help_names_the_extras_as_installed():
    texts = {command: _help(command) for command in ("build", "tokenize", "inspect", "verify")}
    for command in ("build", "tokenize", "inspect", "verify"):
        assert "(needs prepack-llm[s3])" in " ".join(texts[command].split()), command
    assert "(needs prepack-llm[plot])" in " ".join(texts["inspect"].split())
    assert "(needs prepack-llm[ray])" in " ".join(texts["build"].split())


def test_the_shard_size_default_is_the_librarys():
    from prepack.building.build import DEFAULT_SHARD_SIZE
    from prepack.cli import _DEFAULT_SHARD_SIZE, _byte_size

    assert _byte_size(_DEFAULT_SHARD_SIZE) == DEFAULT_SHARD_SIZE


def _imported_after(code: str) -> dict[str, bool]:
    probe = f"{code}\nimport sys; print(' '.join(str(name in sys.modules) for name in {HEAVY!r}))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return dict(zip(HEAVY, map(eval, result.stdout.split()[-len(HEAVY):])))


def test_help_and_import_prepack_import_nothing_heavy():
    help_ = "import sys; sys.argv = ['prepack', '--help']\nfrom prepack.cli import app\ntry: app()\nexcept SystemExit: pass"
    for code in (help_, "import prepack"):
        assert not any(_imported_after(code).values()), code
    light = "import prepack, sys; print(sorted({'numpy', 'pyarrow', 'numba', 'pydantic'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", light], capture_output=True, text=True).stdout.strip() == "[]"
    # Loaded on first use, `prepack.build` is the function, from the module that defines it.
    later = "import prepack; print(prepack.build.__module__, prepack.build_store.__name__)"
    assert subprocess.run([sys.executable, "-c", later], capture_output=True, text=True).stdout.split() == ["prepack.building.build", "build_store"]


@pytest.mark.slow
def test_a_local_build_and_an_index_build_import_nothing_heavy(tmp_path):
    from tests.corpus import corpus_table, write_corpus

    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3], [4, 5], list(range(9))]))
    code = f"""
import prepack
prepack.build({str(corpus)!r}, {str(tmp_path / 'full')!r}, max_len=16, progress=False)
prepack.build_store({str(corpus)!r}, {str(tmp_path / 'store')!r}, progress=False)
prepack.build({str(tmp_path / 'store')!r}, {str(tmp_path / 'index')!r}, max_len=16, index_only=True, progress=False)
"""
    assert _imported_after(code) == dict.fromkeys(HEAVY, False)
    assert run_prepack("verify", str(tmp_path / "index")).returncode == 0
