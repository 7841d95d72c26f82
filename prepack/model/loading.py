"""The one rule of the commands that run a local model (`prepack check-isolation`, `prepack reference-logps`)
for choosing its device and loading it: `torch_device` refuses a device that cannot run it here, and
`load_local_model` a directory that holds no model whose weights are all its own. Nothing is downloaded.

A refusal is an InputError naming the path or device and the cause, before anything is computed.
"""

from __future__ import annotations

import os
from pathlib import Path

from prepack.errors import InputError, optional_imports

with optional_imports("prepack.model.loading"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

__all__ = ["load_local_model", "torch_device"]


def torch_device(name: str | None) -> torch.device:
    """The torch device `name` names (None: CUDA when there is one, else the CPU), refused unless this torch
    can run a model there: an unknown name, an accelerator this torch does not see (or an index past its
    count), and "meta" (tensors without values: a model there computes nothing)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"device {name!r} is not a torch device such as cpu, cuda or cuda:1.") from None
    if device.type == "meta":
        raise InputError(f"device {name!r} holds no values (tensors there have shapes only): choose cpu or cuda.")
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu, ...
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise InputError(f"device {name!r}: this torch ({torch.__version__}) sees no {device.type.upper()} device.")
    count = backend.device_count() if hasattr(backend, "device_count") else None
    if device.index is not None and count is not None and device.index >= count:
        raise InputError(f"device {name!r}: this torch sees {count} {device.type.upper()} device(s), numbered from 0.")
    return device


def load_local_model(
    path: str | os.PathLike,
    attn: str,
    dtype: torch.dtype | None,
    device: torch.device,
    *,
    random_weights_seed: int | None = None,
    progress: bool = True,
):
    """The causal language model of the local model directory `path` (config.json and weights), on
    the attention implementation `attn`, in `dtype` (None: the checkpoint's), moved to `device` (from `torch_device`).

    With `random_weights_seed`, `path` may also be a config.json alone: random weights, seeded so. Without
    `progress`, transformers' own bar of the weights loaded is not shown. Refused
    (InputError): a path that does not exist, or is not a directory where weights are needed; a model
    transformers cannot build or load (a corrupt weights file, shapes its config does not give them); and
    a config that does not match its weights, which transformers would load anyway, filling the weights
    it lacks at random (or leaving out those it does not use)."""
    path = Path(path)
    options = {"attn_implementation": attn, "dtype": "auto" if dtype is None else dtype}
    if dtype == torch.float64:
        options["experts_implementation"] = "eager"  # grouped_mm, the default, has no float64 kernel
    config_alone = random_weights_seed is not None
    if not path.exists():
        raise InputError(f"{path}: no such model directory{' or config.json' if config_alone else ''}.")
    if path.is_file() and not config_alone:
        raise InputError(f"{path} is not a directory; give a local model directory (config.json and weights).")
    bar_shown = transformers_logging.is_progress_bar_enabled()
    if not progress:
        transformers_logging.disable_progress_bar()
    try:
        if path.is_file():
            torch.manual_seed(random_weights_seed)
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            loaded, unmatched = AutoModelForCausalLM.from_config(config, **options), None
        else:
            loaded, info = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, output_loading_info=True, **options)
            unmatched = _unmatched_weights(info)
    except Exception as exc:  # noqa: BLE001 (a model's own code fails in any way: AttributeError, ImportError, ...)
        hint = " (to check random weights, pass its config.json)" if config_alone and (path / "config.json").is_file() else ""
        first_line = str(exc).strip().partition("\n")[0]  # some messages go on to list every known model
        raise InputError(
            f"{path}: no causal language model loads from it{hint}: {type(exc).__name__}: {first_line}"
        ) from exc
    finally:
        if bar_shown:
            transformers_logging.enable_progress_bar()
    if unmatched:
        raise InputError(f"{path}: its config does not match its weights: {unmatched}.")
    return loaded.to(device)


def _unmatched_weights(info: dict) -> str:
    """What of a checkpoint's loading report says its weights are not the model's own ('' when they are)."""
    parts = []
    for key, what in (("missing_keys", "it needs are missing"), ("unexpected_keys", "it holds are not used")):
        names = sorted(info.get(key) or ())
        if names:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            parts.append(f"{len(names)} weights {what} ({shown})")
    return "; ".join(parts)
