"""Preference-pair builds (`--pairs`) of examples/chitchat_pairs.py's pairs and of text pairs made from the
same conversations: TRL's formats read and tokenized as TRL's DPOTrainer tokenizes them,
every pair packed whole, overflow counted, bad rows refused by file, row and column.

The reference tokenization is TRL's own code (`trl.data_utils`: `extract_prompt`, `_tokenize`,
`common_prefix_length`) on transformers' tokenizer of the same GPT-2 files, so prepack's tokenizer
path (tokenizers + jinja2) is checked against an independent implementation.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import prepack
from prepack import PackedDataset
from prepack.building.pair_plan import kept_lengths
from prepack.building.plan import assign_packs
from prepack.errors import FormatError, InputError
from prepack.formats.shards import PairOptions, check_shard, open_shard, read_manifest
from prepack.sources.corpus import find_corpus
from prepack.sources import pairs
from prepack.sources.pairs import pair_documents, split_prompt
from prepack.sources.tokenize import load_tokenizer
from tests.cli import WIDE, failure, run_prepack
from tests.demo_inputs import CHATML, chitchat, chitchat_pairs, gpt2_directory

trl_data = pytest.importorskip("trl.data_utils")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return gpt2_directory(tmp_path_factory.mktemp("tok") / "gpt2", CHATML)


@pytest.fixture(scope="module")
def hf_tokenizer(gpt2):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(gpt2 / "tokenizer.json"), eos_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def trl_pair(tokenizer, example: dict) -> tuple[list[int], list[int], int]:
    """(prompt + chosen ids, prompt + rejected ids, prompt length) as TRL 1.16's DPOTrainer makes them
    (`_prepare_dataset`: extract_prompt, EOS on text completions, tokenize, common prefix)."""
    if "prompt" not in example:
        example = trl_data.extract_prompt(example)
    prompt, chosen, rejected = example["prompt"], example["chosen"], example["rejected"]
    if isinstance(prompt, list):
        prompt_ids = trl_data._tokenize(tokenizer, prompt, add_generation_prompt=True)["input_ids"]
        chosen_ids = trl_data._tokenize(tokenizer, prompt + chosen)["input_ids"]
        rejected_ids = trl_data._tokenize(tokenizer, prompt + rejected)["input_ids"]
    else:
        eos = tokenizer.eos_token
        prompt_ids = trl_data._tokenize(tokenizer, prompt)["input_ids"]
        chosen_ids = trl_data._tokenize(tokenizer, prompt + chosen + eos)["input_ids"]
        rejected_ids = trl_data._tokenize(tokenizer, prompt + rejected + eos)["input_ids"]
    length = min(trl_data.common_prefix_length(prompt_ids, chosen_ids), trl_data.common_prefix_length(prompt_ids, rejected_ids))
    return chosen_ids, rejected_ids, length


MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "and?"}]


def chat_pairs(count: int) -> list[dict]:
    """The first `count` pairs of examples/chitchat_pairs.py (explicit prompts); every third one with its
    prompt left implicit, inside chosen and rejected."""
    rows = []
    for i, pair in enumerate(chitchat_pairs()[:count]):
        if i % 3 == 2:
            rows.append({"chosen": pair["prompt"] + pair["chosen"], "rejected": pair["prompt"] + pair["rejected"]})
        else:
            rows.append(dict(pair))
    return rows


def text_pairs(count: int) -> list[dict]:
    rows = []
    for i, turns in enumerate([c for c in chitchat() if len(c) >= 2][:count]):
        if i % 4 == 3:
            rows.append({"chosen": f"Q: {turns[0]} A: {turns[1]}", "rejected": f"Q: {turns[0]} A: no idea"})
        else:
            rows.append({"prompt": f"Q: {turns[0]} A:", "chosen": f" {turns[1]}", "rejected": " no idea"})
    return rows


def refused(*args) -> str:
    """The one-line message of a `prepack` command that exits 2."""
    return failure(run_prepack(*args, env=WIDE))


def verified(build: Path, corpus: Path, tokenizer: Path) -> None:
    result = run_prepack("verify", build, "--source", corpus, "--tokenizer", tokenizer)
    assert result.returncode == 0, result.stdout + result.stderr


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def documents_of(build: Path) -> dict[int, tuple[np.ndarray, np.ndarray, int]]:
    """Every document of a build by its corpus row: (ids, labels, pack), checking the pairing as it goes."""
    found = {}
    dataset = PackedDataset(build)
    shards = [open_shard(path, True, dataset.manifest.options.max_len, pairs=2) for path in dataset.shard_paths]
    rows = np.concatenate([np.asarray(shard.column("source_rows").values) for shard in shards])
    at = 0
    for index in range(len(dataset)):
        pack = dataset[index]
        cu, roles = pack["cu_seqlens"], pack["pair_roles"]
        assert roles.tolist() == [0, 1] * (len(cu) // 2)
        for j in range(len(cu) - 1):
            found[int(rows[at + j])] = (pack["input_ids"][cu[j] : cu[j + 1]], pack["labels"][cu[j] : cu[j + 1]], index)
        at += len(cu) - 1
    return found


def assert_built_as_trl_tokenizes(tmp_path: Path, gpt2: Path, hf_tokenizer, rows: list[dict], chat: bool) -> None:
    """`rows` built as pairs: every document has TRL's ids, and labels on TRL's completion only."""
    corpus = write_jsonl(tmp_path / "pairs.jsonl", rows)
    manifest = prepack.build(corpus, tmp_path / "out", max_len=1024, tokenizer=gpt2, chat=chat, pairs=True,
                             overflow="error", num_proc=1)  # the slow tests below tokenize with a worker pool
    assert manifest.pairs.pairs == len(rows) and manifest.totals.documents == 2 * len(rows)
    found = documents_of(tmp_path / "out")
    assert sorted(found) == list(range(2 * len(rows)))
    prompt_tokens = 0
    for r, row in enumerate(rows):
        chosen, rejected, length = trl_pair(hf_tokenizer, row)
        for document, expected in ((2 * r, chosen), (2 * r + 1, rejected)):
            ids, labels, pack = found[document]
            assert ids.tolist() == expected, (r, document)
            assert labels.tolist() == [-100] * length + expected[length:], (r, document)
        assert found[2 * r][2] == found[2 * r + 1][2]  # one pack
        prompt_tokens += 2 * length
    assert manifest.pairs.prompt_tokens == prompt_tokens
    assert manifest.pairs.completion_tokens == manifest.totals.tokens - prompt_tokens


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_pairs_are_trls_tokens_with_labels_on_the_completions(tmp_path, gpt2, hf_tokenizer, chat):
    assert_built_as_trl_tokenizes(tmp_path, gpt2, hf_tokenizer, chat_pairs(60) if chat else text_pairs(60), chat)


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_an_implicit_prompt_where_one_completion_starts_the_other_is_trls(tmp_path, gpt2, hf_tokenizer, chat):
    """chosen a prefix of rejected (or the other way): TRL's extract_prompt leaves the last message or
    character of the shorter one to the completions, so its prompt is one shorter than the common prefix."""
    if chat:
        rows = [{"chosen": pair["prompt"] + pair["chosen"], "rejected": pair["prompt"] + pair["chosen"] + pair["prompt"]}
                for pair in chitchat_pairs()[:10]]
        rows += [{"chosen": row["rejected"], "rejected": row["chosen"]} for row in rows[:3]]
    else:
        rows = [{"chosen": f"Q: {turns[0]} A: {turns[1]}", "rejected": f"Q: {turns[0]} A: {turns[1]} Or not."}
                for turns in [c for c in chitchat() if len(c) >= 2][:10]]
        rows += [{"chosen": "Q: yes", "rejected": "Q: yes "}, {"chosen": "Q: yes no", "rejected": "Q: yes"}]
    assert_built_as_trl_tokenizes(tmp_path, gpt2, hf_tokenizer, rows, chat)


def sharing_a_start(parts: st.SearchStrategy) -> st.SearchStrategy:
    """Two strings or message lists that start alike (or not: the start may be empty)."""
    return st.tuples(parts, parts, parts).map(lambda p: (p[0] + p[1], p[0] + p[2]))


@settings(max_examples=300, deadline=None)
@given(pair=st.one_of(sharing_a_start(st.text("ab ", max_size=4)), sharing_a_start(st.lists(st.sampled_from(MESSAGES), max_size=3))))
def test_split_prompt_is_trls_extract_prompt(pair):
    chosen, rejected = pair
    prompt, chosen_part, rejected_part = split_prompt(chosen, rejected)
    # prepack refuses a pair with no prompt; TRL then gives an empty one, fails (an empty side), or, when the
    # first characters differ and chosen ends with a space, takes chosen[:-1] (its index -1): not compared.
    assume(prompt)
    expected = trl_data.extract_prompt({"chosen": chosen, "rejected": rejected})
    assert (prompt, chosen_part, rejected_part) == (expected["prompt"], expected["chosen"], expected["rejected"])


@pytest.mark.slow  # verify --source (or three builds) in subprocesses: ~5-9 s
def test_pairs_are_packed_first_fit_decreasing_on_pair_sizes(tmp_path, gpt2):
    rows = text_pairs(300)
    corpus = write_jsonl(tmp_path / "pairs.jsonl", rows)
    manifest = prepack.build(corpus, tmp_path / "out", max_len=200, tokenizer=gpt2, pairs=True, overflow="drop")
    lengths = np.concatenate([np.diff(pack["cu_seqlens"]) for pack in PackedDataset(tmp_path / "out")])
    assert len(lengths) == manifest.totals.segments == 2 * (manifest.pairs.pairs - manifest.pairs.dropped)
    # The pair sizes, planned alone by prepack's FFD, need exactly as many packs.
    sizes = lengths[0::2] + lengths[1::2]
    assert manifest.totals.packs == int(assign_packs(sizes, 200).max()) + 1
    assert manifest.totals.packs < len(sizes) / 2  # real packing, several pairs a pack
    verified(tmp_path / "out", corpus, gpt2)


@pytest.mark.slow  # verify --source (or three builds) in subprocesses: ~5-9 s
@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_overflow_keeps_pairs_whole_and_counts_everything(tmp_path, gpt2, hf_tokenizer, overflow):
    rows = chat_pairs(60)
    references = [trl_pair(hf_tokenizer, row) for row in rows]
    max_len = int(np.median([len(c) + len(r) for c, r, _ in references]))
    # Pairs whose prompt alone, twice, fills max_len cannot be truncated (a test below): left out here.
    keep = [i for i, (_, _, length) in enumerate(references) if 2 * length + 2 <= max_len]
    rows, references = [rows[i] for i in keep], [references[i] for i in keep]
    corpus = write_jsonl(tmp_path / "pairs.jsonl", rows)
    full = np.array([len(ids) for c, r, _ in references for ids in (c, r)])
    prompts = np.array([length for _, _, length in references])
    manifest = prepack.build(corpus, tmp_path / "out", max_len=max_len, tokenizer=gpt2, chat=True, pairs=True, overflow=overflow)
    found = documents_of(tmp_path / "out")
    over = full[0::2] + full[1::2] > max_len
    t = manifest.totals
    assert t.input_tokens == full.sum() == t.tokens + t.truncated_tokens + t.dropped_tokens
    if overflow == "drop":
        assert manifest.pairs.dropped == over.sum() and t.dropped == 2 * over.sum() > 0
        assert sorted(found) == [d for r in np.flatnonzero(~over) for d in (2 * r, 2 * r + 1)]
        for document, (ids, _, _) in found.items():
            assert ids.tolist() == references[document // 2][document % 2]
    else:
        kept_c, kept_r = kept_lengths(full, prompts, max_len)
        assert (kept_c + kept_r <= max_len).all() and (kept_c > prompts).all() and (kept_r > prompts).all()
        assert sorted(found) == list(range(len(full)))
        for document, (ids, labels, _) in found.items():
            expected = references[document // 2][document % 2]
            kept = (kept_c, kept_r)[document % 2][document // 2]
            assert ids.tolist() == expected[:kept]  # the prompt whole, the completion's first tokens
            assert (labels[: prompts[document // 2]] == -100).all() and (labels[prompts[document // 2] :] >= 0).all()
        assert manifest.pairs.truncated == over.sum() > 0
        assert t.truncated_tokens == int((full - np.stack([kept_c, kept_r], 1).ravel()).sum())
    verified(tmp_path / "out", corpus, gpt2)


@pytest.mark.slow  # verify --source (or three builds) in subprocesses: ~5-9 s
def test_overflow_error_and_overlong_prompts_name_the_row(tmp_path, gpt2):
    rows = [{"prompt": f"Question {i}?", "chosen": " yes", "rejected": " no"} for i in range(10)]
    rows[6] = {"prompt": "word " * 50, "chosen": " yes", "rejected": " no"}
    corpus = write_jsonl(tmp_path / "pairs.jsonl", rows)
    for overflow, says in (("error", "longer than --max-len 60"), ("truncate", "leaves no room in --max-len 60")):
        message = refused("build", corpus, "--tokenizer", gpt2, "--pairs", "--overflow", overflow,
                          "--max-len", "60", "--out", tmp_path / "out", "--quiet")
        assert "pairs.jsonl, row 6:" in message and says in message, message
        assert not (tmp_path / "out").exists()
    assert "never splits a pair" in refused("build", corpus, "--tokenizer", gpt2, "--pairs", "--max-len", "60", "--out", tmp_path / "out")


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": "a", "chosen": " b"}, "row 1: the record has no 'rejected'"),
        ({"prompt": "a", "chosen": 3, "rejected": " c"}, "row 1, column 'chosen': expected a string"),
        ({"prompt": "a", "chosen": " same", "rejected": " same"}, "row 1: chosen and rejected are the same tokens"),
        ({"chosen": "one", "rejected": "two"}, "row 1: no 'prompt', and 'chosen' and 'rejected' share no prompt"),
        ({"prompt": "a", "chosen": [{"role": "assistant", "content": "x"}], "rejected": " c"},
         "row 1, column 'chosen': expected a string (plain-text pairs), found list; --chat reads messages"),
    ],
)
def test_bad_pairs_are_refused_by_file_row_and_column(tmp_path, gpt2, row, says):
    corpus = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "ok", "chosen": " yes", "rejected": " no"}, row])
    with pytest.raises(InputError) as refused_pair:
        prepack.build(corpus, tmp_path / "out", max_len=64, tokenizer=gpt2, pairs=True, overflow="drop", num_proc=1)
    assert f"pairs.jsonl, {says}" in str(refused_pair.value)
    assert not (tmp_path / "out").exists()


def test_empty_chat_completion_is_refused(tmp_path, gpt2):
    row = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [], "rejected": [{"role": "assistant", "content": "no"}]}
    corpus = write_jsonl(tmp_path / "pairs.jsonl", [row])
    with pytest.raises(InputError, match=r"pairs.jsonl, row 0, column 'chosen': the completion is empty"):
        prepack.build(corpus, tmp_path / "out", max_len=64, tokenizer=gpt2, chat=True, pairs=True, overflow="drop")


def test_pair_options_are_refused_where_they_mean_nothing(tmp_path, gpt2):
    corpus = write_jsonl(tmp_path / "pairs.jsonl", text_pairs(3))
    for options, says in (
        ({"prompt_column": "question"}, "add --pairs"),
        ({"pairs": True, "overflow": "drop", "train_on": "all"}, "leave out --train-on"),
        ({"pairs": True, "overflow": "drop", "drop_untrained": True}, "--drop-untrained would break pairs"),
    ):
        with pytest.raises(InputError, match=says):
            prepack.build(corpus, tmp_path / "out", max_len=64, tokenizer=gpt2, **options)
    # The command exits 2 with the message, as for any bad input.
    assert "leave out --train-on" in refused("tokenize", corpus, "--tokenizer", gpt2, "--pairs", "--train-on", "all", "--out", tmp_path / "store")


class RecordingTokenizer:
    """A tokenizer that records the length of each text of each `encode_batch_fast` call."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def encode_batch_fast(self, texts, add_special_tokens):
        self.calls.append([len(text) for text in texts])
        return self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.slow  # a megabyte encoded by prepack and by transformers: ~2 s
def test_a_long_pair_is_encoded_one_text_at_a_time(tmp_path, gpt2, hf_tokenizer):
    """A long row is encoded three times (TRL's rule: the prompt alone and with each completion); with its
    encodings alive one at a time it costs about what the same row as text does (benchmarks/bench_pair_memory.py)."""
    rows = [{"prompt": "Q: " + "word " * 120_000 + "A:", "chosen": " yes", "rejected": " no"}, *text_pairs(3)]
    tokenizer = load_tokenizer(gpt2)
    recording = RecordingTokenizer(tokenizer.tokenizer)
    documents = pair_documents(find_corpus(write_jsonl(tmp_path / "pairs.jsonl", rows)),
                               dataclasses.replace(tokenizer, tokenizer=recording),
                               PairOptions(prompt_column="prompt", chosen_column="chosen", rejected_column="rejected"), chat=False,
                               num_proc=1)
    batches = list(documents.batches)
    longest = pairs._ENCODE_BATCH_CHARS  # a call holds one text, or texts of at most that many characters
    assert recording.calls and all(len(call) == 1 or sum(call) <= longest for call in recording.calls), recording.calls
    ids = np.concatenate([batch.ids for batch in batches])
    expected = [ids for row in rows for ids in trl_pair(hf_tokenizer, row)[:2]]
    assert ids.tolist() == [token for document in expected for token in document]


def test_parquet_pairs_with_columns_named_otherwise(tmp_path, gpt2, hf_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = chat_pairs(12)
    table = pa.table({
        "question": [row.get("prompt") for row in rows],
        "good": [row["chosen"] for row in rows],
        "bad": [row["rejected"] for row in rows],
    })
    pq.write_table(table, tmp_path / "pairs.parquet")
    prepack.build(tmp_path / "pairs.parquet", tmp_path / "out", max_len=1024, tokenizer=gpt2, chat=True, pairs=True,
                  overflow="error", prompt_column="question", chosen_column="good", rejected_column="bad")
    found = documents_of(tmp_path / "out")
    for r, row in enumerate(rows):
        assert found[2 * r][0].tolist() == trl_pair(hf_tokenizer, row)[0]


def test_a_shard_with_broken_pairing_is_refused(tmp_path, gpt2):
    import pyarrow as pa

    corpus = write_jsonl(tmp_path / "pairs.jsonl", text_pairs(40))
    manifest = prepack.build(corpus, tmp_path / "out", max_len=300, tokenizer=gpt2, pairs=True, overflow="drop")
    path = tmp_path / "out" / manifest.shards[0].name
    batch = open_shard(path, True, 300, pairs=2)
    check_shard(batch, 300, "shard")  # as written: whole pairs

    def replaced(column: str, values: np.ndarray) -> pa.RecordBatch:
        array = batch.column(column)
        new = pa.ListArray.from_arrays(array.offsets, pa.array(values, array.type.value_type))
        return batch.set_column(batch.schema.get_field_index(column), batch.schema.field(column), new)

    roles = np.asarray(batch.column("pair_roles").values).copy()
    roles[[0, 1]] = roles[[1, 0]]  # rejected before chosen
    with pytest.raises(FormatError, match="row 0, column 'pair_roles'"):
        check_shard(replaced("pair_roles", roles), 300, "shard")
    rows = np.asarray(batch.column("source_rows").values).copy()
    rows[1] += 2  # the chosen document's partner is another pair's rejected one
    with pytest.raises(FormatError, match="row 0, column 'source_rows'.*not followed by its rejected"):
        check_shard(replaced("source_rows", rows), 300, "shard")
    assert read_manifest(tmp_path / "out").pairs.pairs == 40


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("pairs", 41, "pairs.pairs"),
        ("prompt_tokens", 0, "pairs.prompt_tokens"),
        ("dropped", 3, "pairs.dropped"),
    ],
)
def test_verify_holds_the_pair_counts_to_the_totals(tmp_path, gpt2, field, value, says):
    from prepack.check.verify import verify_build

    corpus = write_jsonl(tmp_path / "pairs.jsonl", text_pairs(40))
    prepack.build(corpus, tmp_path / "out", max_len=300, tokenizer=gpt2, pairs=True, overflow="drop", num_proc=1)
    assert list(verify_build(tmp_path / "out")) == []
    manifest_file = tmp_path / "out" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["pairs"][field] = value
    manifest_file.write_text(json.dumps(manifest))
    assert says in [problem.column for problem in verify_build(tmp_path / "out", all_problems=True)]
