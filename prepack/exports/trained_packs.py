"""The packs as the trainer-format exports (`megatron`, `olmo_core`) write them: per record batch of packs
(shard schema, `schemas/shard-format.md`), the tokens, the documents' boundaries and which tokens are
trained targets, decoded once and vectorized.

Megatron(-Bridge) and OLMo-core take every target from the token ids themselves (the next token, under a
loss mask), so their masks hold `prepack.exports.common.training_tokens`'s trained tokens (the one
definition all exports share, `PackedCollator`'s): a label not -100, never a document's first token. A
build whose labels differ from its token ids where trained is refused: those formats have no place for
such a label, and so is a preference-pair build (its `pair_roles`). An image build is exported as any
other: its image tokens are in `input_ids`, its images stay in the image set beside the build.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from prepack.errors import InputError
from prepack.exports.common import TrainingTokens, training_tokens
from prepack.formats.common import first_index, list_column

__all__ = ["TrainedPacks", "trained_packs", "refuse_pair_build"]


class TrainedPacks(NamedTuple):
    """One batch of packs: their tokens as prepack trains on them, with the number of the batch's first pack
    in the build and a mixture's source ids."""

    first_pack: int
    training: TrainingTokens  # tokens, pack offsets, layout, labels and `trained` (`training_tokens`)
    source_ids: np.ndarray | None  # per document, a mixture's (uint16); None for other builds

    @property
    def document_offsets(self) -> np.ndarray:
        """int64 [packs + 1]: pack p's documents are documents document_offsets[p]:document_offsets[p + 1]."""
        return np.concatenate([[0], np.cumsum(self.training.layout.documents)])


def refuse_pair_build(is_pair_build: bool, export: str) -> None:
    """Refuse a preference-pair build before anything is written."""
    if is_pair_build:
        raise InputError(
            f"This is a preference-pair build: the {export} export has no place for its pair roles (which "
            "document is chosen, which rejected)."
        )


def trained_packs(
    batches: Iterable[pa.RecordBatch], has_labels: bool, sources: bool, export: str
) -> Iterator[TrainedPacks]:
    """Decode `batches` (whole packs, in pack order) of a build with labels or not, a mixture (`sources`) or
    not, for the `export` format (its name, for refusals)."""
    first_pack = 0
    for batch in batches:
        packs = training_tokens(batch)
        tokens, pack_offsets, trained = packs.tokens, packs.pack_offsets, packs.trained
        if has_labels and (other := trained & (packs.labels != tokens)).any():
            token = first_index(other)
            pack = int(np.searchsorted(pack_offsets, token, "right")) - 1
            raise InputError(
                f"Pack {first_pack + pack}, token {token - pack_offsets[pack]}, column 'labels': the label "
                f"{packs.labels[token]} is trained but is not the token id {tokens[token]}; the {export} export takes "
                "every target from the token ids (the next token under a loss mask), so it holds only labels "
                "that are -100 or the token ids."
            )
        source_ids = None
        if sources:
            id_offsets, id_values = list_column(batch, "source_ids")
            source_ids = id_values[id_offsets[0] : id_offsets[-1]]
        yield TrainedPacks(first_pack, packs, source_ids)
        first_pack += batch.num_rows
