"""prepack: pack tokenized documents into fixed-length rows once, offline, and train on them with
exact per-document attention.

    import prepack
    manifest = prepack.build("corpus.parquet", "packed/", max_len=8192)
    prepack.build_store("corpus.parquet", "store/")          # tokenize once, then build many:
    prepack.build("store/", "packed-4k/", max_len=4096)
    dataset = prepack.PackedDataset("packed/")              # torch; imported on first use
    collate = prepack.PackedCollator(max_len=8192)
    model = prepack.enable_packing(model)

`import prepack` imports no third-party package: every public name but the errors loads on first use
(`prepack --help` is timed by benchmarks/bench_startup.py), so the build never
imports torch or transformers, and numba loads with the modules whose kernels a command runs.
"""

import sys
from importlib import import_module
from types import ModuleType

from prepack.errors import (
    DISTRIBUTION,
    ArgumentTypeError,
    DistributedSetupError,
    EngineError,
    FormatError,
    InputError,
    IsolationError,
    MissingExtraError,
    OutputError,
    PackIndexError,
    PrepackError,
    SamplerStateError,
    UsageError,
)

# Public names loaded on first use, and the module that defines each: `import prepack` imports neither
# numpy, pyarrow, numba nor pydantic until a name that needs them is used (`prepack --help` stays quick).
_LAZY = {
    "FORMAT_VERSION": "prepack.format",
    "Manifest": "prepack.format",
    "read_manifest": "prepack.format",
    "StoreManifest": "prepack.store_format",
    "read_store_manifest": "prepack.store_format",
    "build_store": "prepack.build",
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
        "ArgumentTypeError",
        "DistributedSetupError",
        "EngineError",
        "FORMAT_VERSION",
        "FormatError",
        "InputError",
        "IsolationError",
        "MissingExtraError",
        "OutputError",
        "PackIndexError",
        "PrepackError",
        "SamplerStateError",
        "UsageError",
        "build",
        *_LAZY,
    ]
)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    if name == "__version__":
        from importlib.metadata import version

        return version(DISTRIBUTION)
    raise AttributeError(f"module 'prepack' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__


class _Package(ModuleType):
    """The type of the `prepack` module, for one name: `prepack.build` is the function, but importing
    the submodule of the same name (which `build` and `build_store` do) binds the
    submodule to that attribute. This keeps the function there, loaded on first use like the rest."""

    @property
    def build(self):
        return import_module("prepack.build").build

    @build.setter
    def build(self, value) -> None:
        if not isinstance(value, ModuleType):  # only the import system binding the submodule is ignored
            raise AttributeError("prepack.build is the function prepack.build.build and cannot be replaced")


sys.modules[__name__].__class__ = _Package
