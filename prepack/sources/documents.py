"""Where a build's documents come from: a corpus of token ids (`prepack.sources.corpus`), a corpus of text or
chat tokenized on the way (`prepack.sources.tokenize`), or a document store tokenized before
(`prepack.sources.store`). `build` and `build_store` both read through `open_documents`, so a store
holds exactly the documents a build of its corpus would pack."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING


from prepack.errors import InputError
from prepack.formats.shards import TokenizeOptions
from prepack.sources.corpus import Corpus, DocumentBatch, find_corpus, read_documents
from prepack.storage.remote import is_uri
from prepack.sources.store import ShardColumns, Store, group_prompt_lengths, is_store, open_store

if TYPE_CHECKING:  # rich for annotations only: a build without progress bars does not import it
    from rich.progress import Progress

    from prepack.sources.pairs import PairDocuments

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
    pairs: bool = False  # preference pairs (`prepack.sources.pairs`): a prompt, chosen and rejected a row
    prompt_column: str = "prompt"  # pairs: the prompt column; a row without one: the common prefix of chosen and rejected
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    groups: bool = False  # groups of completions (`prepack.sources.pairs`): a prompt and a list of G completions a row
    completions_column: str = "completions"
    scores_column: str | None = None  # groups: a list of G scores a row, one a completion (stored as group_scores)
    ranks_column: str | None = None  # groups: a list of G ranks a row, 1 the best (stored as group_ranks)
    unpaired: bool = False  # unpaired feedback (KTO, `prepack.sources.pairs.unpaired_documents`): a prompt, completion and label a row
    completion_column: str = "completion"
    label_column: str = "label"
    kl_seed: int = 0  # unpaired: seed of each example's KL completion (`prepack.building.kl_plan.kl_partners`)

    @property
    def read_column(self) -> str:
        """The corpus column the documents come from."""
        if self.tokenizer is None:
            return self.column
        if self.groups:
            return self.completions_column
        if self.unpaired:
            return self.completion_column
        if self.pairs:
            return self.chosen_column
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
    pairs: PairDocuments | None = None  # a preference-pair corpus: two documents a pair, and its prompt lengths


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
    if store is not None:
        _check_store_reading(store, reading, location or spec)
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


def _check_store_reading(store: Store, reading: Reading, where: str | os.PathLike) -> None:
    """Refuse reading options given with a store, which is read as it was written: an option that asks
    otherwise would be silently ignored. A store of pairs or groups takes its own kind and columns given
    again alike (`--pairs --prompt-column q`, as its build from the corpus was asked); given otherwise,
    each is refused with the store's value."""
    recorded = {}
    if (pairs := store.manifest.pairs) is not None:
        recorded = {pairs.kind: True, "prompt_column": pairs.prompt_column}
        named = ("completions_column",) if pairs.kind == "groups" else ("chosen_column", "rejected_column")
        recorded.update({name: getattr(pairs, name) for name in named})
    if scored := _given(reading, _GROUP_FIELDS[1:]):  # `build_document_store` refuses them
        raise InputError(f"{where} is a document store, which holds no scores or ranks: leave out {', '.join(scored)}, or "
                         "build with them from the corpus (prepack build CORPUS --groups ...).")
    given = {f.name: getattr(reading, f.name) for f in fields(Reading) if getattr(reading, f.name) != f.default}
    if other := [name for name, value in given.items() if name in recorded and value != recorded[name]]:
        stored = ", ".join(f"{_flag(name)} {recorded[name]!r}" for name in other)
        raise InputError(f"{where} is a document store tokenized with {stored}: leave out {', '.join(_flag(n) for n in other)} "
                         "or give the store's.")
    if other := [name for name in given if name not in recorded]:
        raise InputError(f"{where} is a document store, tokenized already: leave out {', '.join(map(_flag, other))}.")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def store_documents(store: Store, checked: Sequence[ShardColumns] | None = None) -> Documents:
    """The documents of a document store, read as it was written (`Store.documents`, which takes
    `checked`, the shards' columns checked already); a store of pairs or groups with its groups' prompt
    lengths recorded batch by batch (`_with_prompt_lengths`), as `prepack.sources.pairs` records them from
    their corpus."""
    m = store.manifest
    documents = Documents(store.corpus, m.column, m.labels_column, m.tokenize, m.has_labels, store.documents(checked), store)
    if m.pairs is None:
        return documents
    from prepack.sources.pairs import PairDocuments

    pairs = PairDocuments(m.tokenize, m.pairs, iter(()))
    pairs.batches = _with_prompt_lengths(store, documents.batches, pairs)
    return replace(documents, batches=pairs.batches, pairs=pairs)


def _with_prompt_lengths(store: Store, batches: Iterator[DocumentBatch], pairs: PairDocuments) -> Iterator[DocumentBatch]:
    """The batches of a store of pairs or groups, each one's groups' prompt lengths recorded in `pairs` before
    it is yielded, as a pair corpus's stream records them: from the batch's own offsets and labels
    (`group_prompt_lengths`; whole groups: a store's batches end at shards and files, which hold whole groups),
    read and checked by `Store.documents`. A refusal names the batch's shard and row there, counted here."""
    shards = iter(store.manifest.shards)
    shard, row = None, 0  # the shard the next batch starts in, and that batch's first row there
    for batch in batches:
        while shard is None or row == shard.documents:
            shard, row = next(shards), 0
        where = store.shard_where(shard)
        pairs.add_prompt_lengths(group_prompt_lengths(batch.offsets, batch.labels, pairs.options.size, where, row))
        row += len(batch.offsets) - 1
        yield batch


def corpus_documents(corpus: Corpus, reading: Reading, progress: Progress | None, tokenizer=None, group_size: int | None = None) -> Documents:
    """The documents of the corpus files `corpus`, read (and tokenized) as `reading` says, its schema
    and options checked now; `tokenizer`, when given, is `reading.tokenizer` loaded already
    (`prepack.sources.tokenize.load_tokenizer`). `open_documents` reads a whole corpus so; `--engine ray`
    reads each corpus file so on a worker, with `group_size` the whole corpus's (its first row's: a group
    corpus's files are read with G found there, not each file's own). With `reading.pairs`, preference pairs
    (`prepack.sources.pairs`)."""
    if reading.pairs + reading.groups + reading.unpaired > 1:
        kinds = [flag for flag, given in (("--pairs", reading.pairs), ("--groups", reading.groups), ("--unpaired", reading.unpaired)) if given]
        raise InputError(f"{' and '.join(kinds)} are different kinds of corpus: give one.")
    if reading.unpaired:
        return _unpaired_documents(corpus, reading, tokenizer)
    if given := _given(reading, _UNPAIRED_FIELDS):
        raise InputError(f"{', '.join(given)} name{'s' * (len(given) == 1)} the columns and plan of unpaired feedback: add --unpaired.")
    if reading.pairs or reading.groups:
        return _pair_documents(corpus, reading, tokenizer, group_size)
    if given := _given(reading, _PAIR_FIELDS):
        raise InputError(f"{', '.join(given)} name the columns of preference pairs: add --pairs.")
    if given := _given(reading, ("completions_column",)):
        raise InputError(f"{', '.join(given)} names the completions of groups: add --groups.")
    if given := _given(reading, _GROUP_FIELDS[1:]):
        raise InputError(f"{', '.join(given)}: scores and ranks are a group's, one a completion: add --groups.")
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


_PAIR_FIELDS = ("prompt_column", "chosen_column", "rejected_column")
_GROUP_FIELDS = ("completions_column", "scores_column", "ranks_column")
_UNPAIRED_FIELDS = ("completion_column", "label_column", "kl_seed")
# Reading options that a pair build has no use for: its labels are the completions, its columns its own.
_NOT_FOR_PAIRS = ("column", "labels_column", "text_column", "messages_column", "train_on")


def _given(reading: Reading, names: Sequence[str]) -> list[str]:
    """The options among the `Reading` fields `names` that differ from their defaults, as flags."""
    defaults = {f.name: f.default for f in fields(Reading)}
    return [_flag(name) for name in names if getattr(reading, name) != defaults[name]]


def _pair_documents(corpus: Corpus, reading: Reading, tokenizer=None, group_size: int | None = None) -> Documents:
    """A preference-pair corpus's documents: pair r is documents 2r (chosen) and 2r + 1 (rejected); a group
    corpus's (`reading.groups`): group r is documents Gr … Gr + G - 1, G `group_size` or the first row's."""
    flag = "--groups" if reading.groups else "--pairs"
    if reading.tokenizer is None:
        raise InputError(f"{flag} tokenizes its {flag[2:]}: give --tokenizer (and --chat for conversations).")
    if reading.groups and (given := _given(reading, (*_NOT_FOR_PAIRS, "chosen_column", "rejected_column"))):
        raise InputError(f"--groups reads --prompt-column and --completions-column and labels the completions: leave out {', '.join(given)}.")
    if not reading.groups and (given := _given(reading, (*_NOT_FOR_PAIRS, *_GROUP_FIELDS))):
        raise InputError(
            f"--pairs reads --prompt-column, --chosen-column and --rejected-column and labels the completions: "
            f"leave out {', '.join(given)}."
        )
    from prepack.formats.shards import PairOptions
    from prepack.sources.pairs import first_group_size, pair_documents
    from prepack.sources.tokenize import load_tokenizer

    if reading.groups:
        options = PairOptions(prompt_column=reading.prompt_column, completions_column=reading.completions_column,
                              group_size=group_size or first_group_size(corpus, reading.completions_column),
                              scores_column=reading.scores_column, ranks_column=reading.ranks_column)
    else:
        options = PairOptions(
            prompt_column=reading.prompt_column, chosen_column=reading.chosen_column, rejected_column=reading.rejected_column
        )
    pairs = pair_documents(
        corpus,
        tokenizer or load_tokenizer(reading.tokenizer),
        options,
        chat=reading.chat,
        eos=reading.eos,
        chat_template=reading.chat_template,
        num_proc=reading.num_proc,
    )
    return Documents(corpus, reading.read_column, None, pairs.tokenize, True, pairs.batches, pairs=pairs)


def _unpaired_documents(corpus: Corpus, reading: Reading, tokenizer=None) -> Documents:
    """An unpaired (KTO) corpus's documents: example r is documents 2r (its completion) and 2r + 1 (its KL
    completion), as `prepack.sources.pairs.unpaired_documents` lays them out."""
    if reading.tokenizer is None:
        raise InputError("--unpaired tokenizes its examples: give --tokenizer (and --chat for conversations).")
    if given := _given(reading, (*_NOT_FOR_PAIRS, "chosen_column", "rejected_column", *_GROUP_FIELDS)):
        raise InputError(
            "--unpaired reads --prompt-column, --completion-column and --label-column and labels the completions: "
            f"leave out {', '.join(given)}."
        )
    from prepack.formats.shards import PairOptions
    from prepack.sources.pairs import unpaired_documents
    from prepack.sources.tokenize import load_tokenizer

    options = PairOptions(prompt_column=reading.prompt_column, completion_column=reading.completion_column,
                          label_column=reading.label_column, kl_seed=reading.kl_seed)
    pairs = unpaired_documents(corpus, tokenizer or load_tokenizer(reading.tokenizer), options, chat=reading.chat,
                               eos=reading.eos, chat_template=reading.chat_template)
    return Documents(corpus, reading.read_column, None, pairs.tokenize, True, pairs.batches, pairs=pairs)
