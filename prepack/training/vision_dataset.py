"""Serve a build of an image-chat corpus with its images: each pack gets `images`, the encoded bytes of
its documents' images in token order (and, for a set with videos, `videos`, each its encoded frames, and
`video_fps`), from the image set written beside the build
(`prepack.sources.images.prepare_image_chat`, `schemas/image-set.md`). `VisionCollator` decodes them.

Every pack is checked against the image set before it is served: its image placeholder tokens must be
exactly those of its documents' images (a build of another corpus, or a document whose images were cut by
truncation or splitting, is refused by name). Nothing is decoded here; the bytes are read from the
memory-mapped image set, and a DataLoader worker gets the image set's path, not its bytes: it maps the
files again (already checked) when it unpickles the dataset.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from prepack.errors import InputError
from prepack.formats.images import read_image_set
from prepack.training.dataset import PackedDataset

__all__ = ["ImagePackedDataset"]


class ImagePackedDataset:
    """A `PackedDataset` over `build` whose packs also carry `images` (list of bytes) from `images`, the
    image set prepared with the corpus the build was built from. `options` go to `PackedDataset`."""

    def __init__(self, build: str | os.PathLike, images: str | os.PathLike, **options: Any):
        self.packs = PackedDataset(build, **options)
        self.images = images
        self.image_set = read_image_set(images)
        documents = self.packs.manifest.totals.documents
        if self.image_set.manifest.documents != documents:
            raise InputError(
                f"{images} describes {self.image_set.manifest.documents} corpus rows, but {build} was built from "
                f"{documents}: not the image set of this build's corpus."
            )
        self.placeholder_id = self.image_set.manifest.placeholder_id

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "image_set": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.image_set = read_image_set(self.images)

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        pack = self.packs[index]
        rows = self.packs.source_rows(index)
        numbers = [int(number) for row in rows for number in self.image_set.images_of(int(row))]
        expected = int(self.image_set.tokens[numbers].sum()) if numbers else 0
        found = int(np.count_nonzero(pack["input_ids"] == self.placeholder_id))
        if found != expected:
            raise InputError(
                f"Pack {index} holds {found} image placeholder tokens, but its documents (corpus rows "
                f"{rows.tolist()[:8]}) have images of {expected}: a document's images were cut (keep image "
                "documents within max_len: --overflow drop), or the build is not of this image set's corpus."
            )
        served = {**pack, "images": [self.image_set.data(number) for number in numbers]}
        if self.image_set.manifest.video_rule is not None:
            served |= self._videos(index, pack, rows)
        return served

    def _videos(self, index: int, pack: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
        """The pack's `videos` (each its encoded frames) and `video_fps`, its video placeholders checked as its
        image placeholders are."""
        videos = [video for row in rows for video in self.image_set.videos_of(int(row))]
        expected = sum(tokens for _, _, tokens in videos)
        found = int(np.count_nonzero(pack["input_ids"] == self.image_set.manifest.video_placeholder_id))
        if found != expected:
            raise InputError(
                f"Pack {index} holds {found} video placeholder tokens, but its documents (corpus rows "
                f"{rows.tolist()[:8]}) have videos of {expected}: a document's videos were cut (keep video "
                "documents within max_len: --overflow drop), or the build is not of this image set's corpus."
            )
        return {"videos": [[self.image_set.data(int(frame)) for frame in frames] for frames, _, _ in videos],
                "video_fps": [fps for _, fps, _ in videos]}
