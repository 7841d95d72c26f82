"""What a mixture build adds to the shard format (`schemas/shard-format.md`, "Mixtures"): the manifest's
`mixture` key (`MixtureInfo`: the request and what each source put into the packs) and the shards'
`source_ids` column (`SOURCE_ID_TYPE`), both absent from every other build."""

from __future__ import annotations

import hashlib
from typing import Literal

import pyarrow as pa
from pydantic import Field, model_validator

from prepack.formats.common import COUNT_MAX, StrictModel

__all__ = ["SOURCE_ID_TYPE", "MixtureInfo", "SourceCounts", "mixture_fingerprint"]

SOURCE_ID_TYPE = pa.uint16()  # a mixture has at most 65,535 sources
_HEX64 = r"^[0-9a-f]{64}$"


class SourceCounts(StrictModel):
    """One source of a mixture build: what was asked of it, and what it put into the packs."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="Its input files are named NAME/… in `inputs`.")
    path: str = Field(description="The corpus or store as the mixture file gives it.")
    fingerprint: str = Field(pattern=_HEX64, description="The fingerprint of its documents as read (see Fingerprint).")
    weight: float | None = Field(ge=0, description="The weight asked for (null: given in epochs).")
    epochs: float | None = Field(ge=0, description="The epochs asked for (null: given a weight).")
    max_epochs: int | None = Field(ge=1, le=2**31 - 1, description="The most copies of a document allowed.")
    first_row: int = Field(ge=0, le=COUNT_MAX, description="Its row 0 among the build's rows (`source_rows` = first_row + its own row).")
    rows: int = Field(ge=0, le=COUNT_MAX, description="Documents read from it.")
    eligible_documents: int = Field(
        ge=0,
        le=COUNT_MAX,
        description="Documents with tokens to pack (after overflow and drop_untrained); where the mixture counts trained "
        "tokens (`count`), with trained tokens to pack: a document without one adds nothing to the budget and is never selected.",
    )
    eligible_tokens: int = Field(ge=0, le=COUNT_MAX, description="Their tokens (trained tokens, where the mixture counts them): one epoch.")
    requested_tokens: int = Field(ge=0, le=COUNT_MAX, description="Tokens asked of it.")
    requested_weight: float = Field(ge=0, le=1, description="requested_tokens / the sum over sources.")
    full_epochs: int = Field(ge=0, le=COUNT_MAX, description="Times every eligible document was taken whole.")
    partial_documents: int = Field(ge=0, le=COUNT_MAX, description="Documents of the seeded subset taken once more.")
    documents: int = Field(ge=0, le=COUNT_MAX, description="Documents packed: full_epochs x eligible_documents + partial_documents.")
    segments: int = Field(ge=0, le=COUNT_MAX, description="Segments packed (documents, split ones counted per piece).")
    tokens: int = Field(
        ge=0,
        le=COUNT_MAX,
        description="Tokens packed: within one document of requested_tokens (one piece, with overflow split), where the mixture counts tokens.",
    )
    weight_realized: float = Field(ge=0, le=1, description="tokens / totals.tokens.")
    trained_tokens: int | None = Field(
        default=None,
        ge=0,
        le=COUNT_MAX,
        description="Where the mixture counts trained tokens (`count`): those packed, within one document (one piece, "
        "with overflow split) of requested_tokens; absent otherwise.",
    )
    store: str | None = Field(
        default=None,
        description="An index build's: the source's document store, relative to the build ('../' and a path "
        "without '..', as an index build's store.path, which `Manifest` holds it to); null in a full build.",
    )


class MixtureInfo(StrictModel):
    """`manifest.mixture`: the mixture file's request and each source's counts."""

    tokens: int | None = Field(ge=1, le=COUNT_MAX, description="The token budget; null: every source its epochs.")
    seed: int = Field(ge=0, le=COUNT_MAX, description="Seed of the document selection.")
    pack_within_source: bool = Field(description="Whether each pack holds documents of one source only.")
    sources: list[SourceCounts] = Field(min_length=1, max_length=2**16 - 1)
    count: Literal["trained"] | None = Field(
        default=None,
        description="'trained': the budget, weights, epochs, eligible_tokens and requested_tokens count trained tokens "
        "(labels other than -100; a segment's first token never); absent: every token.",
    )

    @model_validator(mode="after")
    def _all_stores_or_none(self) -> MixtureInfo:
        if len({source.store is None for source in self.sources}) > 1:
            raise ValueError("either every source names its store (an index build) or none does")
        if any((source.trained_tokens is None) != (self.count is None) for source in self.sources):
            raise ValueError("every source gives trained_tokens where the mixture counts trained tokens, and none does otherwise")
        return self

    @property
    def index_only(self) -> bool:
        """Whether the build is an index build: its packs' tokens are in the sources' stores."""
        return self.sources[0].store is not None


def mixture_fingerprint(fingerprints: list[str]) -> str:
    """A mixture build's `fingerprint`: the hex sha256 of its sources' fingerprints (32 bytes each), in order."""
    return hashlib.sha256(b"".join(bytes.fromhex(f) for f in fingerprints)).hexdigest()
