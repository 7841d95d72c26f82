"""Read preference pairs (DPO and its relatives), or groups of completions, and tokenize them: two documents a
pair, G a group.

    pairs = pair_documents(find_corpus("prefs.jsonl"), load_tokenizer("./tok"), chat=True)
    for batch in pairs.batches: ...        # DocumentBatches: pair r is documents 2r (chosen), 2r+1 (rejected)
    pairs.prompt_lengths()                 # once consumed: every pair's prompt tokens

The corpus holds TRL's preference formats, one pair a row:

- explicit prompt: `prompt`, `chosen`, `rejected` columns;
- implicit prompt: `chosen` and `rejected` only, the prompt being their longest common prefix (whole
  messages of a conversation, or characters of a string, backed off before a trailing space; when one
  starts the other, less its last message or character), as TRL's `extract_prompt` finds it;
- conversational (`chat=True`: lists of {role, content} messages, rendered with the chat template) or
  plain text (strings).

Each pair becomes two documents, prompt + chosen and prompt + rejected, tokenized as TRL's
DPOTrainer tokenizes them: the prompt alone (chat: rendered with the generation prompt), and prompt +
completion; the completion starts where the two token sequences diverge, so that both documents of a
pair start with exactly the same prompt tokens. Text: tokens as `tokenizer.encode` gives them (BOS as
the post-processor adds it), then EOS after each completion (`eos`); chat: the rendering encoded
without special tokens, since templates write their own, as `--chat` does. Labels are -100 on the
prompt and the token ids on the completion (what TRL's `completion_mask` trains on). A pair whose
completion is empty, or whose chosen and rejected are the same, is refused with its file, row and
column.

Unpaired feedback (KTO) in TRL's format, a `prompt`, a `completion` and a boolean `label` a row, is read by
`unpaired_examples` and tokenized as TRL 1.16's KTOTrainer `_prepare_dataset` tokenizes it, which is how pairs
are: the prompt alone and prompt + completion (text: EOS after it), the completion from where they diverge;
`prepack.training.unpaired` plans each example's KL completion (`kl_partners`) and lays them out (`kto_groups`).
`unpaired_documents` makes them an unpaired build's documents (`--unpaired`): example r is documents 2r (prompt +
its completion) and 2r + 1 (prompt + its KL completion, planned by `prepack.building.kl_plan.kl_partners` from
`PairOptions.kl_seed`), packed as pairs are, its label in `PairDocuments.desirable`.

A group corpus (`PairOptions.completions_column`, `--groups`) holds a prompt and a list of G completions a
row (every row G, its first row's), each group G documents, prompt + completion k, tokenized as pairs are;
its completions may be equal (samples of one prompt). With `PairOptions.scores_column` / `ranks_column` a row also
holds a list of G scores (finite numbers) or ranks (integers, 1 the best, a competition ranking: 1, 2, 2, 4), one a
completion, checked as read (file, row, column) and collected per document (`PairDocuments.group_values`).

Chat pairs are rendered in `num_proc` spawned processes, text in tokenizers' threads, as
`prepack.sources.tokenize` does; the output does not depend on `num_proc`.
"""

from __future__ import annotations

import hashlib
import math
import os
import reprlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from prepack.building.kl_plan import kl_partners
from prepack.errors import InputError
from prepack.formats.shards import GROUP_SIZE_MAX, IGNORE_INDEX, PairOptions, TokenizeOptions, group_ranking_problems
from prepack.sources.chat_templates import render_chat
from prepack.sources.corpus import Corpus, DocumentBatch, file_columns, file_kind, json_object_blocks, record_batches
from prepack.sources.tokenize import (
    LocalTokenizer,
    resolve_chat_template,
    checked_messages,
    encoded_in_order,
    eos_to_append,
    usable_cores,
    type_name,
)

__all__ = [
    "PairDocuments", "UnpairedExamples", "first_group_size", "pair_documents", "split_prompt", "unpaired_documents",
    "unpaired_examples",
]

_CHUNK_BYTES = 1 << 18  # input per task: pairs are rendered three times each, so chunks are smaller than --chat's
_ENCODE_BATCH_CHARS = 1 << 20  # text per call of the tokenizer: a chunk's texts in one call, a long text alone


def split_prompt(chosen, rejected) -> tuple[object, object, object]:
    """(prompt, chosen completion, rejected completion) of an implicit-prompt pair, as TRL's `extract_prompt`
    splits it: the longest common prefix of two message lists (whole messages) or of two strings, where a
    string's prefix is backed off before the space that precedes the first difference. When one of them
    starts the other, TRL's loop ends on the shorter one's last index, leaving its last message or character
    to the completions: so does this."""
    shorter = min(len(chosen), len(rejected))
    end = next((i for i in range(shorter) if chosen[i] != rejected[i]), None)
    if end is None:
        end = max(shorter - 1, 0)
    elif isinstance(chosen, str) and end > 0 and chosen[end - 1] == " ":
        end -= 1
    return chosen[:end], chosen[end:], rejected[end:]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


@dataclass(frozen=True)
class _Encoder:
    """Tokenizes prompts and their completions as TRL's trainers do; pickled once per worker process (chat)."""

    tokenizer: object  # tokenizers.Tokenizer
    vocab_size: int
    chat: bool
    template: str | None
    template_file: str | None  # where the template was read, named in errors
    special_tokens: dict[str, str]
    eos_id: int | None

    def _encoded(self, path: Path, groups: list[tuple[int, object, list[tuple[str, object]]]]) -> tuple[list[np.ndarray], list[int]]:
        """Each group (row, prompt, [(column, completion), …]) as its documents' token ids, prompt + completion
        (+ EOS), in order, and each group's prompt length: where the prompt alone and prompt + completion diverge
        (TRL's rule: tokens may merge across the boundary), the same for every document of the group. EOS is
        TRL's: appended to a text completion unless it already ends with the EOS text. InputError (file, row,
        column) for an empty completion or a token id not below the vocabulary size."""
        prompts, fulls, where, appends = [], [], [], []
        eos_text = self.special_tokens.get("eos_token")
        for row, prompt, completions in groups:
            prompts.append(self._text(f"{path}, row {row}", prompt, None))
            for column, completion in completions:
                fulls.append(self._text(f"{path}, row {row}, column {column}", prompt, completion))
                where.append((row, column))
                appends.append(self.eos_id is not None and not (isinstance(completion, str) and completion.endswith(eos_text)))
        prompt_ids, full_ids = self._ids(prompts), self._ids(fulls)
        documents, prompt_lengths, first = [], [], 0
        for (_, _, completions), prompt in zip(groups, prompt_ids):
            members = range(first, first + len(completions))
            length = min(_common_prefix(prompt, full_ids[d]) for d in members)
            for d in members:
                ids = np.append(full_ids[d], self.eos_id) if appends[d] else full_ids[d]
                if len(ids) == length:
                    raise InputError(f"{path}, row {where[d][0]}, column {where[d][1]}: the completion is empty (no token "
                                     "after the prompt).")
                documents.append(ids)
            prompt_lengths.append(length)
            first += len(completions)
        if documents and (bad := (ids := np.concatenate(documents)) >= self.vocab_size).any():
            offsets = np.cumsum([0, *map(len, documents)])
            d = int(np.searchsorted(offsets, int(np.flatnonzero(bad)[0]), "right")) - 1
            raise InputError(
                f"{path}, row {where[d][0]}, column {where[d][1]}: token id {ids[bad][0]} is not below the tokenizer's "
                f"vocabulary size {self.vocab_size}; is tokenizer.json consistent?"
            )
        return documents, prompt_lengths

    def _ids(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's token ids, encoded in batches of about _ENCODE_BATCH_CHARS characters whose encodings
        are dropped once their ids are copied out: a pair of long texts holds one encoding at a time, not
        all three (`python benchmarks/bench_pair_memory.py --mb 8`)."""
        ids, start = [], 0
        while start < len(texts):
            end, size = start + 1, len(texts[start])
            while end < len(texts) and size + len(texts[end]) <= _ENCODE_BATCH_CHARS:
                size += len(texts[end])
                end += 1
            # Chat templates write their own special tokens.
            for encoding in self.tokenizer.encode_batch_fast(texts[start:end], add_special_tokens=not self.chat):
                ids.append(np.array(encoding.ids, np.int64))
            start = end
        return ids

    def _value(self, where: str, value):
        """A prompt or completion: messages in chat mode, a string otherwise."""
        if self.chat:
            return checked_messages(where, value)
        if isinstance(value, str):
            return value
        hint = "; --chat reads messages" if isinstance(value, list) else ""
        raise InputError(f"{where}: expected a string (plain-text pairs), found {type_name(value)}{hint}.")

    def _text(self, where: str, prompt, completion) -> str:
        """The prompt alone (completion None; chat: with the generation prompt), or prompt + completion."""
        if not self.chat:
            return prompt if completion is None else prompt + completion
        messages = prompt if completion is None else prompt + completion
        return render_chat(self.template, self.template_file, where, messages,
                           add_generation_prompt=completion is None, special_tokens=self.special_tokens)[0]


@dataclass(frozen=True)
class _PairEncoder(_Encoder):
    """Turns a chunk of pair (or group) records into documents."""

    options: PairOptions

    def __call__(self, path: Path, row0: int, records: list[dict]):
        size, o = self.options.size, self.options
        groups, scores, ranks = [], [], []
        for i, record in enumerate(records):
            prompt, completions, columns = self._parts(path, row0 + i, record)
            groups.append((row0 + i, prompt, list(zip(columns, completions))))
            if o.scores_column is not None:
                scores += _group_numbers(path, row0 + i, record, o.scores_column, size, ranks=False)
            if o.ranks_column is not None:
                ranks += _group_numbers(path, row0 + i, record, o.ranks_column, size, ranks=True)
        documents, prompt_lengths = self._encoded(path, groups)
        labels = []
        for i, length in enumerate(prompt_lengths):
            group = documents[size * i : size * (i + 1)]
            if size == 2 and self.options.completions_column is None and np.array_equal(group[0], group[1]):
                raise InputError(
                    f"{path}, row {row0 + i}: chosen and rejected are the same tokens; a preference pair needs two "
                    "different completions."
                )
            for ids in group:
                trained = ids.copy()
                trained[:length] = IGNORE_INDEX
                labels.append(trained)
        lengths = np.fromiter(map(len, documents), np.int64, len(documents))
        offsets = np.zeros(len(documents) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.concatenate(documents).astype(np.int32)
        values = GroupValues(np.array(scores, np.float64) if o.scores_column is not None else None,
                             np.array(ranks, np.uint8) if o.ranks_column is not None else None)
        return offsets, ids, np.concatenate(labels).astype(np.int32), np.asarray(prompt_lengths, np.int64), values

    def _parts(self, path: Path, row: int, record: dict) -> tuple[object, list, list[str]]:
        """The row's prompt and completions, checked (messages in chat mode, strings otherwise), and each
        completion's column as errors name it. A pair row whose prompt column is missing or null has an
        implicit prompt (`split_prompt`); a group row has a prompt and a list of `group_size` completions."""
        o = self.options
        group = o.completions_column is not None
        explicit = group or record.get(o.prompt_column) is not None
        columns = ([o.completions_column] if group else [o.chosen_column, o.rejected_column]) + ([o.prompt_column] if explicit else [])
        values = {}
        for column in columns:
            value = _required(path, row, record, column)
            if column == o.completions_column:
                if not isinstance(value, list) or len(value) != o.size:
                    found = f"{len(value)} completions" if isinstance(value, list) else type_name(value)
                    raise InputError(f"{path}, row {row}, column {column!r}: expected a list of {o.size} completions (the "
                                     f"build's group size, its first row's), found {found}.")
                values[column] = [self._value(f"{path}, row {row}, column {column!r}[{k}]", v) for k, v in enumerate(value)]
            else:
                values[column] = self._value(f"{path}, row {row}, column {column!r}", value)
        if group:
            completions = values[o.completions_column]
            return values[o.prompt_column], completions, [f"{o.completions_column!r}[{k}]" for k in range(o.size)]
        names = [repr(o.chosen_column), repr(o.rejected_column)]
        if explicit:
            return values[o.prompt_column], [values[o.chosen_column], values[o.rejected_column]], names
        prompt, chosen, rejected = split_prompt(values[o.chosen_column], values[o.rejected_column])
        if not prompt:
            raise InputError(
                f"{path}, row {row}: no {o.prompt_column!r}, and {o.chosen_column!r} and {o.rejected_column!r} share "
                "no prompt (no common prefix); give the prompt (--prompt-column names its column)."
            )
        return prompt, [chosen, rejected], names


class GroupValues(NamedTuple):
    """A group build's per-completion values, one a document in corpus order (None: the build reads none)."""

    scores: np.ndarray | None  # float64, finite
    ranks: np.ndarray | None  # uint8, each group's a competition ranking of 1 to G (`group_ranking_problems`)


def _group_numbers(path: Path, row: int, record: dict, column: str, size: int, *, ranks: bool) -> list:
    """The row's list of `size` scores (finite numbers, as floats) or `ranks` (integers, each group's a competition
    ranking of 1 to `size`) in `column`, one a completion; InputError naming file, row and column otherwise."""
    where, kind = f"{path}, row {row}, column {column!r}", "ranks" if ranks else "scores"
    value = _required(path, row, record, column)
    if not isinstance(value, list) or len(value) != size:
        found = f"{len(value)} values" if isinstance(value, list) else type_name(value)
        raise InputError(f"{where}: expected a list of {size} {kind}, one a completion, found {found}.")
    numbers = []
    for k, number in enumerate(value):
        try:  # a bool is an int to Python, not a number here; an int past float's range is no finite score
            usable = not isinstance(number, bool) and (type(number) is int if ranks else math.isfinite(number))
        except (TypeError, OverflowError):
            usable = False
        if not usable:
            expected = "an integer rank (1 the best)" if ranks else "a finite number"
            raise InputError(f"{where}[{k}]: expected {expected}, found {reprlib.repr(number)}.")
        numbers.append(number if ranks else float(number))
    if ranks and (not all(1 <= r <= size for r in numbers) or group_ranking_problems(np.array([numbers]))[0]):
        raise InputError(f"{where}: ranks {numbers} are not a competition ranking of 1 to {size} (1 the best; tied "
                         "completions share a rank and the next rank skips their places, as in 1, 2, 2, 4).")
    return numbers


def _required(path: Path, row: int, record: dict, column: str):
    """The record's value in `column`, or InputError naming the fields it has."""
    value = record.get(column)
    if value is None:
        present = ", ".join(key for key, value in record.items() if value is not None) or "none"
        raise InputError(f"{path}, row {row}: the record has no {column!r} (fields: {present}).")
    return value


def _require_columns(corpus: Corpus, flags: dict[str, str]) -> None:
    """InputError naming the first file (Arrow or Parquet: a JSONL file's rows are checked as they are read) that
    lacks one of the columns `flags` maps to the option naming each, and that option; every file is checked before
    any is read."""
    for path in corpus.files:
        kind = file_kind(path) or "arrow"
        if kind != "jsonl" and (missing := [c for c in flags if c not in (found := file_columns(path, kind))]):
            raise InputError(f"{path}: there is no column {missing[0]!r} (columns: {', '.join(found) or 'none'}), which "
                             f"{flags[missing[0]]} names.")


def _file_records(path: Path, columns: list[str]) -> Iterator[tuple[int, list[dict], int]]:
    """(first row, records, bytes) per block of a file, each record holding `columns` (those present)."""
    kind = file_kind(path) or "arrow"
    if kind != "jsonl":
        present = [c for c in columns if c in file_columns(path, kind)]
        row0 = 0
        for batch in record_batches(path, kind, present):
            yield row0, batch.to_pylist(), batch.nbytes
            row0 += batch.num_rows
        return
    for row0, records, size in json_object_blocks(path, _CHUNK_BYTES):
        yield row0, [{c: record.get(c) for c in columns} for record in records], size


def _chunks(corpus: Corpus, columns: list[str]) -> Iterator[tuple[Path, int, list[dict]]]:
    for path in corpus.files:
        for row0, records, size in _file_records(path, columns):
            rows = max(1, len(records) * _CHUNK_BYTES // max(size, 1))
            for start in range(0, len(records), rows):
                yield path, row0 + start, records[start : start + rows]


@dataclass
class PairDocuments:
    """A pair corpus's documents (`batches`: pair r of a file is its documents 2r, chosen, and 2r + 1,
    rejected), how they were tokenized, and each pair's prompt tokens, collected as the batches are
    consumed (`prompt_lengths`)."""

    tokenize: TokenizeOptions
    options: PairOptions
    batches: Iterator[DocumentBatch]
    _prompt_lengths: list[np.ndarray] = field(default_factory=list)
    _values: list[GroupValues] = field(default_factory=list)  # a group build's scores and ranks, per batch
    desirable: np.ndarray | None = None  # bool, one an example: an unpaired corpus's labels (`unpaired_documents`)

    def group_values(self) -> GroupValues:
        """Once consumed: every document's score and rank (`GroupValues`, one a document in corpus order; None
        for what the build does not read)."""
        def joined(column: str | None, kind: str, dtype) -> np.ndarray | None:
            return None if column is None else np.concatenate([np.empty(0, dtype), *(getattr(v, kind) for v in self._values)])

        o = self.options
        return GroupValues(joined(o.scores_column, "scores", np.float64), joined(o.ranks_column, "ranks", np.uint8))

    def prompt_lengths(self) -> np.ndarray:
        """int64, one per pair read so far, in corpus order."""
        return np.concatenate(self._prompt_lengths) if self._prompt_lengths else np.empty(0, np.int64)

    def add_prompt_lengths(self, lengths: np.ndarray) -> None:
        """Record the prompt lengths of the next pairs, read elsewhere (`--engine ray`'s tasks), in corpus order."""
        self._prompt_lengths.append(np.asarray(lengths, dtype=np.int64))

    def add_group_values(self, values: GroupValues) -> None:
        """Record the scores and ranks of the next documents, read elsewhere (`--engine ray`'s tasks), in corpus order."""
        self._values.append(values)

    def latest_prompt_lengths(self) -> np.ndarray:
        """The prompt lengths of the pairs of the batch yielded last (whose documents are its pairs')."""
        return self._prompt_lengths[-1]


def first_group_size(corpus: Corpus, column: str) -> int:
    """The completions of the corpus's first row (`column`, a list): a group build's G, which every row must have."""
    for path in corpus.files:
        for row0, records, _ in _file_records(path, [column]):
            for row, record in enumerate(records, row0):
                value = record.get(column)
                if not isinstance(value, list) or len(value) < 2:
                    found = f"{len(value)} completion(s)" if isinstance(value, list) else type_name(value)
                    raise InputError(f"{path}, row {row}, column {column!r}: expected a list of two completions or more "
                                     f"(a group), found {found}.")
                if len(value) > GROUP_SIZE_MAX:
                    raise InputError(f"{path}, row {row}, column {column!r}: {len(value)} completions, more than "
                                     f"{GROUP_SIZE_MAX} (a group's documents are numbered by one byte).")
                return len(value)
    raise InputError(f"{corpus.files[0] if corpus.files else 'the corpus'}: the corpus has no rows.")


def pair_documents(
    corpus: Corpus,
    tokenizer: LocalTokenizer,
    options: PairOptions,
    *,
    chat: bool,
    eos: bool = True,
    chat_template: str | os.PathLike | None = None,
    num_proc: int | None = None,
) -> PairDocuments:
    """Check the options and the files' columns now; tokenize while `batches` is consumed. Raises
    InputError (file, row, column) for a bad pair, a missing column or a bad option."""
    num_proc = num_proc or usable_cores()
    if num_proc < 1:
        raise InputError(f"num_proc must be at least 1, not {num_proc}.")
    template, template_file = resolve_chat_template(tokenizer, chat_template) if chat else (None, None)
    group = options.completions_column is not None
    columns = [options.prompt_column, *((options.completions_column,) if group else (options.chosen_column, options.rejected_column))]
    columns += [c for c in (options.scores_column, options.ranks_column) if c is not None]
    # A pair's prompt may be its completions' common prefix: only a group corpus must have a prompt column.
    flags = {options.prompt_column: "--prompt-column", options.completions_column: "--completions-column"} if group else {
        options.chosen_column: "--chosen-column", options.rejected_column: "--rejected-column"}
    flags.update({c: f for c, f in ((options.scores_column, "--scores-column"), (options.ranks_column, "--ranks-column"))
                  if c is not None})
    _require_columns(corpus, flags)
    encoder = _PairEncoder(
        tokenizer=tokenizer.tokenizer,
        vocab_size=tokenizer.vocab_size,
        options=options,
        chat=chat,
        template=template,
        template_file=template_file,
        special_tokens=tokenizer.special_tokens,
        eos_id=eos_to_append(tokenizer) if eos and not chat else None,
    )
    tokenize = _tokenize_options(tokenizer, options.completions_column if group else options.chosen_column, template, eos)
    documents = PairDocuments(tokenize, options, iter(()))
    documents.batches = _stream(corpus, columns, encoder, num_proc, documents._prompt_lengths, documents._values)
    return documents


def _tokenize_options(tokenizer: LocalTokenizer, column: str, template: str | None, eos: bool) -> TokenizeOptions:
    """How a pair, group or unpaired build tokenized its corpus (chat when it has a `template`), as its manifest
    records it: labels on the completions, EOS after a text completion when `eos`."""
    chat = template is not None
    return TokenizeOptions(
        tokenizer=tokenizer.info,
        mode="chat" if chat else "text",
        column=column,
        chat_template_sha256=hashlib.sha256(template.encode()).hexdigest() if chat else None,
        train_on="assistant" if chat else "all",
        eos=eos and not chat,
    )


def _stream(
    corpus: Corpus, columns: list[str], encoder: _PairEncoder, num_proc: int, prompt_lengths: list, values: list
) -> Iterator[DocumentBatch]:
    os.environ["RAYON_NUM_THREADS"] = str(num_proc)
    for (path, row0, _), (offsets, ids, labels, prompts, found) in encoded_in_order(_chunks(corpus, columns), encoder, num_proc):
        prompt_lengths.append(prompts)
        values.append(found)
        yield DocumentBatch(file=path, first_row=encoder.options.size * row0, offsets=offsets, ids=ids, labels=labels)


class UnpairedExamples(NamedTuple):
    """Every example of the corpus, in corpus order: its prompt's and completion's token ids, and its label."""

    prompts: list[np.ndarray]
    completions: list[np.ndarray]
    desirable: np.ndarray  # bool [N]
    rows_per_file: list[int]  # examples of each corpus file, in order


def unpaired_examples(
    corpus: Corpus,
    tokenizer: LocalTokenizer,
    *,
    chat: bool,
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    label_column: str = "label",
    eos: bool = True,
    chat_template: str | os.PathLike | None = None,
) -> UnpairedExamples:
    """The corpus's examples, tokenized; InputError (file, row, column) for a bad row."""
    template, template_file = resolve_chat_template(tokenizer, chat_template) if chat else (None, None)
    encoder = _Encoder(
        tokenizer=tokenizer.tokenizer, vocab_size=tokenizer.vocab_size, chat=chat, template=template,
        template_file=template_file, special_tokens=tokenizer.special_tokens,
        eos_id=eos_to_append(tokenizer) if eos and not chat else None,
    )
    prompts, completions, desirable, rows_per_file = [], [], [], []
    columns = [prompt_column, completion_column, label_column]
    _require_columns(corpus, dict(zip(columns, ("--prompt-column", "--completion-column", "--label-column"))))
    for path in corpus.files:
        before = len(prompts)
        for row0, records, _ in _file_records(path, columns):
            examples = []
            for row, record in enumerate(records, row0):
                values = {column: _required(path, row, record, column) for column in columns}
                if not isinstance(values[label_column], bool):
                    raise InputError(f"{path}, row {row}, column {label_column!r}: expected a boolean (true: desirable), "
                                     f"found {type_name(values[label_column])}.")
                prompt = encoder._value(f"{path}, row {row}, column {prompt_column!r}", values[prompt_column])
                completion = encoder._value(f"{path}, row {row}, column {completion_column!r}", values[completion_column])
                examples.append((row, prompt, [(repr(completion_column), completion)]))
                desirable.append(values[label_column])
            documents, starts = encoder._encoded(path, examples)
            for ids, start in zip(documents, starts):
                prompts.append(ids[:start])
                completions.append(ids[start:])
        rows_per_file.append(len(prompts) - before)
    return UnpairedExamples(prompts, completions, np.array(desirable, bool), rows_per_file)


def unpaired_documents(
    corpus: Corpus,
    tokenizer: LocalTokenizer,
    options: PairOptions,
    *,
    chat: bool,
    eos: bool = True,
    chat_template: str | os.PathLike | None = None,
) -> PairDocuments:
    """An unpaired corpus's examples as an unpaired build's documents: example r is documents 2r (prompt + its
    completion) and 2r + 1 (the same prompt tokens + the completion tokens of example
    `kl_partners(N, seed=options.kl_seed)[r]`, TRL's KL completion, concatenated as TRL concatenates them), labelled
    -100 on the prompt; its labels in `desirable`. The plan needs every example's index, so the corpus is read and
    tokenized here, whole, in one process; the batches (one a file) are laid out as they are consumed. InputError
    (file, row, column) for a bad row, or for fewer than two examples (no mismatch to make)."""
    examples = unpaired_examples(
        corpus, tokenizer, chat=chat, prompt_column=options.prompt_column, completion_column=options.completion_column,
        label_column=options.label_column, eos=eos, chat_template=chat_template,
    )
    if len(examples.prompts) < 2:
        raise InputError(f"{corpus.files[0] if corpus.files else 'the corpus'}: {len(examples.prompts)} example(s); KTO's KL "
                         "term pairs each example's prompt with another example's completion: give two or more.")
    partners = kl_partners(len(examples.prompts), seed=options.kl_seed)
    template = resolve_chat_template(tokenizer, chat_template)[0] if chat else None
    tokenize = _tokenize_options(tokenizer, options.completion_column, template, eos)
    documents = PairDocuments(tokenize, options, iter(()), desirable=examples.desirable)
    documents.batches = _unpaired_batches(corpus, examples, partners, documents._prompt_lengths)
    return documents


def _unpaired_batches(corpus: Corpus, examples: UnpairedExamples, partners: np.ndarray, prompt_lengths: list) -> Iterator[DocumentBatch]:
    """One DocumentBatch a corpus file: each example's document and its KL document (`unpaired_documents`)."""
    count_all = len(examples.prompts)
    prompt_length = np.fromiter(map(len, examples.prompts), np.int64, count_all)
    completion_length = np.fromiter(map(len, examples.completions), np.int64, count_all)
    # Example i's documents: its prompt + its completion, its prompt + its partner's completion.
    lengths = np.stack([prompt_length + completion_length, prompt_length + completion_length[partners]], axis=1).ravel()
    first = 0
    for path, count in zip(corpus.files, examples.rows_per_file):
        empty = np.empty(0, np.int32)  # a file of no example still concatenates
        ids, labels = [empty], [empty]
        for i in range(first, first + count):
            prompt = examples.prompts[i]
            masked = np.full(len(prompt), IGNORE_INDEX, np.int32)
            for completion in (examples.completions[i], examples.completions[int(partners[i])]):
                ids += (prompt, completion)
                labels += (masked, completion)
        offsets = np.zeros(2 * count + 1, np.int64)
        np.cumsum(lengths[2 * first : 2 * (first + count)], out=offsets[1:])
        prompt_lengths.append(prompt_length[first : first + count])
        yield DocumentBatch(file=path, first_row=0, offsets=offsets, ids=np.concatenate(ids, dtype=np.int32),
                            labels=np.concatenate(labels, dtype=np.int32))
        first += count
