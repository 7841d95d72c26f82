"""Plan a preference-pair build: pairs are the units packed, never split.

Pair r is documents 2r (prompt + chosen) and 2r + 1 (prompt + rejected), back to back in the token
store. The planner (`prepack.building.plan.plan_packs`, first- or best-fit-decreasing) packs each pair as one
item of its two documents' lengths together, so both land in the same pack, next to each other, in
every shard, micro-batch, rank and resume. A pair longer than `max_len` follows `overflow`:

- "error": refused (the caller names its file and row, `first_overlong_pair`);
- "drop": left out, both documents counted as dropped;
- "truncate": each document keeps its prompt and the first tokens of its completion, the completions
  cut as evenly as the room left allows (the shorter kept whole when it fits in half); a pair whose
  prompt leaves no room for one completion token each is refused (`overlong_prompts`), as no
  truncation of completions can fit it.

`PairPlan` answers what the engines ask of a `PackingPlan` (`packs`, `max_len`, `pack_sizes`, `slice`,
`totals`), in documents: its `slice` gives each pair as its two documents, with their `pair_roles`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prepack.building.plan import DocumentPieces, PackingPlan, ShardPacks, plan_packs

__all__ = ["PairPlan", "first_overlong_pair", "kept_lengths", "overlong_prompts", "pair_pieces", "plan_pairs"]


def _pair_lengths(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.asarray(lengths, np.int64)
    if len(lengths) % 2:
        raise ValueError(f"a pair build has two documents a pair, not {len(lengths)} documents")
    return lengths[0::2], lengths[1::2]


def first_overlong_pair(lengths: np.ndarray, max_len: int) -> int | None:
    """The first pair whose two documents together are longer than `max_len`, or None."""
    chosen, rejected = _pair_lengths(lengths)
    over = np.flatnonzero(chosen + rejected > max_len)
    return int(over[0]) if len(over) else None


def overlong_prompts(lengths: np.ndarray, prompt_lengths: np.ndarray, max_len: int) -> np.ndarray:
    """The pairs too long for `max_len` whose prompt, twice, leaves less than one completion token each."""
    chosen, rejected = _pair_lengths(lengths)
    return np.flatnonzero((chosen + rejected > max_len) & (2 * np.asarray(prompt_lengths, np.int64) + 2 > max_len))


def kept_lengths(lengths: np.ndarray, prompt_lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens each document of each pair keeps under "truncate": all of a pair that fits; else its prompt
    and completions cut to share the room left, `max_len` - 2 x prompt. The shorter completion is kept
    whole when it takes at most half of the room; otherwise each gets half, the chosen one the odd token.
    Pairs refused by `overlong_prompts` keep everything (the caller refuses them)."""
    chosen, rejected = _pair_lengths(lengths)
    prompt = np.asarray(prompt_lengths, np.int64)
    room = max_len - 2 * prompt
    c, r = chosen - prompt, rejected - prompt
    short = np.minimum(c, r)
    keep_short = 2 * short <= room
    c_kept = np.where(keep_short, np.where(c <= r, c, room - r), room - room // 2)
    r_kept = np.where(keep_short, np.where(c <= r, room - c, r), room // 2)
    cut = (chosen + rejected > max_len) & (room >= 2)
    return np.where(cut, prompt + c_kept, chosen), np.where(cut, prompt + r_kept, rejected)


@dataclass(frozen=True)
class PairPlan:
    """A `PackingPlan` of pairs, seen as documents: pair u is documents 2u, 2u + 1 of `kept` tokens each,
    starting at `starts` in the token store."""

    units: PackingPlan  # the plan of pairs (one item of kept chosen + kept rejected tokens each)
    starts: np.ndarray  # int64 [documents]: each document's first token in the token store
    kept: np.ndarray  # int64 [documents]: tokens each document keeps in its pack
    counts: dict[str, int]  # Totals' overflow and untrained fields, in documents
    pair_counts: dict[str, int]  # `PairTotals`' fields

    @property
    def packs(self) -> int:
        return self.units.packs

    @property
    def max_len(self) -> int:
        return self.units.max_len

    def pack_sizes(self) -> tuple[np.ndarray, np.ndarray]:
        pairs, tokens = self.units.pack_sizes()
        return 2 * pairs, tokens

    def slice(self, first: int, end: int) -> ShardPacks:
        """Written packs first..end-1, each pair as its chosen document and then its rejected one."""
        units = self.units.slice(first, end)
        documents = np.empty(2 * len(units.rows), np.int64)
        documents[0::2], documents[1::2] = 2 * units.rows, 2 * units.rows + 1
        roles = np.tile(np.array([0, 1], np.uint8), len(units.rows))
        return ShardPacks(
            max_len=units.max_len,
            pack_offsets=2 * units.pack_offsets,
            starts=self.starts[documents],
            lengths=self.kept[documents],
            rows=documents,
            pieces=np.zeros(len(documents), np.int32),
            pair_roles=roles,
        )

    def totals(self) -> dict[str, int]:
        unit_totals = self.units.totals()
        return {
            **self.counts,
            "tokens": unit_totals["tokens"],
            "segments": 2 * unit_totals["segments"],
            "packs": unit_totals["packs"],
            "padding_tokens": unit_totals["padding_tokens"],
            "lower_bound": unit_totals["lower_bound"],
        }


def _overflowed(
    lengths: np.ndarray, prompt_lengths: np.ndarray, max_len: int, overflow: str, untrained: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, dict[str, int], dict[str, int]]:
    """What `overflow` makes of the pairs: tokens each document keeps (int64, one a document), which pairs
    are dropped (bool, one a pair), Totals' overflow and untrained counts (in documents) and PairTotals'."""
    if overflow not in ("truncate", "drop", "error"):
        raise ValueError(f"pairs are never split: overflow must be truncate, drop or error, not {overflow!r}")
    lengths = np.asarray(lengths, np.int64)
    chosen, rejected = _pair_lengths(lengths)
    prompt_lengths = np.asarray(prompt_lengths, np.int64)
    if len(prompt_lengths) != len(chosen):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(chosen)} pairs")
    if overflow == "truncate":
        kept_chosen, kept_rejected = kept_lengths(lengths, prompt_lengths, max_len)
    else:
        kept_chosen, kept_rejected = chosen, rejected
    kept = np.empty_like(lengths)
    kept[0::2], kept[1::2] = kept_chosen, kept_rejected
    # Still longer than max_len: every such pair under "drop" (and "error", refused by the caller), none
    # under "truncate" once the caller refused `overlong_prompts`.
    dropped = kept_chosen + kept_rejected > max_len
    cut_chosen, cut_rejected = ~dropped & (kept_chosen < chosen), ~dropped & (kept_rejected < rejected)
    flags = np.zeros(len(lengths), bool) if untrained is None else np.asarray(untrained, bool)
    counts = {
        "input_tokens": int(lengths.sum()),
        "empty": 0,
        "split": 0,
        "split_pieces": 0,
        "truncated": int(cut_chosen.sum() + cut_rejected.sum()),
        "truncated_tokens": int(((chosen - kept_chosen) + (rejected - kept_rejected))[~dropped].sum()),
        "dropped": 2 * int(dropped.sum()),
        "dropped_tokens": int((chosen + rejected)[dropped].sum()),
        "untrained": int(flags.sum()),
        "untrained_tokens": int(lengths[flags].sum()),
    }
    prompt_tokens = int(2 * prompt_lengths[~dropped].sum())
    pair_counts = {
        "pairs": len(chosen),
        "truncated": int((cut_chosen | cut_rejected).sum()),
        "dropped": int(dropped.sum()),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": int((kept_chosen + kept_rejected)[~dropped].sum()) - prompt_tokens,
    }
    return kept, dropped, counts, pair_counts


def pair_pieces(
    lengths: np.ndarray, prompt_lengths: np.ndarray, max_len: int, overflow: str, untrained: np.ndarray | None = None
) -> tuple[DocumentPieces, dict[str, int]]:
    """The segments that pairs' documents become (`prepack.building.plan.document_pieces` for a pair build, which
    `verify` holds it to): each kept document one piece of its first `kept_lengths` tokens; and `PairTotals`' fields."""
    lengths = np.asarray(lengths, np.int64)
    kept, dropped, counts, pair_counts = _overflowed(lengths, prompt_lengths, max_len, overflow, untrained)
    rows = np.flatnonzero(~np.repeat(dropped, 2))
    starts = np.cumsum(lengths) - lengths
    return DocumentPieces(rows, np.zeros(len(rows), np.int64), starts[rows], kept[rows], counts), pair_counts


def plan_pairs(
    lengths: np.ndarray,
    prompt_lengths: np.ndarray,
    max_len: int,
    *,
    algorithm: str = "ffd",
    overflow: str = "truncate",
    seed: int = 0,
    untrained: np.ndarray | None = None,
    max_pairs: int | None = None,
) -> PairPlan:
    """Plan the pairs of documents `lengths` (two a pair) with their `prompt_lengths` (one a pair): each
    pair one item for `plan_packs`, after `overflow` ("truncate", "drop"; "error" is the caller's, as is
    refusing `overlong_prompts` under "truncate"), at most `max_pairs` a pack when given. `untrained` (one
    flag a document) is counted only."""
    lengths = np.asarray(lengths, np.int64)
    kept, _, counts, pair_counts = _overflowed(lengths, prompt_lengths, max_len, overflow, untrained)
    # The planner drops what is still longer than max_len, as `_overflowed` counted.
    units = plan_packs(
        kept[0::2] + kept[1::2], max_len, algorithm=algorithm, overflow="drop", seed=seed, max_documents=max_pairs
    )
    starts = np.cumsum(lengths) - lengths
    return PairPlan(units=units, starts=starts, kept=kept, counts=counts, pair_counts=pair_counts)
