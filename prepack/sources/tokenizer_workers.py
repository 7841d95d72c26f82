"""Chat tokenization in spawned worker processes, results in chunk order; a worker that dies ends it.

    for chunk, encoded in encoded_by_workers(chunks, encoder, num_proc=4): ...

Why not `concurrent.futures.ProcessPoolExecutor`: its workers share one task pipe, written by a
feeder thread and read under one lock, so a dead worker can leave the rest of the pool waiting. On
Python 3.11 a worker killed as it started hung a build for ever (the kill test of
tests/building/test_tokenize.py, now and then): the broken pool waited on its feeder thread, blocked
writing a chunk into that pipe, which the worker still alive did not read. Here each worker has a
pipe of its own each way, and the parent keeps no end of a worker's pipes: a dead worker is an error
on the next send or receive (half a result then the end of the pipe included), never a wait.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from prepack.errors import EngineError

__all__ = ["encoded_by_workers", "quiet_failing_start"]

# Chunks sent ahead to each worker: one to encode while the next travels.
_CHUNKS_IN_FLIGHT_PER_WORKER = 2
_WORKER_NAME = "prepack-chat-tokenizer"  # each worker's process name begins so


def quiet_failing_start() -> None:
    """In a worker that is still starting, an error that ends it ends it without a traceback.

    A spawned worker starts by re-running the script that started the build, as its `__mp_main__`; a
    script that calls prepack unguarded fails there, in every worker. The parent's EngineError says
    why and what to do: it should be the one message, not one traceback per worker before it. `import
    prepack` calls this (spawn names the process before it re-runs the script); `_serve` puts the
    usual hook back once the worker is running."""
    if multiprocessing.current_process().name.startswith(_WORKER_NAME):
        sys.excepthook = _end_quietly


def _end_quietly(kind, value, traceback) -> None:
    """An excepthook that prints nothing: the process still exits with status 1."""


def _serve(encoder_file: str, tasks: Connection, results: Connection) -> None:
    """A worker: encode each chunk `tasks` brings, send back (True, result) or (False, exception)."""
    sys.excepthook = sys.__excepthook__  # started: its own errors print as usual (`quiet_failing_start`)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one of num_proc processes: one core each
    with open(encoder_file, "rb") as file:
        encoder = pickle.load(file)
    # A thread keeps reading chunks while this one encodes, so the parent's send of the next chunk
    # never waits on this worker's send of a result (each would wait for the other).
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        try:
            while (chunk := tasks.recv()) is not None:
                inbox.put(chunk)
        except (EOFError, OSError):  # the parent ended
            pass
        inbox.put(None)

    threading.Thread(target=receive, daemon=True).start()
    while (chunk := inbox.get()) is not None:
        try:
            outcome = (True, encoder(*chunk))
        except Exception as exc:  # the encoder's own error (InputError naming a row): the parent raises it
            outcome = (False, exc)
        try:
            results.send(outcome)
        except OSError:  # the parent ended
            return
        except Exception as exc:  # noqa: BLE001 (an outcome that cannot be pickled; pickling precedes any write)
            what = repr(outcome[1]) if not outcome[0] else type(outcome[1]).__name__
            results.send((False, EngineError(f"a chat tokenizer worker could not send back {what}: {exc}")))


@dataclass
class _Worker:
    process: BaseProcess
    tasks: Connection  # the parent's end: chunks to the worker
    results: Connection  # the parent's end: outcomes from it

    def send(self, chunk: tuple | None) -> None:
        try:
            self.tasks.send(chunk)
        except OSError as exc:  # BrokenPipeError: the worker is gone
            raise BrokenProcessPool(f"worker {self.process.pid} is gone ({exc})") from None

    def receive(self) -> Any:
        try:
            ok, value = self.results.recv()
        except (EOFError, OSError) as exc:
            raise BrokenProcessPool(f"worker {self.process.pid} is gone ({exc!r})") from None
        if not ok:
            raise value
        return value


def _start(encoder_file: str, num_proc: int, workers: list[_Worker]) -> None:
    """Starts `num_proc` workers, appending each to `workers` as it starts: those started are stopped even if
    a later one fails to start."""
    context = multiprocessing.get_context("spawn")  # safe beside the threads of the parent
    for index in range(num_proc):
        task_reader, task_writer = context.Pipe(duplex=False)
        result_reader, result_writer = context.Pipe(duplex=False)
        # Start-up data stays a few bytes (a path, not the encoder): a spawned child that dies before
        # reading it all would otherwise block the parent, which writes it holding the read end.
        process = context.Process(
            target=_serve, args=(encoder_file, task_reader, result_writer), name=f"{_WORKER_NAME}-{index}", daemon=True
        )
        process.start()
        task_reader.close()  # the worker's ends now live only in the worker: its death closes them
        result_writer.close()
        workers.append(_Worker(process, task_writer, result_reader))


def _stop(workers: list[_Worker], finished: bool) -> None:
    """Finished: each worker reads the end of its chunks and exits. Otherwise: killed at once."""
    for worker in workers:
        if finished:
            try:
                worker.send(None)
            except BrokenProcessPool:
                pass  # it delivered every result, then died: nothing is lost
        else:
            worker.process.kill()
    for worker in workers:
        worker.process.join()
        worker.tasks.close()
        worker.results.close()


def encoded_by_workers(
    chunks: Iterable[tuple], encoder: Callable[..., Any], num_proc: int
) -> Iterator[tuple[tuple, Any]]:
    """(chunk, encoder(*chunk)) for each chunk, in order, encoded by `num_proc` spawned processes.

    `encoder` is pickled once to a temporary file that each worker loads as it starts. An exception
    the encoder raises is re-raised here; a worker that dies (killed, out of memory, or failing to
    start) raises `BrokenProcessPool`. Either way, and when the caller stops early, every worker is
    killed; after the last chunk each exits on its own. All are reaped before this returns.
    """
    with tempfile.NamedTemporaryFile(prefix="prepack-encoder-", suffix=".pickle") as file:
        pickle.dump(encoder, file, pickle.HIGHEST_PROTOCOL)
        file.flush()
        workers: list[_Worker] = []
        finished = False
        try:
            _start(file.name, num_proc, workers)
            window: deque[tuple[tuple, _Worker]] = deque()
            for index, chunk in enumerate(chunks):
                worker = workers[index % num_proc]
                worker.send(chunk)
                window.append((chunk, worker))
                if len(window) >= _CHUNKS_IN_FLIGHT_PER_WORKER * num_proc:
                    done, owner = window.popleft()
                    yield done, owner.receive()
            while window:
                done, owner = window.popleft()
                yield done, owner.receive()
            finished = True
        finally:
            _stop(workers, finished)
