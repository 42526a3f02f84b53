"""The ``shm`` all-reduce: ranks on one host exchange tensors through one shared-memory file.

Layout of the file (every rank maps all of it)::

    header  flags   int64 per rank, each on its own 64-byte line: the last round the rank posted
            pids    int64 per rank: the process, to tell a rank that died from one that is late
    data    2 buffers x size slots x slot_bytes: round r writes buffer r % 2

A round: each rank copies its part into its slot of buffer ``r % 2``, posts ``r`` in its flag, waits until
every flag reads ``>= r``, then reads every slot. Two buffers are enough: a rank writes round ``r + 2`` only
after it saw every flag at ``r + 1``, and a rank posts ``r + 1`` only after it finished reading round ``r``.
Every rank adds the slots in rank order, so the sums are identical on every rank. A tensor larger than a
slot goes in several rounds.

The file is unlinked as soon as every rank has mapped it: nothing is left in /dev/shm whatever happens to
the ranks afterwards, and the memory goes when the last rank unmaps it or exits.

Ordering: a rank's slot writes are visible to the others before its flag write; x86-64 (total store order)
guarantees this for plain stores, which is why ``auto`` picks this backend only there.
"""

from __future__ import annotations

import mmap
import os
import secrets
import tempfile
import time
from typing import Any, Optional

import numpy as np
import torch

from pagoda.errors import BackendUnavailable, PagodaError

FLAG_STRIDE = 64  # bytes per flag: one cache line each, so one rank's post does not evict another's line
ALIGN = 4096
NAME_PREFIX = "pagoda-allreduce-"
# waiting: spin this long, then yield the core this long, then sleep in growing naps up to MAX_NAP
SPIN_SECONDS = 100e-6
YIELD_SECONDS = 2e-3
MAX_NAP_SECONDS = 1e-3


class CollectiveError(PagodaError, RuntimeError):
    """A rank did not take part in a collective: it exited, or it did not arrive in time."""


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def shm_directory() -> str:
    """Where the file is made: /dev/shm (memory) where it exists, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmAllReduce:
    """Sum and gather over ``size`` processes on this host through shared memory.

    ``group`` (a torch.distributed group of the same ranks) is used once, to agree on the file; every
    collective after that goes through the file alone. Raises :class:`BackendUnavailable` on every rank
    alike when a rank cannot map the file (another host, another /dev/shm, no space).
    """

    def __init__(self, rank: int, size: int, group: Any, timeout_seconds: float, slot_bytes: int) -> None:
        self.rank, self.size, self.timeout_seconds = rank, size, timeout_seconds
        self.slot_bytes = _round_up(max(slot_bytes, FLAG_STRIDE), FLAG_STRIDE)
        self.header_bytes = _round_up(size * (FLAG_STRIDE + 8), ALIGN)
        total = self.header_bytes + 2 * size * self.slot_bytes
        self.round = 0
        # the error of a collective that failed: the ranks' rounds no longer match, so every later call raises it
        self.failure: Optional[CollectiveError] = None
        self.path: Optional[str] = None
        self._mm: Optional[mmap.mmap] = None
        path, error, fd = None, None, -1
        if rank == 0:
            try:
                path, fd = _create(total)
            except OSError as exc:
                error = (f"cannot make a {total / 2**20:.0f} MiB shared-memory file in {shm_directory()}: {exc}; "
                         "free space there, lower --max-num-batched-tokens, or pass --all-reduce-backend gloo")
        shared = [path, error]
        torch.distributed.broadcast_object_list(shared, group=group, group_src=0)  # the group's first rank
        path, error = shared
        try:
            if error is None:
                try:
                    self._mm = _map(path, total, fd)
                except OSError as exc:
                    error = (f"rank {rank} (pid {os.getpid()}) cannot map {path} made by rank 0: {exc} (a rank on "
                             "another host or in another container); pass --all-reduce-backend gloo")
            errors: list = [None] * size
            torch.distributed.all_gather_object(errors, error, group=group)
        finally:
            if rank == 0 and path is not None:
                os.close(fd)
                os.unlink(path)  # every rank has mapped it, or failed to: the name is not needed any more
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            self.close()
            raise BackendUnavailable(error)
        self.path = path
        ints = np.frombuffer(self._mm, dtype=np.int64, count=self.header_bytes // 8)
        self._flags = ints[: size * FLAG_STRIDE // 8: FLAG_STRIDE // 8]  # [size], strided view of the flags
        self._pids = ints[size * FLAG_STRIDE // 8: size * FLAG_STRIDE // 8 + size]  # [size]
        self._pids[rank] = os.getpid()
        # [2, size, slot_bytes] bytes
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=self.header_bytes,
                                      count=2 * size * self.slot_bytes).view(2, size, self.slot_bytes)
        torch.distributed.barrier(group=group)  # every pid is written before any rank may wait on it

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place: slot 0 + slot 1 + ... on every rank."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        per_round = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), per_round):
            part = flat[start:start + per_round]
            slots = self._exchange(part)
            torch.add(slots[0], slots[1], out=part)
            for other in slots[2:]:
                part.add_(other)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (the same shape on every rank), in rank order."""
        flat = x.contiguous().view(-1)
        out = torch.empty((self.size, flat.numel()), dtype=x.dtype)
        per_round = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), per_round):
            slots = self._exchange(flat[start:start + per_round])
            for r, slot in enumerate(slots):
                out[r, start:start + slot.numel()].copy_(slot)
        return [row.view_as(x) for row in out]

    def close(self) -> None:
        """Unmap the file (its memory goes once every rank has)."""
        self._flags = self._pids = self._data = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a tensor still views it; the mapping goes with the last view
                pass
            self._mm = None

    def _exchange(self, part: torch.Tensor) -> list[torch.Tensor]:
        """One round: post ``part`` (at most a slot), wait for every rank; views of every rank's slot."""
        if self.failure is not None:
            raise self.failure
        self.round += 1
        buffer = self._data[self.round % 2]
        nbytes = part.numel() * part.element_size()
        buffer[self.rank, :nbytes].view(part.dtype).copy_(part)
        self._flags[self.rank] = self.round
        self._wait(self.round)
        return [buffer[r, :nbytes].view(part.dtype) for r in range(self.size)]

    def _wait(self, round_: int) -> None:
        """Until every rank has posted ``round_``: spin, then yield, then nap with backoff; raise for a rank
        that exited or did not arrive within the timeout."""
        flags = self._flags
        if flags.min() >= round_:
            return
        start = time.perf_counter()
        nap = 20e-6
        while flags.min() < round_:
            waited = time.perf_counter() - start
            if waited < SPIN_SECONDS:
                continue
            if waited < YIELD_SECONDS:
                os.sched_yield()
                continue
            try:
                self._check_peers(round_, waited)
            except CollectiveError as exc:
                self.failure = exc
                raise
            time.sleep(nap)
            nap = min(nap * 2, MAX_NAP_SECONDS)

    def _check_peers(self, round_: int, waited: float) -> None:
        for r in range(self.size):
            if self._flags[r] >= round_:
                continue
            pid = int(self._pids[r])
            if not _is_alive(pid):
                raise CollectiveError(f"tensor-parallel rank {r} (process {pid}) exited while rank {self.rank} "
                                      f"waited for it in shared-memory collective #{round_}; the model cannot run "
                                      "without it: restart the engine")
            if waited > self.timeout_seconds:
                raise CollectiveError(f"tensor-parallel rank {r} (process {pid}) did not arrive at shared-memory "
                                      f"collective #{round_} within {self.timeout_seconds:.0f} s (rank {self.rank} "
                                      "waited); it is stuck or far behind: restart the engine")


def _create(total: int) -> tuple[str, int]:
    """A new file of ``total`` bytes with a name no other engine has, its memory reserved now (a full /dev/shm
    fails here, not later as a SIGBUS on first touch)."""
    path = os.path.join(shm_directory(), f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    return path, fd


def _map(path: str, total: int, fd: int) -> mmap.mmap:
    if fd >= 0:
        return mmap.mmap(fd, total)
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != total:
            raise OSError(f"{path} has {os.fstat(fd).st_size} bytes, not the {total} rank 0 made")
        return mmap.mmap(fd, total)
    finally:
        os.close(fd)


def _is_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
