"""What `verify` and `inspect` count of a preference-pair build from its shards (`schemas/shard-format.md`,
"Preference-pair builds"), instead of taking the manifest's `pairs` on trust.

A pair build's document is its prompt, labelled -100, then its completion, labelled with its token ids;
the two documents of a pair (chosen, then rejected: `check_shard` holds every pack to whole pairs)
start with the same prompt tokens. `shard_pairs` checks that of one shard's documents and counts their
prompt and completion tokens, and the pairs filling max_len (the only ones "truncate" may have cut);
`pair_count_problems` holds the manifest's figures to those counts.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from prepack.formats.shards import IGNORE_INDEX, PairTotals, unit_name

__all__ = ["PairCounts", "pair_count_problems", "shard_pairs"]

_CHUNK_TOKENS = 2**22  # tokens checked per step: a few bytes each in the masks below


class PairCounts(NamedTuple):
    """What the packs of a pair build hold (a shard's; `add` sums shards')."""

    pairs: int
    prompt_tokens: int  # each pair's prompt twice, once per document
    completion_tokens: int
    filling: int  # pairs of exactly max_len tokens: a truncated pair is one of them

    def add(self, other: PairCounts) -> PairCounts:
        return PairCounts(*(a + b for a, b in zip(self, other)))


def shard_pairs(
    ids: np.ndarray, labels: np.ndarray, starts: np.ndarray, lengths: np.ndarray, max_len: int, size: int = 2
) -> tuple[PairCounts, list[tuple[int, str, str]]]:
    """Count and check the documents of one pair shard: `starts`, `lengths` (one a document, chosen then
    rejected, back to back in `ids` and `labels`, as a shard that passed `check_shard` lays them); of a group
    shard, `size` documents a group (its counts' `pairs` are groups).
    Returns the counts and, of each kind of problem, the first: (its document's index among the shard's,
    the column, what the document does: "has …")."""
    count = len(lengths)
    prompt = np.zeros(count, np.int64)
    problems: dict[str, tuple[int, str, str]] = {}
    units = lengths.reshape(-1, size).sum(1)
    if count:  # whole pairs per chunk, about _CHUNK_TOKENS tokens each
        chunk_of = (np.cumsum(units) - 1) // _CHUNK_TOKENS
        first = 0
        for end in np.append(np.flatnonzero(np.diff(chunk_of)) + 1, count // size):
            _check_chunk(ids, labels, starts, lengths, size * first, size * int(end), prompt, problems, size)
            first = int(end)
    for document in np.flatnonzero(prompt >= lengths)[:1]:
        problems.setdefault(
            "empty", (int(document), "labels", "has every label -100: a pair's document has a completion.")
        )
    total = int(lengths.sum())
    filling = int((units == max_len).sum())
    counts = PairCounts(count // size, int(prompt.sum()), total - int(prompt.sum()), filling)
    return counts, sorted(problems.values())


def _check_chunk(ids, labels, starts, lengths, lo: int, hi: int, prompt: np.ndarray, problems: dict, size: int) -> None:
    """Documents lo..hi-1 (whole pairs or groups of `size`, back to back from starts[lo]): their prompt lengths
    into `prompt`, the first problem of each kind into `problems`."""
    part = lengths[lo:hi]
    first_token = int(starts[lo])
    tokens = ids[first_token : first_token + int(part.sum())]
    said = labels[first_token : first_token + int(part.sum())]
    is_prompt = said == IGNORE_INDEX
    doc_starts = np.cumsum(part) - part
    prompt[lo:hi] = np.add.reduceat(is_prompt.astype(np.int64), doc_starts)
    position = np.arange(len(tokens)) - np.repeat(doc_starts, part)
    in_prompt = position < np.repeat(prompt[lo:hi], part)
    if (bad := np.flatnonzero(is_prompt != in_prompt)).size:
        document = lo + int(np.searchsorted(doc_starts, bad[0], "right")) - 1
        problems.setdefault("shape", (document, "labels", "has label -100 (a prompt's) after a trained label: a pair's "
                                      "document is its prompt, labelled -100, then its completion."))
        return  # its prompt is not where its labels say: the checks below would misread it
    if (bad := np.flatnonzero(~is_prompt & (said != tokens))).size:
        document = lo + int(np.searchsorted(doc_starts, bad[0], "right")) - 1
        problems.setdefault("label", (document, "labels", f"has label {said[bad[0]]} on token {tokens[bad[0]]}: a "
                                      "completion's labels are its token ids."))
    # Every later document of a pair (group) against its first: the same prompt length, the same prompt tokens.
    first_prompt = prompt[lo:hi:size]
    for member in range(1, size):
        name = "(rejected)" if size == 2 else f"(completion {member})"
        first_name = "its chosen document" if size == 2 else "its group's first document"
        unit = unit_name(size)
        other = prompt[lo + member : hi : size]
        if (bad := np.flatnonzero(first_prompt != other)).size:
            document = lo + size * int(bad[0]) + member
            problems.setdefault("prompt", (document, "labels", f"{name} has a prompt of {other[bad[0]]} tokens, {first_name} "
                                           f"one of {first_prompt[bad[0]]}: a {unit}'s documents share their prompt."))
        # Where both documents have the same prompt length, their prompt tokens line up one to one.
        same = np.repeat(np.repeat(first_prompt == other, size), part) & is_prompt
        role = np.repeat(np.arange(hi - lo) % size, part)
        first_prompts, member_prompts = tokens[same & (role == 0)], tokens[same & (role == member)]
        if (bad := np.flatnonzero(first_prompts != member_prompts)).size:
            shared_ends = np.cumsum(np.where(first_prompt == other, first_prompt, 0))
            group = int(np.searchsorted(shared_ends, bad[0], "right"))
            within = int(bad[0] - (shared_ends[group] - first_prompt[group]))
            document = lo + size * group + member
            problems.setdefault("tokens", (document, "input_ids", f"{name} has token {member_prompts[bad[0]]} at {within} in its "
                                           f"prompt, {first_name} {first_prompts[bad[0]]}: a {unit}'s documents share their "
                                           "prompt tokens."))


def pair_count_problems(said: PairTotals, found: PairCounts, overflow: str) -> list[tuple[str, str]]:
    """The manifest's `pairs` against what the shards hold: (its field, why) for each that differs."""
    problems = []
    for name in ("prompt_tokens", "completion_tokens"):
        if getattr(said, name) != getattr(found, name):
            problems.append((name, f"is {getattr(said, name)}, but the shards hold {getattr(found, name)}."))
    if said.pairs - said.dropped != found.pairs:
        problems.append(("pairs", f"is {said.pairs} with {said.dropped} dropped, but the shards hold {found.pairs} pairs."))
    if said.truncated > (found.filling if overflow == "truncate" else 0):
        problems.append(("truncated", f"is {said.truncated}, but the shards hold {found.filling} pairs of max_len tokens, "
                                      "the only ones truncation leaves (none but with overflow 'truncate')."))
    return problems
