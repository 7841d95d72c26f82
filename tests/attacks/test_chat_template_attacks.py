"""Hostile chat templates in a `--chat` build: a template that raises a plain Python error, or runs without
end, or builds a string of gigabytes, is refused as an InputError naming the conversation (file, row,
column) and the template's file, in one process, in worker processes and from the command line (exit 2,
no traceback); within the render limits of `prepack.sources.chat_templates`, never a truncation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from prepack import build
from prepack.errors import InputError
from prepack.sources import chat_templates
from prepack.sources.corpus import find_corpus
from prepack.sources.tokenize import load_tokenizer, tokenize_corpus
from tests.cli import WIDE, failure, run_prepack

WORDS = {"[UNK]": 0, "<eos>": 1, "user": 2, "assistant": 3, "hi": 4, "yo": 5}
CHAT = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
# Row 1 holds the only conversation of more than one message: a template failing on it names row 1.
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    [{"role": "user", "content": "yo"}],
]


def tokenizer_directory(path: Path, chat_template: str | bytes | None = None) -> Path:
    """A word-level tokenizer directory whose `chat_template.jinja` holds `chat_template` (text or raw bytes)."""
    path.mkdir()
    tokenizer = Tokenizer(models.WordLevel(WORDS, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    if chat_template is not None:
        data = chat_template.encode() if isinstance(chat_template, str) else chat_template
        (path / "chat_template.jinja").write_bytes(data)
    return path


def chats(path: Path) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return path


def tokenized(tmp_path: Path, template: str, num_proc: int = 1) -> list:
    tokenizer = load_tokenizer(tokenizer_directory(tmp_path / "tok", template))
    _, _, batches = tokenize_corpus(find_corpus(chats(tmp_path / "chats.jsonl")), tokenizer, mode="chat", num_proc=num_proc)
    return list(batches)


def on_row_1(body: str) -> str:
    return "{% if messages|length > 1 %}" + body + "{% endif %}" + CHAT


# case: (what the template does on row 1, what the message says of it)
FAILING = {
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    "division by zero": ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    "integer too long to print": ("{{ 10 ** 5000 }}", "ValueError: Exceeds the limit (4300 digits)"),
    "range beyond the sandbox's": ("{% for i in range(10 ** 6) %}{% endfor %}", "OverflowError: Range too big"),
}
# case: (what the template does on row 1, what the message says of it): past a limit of chat_templates
PAST_LIMITS = {
    "10 GB by repetition": ("{{ 'x' * 10 ** 10 }}", "10,000,000,000 characters"),
    "10 GB by doubling": (
        "{% set ns = namespace(s='x' * 10 ** 6) %}{% for i in range(14) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "128,000,000 characters",
    ),
    "10 GB by doubling with +": (
        "{% set ns = namespace(s='x' * 10 ** 6) %}{% for i in range(14) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "128,000,000 characters",
    ),
    "10 GB kept in a macro": (
        "{% macro m() %}{% for i in range(30000) %}{{ 'y' * 3000 }}{% endfor %}{% endmacro %}{% set s = m() %}",
        "wrote more than 67,108,864 characters",
    ),
    "10 GB by a width": ("{{ 'x'|center(10 ** 10) }}", "10,000,000,000"),
    "10 GB by a format width": ("{{ '%9999999999s' % '' }}", "9,999,999,999"),
    "10 GB by a format filter's width": ("{{ '%9999999999s'|format('') }}", "9,999,999,999"),
    "10 GB by str.format's width": ("{{ '{:>9999999999}'.format('') }}", "9,999,999,999"),
    "10 GB by a width given to format": ("{{ '%*s' % (9999999999, '') }}", "9,999,999,999"),
    "huge power": ("{{ 7 ** (10 ** 9) }}", "an integer of more than 65,536 bits"),
    "output": ("{% for i in range(30000) %}{{ 'y' * 3000 }}{% endfor %}", "wrote more than 67,108,864 characters"),
}


@pytest.mark.parametrize("case", [*FAILING, *PAST_LIMITS])
def test_a_failing_template_is_an_input_error_naming_the_row_and_the_template(tmp_path, case):
    body, says = {**FAILING, **PAST_LIMITS}[case]
    with pytest.raises(InputError) as error:
        tokenized(tmp_path, on_row_1(body))
    message = str(error.value)
    assert "chats.jsonl, row 1, column 'messages'" in message, message
    assert f"{tmp_path / 'tok' / 'chat_template.jinja'}" in message, message
    assert says in message, message


def test_a_template_failing_on_a_preference_pair_names_its_row_column_and_file(tmp_path):
    failing = "{% for m in messages %}{% if m.content == 'boom' %}{{ 1/0 }}{% endif %}{% endfor %}" + CHAT
    tokenizer = tokenizer_directory(tmp_path / "tok", failing)
    pairs = [{"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": answer}],
              "rejected": [{"role": "assistant", "content": "hi"}]} for answer in ("yo", "boom")]
    corpus = tmp_path / "pairs.jsonl"
    corpus.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    with pytest.raises(InputError) as error:
        build(corpus, tmp_path / "out", max_len=64, tokenizer=tokenizer, chat=True, pairs=True, overflow="drop", num_proc=1)
    message = str(error.value)
    assert "pairs.jsonl, row 1, column 'chosen'" in message and "ZeroDivisionError" in message, message
    assert f"{tmp_path / 'tok' / 'chat_template.jinja'}" in message and not (tmp_path / "out").exists()


def test_a_template_that_runs_too_long_is_stopped_at_the_time_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_templates, "RENDER_SECONDS", 0.5)
    looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(InputError, match=r"chats\.jsonl, row 1, column 'messages': .* ran past 0\.5 s"):
        tokenized(tmp_path, on_row_1(looping))
    assert time.monotonic() - start < 5


def test_the_size_limit_grows_with_the_conversation(tmp_path, monkeypatch):
    """A fixed floor, or so many times the conversation's own characters: a long conversation renders."""
    monkeypatch.setattr(chat_templates, "RENDER_MAX_CHARS", 100)
    words = " ".join(["hi"] * 200)
    long = [{"role": "user", "content": words}]  # 603 characters: "user" and 599
    limit = chat_templates.RENDER_CHARS_PER_INPUT_CHAR * 603
    assert chat_templates.render_chat(CHAT, "t.jinja", "here", long, add_generation_prompt=False, special_tokens={}) == (
        f"user {words} ", []
    )
    doubled = "{% for m in messages %}" + "{{ m.content }}" * (chat_templates.RENDER_CHARS_PER_INPUT_CHAR + 1) + "{% endfor %}"
    with pytest.raises(InputError, match=rf"here: .*t\.jinja.* wrote more than {limit:,} characters"):
        chat_templates.render_chat(doubled, "t.jinja", "here", long, add_generation_prompt=False, special_tokens={})


def test_a_chat_template_that_is_not_utf8_is_named(tmp_path):
    with pytest.raises(InputError, match=r"tok/chat_template\.jinja: .*not UTF-8.*byte 0xff at offset 3"):
        load_tokenizer(tokenizer_directory(tmp_path / "tok", b"{{ \xff }}"))


@pytest.mark.slow  # worker processes, and the command in a subprocess
@pytest.mark.parametrize("case", ["recursive macro", "integer too long to print", "10 GB by repetition", "not UTF-8"])
def test_the_command_refuses_them_with_exit_2_and_no_traceback(tmp_path, case):
    template = b"\xff" + CHAT.encode() if case == "not UTF-8" else on_row_1({**FAILING, **PAST_LIMITS}[case][0])
    tokenizer = tokenizer_directory(tmp_path / "tok", template)
    corpus = chats(tmp_path / "chats.jsonl")
    message = failure(run_prepack("build", corpus, "--tokenizer", tokenizer, "--chat", "--max-len", "64",
                                  "--num-proc", "2", "--out", tmp_path / "out", env=WIDE))
    assert "chat_template.jinja" in message, message
    if case != "not UTF-8":
        assert "chats.jsonl, row 1, column 'messages'" in message, message
    assert not (tmp_path / "out").exists()
