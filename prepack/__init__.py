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
imports torch or transformers, and numba loads when a command first runs one of its kernels (an index build
of a small store runs none: `prepack.building.kernels`).
"""

import sys
from importlib import import_module

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
    SequenceTooLongError,
    UsageError,
)

# Public names loaded on first use, and the module that defines each: `import prepack` imports neither
# numpy, pyarrow, numba nor pydantic until a name that needs them is used (`prepack --help` stays quick).
_LAZY = {
    "FORMAT_VERSION": "prepack.formats.shards",
    "Manifest": "prepack.formats.shards",
    "read_manifest": "prepack.formats.shards",
    "StoreManifest": "prepack.formats.store",
    "read_store_manifest": "prepack.formats.store",
    "build": "prepack.building.build",
    "build_store": "prepack.building.build",
    "PackedDataset": "prepack.training.dataset",
    "PackedSampler": "prepack.training.sampler",
    "open_hf_dataset": "prepack.training.dataset",
    "PackedCollator": "prepack.training.collate",
    "loss_weights": "prepack.training.loss",
    "split_for_cp": "prepack.training.context_parallel",
    "weighted_loss": "prepack.training.loss",
    "enable_packing": "prepack.model.packing",
    "disable_packing": "prepack.model.packing",
    "UsefulThroughputCallback": "prepack.training.throughput",
    "batch_tokens": "prepack.training.throughput",
    "ImagePackedDataset": "prepack.training.vision_dataset",
    "VisionCollator": "prepack.training.vision_collate",
    "VisionSpec": "prepack.training.vision_collate",
    "check_isolation": "prepack.model.isolation",
    "inspect_build": "prepack.check.report",
    "verify_build": "prepack.check.verify",
    "verify_store": "prepack.check.verify",
    "export_build": "prepack.exports",
    "verify_export": "prepack.exports",
    "plan_rollouts": "prepack.building.rollouts",
    "rollout_micro_batches": "prepack.training.rollouts",
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
        "SequenceTooLongError",
        "UsageError",
        *_LAZY,
    ]
)


# A chat tokenizer worker that is starting re-runs the script that started the build; when that fails (a
# script calling prepack unguarded), the build's EngineError is the one message, not a traceback per worker.
if "multiprocessing" in sys.modules:
    from prepack.sources.tokenizer_workers import quiet_failing_start

    quiet_failing_start()


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    if name == "__version__":
        from importlib.metadata import version

        return version(DISTRIBUTION)
    raise AttributeError(f"module 'prepack' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
