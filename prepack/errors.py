"""The errors prepack raises.

    PrepackError                 every error prepack raises on purpose; the CLI prints it and exits 2
    ├── InputError               the corpus (or an option) is wrong: names the file, row and column
    ├── OutputError              the output directory cannot be written as asked
    ├── FormatError              a shard directory breaks the format in schemas/shard-format.md
    └── IsolationError           a batch or a model set-up would let documents attend to each other
"""

__all__ = ["FormatError", "InputError", "IsolationError", "OutputError", "PrepackError"]


class PrepackError(Exception):
    """Base class of every error prepack raises on purpose."""


class InputError(PrepackError):
    """The corpus or an option is wrong; the message names the file, row and column."""


class OutputError(PrepackError):
    """The output directory cannot be written as asked."""


class FormatError(PrepackError):
    """A shard directory does not follow the prepack shard format."""


class IsolationError(PrepackError):
    """A batch or model configuration would let tokens attend across document boundaries."""
