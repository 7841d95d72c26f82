"""The errors prepack raises.

    PrepackError                 every error prepack raises on purpose; the CLI prints it and exits 2
    ├── InputError               the corpus (or an option) is wrong: names the file, row and column
    ├── OutputError              the output directory cannot be written as asked
    ├── FormatError              a shard directory breaks the format in schemas/shard-format.md
    ├── EngineError              the engine itself failed: a Ray cluster unreachable, a task or node lost,
    │                            a chat tokenizer worker process dead
    ├── IsolationError           a batch or a model set-up would let documents attend to each other
    ├── SamplerStateError        a PackedSampler state (a checkpoint's) is malformed or for another setup
    └── DistributedSetupError    the processes of a job are not set up to train as one
"""

__all__ = [
    "DistributedSetupError",
    "EngineError",
    "FormatError",
    "InputError",
    "IsolationError",
    "OutputError",
    "PrepackError",
    "SamplerStateError",
]


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

    `problem` is the finding as fields (a `prepack.format.FormatProblem`: file, message, row, column)
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
