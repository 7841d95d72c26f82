"""The demo's real corpus and tokenizer, for tests: written by running examples/chitchat.py as a script
(`--inputs-only`), once per test process, never by importing it (examples/ is not a package).

    chitchat()                          # the 7,168 conversations, each as its turns
    chitchat_pairs()                    # examples/chitchat_pairs.py's preference pairs (TRL's format, messages)
    as_chat(turns)                      # turns as {role, content} messages, user first, as the demo does
    gpt2_directory(directory, CHATML)   # a copy of the demo's GPT-2 tokenizer, with a chat template or none
"""

from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "chitchat.py"
PAIRS_SCRIPT = SCRIPT.with_name("chitchat_pairs.py")


@lru_cache
def _inputs(script: Path = SCRIPT) -> Path:
    """The directory `script` (examples/chitchat.py or chitchat_pairs.py) wrote its corpus and gpt2/ into
    (deleted at exit)."""
    workdir = Path(tempfile.mkdtemp(prefix="prepack-demo-inputs-"))
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    result = subprocess.run(
        [sys.executable, str(script), "--workdir", str(workdir), "--inputs-only"],
        capture_output=True, text=True, timeout=300,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{script} --inputs-only failed:\n{result.stderr[-3000:]}")
    return workdir


def _demo_config() -> dict:
    return json.loads((_inputs() / "gpt2" / "tokenizer_config.json").read_text())


CHATML = _demo_config()["chat_template"]  # the demo tokenizer's template


@lru_cache
def chitchat() -> list[list[str]]:
    """The demo corpus's conversations in file order, each as the contents of its messages."""
    with open(_inputs() / "chitchat.jsonl", encoding="utf-8") as corpus:
        return [[message["content"] for message in json.loads(line)["messages"]] for line in corpus]


@lru_cache
def chitchat_pairs() -> tuple[dict, ...]:
    """examples/chitchat_pairs.py's preference pairs, in file order: {"prompt", "chosen", "rejected"},
    each a list of messages."""
    with open(_inputs(PAIRS_SCRIPT) / "pairs.jsonl", encoding="utf-8") as corpus:
        return tuple(json.loads(line) for line in corpus)


def as_chat(turns: list[str]) -> list[dict]:
    """Turns as messages, alternating user / assistant from the first."""
    return [{"role": ("user", "assistant")[i % 2], "content": turn} for i, turn in enumerate(turns)]


def gpt2_directory(directory: Path, chat_template: str | None = None) -> Path:
    """A copy of the demo's tokenizer directory at `directory` (which must not exist), its chat
    template replaced by `chat_template`, or removed when None."""
    shutil.copytree(_inputs() / "gpt2", directory)
    config = _demo_config()
    config.pop("chat_template")
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
