"""Useful throughput during training: real tokens a second and the padding fraction of each batch.

Most trainers count every slot of a batch as throughput (HF Trainer's `num_input_tokens_seen` counts
the padding of a prepack batch too: it has no attention mask, and its padding repeats a real token).
`batch_tokens(batch)` counts what a batch holds, from the batch alone:

- `slots`: the batch's shape, rows x width;
- `real`: the tokens that are not padding, counted from what marks the batch's segments. A 2-D
  `attention_mask` (a padded batch, prepack's `indexed_mask` layout) says it: its non-zero entries. A
  context-parallel batch (`PackedCollator(cp_size=k)`, whole or a rank's part from `split_for_cp`) pads
  inside each document: its `cu_seqlens` hold the documents' real lengths. Otherwise, where the batch has
  `position_ids` (prepack's `PackedCollator` and `VisionCollator`, transformers'
  `DataCollatorWithFlattening`; of 3-D rotary [4, B, L] or [3, B, L] positions the first row), a row's
  padding is its last segment (position_ids restart at 0 there) when it is the collators' padding
  segment: not the whole row, one token repeated (the row's last token, or the pad id) and never trained
  on. A document that looks the same (untrained, one token repeated, at the very end of a full row) is
  counted as padding too, so the figure errs low, never high. A batch with none of these has no padding
  that can be seen;
- `trained`: the labels other than -100, the tokens the loss is averaged over.

`UsefulThroughputCallback` is an HF `TrainerCallback` that counts every training forward's batch (a
forward pre-hook on the model) and adds to each log `real_tokens_per_second`, `padding_fraction` and
`trained_tokens_per_second` over the steps since the previous log, plus the running `real_tokens` total.
The counts stay on the batch's device until a log reads them, so counting costs no device sync a step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from prepack.errors import UsageError, optional_imports
from prepack.formats.shards import IGNORE_INDEX

with optional_imports("prepack.training.throughput"):
    import torch
    from transformers import TrainerCallback

__all__ = ["BatchTokens", "UsefulThroughputCallback", "batch_tokens"]


class BatchTokens(NamedTuple):
    """Token counts of one batch (0-d tensors on the batch's device, or ints; see `batch_tokens`)."""

    slots: int  # rows x width: what a trainer that counts the batch's shape calls its tokens
    real: torch.Tensor | int  # tokens that are not padding
    trained: torch.Tensor | int  # labels other than -100

    @property
    def padding_fraction(self) -> float:
        return 1.0 - int(self.real) / self.slots if self.slots else 0.0


def batch_tokens(batch: Mapping[str, Any]) -> BatchTokens:
    """Slots, real and trained tokens of a batch of `input_ids` (or `inputs_embeds`) [B, L] (module docstring)."""
    tokens = batch.get("input_ids")
    tokens = batch.get("inputs_embeds") if tokens is None else tokens
    if tokens is None or tokens.dim() < 2:
        raise UsageError("batch_tokens needs a batch with input_ids (or inputs_embeds) of shape [rows, width].")
    rows, width = tokens.shape[:2]
    slots = rows * width
    labels = batch.get("labels")
    trained = (labels != IGNORE_INDEX).sum() if labels is not None else slots
    mask, positions, input_ids = batch.get("attention_mask"), batch.get("position_ids"), batch.get("input_ids")
    if mask is not None and mask.dim() == 2:
        real = (mask != 0).sum()
    elif batch.get("cu_seqlens") is not None and batch.get("cu_seqlens_padded") is not None:
        real = _real_in_documents(batch, slots)
    elif positions is not None and (input_ids is not None or labels is not None):
        if positions.dim() == 3:  # 3-D rotary: the text row of [4, B, L]; of [3, B, L], the temporal row
            positions = positions[0]
        shape = (rows, width)
        real = slots - _padding_tails(
            positions.expand(shape),
            None if input_ids is None else input_ids.reshape(shape),
            None if labels is None else labels.reshape(shape),
        ).sum()
    else:
        real = slots
    return BatchTokens(slots, real, trained)


def _padding_tails(positions: torch.Tensor, input_ids: torch.Tensor | None, labels: torch.Tensor | None) -> torch.Tensor:
    """Per row, the length of its padding segment: its last segment when that is not the whole row, holds one
    token repeated and no trained label (of input_ids and labels, those the batch has), else 0."""
    width = positions.shape[1]
    columns = torch.arange(width, device=positions.device).expand_as(positions)
    last_start = torch.where(positions == 0, columns, 0).amax(dim=1)
    in_tail = columns >= last_start[:, None]
    padding = last_start > 0
    if input_ids is not None:
        first = input_ids.gather(1, last_start[:, None])
        padding &= ((input_ids == first) | ~in_tail).all(dim=1)
    if labels is not None:
        padding &= ~((labels != IGNORE_INDEX) & in_tail).any(dim=1)
    return torch.where(padding, width - last_start, 0)


def _real_in_documents(batch: Mapping[str, Any], slots: int) -> torch.Tensor:
    """How many of a context-parallel batch's tokens (all, or a part's `cp_indices`) lie within their
    document's real length (`cu_seqlens`) rather than in its padding (`cu_seqlens_padded`)."""
    real_ends, padded = batch["cu_seqlens"].to(torch.int64), batch["cu_seqlens_padded"].to(torch.int64)
    index = batch.get("cp_indices")
    index = torch.arange(slots, device=padded.device) if index is None else index.to(padded.device)
    document = torch.searchsorted(padded, index, right=True) - 1
    lengths = real_ends[1:] - real_ends[:-1]
    return (index - padded[document] < lengths[document]).sum()


class UsefulThroughputCallback(TrainerCallback):
    """Log real tokens/s, trained tokens/s and the padding fraction of the batches a Trainer trains on.

        trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                          callbacks=[UsefulThroughputCallback()])

    The figures go into each log the Trainer writes (the console, `trainer.state.log_history`). Reporting
    integrations chosen with `report_to` run before the callbacks passed in: to send them these figures too,
    put it first, `trainer.callback_handler.callbacks.insert(0, UsefulThroughputCallback())`.
    """

    def __init__(self) -> None:
        self._hook = None
        self._real_total = 0
        self._reset_window()

    def _reset_window(self) -> None:
        self._slots = 0
        self._real: list[torch.Tensor | int] = []
        self._trained: list[torch.Tensor | int] = []
        self._since = time.perf_counter()

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not module.training:
            return  # evaluation batches are not training throughput
        batch = dict(kwargs)
        if args:  # model(input_ids) positionally
            batch.setdefault("input_ids", args[0])
        if batch.get("input_ids") is None and batch.get("inputs_embeds") is None:
            return
        counts = batch_tokens(batch)
        self._slots += counts.slots
        self._real.append(counts.real)
        self._trained.append(counts.trained)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._remove_hook()
        if model is not None:
            self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)
        self._reset_window()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self._slots or "loss" not in logs:
            return  # evaluation or end-of-training summaries: no training window to report
        seconds = max(time.perf_counter() - self._since, 1e-9)
        real = int(sum(int(count) for count in self._real))
        trained = int(sum(int(count) for count in self._trained))
        self._real_total += real
        figures = {
            "real_tokens_per_second": round(real / seconds, 1),
            "trained_tokens_per_second": round(trained / seconds, 1),
            "padding_fraction": round(1.0 - real / self._slots, 4),
            "real_tokens": self._real_total,
        }
        logs.update(figures)
        if state.log_history:  # the Trainer appended its copy of `logs` before calling the callbacks
            state.log_history[-1].update(figures)
        self._reset_window()

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hook()

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
