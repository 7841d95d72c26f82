"""The document stores of a mixture's index build, read as one store (`StoreChain`): their shards one
after the other, in source order, so that the build's rows (`source_rows`: a source's `first_row` plus
its own row) number the chain's documents, and the loader and `verify` gather and check them as they
do one store's."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prepack.errors import FormatError
from prepack.formats.shards import MANIFEST_NAME, Manifest, store_location_problem
from prepack.formats.store import StoreShard
from prepack.sources.store import ShardColumns, Store, is_store, open_store

__all__ = ["ChainManifest", "StoreChain", "open_mixture_stores"]


@dataclass(frozen=True)
class ChainManifest:
    """What readers take from a store's manifest, for the chain."""

    shards: list[StoreShard]
    has_labels: bool
    documents: int


class StoreChain:
    """Stores read as one (a `prepack.sources.store.Store` for the loader and `verify`). A store without
    labels in a chain with labels serves its token ids as labels: every token trained, as the full
    build packs it."""

    def __init__(self, stores: list[Store], names: list[str], has_labels: bool) -> None:
        self.stores, self.names = stores, names
        self.manifest = ChainManifest(
            [shard for store in stores for shard in store.manifest.shards],
            has_labels,
            sum(store.manifest.documents for store in stores),
        )
        self._owner = {id(shard): store for store in stores for shard in store.manifest.shards}

    def shard_columns(self, shard: StoreShard) -> ShardColumns:
        """`Store.shard_columns` of the store that holds `shard` (one of `manifest.shards`)."""
        offsets, ids, labels = self._owner[id(shard)].shard_columns(shard)
        return offsets, ids, ids if labels is None and self.manifest.has_labels else labels


def open_mixture_stores(build: str | os.PathLike, manifest: Manifest) -> StoreChain:
    """The stores of the mixture index build at `build`, each where its source's `store` says (inside the
    build's parent directory, through no symbolic link: `store_location_problem`, checked before it is
    opened) and refused (FormatError) unless it is the store the build was planned from: the source's
    fingerprint and rows."""
    stores = []
    for number, source in enumerate(manifest.mixture.sources):
        if (problem := store_location_problem(build, source.store)) is not None:
            raise FormatError(f"{Path(build) / MANIFEST_NAME}: mixture.sources[{number}].store {source.store!r} {problem}.")
        root = Path(build) / source.store
        if not is_store(root):
            raise FormatError(
                f"{Path(build) / MANIFEST_NAME}: the document store {source.store!r} of source {source.name!r} "
                f"({root}) is not there: a mixture's index build reads its tokens from its sources' stores."
            )
        store = open_store(root)
        if store.manifest.fingerprint != source.fingerprint or store.manifest.documents != source.rows:
            raise FormatError(
                f"{root}: the store's fingerprint is {store.manifest.fingerprint} ({store.manifest.documents} documents), "
                f"but source {source.name!r} of the index build {build} was planned from {source.fingerprint} "
                f"({source.rows}): the store changed; build the index again."
            )
        stores.append(store)
    return StoreChain(stores, [source.name for source in manifest.mixture.sources], manifest.has_labels)
