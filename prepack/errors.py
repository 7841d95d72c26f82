"""The errors prepack raises.

    PrepackError                 every error prepack raises on purpose; the CLI prints it and exits 2
    ├── InputError               the corpus (or an option) is wrong: names the file, row and column
    ├── OutputError              the output directory cannot be written as asked
    ├── FormatError              a shard directory breaks the format in schemas/shard-format.md
    ├── EngineError              the engine itself failed: a Ray cluster unreachable, a task or node lost,
    │                            a chat tokenizer worker process dead
    ├── IsolationError           a batch or a model set-up would let documents attend to each other
    ├── SamplerStateError        a PackedSampler state (a checkpoint's) is malformed or for another setup
    ├── DistributedSetupError    the processes of a job are not set up to train as one
    ├── UsageError               the training API is called wrongly: an argument out of range or not one of
    │   │                        its choices, a batch without the fields the call needs (also a ValueError)
    │   ├── ArgumentTypeError    an argument of a type the call cannot use (also a TypeError)
    │   ├── SequenceTooLongError a rollout sequence (or GRPO group) longer than the micro-batch token cap
    │   └── PackIndexError       a pack index out of range of a PackedDataset (also an IndexError)
    └── MissingExtraError        an optional dependency is not installed: names the extra and its install line
                                 (also an ImportError)

`optional_imports` and `require` are how every optional dependency is imported, so that a missing one is
announced one way: MissingExtraError.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import import_module
from types import ModuleType

__all__ = [
    "ArgumentTypeError",
    "DISTRIBUTION",
    "DistributedSetupError",
    "EXTRAS",
    "EngineError",
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
    "optional_imports",
    "require",
]

# The name prepack is installed under (`prepack` on the package index is an unrelated library): install
# lines and the version recorded in manifests use it.
DISTRIBUTION = "prepack-llm"

# Each optional dependency, by the name it is imported as, and the extra of pyproject.toml installing it.
EXTRAS = {
    "torch": "train",
    "transformers": "train",
    "datasets": "train",
    "accelerate": "train",
    "torchdata": "train",
    "tokenizers": "tokenize",
    "jinja2": "tokenize",
    "fsspec": "s3",
    "s3fs": "s3",
    "gcsfs": "gcs",
    "ray": "ray",
    "matplotlib": "plot",
    "trl": "trl",
    "flash_attn": "flash",
    "PIL": "images",
    "lance": "export",
}


class PrepackError(Exception):
    """Base class of every error prepack raises on purpose."""


class InputError(PrepackError):
    """The corpus or an option is wrong; the message names the file, row and column."""


class OutputError(PrepackError):
    """The output directory cannot be written as asked."""


class EngineError(PrepackError):
    """The engine running a build failed, not its input or output: a Ray cluster that cannot be joined,
    a task that failed after its retries, a node lost with what it held, a local chat tokenizer worker
    process that died (killed, or unable to start: a script calling prepack without a main guard)."""


class FormatError(PrepackError):
    """A shard directory does not follow the prepack shard format.

    `problem` is the finding as fields (a `prepack.formats.shards.FormatProblem`: file, message, row, column)
    when the format's readers raise it, so that callers never take the message text apart.
    """

    def __init__(self, message: str, problem=None):
        super().__init__(message)
        self.problem = problem

    def __reduce__(self):  # pickled whole, `problem` included (a Ray worker's error reaches the driver so)
        return type(self), (str(self), self.problem)


class IsolationError(PrepackError):
    """A batch or model configuration would let tokens attend across document boundaries."""


class SamplerStateError(PrepackError, ValueError):
    """A `PackedSampler` state is not one it can resume from: a field missing, mistyped or out of range,
    or saved for another dataset size, seed or order. A ValueError too, as the sampler raised before."""


class DistributedSetupError(PrepackError, RuntimeError):
    """The processes of a job would not train as one: launched as several (`WORLD_SIZE` > 1) without a
    process group, or with one that Accelerate does not use for DDP, so that each rank would train a
    model of its own on its share of the packs. A RuntimeError too, as the sampler raised before."""


class UsageError(PrepackError, ValueError):
    """The training API is called wrongly: an argument out of its range or not one of its choices, or a
    batch or pack without the fields (or shapes) the call needs. A ValueError too, as raised before."""


class ArgumentTypeError(UsageError, TypeError):
    """An argument of a type the call cannot use: a dataset `PackedCollator.for_dataset` cannot size, one
    `PackedSampler` cannot balance. A TypeError too, as raised before."""


class SequenceTooLongError(UsageError):
    """A rollout sequence, or a group kept whole, has more tokens than a micro-batch may hold
    (`prepack.building.rollouts.plan_rollouts`): no plan keeps it whole under the cap, and cutting it would
    change its log-probabilities."""


class PackIndexError(UsageError, IndexError):
    """A pack index out of range of a `PackedDataset`. An IndexError too, which is what ends iterating a
    dataset by index (`for pack in dataset`) and what sequence code expects."""


class MissingExtraError(PrepackError, ImportError):
    """An optional dependency is missing: `module` (a key of EXTRAS), which `needed_by` needs and the extra
    `extra` of prepack installs; the message says so with the install line. An ImportError too, which is
    what callers catching a missing import expect."""

    def __init__(self, module: str, needed_by: str):
        self.module, self.needed_by, self.extra = module, needed_by, EXTRAS[module]
        super().__init__(
            f"{needed_by} needs {module}, which is not installed: pip install '{DISTRIBUTION}[{self.extra}]' "
            f"(from a checkout of prepack: pip install -e '.[{self.extra}]')",
            name=module,
        )

    def __reduce__(self):  # pickled by its arguments (a Ray worker's error reaches the driver so)
        return type(self), (self.module, self.needed_by)


@contextmanager
def optional_imports(needed_by: str) -> Iterator[None]:
    """Around the imports of optional dependencies: one found missing (itself, or a module it imports)
    becomes MissingExtraError naming `needed_by` (what needs it, e.g. "PackedDataset"). Any other
    ImportError passes unchanged."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in EXTRAS:
            raise
        raise MissingExtraError(missing, needed_by) from None


def require(module: str, needed_by: str) -> ModuleType:
    """`import_module(module)` within `optional_imports(needed_by)`."""
    with optional_imports(needed_by):
        return import_module(module)
