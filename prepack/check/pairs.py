"""What `verify` and `inspect` count of a preference-pair build from its shards (`schemas/shard-format.md`,
"Preference-pair builds"), instead of taking the manifest's `pairs` on trust.

A pair build's document is its prompt, labelled -100, then its completion, labelled with its token ids;
the two documents of a pair (chosen, then rejected: `check_shard` holds every pack to whole pairs)
start with the same prompt tokens. `shard_pairs` checks that of one shard's documents and counts their
prompt and completion tokens, and the pairs filling max_len (the only ones "truncate" may have cut);
`pair_count_problems` holds the manifest's figures to those counts.

An unpaired (KTO) build's examples are pairs of a completion (role 0) and a KL completion (role 1) after the same
prompt: `UnpairedFound` gathers each example's label (the shards' `desirable`), completion and KL completion
across shards, and holds the labels' counts to the manifest's and each KL completion to the completion of the
example `kl_partners` planned for it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from prepack.building.kl_plan import kl_partners
from prepack.formats.shards import IGNORE_INDEX, MANIFEST_NAME, Manifest, PairTotals, unit_name

__all__ = ["PairCounts", "UnpairedFound", "pair_count_problems", "shard_pairs"]

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


class UnpairedFound:
    """What the packs of an unpaired build hold of each of its `examples` examples (the corpus's), gathered shard
    by shard (`add`): its label (-1 while not found), its completion's and its KL completion's tokens as kept,
    and where its documents lie (shard name, pack row, document number). Holds the completion tokens of the whole
    build in memory: an unpaired build's examples are planned in memory too (`unpaired_documents`)."""

    def __init__(self, examples: int):
        self.label = np.full(examples, -1, np.int8)
        self.completions: dict[int, np.ndarray] = {}
        self.kl_completions: dict[int, np.ndarray] = {}
        self.where: dict[tuple[int, int], tuple[str, int, int]] = {}  # (example, role) -> (shard, pack, document)

    def add(self, name: str, rows: np.ndarray, packs: np.ndarray, numbers: np.ndarray, ids: np.ndarray,
            labels: np.ndarray, starts: np.ndarray, lengths: np.ndarray, desirable: np.ndarray) -> None:
        """One shard's documents (corpus `rows`, their `packs`, 1-based `numbers`, `starts` and `lengths` in `ids`
        and `labels`, whole pairs as `check_shard` holds them) and its `desirable` values, one a pair in order."""
        examples = rows[rows % 2 == 0] // 2
        self.label[examples[examples < len(self.label)]] = np.asarray(desirable, bool)[examples < len(self.label)]
        for row, pack, number, start, length in zip(rows.tolist(), packs.tolist(), numbers.tolist(), starts.tolist(), lengths.tolist()):
            example, role = divmod(row, 2)
            completion = ids[start : start + length][labels[start : start + length] != IGNORE_INDEX]
            (self.kl_completions if role else self.completions)[example] = completion
            self.where[example, role] = (name, pack, number)

    def problems(self, manifest: Manifest) -> list[tuple[str, int | None, str, str]]:
        """(file, row, column, message) of each count of `manifest.pairs` the labels found contradict, and of each
        KL completion that is not its planned partner's completion (as far as both were kept: truncation cuts
        them apart, "drop" may leave the partner out)."""
        said, options = manifest.pairs, manifest.options.pairs
        found = {"desirable": int((self.label == 1).sum()), "undesirable": int((self.label == 0).sum())}
        problems = [(MANIFEST_NAME, None, f"pairs.{name}", f"is {getattr(said, name)}, but the shards' desirable column "
                     f"labels {value} examples so.") for name, value in found.items() if getattr(said, name) != value]
        if len(self.label) < 2:
            return problems
        partners = kl_partners(len(self.label), seed=options.kl_seed)
        for example, kl in sorted(self.kl_completions.items()):
            partner = int(partners[example]) if example < len(partners) else -1
            own = self.completions.get(partner)
            if own is None:
                continue
            kept = min(len(kl), len(own))
            cut = manifest.options.overflow == "truncate"
            if not np.array_equal(kl[:kept], own[:kept]) or (not cut and len(kl) != len(own)):
                name, pack, number = self.where[example, 1]
                problems.append((name, pack, "input_ids", f"document {number} (example {example}'s KL completion) is not the "
                                 f"completion of example {partner}, which kl_partners({len(self.label)}, seed="
                                 f"{options.kl_seed}) plans for it."))
        return problems

    def label_problems(self, first: int, desirable: np.ndarray) -> list[tuple[int, str, int, str, str]]:
        """(example, file, row, column, message) of each packed example among `first`, `first` + 1, … whose label is
        not the source's (`desirable`, one a source example from `first`)."""
        problems = []
        found = self.label[first : first + len(desirable)]
        for offset in np.flatnonzero((found >= 0) & (found != np.asarray(desirable, np.int8))).tolist():
            example = first + offset
            name, pack, number = self.where[example, 0]
            problems.append((example, name, pack, "desirable", f"labels example {example} (document {number}) "
                             f"{'desirable' if found[offset] else 'undesirable'}, but the source says "
                             f"{'desirable' if desirable[offset] else 'undesirable'}."))
        return problems
