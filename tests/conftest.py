"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
import warnings

import pytest

# `pytest -n N` (pytest-xdist, the default in pyproject.toml): N workers share the machine's cores, so each gives
# torch's (OpenMP's) kernels its share of them, set before any test imports torch; more threads than cores
# would leave every worker spinning on the others' (a process started by a test inherits it).
if (workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT")) is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(workers))))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """`--dist loadgroup` (addopts) sends the tests of one `xdist_group` to one worker by the "@NAME" that
    pytest-xdist's worker appends to their node ids. pytest-xdist 3.8 writes it to `item._nodeid`, which pytest 9
    no longer reads (a node's id is `item._id`), so each group's tests were spread over the workers
    (pytest-dev/pytest-xdist#1386, its fix #1388 open): here the worker appends it as xdist does, where xdist's did
    not take. A pytest where that fails (`_pytest.nodeid` is private) leaves the groups as xdist made them, with a
    warning, rather than fail."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup only
        return
    for item in items:
        names = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default")) for mark in item.iter_markers("xdist_group")}
        suffix = "@" + "_".join(sorted(names))
        if names and not item.nodeid.endswith(suffix):  # under pytest 8, xdist's own took
            try:
                from _pytest.nodeid import NodeId  # pytest 9's

                item._id = NodeId.parse(item.nodeid + suffix)
            except (ImportError, AttributeError):
                pass
            if not item.nodeid.endswith(suffix):
                warnings.warn(f"xdist_group {suffix[1:]!r} is not applied under this pytest: its tests may run on "
                              "several workers", stacklevel=1)
                return


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on loopback (`tests.s3server`), started once for the session, with
    the AWS variables that point clients at it set for the whole session."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from tests.s3server import S3Server

    server = S3Server()
    server.start()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in server.environment.items():
            patch.setenv(name, value)
        yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A new, empty bucket of the session's server, as `s3://NAME`."""
    return f"s3://{s3_server.new_bucket()}"
