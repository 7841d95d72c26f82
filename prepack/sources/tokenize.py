"""Tokenize a text or chat corpus with a local Hugging Face tokenizer: streamed, parallel, checked.

    tokenizer = load_tokenizer("./my-tokenizer")             # a directory, or a tokenizer.json
    options, has_labels, batches = tokenize_corpus(find_corpus("chats.parquet"), tokenizer, mode="chat")

The batches are `DocumentBatch`es, in row order, as `read_documents` yields them for a tokenized corpus.

- Only `tokenizers` and `jinja2` are used, never `transformers`: nothing can be downloaded and no
  repository code runs. A directory needs a `tokenizer.json`, or GPT-2's `vocab.json` and `merges.txt`
  (built into the tokenizer transformers' GPT2Tokenizer builds; anything else without a tokenizer.json,
  a SentencePiece `tokenizer.model` included, is refused with the command that writes one);
  `tokenizer_config.json`, `special_tokens_map.json` and `chat_template.jinja` are read when present.
- Text: each document is `tokenizer.encode(text)` (so BOS is whatever the tokenizer's post-processor
  adds), then EOS, unless the post-processor already ends every encoding with it.
- Chat: the conversation is rendered with the chat template the way transformers renders it (same
  sandboxed jinja environment and variables), within the time and size limits of
  `prepack.sources.chat_templates`, then encoded without special tokens, since templates
  write their own. A token keeps its label when its characters overlap an assistant turn; the rest
  get -100. An assistant turn is what the template marks with `{% generation %}` (the transformers and
  TRL convention) or, for templates without that tag, the text that rendering the conversation up to
  and including that message adds to the generation prompt rendered before it. Both include the
  template's end-of-turn tokens, so the model learns to stop.
- Parallel: text is encoded in batches by tokenizers' own Rust threads (`num_proc` of them), which
  release the GIL; on the benchmark machine that beat one process per core by 1.1-1.5x. Chat
  templates are Python and hold the GIL, so chat uses `num_proc` processes (`spawn`, safe beside
  threads), one core each. The main process reads record batches and keeps a bounded number of
  chunks in flight, so memory stays flat whatever the corpus size.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa
from rich.progress import Progress

from prepack.errors import EngineError, InputError, optional_imports
from prepack.formats.shards import IGNORE_INDEX, TokenizeOptions, TokenizerInfo
from prepack.sources.corpus import (
    Corpus,
    DocumentBatch,
    file_columns,
    file_kind,
    json_object_blocks,
    missing_column_fix,
    parse_json,
    record_batches,
)
from prepack.sources.chat_templates import check_template, render_chat
from prepack.sources.tokenizer_workers import encoded_by_workers

with optional_imports("tokenizing (--tokenizer)"):
    from tokenizers import AddedToken, ByteLevelBPETokenizer, Encoding, Tokenizer

__all__ = [
    "LocalTokenizer",
    "checked_messages",
    "encoded_in_order",
    "eos_to_append",
    "load_tokenizer",
    "resolve_chat_template",
    "tokenize_corpus",
    "type_name",
    "usable_cores",
]

# The files of a tokenizer directory that prepack reads, and hashes into the tokenizer's identity.
_TOKENIZER_FILES = ("chat_template.jinja", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")
# A directory without tokenizer.json: GPT-2's BPE files, and what transformers saves beside them.
_GPT2_FILES = ("added_tokens.json", "chat_template.jinja", "merges.txt", "special_tokens_map.json", "tokenizer_config.json", "vocab.json")
_GPT2_CLASSES = (None, "GPT2Tokenizer", "GPT2TokenizerFast")
_ROLES = ("assistant", "developer", "system", "tool", "user")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_CHUNK_BYTES = 1 << 20  # input per thread or process and task: amortizes the hand-over, still balances
_JSON_BLOCK_BYTES = 16 << 20  # JSON Lines parsed per block, before the block is cut into chunks


@dataclass(frozen=True)
class LocalTokenizer:
    """A tokenizer read from local files, with what text and chat tokenization need from its config."""

    tokenizer: Tokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, …: the strings chat templates see
    chat_template: str | None
    info: TokenizerInfo  # name and sha256, recorded in the manifest
    chat_template_file: str | None = None  # the file the chat template was read from, named in errors

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def _read_json(path: Path, contents: bytes) -> dict:
    try:
        data = parse_json(contents.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{path}: cannot be read as JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object.")
    return data


def _special_tokens(config: dict) -> dict[str, str]:
    """`*_token` entries, written as a string or as a serialized AddedToken {"content": …}: the top-level keys, then
    those of an `extra_special_tokens` mapping over them, as transformers' tokenizer takes its named tokens."""
    tokens = {}
    extra = config.get("extra_special_tokens")
    for source in (config, extra if isinstance(extra, dict) else {}):
        for key, value in source.items():
            if isinstance(value, dict):
                value = value.get("content")
            if key.endswith("_token") and isinstance(value, str):
                tokens[key] = value
    return tokens


def _config_template(config: dict, path: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # older format: named templates, the "default" one is the chat template
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise InputError(f"{path}: named chat templates ({', '.join(map(str, named))}) but no 'default'.")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise InputError(f"{path}: 'chat_template' must be a string.")
    return template


def load_tokenizer(path: str | os.PathLike) -> LocalTokenizer:
    """Read a tokenizer directory or a single `tokenizer.json` file.

    A directory holds a `tokenizer.json`, or GPT-2's `vocab.json` and `merges.txt`, built here into the
    tokenizer transformers' GPT2Tokenizer builds from them (`_gpt2_bpe`). Its identity is the
    directory's or file's name and a sha256 over the files read, in name order (each as name, NUL, byte
    length, NUL, bytes): the two kinds of directory read different files. A bare file has no config: no
    EOS, no template.
    """
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            names = _TOKENIZER_FILES
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            names = _GPT2_FILES
        elif (path / "tokenizer.model").is_file():
            raise InputError(
                f"{path}: a SentencePiece tokenizer (tokenizer.model) without a tokenizer.json. prepack reads fast "
                "tokenizers only and does not convert this one itself (how depends on its tokenizer class, and on "
                f"the versions of transformers and sentencepiece); write its tokenizer.json once with "
                f"{_conversion(path)} (needs transformers and sentencepiece), then pass --tokenizer {path}-fast."
            )
        else:
            raise InputError(
                f"{path}: no tokenizer.json (nor GPT-2's vocab.json and merges.txt) in this tokenizer directory; "
                "prepack reads fast tokenizers only (save one with transformers' "
                "AutoTokenizer.from_pretrained(...).save_pretrained(dir))."
            )
        files = {name: path / name for name in names if (path / name).is_file()}
    elif path.is_file():
        files = {"tokenizer.json": path}
    else:
        raise InputError(f"{path}: no such tokenizer directory or tokenizer.json file.")
    digest, contents = hashlib.sha256(), {}
    for name, file in sorted(files.items()):
        try:
            contents[name] = data = file.read_bytes()
        except OSError as exc:
            raise InputError(f"{file}: cannot be read ({exc}).") from None
        digest.update(f"{file.name}\0{len(data)}\0".encode())
        digest.update(data)
    config, template_file = {}, None
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        if name in files:
            settings = _read_json(files[name], contents[name])
            config |= settings
            template_file = files[name] if "chat_template" in settings else template_file
    if "tokenizer.json" in files:
        try:
            tokenizer = Tokenizer.from_file(str(files["tokenizer.json"]))
        except Exception as exc:  # tokenizers raises a bare Exception for any file it cannot parse
            raise InputError(f"{files['tokenizer.json']}: not a readable tokenizer.json ({exc}).") from None
    else:
        tokenizer = _gpt2_bpe(path, files, contents, config)
    template = _config_template(config, template_file or path)
    if "chat_template.jinja" in files:  # transformers saves templates there and prefers it
        template_file = files["chat_template.jinja"]
        try:
            template = contents["chat_template.jinja"].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(
                f"{template_file}: the chat template is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                f"{exc.start})."
            ) from None
    return LocalTokenizer(
        tokenizer=tokenizer,
        special_tokens=_special_tokens(config),
        chat_template=template,
        info=TokenizerInfo(name=path.name, sha256=digest.hexdigest()),
        chat_template_file=None if template is None else str(template_file),
    )


def _conversion(path: Path) -> str:
    """The command that writes a tokenizer directory's tokenizer.json, into a copy beside it."""
    return (
        f"python -c \"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('{path}')"
        f".save_pretrained('{path}-fast')\""
    )


def _gpt2_bpe(path: Path, files: dict[str, Path], contents: dict[str, bytes], config: dict) -> Tokenizer:
    """GPT-2's byte-level BPE from `vocab.json` and `merges.txt`, built as transformers' GPT2Tokenizer builds
    it: byte-level pre-tokenizer and decoder (`add_prefix_space` as configured), the tokens of
    tokenizer_config.json's `added_tokens_decoder` at their ids, the named special tokens unsplit. Only
    what it builds exactly so; a directory that needs more (another tokenizer class, a BOS or EOS the
    tokenizer adds, added tokens elsewhere) is refused with the command that writes its tokenizer.json."""

    def refused(why: str) -> InputError:
        return InputError(
            f"{path}: {why}; prepack builds a tokenizer from vocab.json and merges.txt only for GPT-2's own "
            f"BPE. Write its tokenizer.json once with {_conversion(path)}, then pass --tokenizer {path}-fast."
        )

    kind = config.get("tokenizer_class")
    if kind not in _GPT2_CLASSES:
        raise refused(f"vocab.json and merges.txt of a {kind}, not a GPT2Tokenizer")
    for option in ("add_bos_token", "add_eos_token"):
        if config.get(option):
            raise refused(f"tokenizer_config.json sets {option}")
    added = config.get("added_tokens_decoder", {})
    if not isinstance(added, dict) or not all(
        isinstance(token, dict) and isinstance(token.get("content"), str) and index.isdigit() for index, token in added.items()
    ):
        raise InputError(f"{files['tokenizer_config.json']}: 'added_tokens_decoder' must map token ids to {{\"content\": ...}}.")
    if "added_tokens.json" in contents:
        listed = _read_json(files["added_tokens.json"], contents["added_tokens.json"])
        if any(added.get(str(index), {}).get("content") != token for token, index in listed.items()):
            raise refused("added_tokens.json holds added tokens that tokenizer_config.json's added_tokens_decoder does not")
    try:
        bpe = ByteLevelBPETokenizer(
            str(files["vocab.json"]), str(files["merges.txt"]), add_prefix_space=bool(config.get("add_prefix_space"))
        )
        tokenizer = Tokenizer.from_str(bpe.to_str())
    except Exception as exc:  # tokenizers raises a bare Exception for files it cannot parse
        raise InputError(f"{path}: vocab.json and merges.txt are not a readable BPE vocabulary ({exc}).") from None
    for index, token in sorted(((int(index), token) for index, token in added.items())):
        special = bool(token.get("special", False))
        options = {option: bool(token[option]) for option in ("single_word", "lstrip", "rstrip", "normalized") if option in token}
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([AddedToken(token["content"], special=special, **options)])
        if tokenizer.token_to_id(token["content"]) != index:
            raise refused(
                f"tokenizer_config.json gives the added token {token['content']!r} the id {index}, but it comes after "
                f"the vocabulary as {tokenizer.token_to_id(token['content'])}"
            )
    listed = {token["content"] for token in added.values()}
    named = [*_special_tokens(config).values(), *config.get("additional_special_tokens", [])]
    tokenizer.add_special_tokens([token for token in named if isinstance(token, str) and token not in listed])
    return tokenizer


def type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def checked_messages(where: str, messages) -> list[dict]:
    if not isinstance(messages, list):
        raise InputError(f"{where}: expected a list of messages, found {type_name(messages)}.")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InputError(f"{where}, message {i}: expected an object with role and content, found {type_name(message)}.")
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES:
            raise InputError(f"{where}, message {i}: unknown role {role!r}; expected one of {', '.join(_ROLES)}.")
        if not isinstance(content, str):
            what = "no content" if content is None else f"content must be a string, found {type_name(content)}"
            raise InputError(f"{where}, message {i} ({role}): {what}.")
        # Parquet stores messages as structs, where a field one message lacks reads back as None; dropping
        # those keeps `is defined` tests in templates true to the messages as written.
        checked.append({key: value for key, value in message.items() if value is not None})
    return checked


@dataclass(frozen=True)
class _Encoder:
    """Everything a worker needs to turn a chunk of rows into tokens; pickled once per worker."""

    tokenizer: Tokenizer
    vocab_size: int
    column: str
    chat: bool
    eos_id: int | None  # appended to every text document
    template: str | None
    template_file: str | None  # where the template was read, named in errors
    special_tokens: dict[str, str]
    assistant_only: bool

    def __call__(self, path: Path, row0: int, values: list) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        texts, spans = [], []
        for i, value in enumerate(values):
            where = f"{path}, row {row0 + i}, column {self.column!r}"
            if self.chat:
                text, turns = self._render(where, checked_messages(where, value))
                texts.append(text)
                spans.append(turns)
            elif isinstance(value, str):
                texts.append(value)
            else:
                raise InputError(f"{where}: expected a string, found {type_name(value)}.")
        try:
            encodings = self._encode(texts, add_special_tokens=not self.chat)
        except TypeError:  # what tokenizers raises for a str it cannot turn into UTF-8
            self._refuse_surrogates(path, row0, texts)
            raise
        documents = [encoding.ids for encoding in encodings]
        if self.eos_id is not None:
            for ids in documents:
                ids.append(self.eos_id)
        lengths = np.fromiter(map(len, documents), np.int64, len(documents))
        offsets = np.zeros(len(documents) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter(chain.from_iterable(documents), np.int64, int(offsets[-1]))
        if (bad := ids >= self.vocab_size).any():
            token = int(np.flatnonzero(bad)[0])
            row = row0 + int(np.searchsorted(offsets, token, "right")) - 1
            raise InputError(
                f"{path}, row {row}, column {self.column!r}: token id {ids[token]} is not below the "
                f"tokenizer's vocabulary size {self.vocab_size}; is tokenizer.json consistent?"
            )
        labels = None
        if self.assistant_only:
            labels = np.concatenate(
                [_assistant_labels(doc, e.offsets, turns) for doc, e, turns in zip(documents, encodings, spans)]
            ).astype(np.int32)
        return offsets, ids.astype(np.int32), labels

    def _refuse_surrogates(self, path: Path, row0: int, texts: list[str]) -> None:
        """The first text holding a lone surrogate (JSON can write "\\ud800"; UTF-8 cannot encode it)."""
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InputError(
                    f"{path}, row {row0 + i}, column {self.column!r}: {text[exc.start]!r} at character "
                    f"{exc.start} is a lone UTF-16 surrogate, not a Unicode character."
                ) from None

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[Encoding]:
        # Labels need character offsets; text ids alone come faster without them.
        encode = self.tokenizer.encode_batch if self.assistant_only else self.tokenizer.encode_batch_fast
        return encode(texts, add_special_tokens=add_special_tokens)

    def _render(self, where: str, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns."""

        def render(messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
            return render_chat(self.template, self.template_file, where, messages,
                               add_generation_prompt=add_generation_prompt, special_tokens=self.special_tokens)

        text, marked = render(messages, False)
        if _GENERATION_TAG.search(self.template) or not self.assistant_only:
            return text, marked
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            through = render(messages[: i + 1], False)[0]
            if not text.startswith(through):
                raise InputError(
                    f"{where}: the chat template renders messages 0-{i} differently once later messages "
                    "follow, so the assistant turns cannot be found by rendering prefixes; mark them with "
                    "{% generation %}…{% endgeneration %} in the template, or train on all tokens."
                )
            prompt = render(messages[:i], True)[0]
            # Usually the generation prompt is the start of the turn; some templates put more in it
            # (an empty <think></think>), so the turn starts where the two differ. commonprefix is
            # a Python loop over characters: only called then.
            start = len(prompt) if through.startswith(prompt) else len(os.path.commonprefix([prompt, through]))
            spans.append((start, len(through)))
        return text, spans


def _assistant_labels(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """ids where a token's characters overlap an assistant span, IGNORE_INDEX elsewhere."""
    chars = np.asarray(offsets, np.int64).reshape(-1, 2)
    keep = np.zeros(len(ids), bool)
    for start, end in spans:
        keep |= (chars[:, 0] < end) & (chars[:, 1] > start)
    return np.where(keep, np.asarray(ids, np.int64), IGNORE_INDEX)


def _arrow_values(path: Path, kind: str, column: str) -> Iterator[tuple[int, list, int]]:
    """(first row, values, bytes) per record batch of a Parquet or Arrow file."""
    row0 = 0
    for batch in record_batches(path, kind, [column]):
        array = batch.column(column)
        yield row0, array.to_pylist(), array.nbytes
        row0 += batch.num_rows


def _json_values(path: Path, column: str, chat: bool) -> Iterator[tuple[int, list, int]]:
    """(first row, values, bytes) per block of JSON Lines records."""
    for row0, records, size in json_object_blocks(path, _JSON_BLOCK_BYTES):
        for row, record in enumerate(records, row0):
            if column not in record:
                raise InputError(
                    f"{path}, row {row}: the record has no {column!r} field (fields: "
                    f"{', '.join(record) or 'none'}); {missing_column_fix(record, 'chat' if chat else 'text')}."
                )
        yield row0, [record[column] for record in records], size


def _chunks(corpus: Corpus, column: str, chat: bool, chunk_bytes: int) -> Iterator[tuple[Path, int, list]]:
    """(file, first row, values) of about `chunk_bytes` of input each, in corpus order."""
    for path in corpus.files:
        kind = file_kind(path) or "arrow"
        blocks = _json_values(path, column, chat) if kind == "jsonl" else _arrow_values(path, kind, column)
        for row0, values, size in blocks:
            rows = max(1, len(values) * chunk_bytes // max(size, 1))
            for start in range(0, len(values), rows):
                yield path, row0 + start, values[start : start + rows]


def _check_columns(corpus: Corpus, column: str, chat: bool) -> None:
    """The column exists with the right type in every Parquet and Arrow file (JSON Lines: row by row)."""
    for path in corpus.files:
        kind = file_kind(path) or "arrow"
        if kind == "jsonl":
            continue
        columns = file_columns(path, kind)
        if column not in columns:
            raise InputError(
                f"{path}: there is no column {column!r} (columns: {', '.join(columns) or 'none'}); "
                f"{missing_column_fix(columns, 'chat' if chat else 'text')}."
            )
        dtype = columns[column]
        if chat:
            is_list = pa.types.is_list(dtype) or pa.types.is_large_list(dtype)
            ok = is_list and pa.types.is_struct(dtype.value_type)
        else:
            ok = pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype)
        if not ok:
            expected = "a list of {role, content} messages per row" if chat else "strings"
            raise InputError(f"{path}, column {column!r}: expected {expected}, found {dtype}.")


def encoded_in_order(chunks: Iterator[tuple[Path, int, list]], encoder: _Encoder, num_proc: int):
    """(chunk, encoder(chunk)) in chunk order, with a bounded number of chunks in flight. `encoder` is an
    `_Encoder`, or any picklable callable of (file, first row, values) with a `chat` attribute (the pair
    encoder of `prepack.sources.pairs`).

    Chat with num_proc > 1: `num_proc` processes (`prepack.sources.tokenizer_workers`); one that dies
    ends the tokenization with `EngineError`. Otherwise one helper thread: the tokenizer's own threads
    do the work with the GIL released, and the helper overlaps them with reading and with the consumer.
    """
    if encoder.chat and num_proc > 1:
        try:
            yield from encoded_by_workers(chunks, encoder, num_proc)
        except BrokenProcessPool:
            raise EngineError(
                "a chat tokenizer worker process ended abruptly (killed, out of memory, or it failed to start: "
                "each worker imports the script that started it, so a script that calls prepack at its top level "
                "runs again in every worker, which fails; put those calls under `if __name__ == \"__main__\":`)."
            ) from None
        return
    executor = ThreadPoolExecutor(1)
    try:
        window = deque()
        for chunk in chunks:
            window.append((chunk, executor.submit(encoder, *chunk)))
            if len(window) >= 2:
                done, future = window.popleft()
                yield done, future.result()
        while window:
            done, future = window.popleft()
            yield done, future.result()
    finally:
        executor.shutdown(cancel_futures=True)


def _stream(corpus: Corpus, encoder: _Encoder, num_proc: int, progress: Progress | None) -> Iterator[DocumentBatch]:
    # tokenizers sizes its thread pool from this when it first encodes a batch; the pool is fixed
    # afterwards, so num_proc binds exactly in a fresh process such as the CLI's.
    os.environ["RAYON_NUM_THREADS"] = str(num_proc)
    task = progress.add_task("tokenize", total=None) if progress is not None else None
    start, tokens = time.perf_counter(), 0
    chunk_bytes = _CHUNK_BYTES * (1 if encoder.chat else num_proc)  # text: one chunk feeds every thread
    chunks = _chunks(corpus, encoder.column, encoder.chat, chunk_bytes)
    for (path, row0, values), (offsets, ids, labels) in encoded_in_order(chunks, encoder, num_proc):
        if task is not None:
            tokens += len(ids)
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            progress.update(task, advance=len(values), description=f"tokenize: {tokens:,} tokens, {rate:,.0f}/s")
        yield DocumentBatch(file=path, first_row=row0, offsets=offsets, ids=ids, labels=labels)


def tokenize_corpus(
    corpus: Corpus,
    tokenizer: LocalTokenizer,
    *,
    mode: str = "text",
    column: str | None = None,
    eos: bool = True,
    chat_template: str | os.PathLike | None = None,
    train_on: str = "assistant",
    num_proc: int | None = None,
    progress: Progress | None = None,
) -> tuple[TokenizeOptions, bool, Iterator[DocumentBatch]]:
    """Check the options and the corpus schema now, then tokenize while the batches are consumed.

    - mode "text": `column` (default "text") holds strings; `eos` appends the tokenizer's EOS.
    - mode "chat": `column` (default "messages") holds lists of {role, content} messages, rendered with
      `chat_template` (a file) or the tokenizer's own; `train_on="assistant"` labels assistant turns
      only, `"all"` keeps every token trained and so needs no labels.
    - `num_proc` (default: the usable cores): tokenizer threads for text, processes for chat. The
      thread count is set through RAYON_NUM_THREADS, which tokenizers reads once, when it first
      encodes a batch in this process. Chat with num_proc > 1 from a script needs the usual
      `if __name__ == "__main__":` guard.

    Returns the manifest's `TokenizeOptions`, whether the batches carry labels, and the batches. Raises
    `InputError` for bad options or schemas here, and for bad rows (naming file, row, column) while
    iterating; `EngineError` while iterating when a chat worker process dies (killed, or failing to
    start because the script it imports calls prepack unguarded).
    """
    if mode not in ("text", "chat"):
        raise InputError(f"unknown tokenize mode {mode!r}; expected 'text' or 'chat'.")
    if train_on not in ("assistant", "all"):
        raise InputError(f"unknown train_on {train_on!r}; expected 'assistant' or 'all'.")
    chat = mode == "chat"
    column = column or ("messages" if chat else "text")
    num_proc = num_proc or usable_cores()
    if num_proc < 1:
        raise InputError(f"num_proc must be at least 1, not {num_proc}.")
    template, template_file = resolve_chat_template(tokenizer, chat_template) if chat else (None, None)
    eos_id = eos_to_append(tokenizer) if eos and not chat else None
    _check_columns(corpus, column, chat)
    encoder = _Encoder(
        tokenizer=tokenizer.tokenizer,
        vocab_size=tokenizer.vocab_size,
        column=column,
        chat=chat,
        eos_id=eos_id,
        template=template,
        template_file=template_file,
        special_tokens=tokenizer.special_tokens,
        assistant_only=chat and train_on == "assistant",
    )
    options = TokenizeOptions(
        tokenizer=tokenizer.info,
        mode=mode,
        column=column,
        chat_template_sha256=hashlib.sha256(template.encode()).hexdigest() if chat else None,
        train_on=train_on if chat else "all",
        eos=eos and not chat,
    )
    return options, encoder.assistant_only, _stream(corpus, encoder, num_proc, progress)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_chat_template(tokenizer: LocalTokenizer, path: str | os.PathLike | None) -> tuple[str, str]:
    """The chat template (the file `path`, or the tokenizer's), compiled once to check it, and the file
    it was read from."""
    if path is not None:
        template_file = str(path)
        try:
            template = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"{path}: cannot read the chat template ({exc}).") from None
    elif tokenizer.chat_template is None:
        raise InputError(
            f"tokenizer {tokenizer.info.name!r} has no chat template (neither chat_template.jinja nor a "
            "'chat_template' in tokenizer_config.json); pass one with --chat-template FILE."
        )
    else:
        template, template_file = tokenizer.chat_template, tokenizer.chat_template_file or tokenizer.info.name
    check_template(template, template_file)
    return template, template_file


def eos_to_append(tokenizer: LocalTokenizer) -> int | None:
    """EOS to append, or None when the tokenizer's post-processor already ends every encoding with it."""
    token = tokenizer.special_tokens.get("eos_token")
    if token is None:
        raise InputError(
            f"tokenizer {tokenizer.info.name!r} defines no eos_token (tokenizer_config.json); "
            "pass a tokenizer directory that does, or turn EOS off with --no-eos."
        )
    eos_id = tokenizer.tokenizer.token_to_id(token)
    if eos_id is None:
        raise InputError(f"tokenizer {tokenizer.info.name!r}: eos_token {token!r} is not in its vocabulary.")
    return None if tokenizer.tokenizer.encode("").ids[-1:] == [eos_id] else eos_id
