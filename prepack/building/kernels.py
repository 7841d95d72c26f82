"""`kernel`: numba's `njit` for the build's kernels, compiled (or loaded from numba's cache) on a kernel's
first call instead of when its module is imported.

Importing numba and setting up its CPU target takes 0.5-0.7 CPU s (`python benchmarks/bench_index_planner.py`),
most of what an index build took (`python benchmarks/bench_startup.py`), and an index build of a small
store runs no kernel at all (`prepack.building.plan_vectorized`). So the modules of the build path import this instead of numba: numba is
imported by the first kernel that runs. A kernel that calls another compiles against the other's
numba dispatcher (`_typeof_kernel`), so kernels call each other as plain numba functions do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["Kernel", "kernel", "started"]


class Kernel:
    """A function jitted by numba (`numba.njit(**options)`) when it is first called or compiled against."""

    def __init__(self, function: Callable[..., Any], options: dict[str, Any]) -> None:
        functools.update_wrapper(self, function)
        self.py_func, self.options = function, options

    @functools.cached_property
    def dispatcher(self) -> Any:
        """The numba dispatcher of the function: importing numba, on the first use of any kernel."""
        return _numba().njit(**self.options)(self.py_func)

    def __call__(self, *args: Any) -> Any:
        return self.dispatcher(*args)


def kernel(**options: Any) -> Callable[[Callable[..., Any]], Kernel]:
    """`@kernel(cache=True, nogil=True)`: `@numba.njit(...)`, without importing numba until the kernel runs."""
    return lambda function: Kernel(function, options)


def started() -> bool:
    """Whether a kernel has run in this process: numba's start-up is paid, so numpy saves it no more."""
    return _numba.cache_info().currsize > 0


@functools.cache
def _numba() -> Any:
    import numba
    from numba.extending import typeof_impl

    @typeof_impl.register(Kernel)
    def _typeof_kernel(value: Kernel, context: Any) -> Any:
        # A kernel named in a kernel being compiled is typed as its dispatcher, which numba calls natively.
        return numba.typeof(value.dispatcher, context.purpose)

    return numba
