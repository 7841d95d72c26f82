"""Read unpaired feedback (KTO) in TRL's format and tokenize it as TRL's KTOTrainer does.

    examples = unpaired_examples(find_corpus("feedback.jsonl"), load_tokenizer("./tok"), chat=True)
    examples.prompts[i], examples.completions[i], examples.desirable[i]

The corpus holds one example a row: `prompt`, `completion` and `label` (a JSON boolean: desirable or not),
text (strings) or conversational (`chat=True`: lists of {role, content} messages, rendered with the chat
template). Each is tokenized as TRL 1.16's KTOTrainer `_prepare_dataset` does, which is how pairs are
(`prepack.sources.pairs`, whose encoder this uses): the prompt alone (chat: with the generation prompt), and
prompt + completion (text: EOS after it); the completion starts where the two diverge. A row whose label is
not a boolean, whose completion is empty, or that lacks a column is refused with its file, row and column.

`prepack.training.unpaired` plans each example's KL completion (`kl_partners`) and lays them out (`kto_groups`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from prepack.errors import InputError
from prepack.formats.shards import PairOptions
from prepack.sources.corpus import Corpus
from prepack.sources.pairs import _common_prefix, _file_records, _PairEncoder
from prepack.sources.tokenize import LocalTokenizer, eos_to_append, resolve_chat_template, type_name

__all__ = ["UnpairedExamples", "unpaired_examples"]


class UnpairedExamples(NamedTuple):
    """Every example of the corpus, in corpus order: its prompt's and completion's token ids, and its label."""

    prompts: list[list[int]]
    completions: list[list[int]]
    desirable: np.ndarray  # bool [N]


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
    # The pair encoder renders, checks and encodes prompts and completions; its options are not read here.
    encoder = _PairEncoder(
        tokenizer=tokenizer.tokenizer, vocab_size=tokenizer.vocab_size,
        options=PairOptions(prompt_column=prompt_column, completions_column=completion_column, group_size=2),
        chat=chat, template=template, template_file=template_file, special_tokens=tokenizer.special_tokens,
        eos_id=eos_to_append(tokenizer) if eos and not chat else None,
    )
    prompts, completions, desirable = [], [], []
    columns = [prompt_column, completion_column, label_column]
    for path in corpus.files:
        for row0, records, _ in _file_records(path, columns):
            texts, fulls, rows = [], [], []
            for row, record in enumerate(records, row0):
                values = {}
                for column in columns:
                    if record.get(column) is None:
                        present = ", ".join(key for key, value in record.items() if value is not None) or "none"
                        raise InputError(f"{path}, row {row}: the record has no {column!r} (fields: {present}).")
                    values[column] = record[column]
                if not isinstance(values[label_column], bool):
                    raise InputError(f"{path}, row {row}, column {label_column!r}: expected a boolean (true: desirable), "
                                     f"found {type_name(values[label_column])}.")
                prompt = encoder._value(f"{path}, row {row}, column {prompt_column!r}", values[prompt_column])
                completion = encoder._value(f"{path}, row {row}, column {completion_column!r}", values[completion_column])
                texts.append(encoder._text(f"{path}, row {row}", prompt, None))
                fulls.append(encoder._text(f"{path}, row {row}, column {completion_column!r}", prompt, completion))
                rows.append(row)
                desirable.append(values[label_column])
            for row, prompt_ids, full_ids in zip(rows, encoder._ids(texts), encoder._ids(fulls)):
                if encoder.eos_id is not None:
                    full_ids = np.append(full_ids, encoder.eos_id)
                start = _common_prefix(prompt_ids, full_ids)
                if start == len(full_ids):
                    raise InputError(f"{path}, row {row}, column {completion_column!r}: the completion is empty (no token "
                                     "after the prompt).")
                prompts.append(full_ids[:start].tolist())
                completions.append(full_ids[start:].tolist())
    return UnpairedExamples(prompts, completions, np.array(desirable, bool))
