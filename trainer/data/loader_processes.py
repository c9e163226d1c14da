"""Loader processes: run a generator of decoded-image chunks in forked processes that hand each
chunk's pixels to the training process through a ring of shared-memory slots made once per pass.

Why not torch's DataLoader workers: they put every chunk into a fresh shared-memory file, whose
pages the kernel allocates and zeroes again, and pass its descriptor over a socket; on Flickr8k's
224 px thumbnails (0.35-0.46 ms to decode) that made a loader process spend 0.77-1.0 ms per image.
Here the slots are mapped before the fork and reused, a slot is handed back by a semaphore, and a
chunk costs one small pickled message: a loader process spends about what decoding alone costs
(benchmarks/README.md, "Loader").

The chunks arrive in the order DataLoader gives: one from each process in turn, skipping processes
that have finished, so the result depends only on what each process generates.
"""

from __future__ import annotations

import gc
import mmap
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Semaphore
from typing import Any

import numpy as np

# (rows, each row's pixels: an array, which travels through the ring, or any other picklable value
# such as None (not decoded) or a JPEG's bytes, which travels in the chunk's message; notes)
Chunk = tuple[list, Sequence[Any], Any]
IN_RING = "ring"  # a row's pixels in the chunk's message: they are in its ring slot
ChunkSource = Callable[[int, int], Iterator[Chunk]]  # (process, processes) -> its chunks


@dataclass
class _Failure:
    """An exception raised in a loader process, with its traceback there."""

    error: BaseException
    where: str


def _shared_ring(slots: int, chunk_images: int, image_shape: tuple[int, ...]) -> np.ndarray:
    """uint8 [slots, chunk_images, *image_shape] in anonymous shared memory: a process forked
    after this call writes into the same pages this process reads."""
    shape = (slots, chunk_images, *image_shape)
    return np.frombuffer(mmap.mmap(-1, int(np.prod(shape))), np.uint8).reshape(shape)


def _serve(source: ChunkSource, process: int, processes: int, ring: np.ndarray,
           free_slots: Semaphore, connection: Connection, parent: int) -> None:
    """A loader process: each chunk of `source` into the next ring slot once the training
    process has freed it, then a message naming the slot; None at the end."""
    # Ctrl-C and SIGTERM (SLURM's, to every process of a job) are for the training process,
    # which then stops at a step (trainer/training/preemption.py) and kills its loader processes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        for number, (rows, pixels, notes) in enumerate(source(process, processes)):
            slot = number % len(ring)
            while not free_slots.acquire(timeout=5.0):
                if os.getppid() != parent:  # the training process died: nobody reads
                    return
            for row, image in enumerate(pixels):
                if isinstance(image, np.ndarray):
                    ring[slot, row] = image
            others = [IN_RING if isinstance(image, np.ndarray) else image for image in pixels]
            connection.send((slot, rows, others, notes))
        connection.send(None)
    except BaseException as err:  # noqa: BLE001 - reported to the training process, re-raised
        where = traceback.format_exc()
        try:
            connection.send(_Failure(err, where))
        except Exception:  # an exception that cannot be pickled: its text then
            connection.send(_Failure(RuntimeError(f"{type(err).__name__}: {err}"), where))
    finally:
        connection.close()


def run_in_processes(source: ChunkSource, processes: int, chunk_images: int,
                     image_shape: tuple[int, ...], prefetch: int) -> Iterator[Chunk]:
    """The chunks of `source(p, processes)` for p = 0..processes-1, generated in that many
    forked processes (each at most `prefetch` chunks ahead), or in this one when processes is 0.
    Each chunk holds at most `chunk_images` images of shape `image_shape` (uint8)."""
    if processes == 0:
        yield from source(0, 1)
        return
    context = multiprocessing.get_context("fork")  # the slots and the source are inherited
    children: list[tuple[multiprocessing.Process, Connection, np.ndarray, Semaphore]] = []
    running: list[int] = []  # processes that have not sent their last chunk yet
    try:
        gc.freeze()  # a child's garbage collector then leaves the inherited objects alone, and
        try:  # their pages are not copied (copy-on-write) as it walks them
            for process in range(processes):
                ring = _shared_ring(prefetch, chunk_images, image_shape)
                free_slots = context.Semaphore(prefetch)
                reader, writer = context.Pipe(duplex=False)
                child = context.Process(
                    target=_serve, name=f"defrag-loader-{process}", daemon=True,
                    args=(source, process, processes, ring, free_slots, writer, os.getpid()))
                child.start()
                writer.close()  # the child's copy is now the only one: its exit ends the pipe
                children.append((child, reader, ring, free_slots))
                running.append(process)
        finally:
            gc.unfreeze()
        while running:
            for process in list(running):
                child, reader, ring, free_slots = children[process]
                message = _receive(child, reader, process)
                if message is None:
                    running.remove(process)
                    continue
                slot, rows, others, notes = message
                pixels = [ring[slot, row].copy() if other == IN_RING else other
                          for row, other in enumerate(others)]
                free_slots.release()
                yield rows, pixels, notes
    finally:
        for process, (child, reader, _, _) in enumerate(children):
            if process in running:  # stopped early, or failed: nothing more is wanted
                child.kill()
            child.join()
            reader.close()


def _receive(child: multiprocessing.Process, reader: Connection, process: int) -> tuple | None:
    """The next message of a loader process; its exception re-raised here if it failed."""
    try:
        message = reader.recv()
    except (EOFError, OSError):  # OSError: the process died in the middle of a message
        child.join(timeout=5.0)
        raise RuntimeError(
            f"loader process {process} (pid {child.pid}) exited unexpectedly with exit code "
            f"{child.exitcode} (a negative code is the signal that killed it, e.g. -9 when the "
            f"machine ran out of memory): lower data.workers or see its log above") from None
    if isinstance(message, _Failure):
        raise message.error from RuntimeError(f"in loader process {process}:\n{message.where}")
    return message
