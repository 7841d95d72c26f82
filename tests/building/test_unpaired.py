"""`prepack.sources.pairs.unpaired_examples`: TRL's unpaired (KTO) format read and tokenized as TRL 1.16's KTOTrainer
`_prepare_dataset` tokenizes it (text with EOS, and chat with the generation prompt), rows refused by file, row
and column; with `prepack.training.unpaired` the examples lay out so that every KL completion follows its own
example's prompt.
"""

from __future__ import annotations

import numpy as np
import pytest

from prepack.errors import InputError
from prepack.sources.corpus import find_corpus
from prepack.sources.tokenize import load_tokenizer
from prepack.sources.pairs import unpaired_examples
from prepack.training.unpaired import kl_partners, kto_groups
from tests.building.test_pairs import gpt2, hf_tokenizer, write_jsonl  # noqa: F401 (fixtures)
from tests.demo_inputs import chitchat, chitchat_pairs

trl_data = pytest.importorskip("trl.data_utils")


def trl_kto_example(tokenizer, example: dict) -> tuple[list[int], list[int]]:
    """(prompt_ids, completion_ids) as TRL 1.16's KTOTrainer makes them: EOS text added to a text completion,
    the prompt and prompt + completion tokenized, the completion from where they diverge."""
    prompt, completion = example["prompt"], example["completion"]
    if isinstance(prompt, list):
        prompt_ids = trl_data._tokenize(tokenizer, prompt, add_generation_prompt=True)["input_ids"]
        full = trl_data._tokenize(tokenizer, prompt + completion)["input_ids"]
    else:
        prompt_ids = trl_data._tokenize(tokenizer, prompt)["input_ids"]
        full = trl_data._tokenize(tokenizer, prompt + completion + tokenizer.eos_token)["input_ids"]
    length = trl_data.common_prefix_length(prompt_ids, full)
    return prompt_ids[:length], full[length:]


def text_rows(count: int) -> list[dict]:
    turns = [c for c in chitchat() if len(c) >= 2][:count]
    return [{"prompt": f"Q: {t[0]} A:", "completion": f" {t[1]}", "label": i % 3 != 0} for i, t in enumerate(turns)]


def chat_rows(count: int) -> list[dict]:
    return [{"prompt": p["prompt"], "completion": p["chosen"] if i % 2 else p["rejected"], "label": bool(i % 2)}
            for i, p in enumerate(chitchat_pairs()[:count])]


@pytest.mark.parametrize("chat", [False, True])
def test_examples_are_tokenized_as_trls_kto_trainer_does(tmp_path, gpt2, hf_tokenizer, chat):  # noqa: F811
    rows = chat_rows(12) if chat else text_rows(12)
    corpus = write_jsonl(tmp_path / "kto.jsonl", rows)
    examples = unpaired_examples(find_corpus(corpus), load_tokenizer(gpt2), chat=chat)
    assert examples.desirable.tolist() == [row["label"] for row in rows]
    for i, row in enumerate(rows):
        assert (examples.prompts[i].tolist(), examples.completions[i].tolist()) == trl_kto_example(hf_tokenizer, row), i


def test_bad_rows_are_refused_by_file_row_and_column(tmp_path, gpt2):  # noqa: F811
    tokenizer = load_tokenizer(gpt2)
    for change, says in (
        ({"label": "yes"}, r"row 1, column 'label': expected a boolean"),
        ({"label": None}, r"row 1: the record has no 'label'"),
        ({"completion": ["x"]}, r"row 1, column 'completion': expected a string"),
    ):
        rows = text_rows(3)
        rows[1].update(change)
        corpus = write_jsonl(tmp_path / "bad.jsonl", rows)
        with pytest.raises(InputError, match=says):
            unpaired_examples(find_corpus(corpus), tokenizer, chat=False)


def test_every_files_columns_are_checked_before_any_row_is_read(tmp_path, gpt2):  # noqa: F811
    """A file without the label column is named, not a bad row of a file before it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = text_rows(3)
    rows[1]["label"] = None  # a bad row in the first file
    (corpus := tmp_path / "kto").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), corpus / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": r["prompt"], "completion": r["completion"]} for r in text_rows(3)]),
                   corpus / "b.parquet")
    with pytest.raises(InputError, match=r"b\.parquet: there is no column 'label'"):
        unpaired_examples(find_corpus(corpus), load_tokenizer(gpt2), chat=False)


def test_each_kl_completion_follows_its_own_examples_prompt(tmp_path, gpt2):  # noqa: F811
    corpus = write_jsonl(tmp_path / "kto.jsonl", text_rows(9))
    examples = unpaired_examples(find_corpus(corpus), load_tokenizer(gpt2), chat=False)
    partners = kl_partners(9, seed=3)
    groups = kto_groups(examples.prompts, examples.completions, partners)
    for i, group in enumerate(groups):
        assert list(group.prompt) == examples.prompts[i].tolist() and int(partners[i]) != i
        assert [list(c) for c in group.completions] == [examples.completions[i].tolist(), examples.completions[int(partners[i])].tolist()]
    assert np.array_equal(partners, kl_partners(9, seed=3))


def test_a_completion_that_ends_with_eos_gets_no_second_one_as_in_trls_trainer(tmp_path, gpt2, hf_tokenizer):  # noqa: F811
    """TRL's KTOTrainer appends the EOS text only to a completion that does not end with it: its own
    `_prepare_dataset` (bound to a stand-in for the trainer) tokenizes the rows, one completion ending in EOS."""
    from types import SimpleNamespace

    from datasets import Dataset
    from trl.trainer.kto_trainer import KTOTrainer

    rows = text_rows(4)
    rows[1]["completion"] += hf_tokenizer.eos_token
    examples = unpaired_examples(find_corpus(write_jsonl(tmp_path / "kto.jsonl", rows)), load_tokenizer(gpt2), chat=False)
    trainer = SimpleNamespace(_tokenizer=hf_tokenizer, calculate_KL=False)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, per_device_train_batch_size=4)
    trl = KTOTrainer._prepare_dataset(trainer, Dataset.from_list(rows), hf_tokenizer, args, "eval")
    assert [p.tolist() for p in examples.prompts] == trl["prompt_ids"]
    assert [c.tolist() for c in examples.completions] == trl["completion_ids"]
    assert examples.completions[1][-2:].tolist() != [hf_tokenizer.eos_token_id] * 2
