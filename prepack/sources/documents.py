"""Where a build's documents come from: a corpus of token ids (`prepack.sources.corpus`), a corpus of text or
chat tokenized on the way (`prepack.sources.tokenize`), or a document store tokenized before
(`prepack.sources.store`). `build` and `build_store` both read through `open_documents`, so a store
holds exactly the documents a build of its corpus would pack."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from prepack.errors import InputError
from prepack.formats.shards import TokenizeOptions
from prepack.sources.corpus import Corpus, DocumentBatch, find_corpus, read_documents
from prepack.storage.remote import is_uri
from prepack.sources.store import ShardColumns, Store, is_store, open_store

if TYPE_CHECKING:  # rich for annotations only: a build without progress bars does not import it
    from rich.progress import Progress

__all__ = ["Documents", "Reading", "corpus_documents", "open_documents", "store_documents"]


@dataclass(frozen=True)
class Reading:
    """How a corpus is read: token ids from `column` (and `labels_column` when every file has it), or
    with `tokenizer` text from `text_column` or, with `chat`, conversations from `messages_column`,
    tokenized as `prepack.sources.tokenize.tokenize_corpus` describes."""

    column: str = "input_ids"
    labels_column: str | None = "labels"  # None: no labels are read
    tokenizer: str | os.PathLike | None = None
    chat: bool = False
    text_column: str = "text"
    messages_column: str = "messages"
    eos: bool = True
    chat_template: str | os.PathLike | None = None
    train_on: str = "assistant"
    num_proc: int | None = None

    @property
    def read_column(self) -> str:
        """The corpus column the documents come from."""
        if self.tokenizer is None:
            return self.column
        return self.messages_column if self.chat else self.text_column


@dataclass(frozen=True)
class Documents:
    """A corpus's documents, streamed, and how they were read (what a manifest records)."""

    corpus: Corpus
    column: str  # the column read: token ids, or text / messages when tokenized
    labels_column: str | None  # the labels column read from the corpus; None when tokenized or absent
    tokenize: TokenizeOptions | None
    has_labels: bool
    batches: Iterator[DocumentBatch]
    store: Store | None = None  # when the documents come from a document store: it, opened and checked


def _real(path: str | os.PathLike) -> Path:
    # realpath, not resolve(): on Python 3.11 resolve() raises RuntimeError for a symlink loop, which
    # `--out` may well be; the output stage then refuses it by name.
    return Path(os.path.realpath(path))


def open_documents(
    spec: str | os.PathLike,
    reading: Reading,
    out: str | os.PathLike | None,
    progress: Progress | None,
    location: str | None = None,
) -> Documents:
    """Find the corpus or store at `spec`, check its schema (or its store manifest) and the options
    now, and return its documents, read (and tokenized) while they are consumed. A store is read as it
    was written: reading options other than the defaults are refused with it. Raises InputError, or
    FormatError for a broken store; a corpus with files inside `out` (the output being written, None
    for a reader that writes none: `verify`) is refused.

    `location`: the URI that `spec` is a local copy of (`prepack.storage.remote.local_input`); its files are
    named by it, and the copy is not compared with `out`."""
    store = open_store(spec, location) if is_store(spec) else None
    given = [f"--{f.name.replace('_', '-')}" for f in fields(Reading) if getattr(reading, f.name) != f.default]
    if store is not None and given:
        # A store is read as it was written; an option that asks otherwise would be silently ignored.
        raise InputError(f"{location or spec} is a document store, tokenized already: leave out {', '.join(given)}.")
    local = out is not None and location is None and not is_uri(out)
    if store is not None and local:
        root, target = _real(store.root), _real(out)
        if root.is_relative_to(target) or target.is_relative_to(root):
            raise InputError(f"{spec}: the document store and --out {out} must not lie inside each other; choose another --out.")
    corpus = store.corpus if store is not None else find_corpus(spec)
    corpus = corpus if location is None or store is not None else corpus.located(location)
    inside = [f for f in corpus.files if local and _real(f).is_relative_to(_real(out))]
    if inside:
        raise InputError(f"{inside[0]}: the corpus includes files inside --out {out}; choose another --out.")
    if store is not None:
        return store_documents(store)
    return corpus_documents(corpus, reading, progress)


def store_documents(store: Store, checked: Sequence[ShardColumns] | None = None) -> Documents:
    """The documents of a document store, read as it was written (`Store.documents`, which takes
    `checked`, the shards' columns checked already)."""
    m = store.manifest
    return Documents(store.corpus, m.column, m.labels_column, m.tokenize, m.has_labels, store.documents(checked), store)


def corpus_documents(corpus: Corpus, reading: Reading, progress: Progress | None, tokenizer=None) -> Documents:
    """The documents of the corpus files `corpus`, read (and tokenized) as `reading` says, its schema
    and options checked now; `tokenizer`, when given, is `reading.tokenizer` loaded already
    (`prepack.sources.tokenize.load_tokenizer`). `open_documents` reads a whole corpus so; `--engine ray`
    reads each corpus file so on a worker."""
    if reading.tokenizer is None:
        used_labels, batches = read_documents(corpus, reading.column, reading.labels_column)
        return Documents(corpus, reading.column, used_labels, None, used_labels is not None, batches)
    # Imported here: tokenizers and jinja2 are needed only to tokenize.
    from prepack.sources.tokenize import load_tokenizer, tokenize_corpus

    options, has_labels, batches = tokenize_corpus(
        corpus,
        tokenizer or load_tokenizer(reading.tokenizer),
        mode="chat" if reading.chat else "text",
        column=reading.read_column,
        eos=reading.eos,
        chat_template=reading.chat_template,
        train_on=reading.train_on,
        num_proc=reading.num_proc,
        progress=progress,
    )
    return Documents(corpus, reading.read_column, None, options, has_labels, batches)
