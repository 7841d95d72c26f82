"""Turn packs into a training batch whose documents cannot see each other.

A pack (a row of a build, see `schemas/shard-format.md`) holds the tokens of k documents back to back,
unpadded, with `cu_seqlens = [0, l1, l1+l2, ..., n]`. `PackedCollator` pads B packs into one batch in
the form transformers 5.x isolates natively:

    input_ids     [B, L] int64   at padding, the row's last token again (or pad_token_id if given)
    labels        [B, L] int64   -100 at padding, at each document's first token, and where the pack says so
    position_ids  [B, L] int64   0, 1, ... restarting at every document; a row's padding tail restarts too
    cu_seq_lens_q/_k  [S + 1] int32   offsets of the S segments over the flattened B·L tokens (documents and
                                      each row's padding tail), from 0 to B·L
    max_length_q/_k   int             the longest segment
    use_cache         False           sdpa/eager isolate documents only when the model makes no cache

With `max_docs_per_pack=K` (fixed-shape batches, for `torch.compile(dynamic=False)` and CUDA graphs), every
shape and Python value depends on (B, L, K) alone: `cu_seq_lens_q/_k` has B·(K + 1) + 1 offsets, the segments
not used repeating the last offset (zero-length segments at the end), and `max_length_q/_k` is L.

There is no `attention_mask`: a 2-D mask turns off transformers' own packed-sequence handling.
`use_cache=False` travels in the batch so that `model(**batch)` is isolated on the families that
isolate natively even where nobody called `enable_packing` (a model's config defaults to a cache).

Every field is derived from one [B, L] array of segment ids by `segment_fields`, which the attention
integration (`prepack.model.packing`) also uses to convert a legacy indexed mask.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from prepack.errors import ArgumentTypeError, IsolationError, UsageError, optional_imports
from prepack.formats.shards import IGNORE_INDEX, read_manifest, unit_name

with optional_imports("PackedCollator"):
    import torch

if TYPE_CHECKING:
    from prepack.training.dataset import PackedDataset

__all__ = ["Layout", "PackedCollator", "SegmentFields", "segment_fields"]

Layout = Literal["padded", "padding_free", "indexed_mask"]
_LAYOUTS = ("padded", "padding_free", "indexed_mask")


class SegmentFields(NamedTuple):
    """What attention kernels need to keep segments apart, as numpy arrays (see `segment_fields`)."""

    position_ids: np.ndarray  # [B, L] int64: index of each token within its segment
    cu_seq_lens: np.ndarray  # [S + 1] int32: segment offsets over the flattened B·L tokens
    max_length: int  # the longest segment
    seq_idx: np.ndarray  # [B, L] int32: 0-based number of each token's segment over the flattened batch


def segment_fields(segment_ids: np.ndarray) -> SegmentFields:
    """Position ids, global cu_seq_lens and segment numbers from a [B, L] array of segment ids.

    A segment is a run of equal ids within a row, so an indexed attention mask (`[1, 1, 2, 2, 2, 0]`, 0 =
    padding) is a valid input: its padding becomes a segment of its own. Adjacent documents must have
    different ids; a segment never spans two rows.
    """
    rows, width = segment_ids.shape
    starts = np.ones((rows, width), dtype=bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    flat_starts = starts.ravel()
    token = np.arange(rows * width, dtype=np.int64)
    # Each token's segment start is the latest start at or before it.
    segment_start = np.maximum.accumulate(np.where(flat_starts, token, 0))
    cu_seq_lens = np.append(np.flatnonzero(flat_starts), rows * width).astype(np.int32)
    return SegmentFields(
        position_ids=(token - segment_start).reshape(rows, width),
        cu_seq_lens=cu_seq_lens,
        max_length=int(np.diff(cu_seq_lens).max()) if rows * width else 0,
        seq_idx=(np.cumsum(flat_starts, dtype=np.int32) - 1).reshape(rows, width),
    )


class PackedCollator:
    """Collate packs (`input_ids`, `cu_seqlens`, optional `labels`; numpy arrays or lists) into a batch.

    Use it as a DataLoader `collate_fn` or a Trainer `data_collator`; other keys of a pack are ignored.

    - `max_len`: the row length L, and the longest pack accepted (a longer one raises UsageError).
    - `pad_to="longest"`: make L the longest pack of this batch instead (`max_len` then only validates).
      The default, None, is `"max_len"`, or `"longest"` with `shared_prompt` (see there).
    - `pad_to_multiple_of`: round L up to a multiple of it (fewer distinct shapes for compiled kernels).
    - `layout`:
        - `"padded"` (default): the fields in the module docstring.
        - `"padding_free"`: one row [1, ΣL] of all packs back to back, no padding, same fields (the form
          of transformers' `DataCollatorWithFlattening`).
        - `"indexed_mask"`: `input_ids`, `labels` and an int64 `attention_mask` numbering the documents of
          each row from 1, 0 at padding (`[1, 1, 2, 2, 2, 0]`), for trainers that expect that form.
          transformers itself reads any 2-D mask as a binary one, so this layout is only safe on a model
          passed to `prepack.enable_packing`, which converts it back to position ids and offsets.
    - `cp_size=k` (context parallelism, `layout="padding_free"` only): every document is padded to a
      multiple of 2k tokens, the padding in the document's segment after its tokens (causal attention
      keeps the document's outputs exact; the padding is never trained on, and its position ids count
      on), so that `prepack.training.context_parallel.split_for_cp` can cut each into 2k equal chunks. The batch
      also carries the THD offsets of Transformer Engine and Megatron: `cu_seqlens` [D + 1] int32, the
      documents' real lengths, and `cu_seqlens_padded` [D + 1] int32, their padded lengths (equal to
      `cu_seq_lens_q` here: the tokens lie at the padded offsets).
    - `seq_idx=True`: also return `seq_idx` [B, L] int32, the 0-based number of each token's segment
      over the flattened batch (the segments of `cu_seq_lens_q`), as Mamba-style kernels take it. On a
      family whose sequence-state layers `enable_packing` runs per document (docs/model-support.md), it
      drops `seq_idx`: those layers need no boundaries (transformers' torch fallbacks raise on it).
    - `source_ids=True` (a mixture's packs, which carry `source_ids` per document): also return
      `source_ids` [B, L] int64, each token's source (-1 at padding), for `prepack.training.source_loss`. Pop it
      before `model(**batch)`: a model takes no such argument.
    - Packs of a preference-pair build (`pair_roles`, from `PackedDataset`) also give `pair_segments`
      [P, 2] int64: each pair's chosen and rejected document as segment numbers of `cu_seq_lens_q`, what
      `prepack.training.preference.pair_logps` reads (every pack must hold whole pairs); packs with stored
      reference log-probabilities (`PackedDataset` or `open_hf_dataset` with `reference=DIR`; float64, else
      refused) also give `reference_logps` [P, 2] float64, each pair's chosen and rejected value, for
      `prepack.training.reference.stored_reference`. Packs of a group build (`--groups`: roles 0 … G - 1)
      give the same fields [P, G], a group's G completions (`prepack.training.preference.group_logps`), and a
      group build's with scores or ranks (`--scores-column`, `--ranks-column`) `group_scores` [P, G] float64 and
      `group_ranks` [P, G] int64 (1 the best), each completion's value, in the rows of `group_logps`, in every layout.
      Packs of an unpaired (KTO) build (`--unpaired`, pairs of completion and KL completion) also give `desirable`
      [P] bool, each example's label, in the order of `pair_segments` (`prepack.training.preference.kto_loss` takes it).
    - `shared_prompt=True` (packs of a preference-pair or group build; `padded` or `padding_free`): each pair's
      or group's prompt once, then its completions, their position ids continuing from the prompt's end; the
      batch carries `shared_prompt_ids` and `shared_prompt_parts` instead of offsets and `pair_segments`
      (`prepack.training.shared_prompt`). Only a
      model passed to `prepack.enable_packing`, on sdpa, eager or flex_attention, masks it. A re-laid pack is
      shorter than the pack by one prompt a pair, and the saving is the layout's point, so its `padded` rows are
      as long as the batch's longest re-laid pack unless `pad_to="max_len"` asks for fixed rows (which compute
      as many positions as the two-sequence layout).
    - `max_docs_per_pack=K` (the `padded` layout, rows of `max_len`): fixed-shape batches. Each row holds at
      most K documents and a padding tail, so B rows have at most B·(K + 1) segments: `cu_seq_lens_q/_k` always
      has B·(K + 1) + 1 offsets, the unused ones repeating B·L (segments of no token, which every backend
      prepack supports skips: tests/model/test_compile.py measures it), and `max_length_q/_k` is L, an upper
      bound of every segment. Nothing the model receives then changes from batch to batch but the values of
      tensors, so `torch.compile(model, dynamic=False)` traces once (a smaller last batch is another shape:
      drop it, `drop_last=True` / `dataloader_drop_last=True`). A pack of more than K documents is refused
      by name: build with `--max-docs-per-pack K` (`for_dataset(..., fixed_shape=True)` takes K from the build).
      Pairs count as two documents; `pair_segments` and `reference_logps` stay one row a pair (the loss's, not the
      model's). With `shared_prompt` it refuses packs over K and pads rows to `max_len` (its default then), the
      rows being the only shapes that layout gives the model.
    - `pad_token_id`: the token id written at padding (its label is always -100). By default each row's
      padding repeats the row's last token: padding is a segment of its own and never trained on, but
      its gradient still flows through the model as 0 times the local derivative, and a token whose
      embedding is all zeros (a model's own pad id, initialised to zeros) makes some normalisations
      divide 0 by 0 (measured: Gemma 3n's gradients turn NaN with pad id 0). A real token's embedding
      is never degenerate.
    - `group_size=G`: the packs' groups have G documents (2: pairs); packs whose `pair_roles` make other
      groups are refused (without it G is read from the roles). `for_dataset` takes it from a pair or group build.

    Every layout also carries `use_cache=False` (see the module docstring). `for_dataset` takes
    `max_len` from the build, with `fixed_shape=True` its `max_docs_per_pack`, and its group size.
    """

    def __init__(
        self,
        max_len: int | None = None,
        *,
        layout: Layout = "padded",
        pad_to: Literal["max_len", "longest"] | None = None,
        pad_to_multiple_of: int | None = None,
        seq_idx: bool = False,
        pad_token_id: int | None = None,
        cp_size: int | None = None,
        source_ids: bool = False,
        shared_prompt: bool = False,
        max_docs_per_pack: int | None = None,
        group_size: int | None = None,
    ):
        if layout not in _LAYOUTS:
            raise UsageError(f"layout must be one of {_LAYOUTS}, not {layout!r}.")
        if pad_to is None:
            pad_to = "longest" if shared_prompt and max_docs_per_pack is None else "max_len"
        if pad_to not in ("max_len", "longest"):
            raise UsageError(f"pad_to must be 'max_len' or 'longest', not {pad_to!r}.")
        if pad_to == "max_len" and max_len is None and layout != "padding_free":
            raise UsageError("Give max_len, or pad_to='longest' to pad each batch to its longest pack.")
        if max_len is not None and max_len < 1:
            raise UsageError(f"max_len must be at least 1, not {max_len}.")
        if pad_to_multiple_of is not None and (pad_to_multiple_of < 1 or layout == "padding_free"):
            raise UsageError("pad_to_multiple_of must be at least 1, and the padding_free layout takes none.")
        if cp_size is not None and (cp_size < 1 or layout != "padding_free"):
            raise UsageError("cp_size must be at least 1, and only the padding_free layout (THD) takes it.")
        if shared_prompt and (layout == "indexed_mask" or cp_size is not None or seq_idx or source_ids):
            raise UsageError(
                "shared_prompt takes the padded or padding_free layout, without cp_size, seq_idx or source_ids."
            )
        if max_docs_per_pack is not None:
            if type(max_docs_per_pack) is not int or max_docs_per_pack < 1:
                raise UsageError(f"max_docs_per_pack must be an int of at least 1, not {max_docs_per_pack!r}.")
            if layout != "padded" or pad_to != "max_len" or max_len is None or cp_size is not None:
                raise UsageError(
                    "max_docs_per_pack (fixed-shape batches) takes the padded layout with rows of max_len "
                    "(pad_to='max_len'), without cp_size: any other shape follows the batch."
                )
        if group_size is not None and (type(group_size) is not int or group_size < 2):
            raise UsageError(f"group_size must be an int of at least 2, not {group_size!r}.")
        self.group_size = group_size
        self.max_docs_per_pack = max_docs_per_pack
        self.shared_prompt = shared_prompt
        self.cp_size = cp_size
        self.max_len = max_len
        self.layout = layout
        self.pad_to = pad_to
        self.pad_to_multiple_of = pad_to_multiple_of
        self.seq_idx = seq_idx
        self.pad_token_id = pad_token_id
        self.source_ids = source_ids

    @classmethod
    def for_dataset(
        cls, dataset: PackedDataset | Any | str | os.PathLike, *, fixed_shape: bool = False, **options: Any
    ) -> PackedCollator:
        """A collator for the packs of `dataset` (a `PackedDataset`, a `datasets.Dataset` from
        `open_hf_dataset`, or a build directory): `max_len` is the build's, so that it is never typed
        twice, and with `fixed_shape` its `max_docs_per_pack` (a build without one is refused); `options`
        are the other arguments."""
        build_options = None
        if isinstance(dataset, (str, os.PathLike)):
            build_options = read_manifest(dataset).options
        elif hasattr(dataset, "manifest"):  # a PackedDataset
            build_options = dataset.manifest.options
        if build_options is not None:
            max_len, cap = build_options.max_len, build_options.max_docs_per_pack
            if build_options.pairs is not None:
                options.setdefault("group_size", build_options.pairs.size)
        else:
            from prepack.training.dataset import hf_dataset_options  # a datasets.Dataset: the build's options are in its info

            max_len, cap = hf_dataset_options(dataset) if hasattr(dataset, "info") else (None, None)
            if max_len is None:
                raise ArgumentTypeError(
                    f"PackedCollator.for_dataset takes a PackedDataset, a build directory or a dataset from "
                    f"prepack.open_hf_dataset, not {type(dataset).__name__}; give max_len: PackedCollator(max_len)."
                )
        if fixed_shape:
            if cap is None:
                raise UsageError(
                    "fixed_shape=True needs a build with --max-docs-per-pack K: without a cap a pack may hold up to "
                    "max_len documents, and batches sized for that would be mostly empty segments."
                )
            options["max_docs_per_pack"] = cap
        return cls(max_len, **options)

    def __call__(self, packs: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor | int | bool]:
        checked = [_checked_pack(pack, number, self.max_len, self.source_ids) for number, pack in enumerate(packs)]
        if not checked:
            raise UsageError("Cannot collate an empty list of packs.")
        if self.max_docs_per_pack is not None:
            _require_at_most(checked, self.max_docs_per_pack)
        if self.shared_prompt:
            return self._shared_prompt_batch(checked)
        input_ids, labels, segment_ids, sources = self._fill_rows(checked)
        fields = segment_fields(segment_ids)
        if self.max_docs_per_pack is not None:
            fields = _fixed_shape(fields, len(checked) * (self.max_docs_per_pack + 1))
        # A document's first token is predicted by the end of the previous document: never train on it.
        labels[(fields.position_ids == 0) | (segment_ids == 0)] = IGNORE_INDEX
        batch: dict[str, torch.Tensor | int | bool] = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "use_cache": False,
        }
        if self.layout == "indexed_mask":
            batch["attention_mask"] = torch.from_numpy(segment_ids.astype(np.int64))
        else:
            cu_seq_lens = torch.from_numpy(fields.cu_seq_lens)
            batch |= {
                "position_ids": torch.from_numpy(fields.position_ids),
                "cu_seq_lens_q": cu_seq_lens,
                "cu_seq_lens_k": cu_seq_lens,
                "max_length_q": fields.max_length,
                "max_length_k": fields.max_length,
            }
        if sources is not None:
            batch["source_ids"] = torch.from_numpy(sources)
        if self.seq_idx:
            batch["seq_idx"] = torch.from_numpy(fields.seq_idx)
        if any(pack.pair_roles is not None for pack in checked):
            segments = _pair_segments(checked, segment_ids, fields.cu_seq_lens, self.group_size)
            batch["pair_segments"] = torch.from_numpy(segments)
            if any(pack.reference_logps is not None for pack in checked):
                batch["reference_logps"] = torch.from_numpy(_reference_logps(checked, segments.shape[1]))
            batch |= _group_values(checked, segments.shape[1])
            if any(pack.desirable is not None for pack in checked):
                batch["desirable"] = torch.from_numpy(_desirable(checked))
        if self.cp_size is not None:
            lengths = np.concatenate([np.diff(pack.cu_seqlens) for pack in checked])
            batch["cu_seqlens"] = torch.from_numpy(np.append(0, np.cumsum(lengths)).astype(np.int32))
            batch["cu_seqlens_padded"] = torch.from_numpy(fields.cu_seq_lens)
        return batch

    def _shared_prompt_batch(self, packs: list[_Pack]) -> dict[str, torch.Tensor | int | bool]:
        """The batch of `shared_prompt=True`: each pack's groups re-laid (`prepack.training.shared_prompt`), in rows."""
        from prepack.training.shared_prompt import pack_groups, shared_prompt_layout

        size = _require_whole_groups(packs, self.group_size)
        rows = []
        for number, pack in enumerate(packs):
            if pack.labels is None:
                raise UsageError(
                    f"Pack {number} has no labels: shared_prompt finds each group's prompt by its -100 labels."
                )
            rows.append(pack_groups(pack.input_ids, pack.cu_seqlens, pack.labels, size, number))
        lengths = [sum(len(g.prompt) + sum(map(len, g.completions)) for g in row) for row in rows]
        padding_free = self.layout == "padding_free"
        batch = shared_prompt_layout(rows, padding_free=padding_free, pad_token_id=self.pad_token_id,
                                     row_length=None if padding_free else self._row_length(lengths))
        if any(pack.reference_logps is not None for pack in packs):
            batch["reference_logps"] = torch.from_numpy(_reference_logps(packs, size))
        if any(pack.desirable is not None for pack in packs):
            batch["desirable"] = torch.from_numpy(_desirable(packs))
        return batch | _group_values(packs, size)

    def _fill_rows(self, packs: list[_Pack]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """input_ids, labels (before masking), segment ids (0 = padding) and, with `source_ids`, each
        token's source (-1 = padding), one pack per row or all in one."""
        padding_free = self.layout == "padding_free"
        if self.cp_size is not None:
            packs = [_cp_padded(pack, 2 * self.cp_size, self.pad_token_id) for pack in packs]
        total = sum(len(pack.input_ids) for pack in packs)
        shape = (1, total) if padding_free else (len(packs), self._row_length([len(pack.input_ids) for pack in packs]))
        input_ids = np.full(shape, self.pad_token_id or 0, dtype=np.int64)
        labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        segment_ids = np.zeros(shape, dtype=np.int32)
        sources = np.full(shape, -1, dtype=np.int64) if self.source_ids else None
        row, start, first_segment = 0, 0, 1
        for pack in packs:
            end = start + len(pack.input_ids)
            input_ids[row, start:end] = pack.input_ids
            labels[row, start:end] = pack.input_ids if pack.labels is None else pack.labels
            lengths = np.diff(pack.cu_seqlens)
            segment_ids[row, start:end] = np.repeat(np.arange(first_segment, first_segment + len(lengths)), lengths)
            if sources is not None:
                sources[row, start:end] = np.repeat(pack.source_ids, lengths)
            if padding_free:
                # Numbering runs on so that the last document of a pack and the first of the next differ.
                start, first_segment = end, first_segment + len(lengths)
            else:
                if self.pad_token_id is None:
                    input_ids[row, end:] = pack.input_ids[-1]  # a real token's embedding (see pad_token_id)
                row += 1
        return input_ids, labels, segment_ids, sources

    def _row_length(self, lengths: Sequence[int]) -> int:
        length = self.max_len if self.pad_to == "max_len" else max(lengths)
        multiple = self.pad_to_multiple_of or 1
        return -(-length // multiple) * multiple


class _Pack(NamedTuple):
    input_ids: np.ndarray
    cu_seqlens: np.ndarray
    labels: np.ndarray | None
    source_ids: np.ndarray | None = None  # one per document
    pair_roles: np.ndarray | None = None  # a preference-pair build's pack: 0 chosen, 1 rejected, per document
    reference_logps: np.ndarray | None = None  # its stored reference log-probabilities, per document
    group_scores: np.ndarray | None = None  # a group build's scores (float64), per document
    group_ranks: np.ndarray | None = None  # a group build's ranks (1 the best), per document
    desirable: np.ndarray | None = None  # an unpaired build's pack: each example's label (2 documents an example)


def _pair_segments(packs: list[_Pack], segment_ids: np.ndarray, cu_seq_lens: np.ndarray, group_size: int | None) -> np.ndarray:
    """[P, G] int64: for each group of the batch, in pack order, the numbers of its G documents among the
    batch's segments (those of `cu_seq_lens_q`; padding tails are segments too): a pair's chosen and rejected
    (G = 2). Every pack must hold whole groups of one size (`pair_roles` 0, 1, …, G - 1, 0, 1, …)."""
    size = _require_whole_groups(packs, group_size)
    starts = cu_seq_lens[:-1]
    starts = starts[starts < segment_ids.size]  # a fixed-shape batch's unused segments: at the end, of no token
    documents = np.flatnonzero(segment_ids.reshape(-1)[starts] != 0)  # not a padding tail
    return documents.astype(np.int64).reshape(-1, size)


def _require_at_most(packs: list[_Pack], cap: int) -> None:
    for number, pack in enumerate(packs):
        if (documents := len(pack.cu_seqlens) - 1) > cap:
            raise UsageError(
                f"Pack {number} holds {documents} documents, more than max_docs_per_pack={cap}: a fixed-shape batch "
                "never splits or truncates a pack. Build with --max-docs-per-pack, at most this collator's."
            )


def _fixed_shape(fields: SegmentFields, segments: int) -> SegmentFields:
    """`fields` with `segments` segments in all, the ones not used of no token at the end (each a repeat of the
    last offset), and the longest segment taken as the row length: values that never change with the batch."""
    cu_seq_lens = np.full(segments + 1, fields.cu_seq_lens[-1], dtype=np.int32)
    cu_seq_lens[: len(fields.cu_seq_lens)] = fields.cu_seq_lens
    return fields._replace(cu_seq_lens=cu_seq_lens, max_length=fields.position_ids.shape[1])


def _require_whole_groups(packs: list[_Pack], group_size: int | None) -> int:
    """The batch's group size G (2: pairs), every pack holding whole groups: `pair_roles` 0, 1, …, G - 1 repeated.
    G is `group_size` (the build's, `for_dataset`) where given, else the packs' largest role + 1."""
    sizes = {int(pack.pair_roles.max()) + 1 for pack in packs if pack.pair_roles is not None and len(pack.pair_roles)}
    if group_size is not None:
        sizes.add(group_size)
    size = max(sizes, default=2)
    for number, pack in enumerate(packs):
        roles = pack.pair_roles
        documents = len(pack.cu_seqlens) - 1
        if roles is None or roles.tolist() != list(range(size)) * (documents // size) or documents % size or len(sizes) > 1:
            whole = unit_name(size, plural=True)
            first = "chosen 0, then rejected 1" if size == 2 else f"completions 0 to {size - 1} in order"
            raise IsolationError(
                f"Pack {number}: pair_roles {None if roles is None else roles.tolist()} do not make whole {whole} of "
                f"its {documents} documents ({first}); a batch of pairs or groups takes packs of one preference-pair "
                "or group build only."
            )
    return size


def _reference_logps(packs: list[_Pack], size: int) -> np.ndarray:
    """[P, G] float64: the stored reference log-probabilities of each group's documents (a pair's chosen and
    rejected), in the order of `_pair_segments` (every pack's documents, in order, make whole groups)."""
    return _per_group(packs, "reference_logps", size, "one PackedDataset(build, reference=DIR)").astype(np.float64)


def _group_values(packs: list[_Pack], size: int) -> dict[str, torch.Tensor]:
    """`group_scores` [P, G] float64 and `group_ranks` [P, G] int64 where the packs carry them: each group's
    values, its completions' in order, in the order of `_pair_segments` and of the shared-prompt layout's groups
    (the packs' groups, in pack order), so that row p is row p of `group_logps`."""
    fields = {}
    for name, dtype in (("group_scores", np.float64), ("group_ranks", np.int64)):
        if any(getattr(pack, name) is not None for pack in packs):
            build = "one group build (prepack build --groups with --scores-column or --ranks-column)"
            fields[name] = torch.from_numpy(_per_group(packs, name, size, build).astype(dtype))
    return fields


def _per_group(packs: list[_Pack], name: str, size: int, source: str) -> np.ndarray:
    """[P, G]: the packs' per-document values `name` (a `_Pack` field), a row a group, in the order of
    `_pair_segments` (every pack's documents, in order, make whole groups); UsageError when a pack has none."""
    if (missing := next((n for n, pack in enumerate(packs) if getattr(pack, name) is None), None)) is not None:
        raise UsageError(f"Pack {missing} has no {name!r} while others of the batch have: collate packs of {source}.")
    return np.concatenate([getattr(pack, name) for pack in packs]).reshape(-1, size)


def _desirable(packs: list[_Pack]) -> np.ndarray:
    """[P] bool: each example's label, in the order of the batch's groups (every pack's documents make whole pairs,
    `_require_whole_groups`, each with its label, `_checked_pack`)."""
    return _per_group(packs, "desirable", 1, "one unpaired build").reshape(-1).astype(bool)


def _cp_padded(pack: _Pack, multiple: int, pad_token_id: int | None) -> _Pack:
    """The pack with every document padded to a multiple of `multiple` (pad id, else the document's
    last token, as a row's padding), labels -100 there; the padding belongs to its document."""
    lengths = np.diff(pack.cu_seqlens)
    padded = -(-lengths // multiple) * multiple
    cu_padded = np.append(0, np.cumsum(padded))
    # Each token moves right by the padding of the documents before it.
    destination = np.arange(len(pack.input_ids)) + np.repeat(cu_padded[:-1] - pack.cu_seqlens[:-1], lengths)
    fill = np.repeat(pack.input_ids[pack.cu_seqlens[1:] - 1], padded) if pad_token_id is None else pad_token_id
    input_ids = np.full(cu_padded[-1], fill, dtype=np.int64) if np.isscalar(fill) else fill.astype(np.int64)
    labels = np.full(cu_padded[-1], IGNORE_INDEX, dtype=np.int64)
    input_ids[destination] = pack.input_ids
    labels[destination] = pack.input_ids if pack.labels is None else pack.labels
    return pack._replace(input_ids=input_ids, cu_seqlens=cu_padded, labels=labels)


def _per_document(pack: Mapping[str, Any], name: str, number: int, documents: int, float64: bool = False) -> np.ndarray | None:
    """Pack `number`'s column `name`, one value for each of its `documents`, or None where it has none; with
    `float64`, refused unless float64 as stored (a float32 copy has lost the stored values' precision)."""
    if pack.get(name) is None:
        return None
    values = np.asarray(pack[name])
    if values.shape != (documents,):
        raise UsageError(f"Pack {number}: {values.shape} {name} for {documents} documents.")
    if float64 and values.dtype != np.float64:
        raise UsageError(f"Pack {number}: {name} are {values.dtype}, not the stored float64 (datasets' numpy and torch "
                         "formats make floats float32: keep the column as open_hf_dataset formats it).")
    return values


def _checked_pack(pack: Mapping[str, Any], number: int, max_len: int | None, sources: bool = False) -> _Pack:
    """The pack's arrays, refused when its offsets do not describe its tokens (they would mix documents),
    with its `source_ids` when `sources` asks for them."""
    for key in ("input_ids", "cu_seqlens"):
        if key not in pack:
            raise UsageError(
                f"Pack {number} has no {key!r} (keys: {sorted(pack)}). With a Hugging Face Trainer, "
                "set remove_unused_columns=False so that the pack's columns reach the collator."
            )
    input_ids = np.asarray(pack["input_ids"])
    cu_seqlens = np.asarray(pack["cu_seqlens"])
    labels = np.asarray(pack["labels"]) if pack.get("labels") is not None else None
    tokens = len(input_ids)
    if input_ids.ndim != 1 or tokens == 0:
        raise UsageError(f"Pack {number}: input_ids must be a non-empty 1-D sequence, not shape {input_ids.shape}.")
    if max_len is not None and tokens > max_len:
        raise UsageError(f"Pack {number} has {tokens} tokens, more than max_len={max_len}.")
    if labels is not None and labels.shape != input_ids.shape:
        raise UsageError(f"Pack {number}: labels have shape {labels.shape}, input_ids {input_ids.shape}.")
    if (
        cu_seqlens.ndim != 1
        or len(cu_seqlens) < 2
        or cu_seqlens[0] != 0
        or cu_seqlens[-1] != tokens
        or not np.all(np.diff(cu_seqlens) > 0)
    ):
        raise IsolationError(
            f"Pack {number}: cu_seqlens {cu_seqlens.tolist()} must rise strictly from 0 to its {tokens} tokens."
        )
    documents = len(cu_seqlens) - 1
    source_ids = None
    if sources:
        if (source_ids := _per_document(pack, "source_ids", number, documents)) is None:
            raise UsageError(f"Pack {number} has no 'source_ids': source_ids=True collates the packs of a mixture build.")
        source_ids = source_ids.astype(np.int64)
    pair_roles = np.asarray(pack["pair_roles"]) if pack.get("pair_roles") is not None else None
    reference = _per_document(pack, "reference_logps", number, documents, float64=True)
    scores = _per_document(pack, "group_scores", number, documents, float64=True)
    if scores is not None and not np.isfinite(scores).all():
        raise UsageError(f"Pack {number}: group_scores must be finite, not {scores.tolist()}.")
    ranks = _per_document(pack, "group_ranks", number, documents)
    if ranks is not None and ranks.dtype.kind not in "iu":
        raise UsageError(f"Pack {number}: group_ranks must be integers, not {ranks.dtype}.")
    desirable = np.asarray(pack["desirable"]) if pack.get("desirable") is not None else None
    if desirable is not None and (desirable.ndim != 1 or 2 * desirable.size != documents):
        raise UsageError(f"Pack {number}: {desirable.size} 'desirable' labels for {documents} documents: a pack "
                         "of an unpaired build has one label every 2 documents.")
    return _Pack(input_ids, cu_seqlens, labels, source_ids, pair_roles, reference, scores, ranks, desirable)
