"""The chat tokenizer's worker processes: results in chunk order, an encoder's own error raised as itself,
and a worker that dies, at any point, or a consumer that stops early, ending the pool at once with no
process left behind. (The kill of a real chat build's worker is in test_tokenize.py.)"""

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import pytest

from prepack.errors import EngineError
from prepack.sources.tokenizer_workers import encoded_by_workers

pytestmark = pytest.mark.slow  # each test spawns Python processes


class Doubler:
    """Doubles a chunk's values; `plan` maps a chunk index to what goes wrong there instead."""

    def __init__(self, **plan: int):
        self.plan = {index: what for what, index in plan.items()}

    def __call__(self, index: int, values: list[int]):
        what = self.plan.get(index)
        if what == "fail":
            raise ValueError(f"chunk {index} is bad")
        if what == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "slow":
            time.sleep(2)
        if what == "unpicklable":
            return lambda: values
        if what == "die_sending":
            # Dies 0.5 s from now, while sending a result far larger than a pipe holds: the parent reads
            # it only after the slow chunk before it, so the worker is part-way through the send.
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return bytes(64 << 20)
        return [2 * v for v in values]


def chunks(n: int) -> list[tuple[int, list[int]]]:
    return [(index, list(range(index, index + 3))) for index in range(n)]


def test_results_come_back_in_chunk_order():
    got = list(encoded_by_workers(chunks(11), Doubler(), num_proc=3))
    assert got == [(chunk, [2 * v for v in chunk[1]]) for chunk in chunks(11)]
    assert multiprocessing.active_children() == []


def test_an_encoders_error_is_raised_as_itself():
    with pytest.raises(ValueError, match="chunk 4 is bad"):
        list(encoded_by_workers(chunks(9), Doubler(fail=4), num_proc=2))
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    "plan, dead, says",
    [
        ({"die": 0}, 0, "is gone"),
        ({"die": 5}, 5, "is gone"),
        ({"slow": 0, "die_sending": 1}, 1, "is gone .*end of file during message"),  # half a result read
    ],
    ids=["first-chunk", "later-chunk", "part-way-through-sending"],
)
def test_a_worker_that_dies_ends_the_pool_instead_of_a_wait(plan, dead, says):
    results = []
    with pytest.raises(BrokenProcessPool, match=says):
        for _, result in encoded_by_workers(chunks(9), Doubler(**plan), num_proc=2):
            results.append(result)
    # What came back is right and in order, and stops before the dead chunk (how far before depends on
    # whether the parent first meets the death sending a chunk or receiving one).
    assert results == [[2 * v for v in values] for _, values in chunks(len(results))]
    assert len(results) <= dead
    assert multiprocessing.active_children() == []


def test_a_result_that_cannot_travel_is_an_engine_error():
    with pytest.raises(EngineError, match="could not send back function"):
        list(encoded_by_workers(chunks(3), Doubler(unpicklable=1), num_proc=2))
    assert multiprocessing.active_children() == []


def test_a_consumer_that_stops_early_leaves_no_worker():
    encoded = encoded_by_workers(chunks(20), Doubler(), num_proc=2)
    assert next(encoded)[0] == chunks(1)[0]
    encoded.close()
    assert multiprocessing.active_children() == []
