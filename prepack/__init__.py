"""prepack: pack tokenized documents into fixed-length rows once, offline, and train on them with
exact per-document attention.

    import prepack
    manifest = prepack.build("corpus.parquet", "packed/", max_len=8192)
    prepack.build_store("corpus.parquet", "store/")          # tokenize once, then build many:
    prepack.build("store/", "packed-4k/", max_len=4096)
    dataset = prepack.PackedDataset("packed/")              # torch; imported on first use
    collate = prepack.PackedCollator(max_len=8192)
    model = prepack.enable_packing(model)

`import prepack` does not import torch or transformers: the loader, the attention integration, the
report and verify load when their names are first used.
"""

from importlib import import_module
from importlib.metadata import version

from prepack.build import build
from prepack.errors import EngineError, FormatError, InputError, IsolationError, OutputError, PrepackError
from prepack.format import FORMAT_VERSION, Manifest, read_manifest
from prepack.store_format import StoreManifest, read_store_manifest
from prepack.store_write import build_store

__version__ = version("prepack-llm")

# Public names loaded on first use, and the module that defines each.
_LAZY = {
    "PackedDataset": "prepack.load",
    "PackedSampler": "prepack.sample",
    "open_hf_dataset": "prepack.load",
    "PackedCollator": "prepack.collate",
    "loss_weights": "prepack.loss",
    "split_for_cp": "prepack.context_parallel",
    "weighted_loss": "prepack.loss",
    "enable_packing": "prepack.attention",
    "disable_packing": "prepack.attention",
    "UsefulThroughputCallback": "prepack.throughput",
    "batch_tokens": "prepack.throughput",
    "check_isolation": "prepack.isolation",
    "inspect_build": "prepack.report",
    "verify_build": "prepack.verify",
}

__all__ = sorted(
    [
        "EngineError",
        "FORMAT_VERSION",
        "FormatError",
        "InputError",
        "IsolationError",
        "Manifest",
        "OutputError",
        "PrepackError",
        "StoreManifest",
        "build",
        "build_store",
        "read_manifest",
        "read_store_manifest",
        *_LAZY,
    ]
)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'prepack' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
