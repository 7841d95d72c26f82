"""Prove that packed documents stay apart: run a packed batch and each of its documents alone, and compare.

`measure_isolation` does the comparison (the tests use it too); `check_isolation` loads a local model or
a config, applies `enable_packing`, and measures it on random packs (`prepack check-isolation`);
`sweep` runs `check_isolation` on a tiny random model of every causal LM family the installed transformers
registers (`prepack.model.tiny_models`) and compares with `prepack.model.families`, the table measured on one release
(`prepack check-isolation --sweep`; the family sweep of the tests runs the same per family).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prepack.errors import InputError, IsolationError, PrepackError, optional_imports, require

with optional_imports("check_isolation"):
    import torch
    import transformers
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available, is_flash_attn_4_available

from prepack.model import families
from prepack.model.loading import load_local_model, torch_device
from prepack.model.packing import FLASH_ATTENTION, SUPPORTED_ATTENTION, enable_packing
from prepack.training.collate import PackedCollator
from prepack.formats.shards import IGNORE_INDEX

__all__ = [
    "FamilyCheck",
    "IsolationResult",
    "check_family",
    "check_isolation",
    "default_tolerances",
    "measure_isolation",
    "random_packs",
    "sweep",
]


@dataclass(frozen=True)
class IsolationResult:
    """How far a packed batch's outputs are from the same documents run one at a time.

    Logits are compared token by token over every document. The loss and gradients are compared with
    `loss_tolerance`, because transformers computes the loss from logits cast to float32.
    """

    model_class: str
    attn_implementation: str
    dtype: str
    device: str
    documents: int
    max_logit_diff: float  # largest |packed - alone| over the logits of every real token
    loss_diff: float  # |packed loss - token-weighted mean of the documents' losses alone|
    max_grad_diff: float | None  # largest difference in a parameter gradient; None when not measured
    tolerance: float
    loss_tolerance: float

    @property
    def passed(self) -> bool:
        grad_ok = self.max_grad_diff is None or self.max_grad_diff <= self.loss_tolerance
        return self.max_logit_diff <= self.tolerance and self.loss_diff <= self.loss_tolerance and grad_ok


# Default tolerances (logits, loss and gradients) per dtype, for check_isolation and the family sweep.
# float64 is bounded by what transformers computes in float32 inside a float64 model: MoE routers (measured
# up to 5e-8) and eager attention's softmax (up to 2e-6, hence its own bound). The smallest leak measured
# over every family was 1.3e-5, which float32's bound (1e-4) misses: check in float64 on a CPU.
_TOLERANCES = {
    torch.float64: (1e-6, 1e-5),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (5e-2, 5e-2),
    torch.float16: (1e-2, 1e-2),
}
_EAGER_FLOAT64_TOLERANCE = 5e-6


def default_tolerances(dtype: torch.dtype, attn: str) -> tuple[float, float]:
    """(logits, loss and gradients) tolerances for a model of `dtype` on attention `attn`."""
    tolerance, loss_tolerance = _TOLERANCES[dtype]
    if dtype == torch.float64 and attn == "eager":
        tolerance = _EAGER_FLOAT64_TOLERANCE
    return tolerance, loss_tolerance


def measure_isolation(
    model: transformers.PreTrainedModel,
    packs: Sequence[Mapping[str, Any]],
    batch: Mapping[str, Any],
    *,
    tolerance: float,
    loss_tolerance: float | None = None,
    gradients: bool = True,
) -> IsolationResult:
    """Run `batch` (collated from `packs`, one pack per row or all in one row) and each document alone.

    The model runs in eval mode (no dropout) and is put back in its mode afterwards; gradients are
    taken with `torch.autograd.grad`, so the parameters' `.grad` are left alone. `batch` is passed as
    it is: apply `enable_packing` first to measure the protected model.
    """
    parameters = [p for p in model.parameters() if p.requires_grad] if gradients else []
    was_training = model.training
    model.eval()
    try:
        packed = _run(model, _on_device(batch, model.device), parameters)
        alone = [_run(model, _alone_batch(document, model.device), parameters) for document in _documents(packs)]
    finally:
        model.train(was_training)
    targets = sum(run.targets for run in alone)
    loss_diff = 0.0  # no token is trained on: there is no loss to compare
    if targets:
        alone_loss = sum(run.loss * run.targets for run in alone if run.targets) / targets
        loss_diff = abs(float(packed.loss) - float(alone_loss))
    return IsolationResult(
        model_class=type(model).__name__,
        attn_implementation=model.config.get_text_config()._attn_implementation,
        dtype=str(model.dtype).removeprefix("torch."),
        device=str(model.device),
        documents=len(alone),
        max_logit_diff=_largest_logit_diff(packed.logits, [run.logits for run in alone], packs),
        loss_diff=loss_diff,
        max_grad_diff=_largest_grad_diff(packed, alone, targets) if parameters and targets else None,
        tolerance=tolerance,
        loss_tolerance=max(tolerance, 1e-5) if loss_tolerance is None else loss_tolerance,
    )


@dataclass
class _Run:
    logits: torch.Tensor  # [rows, width, vocab], detached
    loss: torch.Tensor | None
    targets: int  # tokens the loss is averaged over
    grads: list[torch.Tensor | None]


def _run(model, batch: Mapping[str, Any], parameters: list[torch.nn.Parameter]) -> _Run:
    labels = batch.get("labels")
    targets = int((labels[:, 1:] != IGNORE_INDEX).sum()) if labels is not None else 0
    if not targets:
        batch = {key: value for key, value in batch.items() if key != "labels"}
    with torch.set_grad_enabled(bool(parameters and targets)):
        output = model(**batch)
    grads = []
    if parameters and targets:
        grads = list(torch.autograd.grad(output.loss, parameters, allow_unused=True))
    loss = output.loss.detach() if targets else None
    return _Run(output.logits.detach(), loss, targets, grads)


def _documents(packs: Sequence[Mapping[str, Any]]):
    """Each document of each pack as (input_ids, labels) numpy arrays."""
    for pack in packs:
        input_ids = np.asarray(pack["input_ids"])
        labels = np.asarray(pack["labels"]) if pack.get("labels") is not None else input_ids
        cu_seqlens = np.asarray(pack["cu_seqlens"])
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            yield input_ids[start:end], labels[start:end]


def _alone_batch(document: tuple[np.ndarray, np.ndarray], device: torch.device) -> dict[str, Any]:
    input_ids, labels = (torch.as_tensor(array, dtype=torch.long, device=device)[None] for array in document)
    return {"input_ids": input_ids, "labels": labels, "use_cache": False}


def _on_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def _largest_logit_diff(packed: torch.Tensor, alone: list[torch.Tensor], packs: Sequence[Mapping[str, Any]]) -> float:
    """Pack i is row i's first tokens, or (one row holding every pack) the i-th stretch of row 0."""
    one_row = packed.shape[0] == 1
    documents = iter(alone)
    differences, start = [], 0
    for row, pack in enumerate(packs):
        count = len(pack["cu_seqlens"]) - 1
        expected = torch.cat([next(documents)[0] for _ in range(count)])
        got = packed[0, start : start + len(expected)] if one_row else packed[row, : len(expected)]
        differences.append(got - expected)
        start += len(expected)
    return _largest(differences)


def _largest_grad_diff(packed: _Run, alone: list[_Run], targets: int) -> float:
    """Packed gradients against the gradients of the token-weighted sum of the documents' losses."""
    differences = []
    for index, packed_grad in enumerate(packed.grads):
        weighted = [
            run.grads[index] * (run.targets / targets) for run in alone if run.grads and run.grads[index] is not None
        ]
        if packed_grad is None and not weighted:
            continue  # a parameter the text path does not use (a vision tower)
        expected = sum(weighted) if weighted else torch.zeros_like(packed_grad)
        differences.append(expected if packed_grad is None else packed_grad - expected)
    return _largest(differences)


def _largest(differences: list[torch.Tensor]) -> float:
    """The largest absolute value; NaN if any is NaN (Python's max would drop it)."""
    return float(torch.stack([difference.abs().max() for difference in differences]).max()) if differences else 0.0


def random_packs(
    count: int, max_len: int, vocab_size: int, *, seed: int = 0, labels: bool = False, avoid: Iterable[int] = ()
) -> list[dict[str, np.ndarray]]:
    """`count` packs of random documents, each pack 1-4 documents filling half to all but one of `max_len`.

    Every pack leaves padding in its row (so the padding path is exercised); with `labels`, about a
    fifth of the labels are -100, as prompts would be. Token ids in `avoid` (a model's image or audio
    placeholders, which would need pixels or sound) are not drawn.
    """
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(avoid, dtype=np.int64))
    packs = []
    for _ in range(count):
        tokens = int(rng.integers(max(1, max_len // 2), max_len)) if max_len > 1 else 1
        cuts = rng.choice(np.arange(1, tokens), size=min(int(rng.integers(0, 4)), tokens - 1), replace=False)
        pack = {
            "input_ids": allowed[rng.integers(0, len(allowed), size=tokens)].astype(np.int32),
            "cu_seqlens": np.array([0, *sorted(cuts), tokens], dtype=np.int32),
        }
        if labels:
            pack["labels"] = np.where(rng.random(tokens) < 0.2, IGNORE_INDEX, pack["input_ids"]).astype(np.int32)
        packs.append(pack)
    return packs


def check_isolation(
    model: str | os.PathLike,
    attn: str = "sdpa",
    *,
    dtype: str | None = None,
    device: str | None = None,
    packs: int = 2,
    max_len: int = 256,
    seed: int = 0,
    tolerance: float | None = None,
    gradients: bool = True,
) -> IsolationResult:
    """Check that packed batches are isolated on a local model with `enable_packing`.

    `model` is a local model directory (loaded with `local_files_only=True`) or a `config.json` (random
    weights, seeded). Runs `packs` random packs padded to `max_len` in one batch, then each document
    alone, and compares logits, loss and (with `gradients`) parameter gradients. `device` defaults to
    CUDA when available; `dtype` to "float64" on a CPU (float32 hides leaks of 1e-5), "float32" on CUDA
    and on flex_attention on a CPU (compiled flex has no float64 there), and "bfloat16" on flash attention;
    `tolerance` per dtype (`default_tolerances`). flex_attention on a CPU compares logits and loss only:
    torch's flex has no backward there. In float64 the MoE
    experts run transformers' eager loop (`experts_implementation="eager"`): its grouped_mm kernel has no
    float64. Image and audio placeholder tokens are not drawn. flash_attention_2/3/4 need a CUDA device, the
    flash-attn (flash-attn-3, flash-attn-4) package and dtype "bfloat16" or "float16".

    A model type that `prepack.model.families` lacks is measured (`enable_packing(..., allow_unlisted=True)`):
    that is how to check one. Raises InputError for a path that holds no loadable model (or one whose config
    does not match its weights: `prepack.model.loading`), an unknown `attn` or `dtype`, a device that cannot
    run it here, or a flash backend that cannot run here; IsolationError for a family
    prepack refuses on this backend (with the reason), and for a model that fails on the packed batch
    or a document alone.
    """
    dtypes = {str(known).removeprefix("torch."): known for known in _TOLERANCES}
    flash = attn in FLASH_ATTENTION
    target = torch_device(device)
    flex_on_cpu = attn == "flex_attention" and target.type == "cpu"
    dtype = dtype or ("bfloat16" if flash else "float32" if target.type == "cuda" or flex_on_cpu else "float64")
    gradients = gradients and not flex_on_cpu  # torch's flex_attention has no backward on a CPU
    if attn not in SUPPORTED_ATTENTION or dtype not in dtypes:
        raise InputError(
            f"attn must be one of {', '.join(SUPPORTED_ATTENTION)} (got {attn!r}) and dtype one of "
            f"{', '.join(dtypes)} (got {dtype!r})."
        )
    if flash:
        _require_flash_kernels(attn, dtype, target)
    loaded = load_local_model(model, attn, dtypes[dtype], target, random_weights_seed=seed)
    enable_packing(loaded, allow_unlisted=True)
    config = loaded.config.get_text_config()
    placeholders = _placeholder_ids(loaded.config) | _placeholder_ids(config)
    sample = random_packs(packs, max_len, config.vocab_size, seed=seed, avoid=placeholders)
    loss_tolerance = None  # measure_isolation's default for a given tolerance
    if tolerance is None:
        tolerance, loss_tolerance = default_tolerances(dtypes[dtype], attn)
    try:
        return measure_isolation(
            loaded,
            sample,
            PackedCollator(max_len)(sample),
            tolerance=tolerance,
            loss_tolerance=loss_tolerance,
            gradients=gradients,
        )
    except PrepackError:
        raise
    except Exception as exc:  # the model's own failure: not a leak, and not a measurement either
        first_line = str(exc).strip().partition("\n")[0]
        raise IsolationError(
            f"{loaded.config.model_type} ({type(loaded).__name__}) on {attn} failed on the packed batch or on a "
            f"document alone, so isolation could not be measured: {type(exc).__name__}: {first_line}"
        ) from exc


# Token ids that stand for something other than text; pad, bos, eos and the like are ordinary tokens.
_ORDINARY_TOKENS = frozenset({"pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id"})


def _placeholder_ids(config) -> set[int]:
    """Image, video and audio placeholder ids of a config: a model asks for pixels or sound where they are."""
    return {
        value
        for key, value in config.to_dict().items()
        if key.endswith(("_token_id", "_token_index")) and key not in _ORDINARY_TOKENS
        and type(value) is int
    }


def _require_flash_kernels(attn: str, dtype: str, device: torch.device) -> None:
    """Refuse before loading: transformers would fail later, or (with the `kernels` package installed
    and no flash-attn) try to download a kernel from the Hub."""
    package, available = {
        "flash_attention_2": ("flash-attn", is_flash_attn_2_available),
        "flash_attention_3": ("flash-attn-3", is_flash_attn_3_available),
        "flash_attention_4": ("flash-attn-4", is_flash_attn_4_available),
    }[attn]
    usable = available()
    if device.type == "cuda" and attn == "flash_attention_2" and not usable:
        require("flash_attn", "--attn flash_attention_2")  # MissingExtraError where it is not installed
    if device.type != "cuda" or not usable:
        raise InputError(
            f"{attn} runs {package}'s CUDA kernels: it needs a CUDA device and {package} installed. Here the "
            f"device is {device}, and transformers finds {package} {'usable' if usable else 'not usable'}. "
            f"Check sdpa or eager instead, or run it on a CUDA machine where {package} is installed."
        )
    if dtype not in ("bfloat16", "float16"):
        raise InputError(f"{attn}: flash-attn kernels take bfloat16 or float16, not {dtype}.")


@dataclass(frozen=True)
class FamilyCheck:
    """One family of the installed transformers, checked on one backend, against `prepack.model.families`."""

    model_type: str
    attn_implementation: str
    table: str  # the table's verdict ("isolated (native)", "refused", "not measured on this version")
    measured: str  # "isolated", "leaks", "refused: ...", "fails: ...", "no tiny model: ..."

    @property
    def agrees(self) -> bool:
        """The measurement gives the table's verdict (a family the table lacks never agrees: add its row)."""
        if self.table.startswith("isolated"):
            return self.measured == "isolated"
        return self.table == "refused" and not self.measured.startswith(("isolated", "leaks"))


# Sweep sizes: packs of 3 random packs of up to 32 tokens, longer than the tiny models' windows and chunks.
_SWEEP_PACKS, _SWEEP_MAX_LEN = 3, 32


def check_family(model_type: str, attn: str = "sdpa", *, device: str | None = None) -> FamilyCheck:
    """`check_isolation` on a tiny random model of `model_type` (its default dtype: float64 on a CPU, float32
    for flex there; no gradients), compared with the table's verdict. A family the table lacks is measured
    (`allow_unlisted`). flash_attention_2/3/4 need CUDA and their package, as for `check_isolation`."""
    from prepack.model.tiny_models import tiny_config  # the config shrinking: only the sweep needs it

    found = families.verdict(model_type, attn)
    table = "not measured on this version" if found is None else f"isolated ({found.label})" if found.isolated else "refused"
    with tempfile.TemporaryDirectory(prefix="prepack-sweep-") as folder:
        path = Path(folder) / "config.json"
        try:
            tiny_config(model_type).to_json_file(path)
        except Exception as exc:  # noqa: BLE001 (a config class that does not build from its own defaults)
            return FamilyCheck(model_type, attn, table, f"no tiny model: {type(exc).__name__}: {_first_line(exc)}")
        try:
            result = check_isolation(
                path, attn, device=device, packs=_SWEEP_PACKS, max_len=_SWEEP_MAX_LEN, gradients=False
            )
        except IsolationError as exc:
            return FamilyCheck(model_type, attn, table, f"{'refused' if found else 'fails'}: {_first_line(exc)}")
        except PrepackError as exc:
            return FamilyCheck(model_type, attn, table, f"fails: {_first_line(exc)}")
    return FamilyCheck(model_type, attn, table, "isolated" if result.passed else "leaks")


def sweep(attn: str = "sdpa", *, device: str | None = None) -> Iterator[FamilyCheck]:
    """`check_family` for every causal LM family the installed transformers registers, in name order."""
    from prepack.model.tiny_models import CAUSAL_LM_TYPES

    for model_type in CAUSAL_LM_TYPES:
        yield check_family(model_type, attn, device=device)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().partition("\n")[0]
