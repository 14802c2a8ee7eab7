"""Rank heartbeats for the launcher's hang detection: ``beat()`` says "this rank made progress".

Call ``launch.heartbeat.beat()`` whenever a rank makes progress (the compile stack calls it on every
compiled-model and train-step call); call ``beat("compile")`` right before something long and silent such
as a compile, so the watchdog applies its long grace until the next plain ``beat()``. Without
``DDP_LAUNCH_HEARTBEAT_DIR`` in the environment (hang detection off, or not launched by us) ``beat()`` is a
no-op costing well under a microsecond.

Note (protocol, read by ``launch.watchdog``):

* The launcher puts ``DDP_LAUNCH_HEARTBEAT_DIR`` into every rank's environment. Each rank owns one file
  there, ``rank<RANK>`` (global rank), created whole (write to a temp name, then rename) by ``start()`` (the
  per-rank trampoline ``launch.worker`` calls it before the user's script runs) or by the first ``beat()``.
* The file is ``RECORD_SIZE`` bytes: ``MAGIC``, then (last beat wall time: float64, number of beats:
  uint64, phase: 16 ASCII bytes) at offset 8, then a JSON object with the rank's static facts (rank,
  local_rank, group_rank, host, pid, start) at offset 64, NUL padded.
* ``beat()`` updates the 32 dynamic bytes through a shared memory map of that file: no system call, ~1 us,
  so it needs no rate limit and the watchdog sees the exact time of each rank's last beat. That exactness
  matters: the stuck rank is named by comparing last-beat times, and in a hang the others stop only a few
  milliseconds after it (a rate-limited file write would blur exactly that difference).
* The price of the memory map: the watchdog must run on the rank's host (it does: ``launch.watchdog``
  supervises torchrun on each node). A shared filesystem would not carry the updates to other hosts.
* A process forked from a rank (a data-loader worker) does not beat for the rank: the writer remembers its
  pid. This module imports nothing heavy (no torch): the library imports it on every compiled call path.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import re
import socket
import struct
import sys
import time
from typing import Optional

HEARTBEAT_DIR_ENV = "DDP_LAUNCH_HEARTBEAT_DIR"
MAGIC = b"DDPHB001"
RECORD_SIZE = 1024
_DYNAMIC = struct.Struct("<dQ16s")  # last beat time, beats, phase; at offset 8, right after MAGIC
_STATIC_OFFSET = 64
_RECORD_RE = re.compile(r"^rank(\d+)$")
DEFAULT_PHASE = "step"
START_PHASE = "start"  # written by start(): the rank is up but has not beaten yet


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """One rank's heartbeat record as the watchdog reads it."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on its node."""
    host: str
    """Host name the rank runs on."""
    pid: int
    """Process id of the rank (on `host`)."""
    start: float
    """Wall time the record was created (rank start)."""
    last: float
    """Wall time of the last beat (equals `start` before the first beat)."""
    beats: int
    """Number of beats so far (0: the rank has not beaten yet)."""
    phase: str
    """Phase named by the last beat: "start" before the first beat, "step" by default, or the caller's."""
    node: int = 0
    """The rank's node (torchrun's GROUP_RANK)."""
    nodes: int = 1
    """Nodes in the job (torchrun's GROUP_WORLD_SIZE)."""


class _Writer:
    __slots__ = ("pid", "mm", "beats", "path")

    def __init__(self, pid: int, mm: mmap.mmap, path: str) -> None:
        self.pid, self.mm, self.beats, self.path = pid, mm, 0, path


_writer: Optional[_Writer] = None
_disabled = False  # env var absent or the record could not be created: beat() returns at once
_phases: dict = {}  # phase str -> its 16 encoded bytes (encoding checked once per distinct phase)


def beat(phase: Optional[str] = None) -> None:
    """Record progress of this rank now; `phase` ("step" by default, "compile" for a long compile, any
    ASCII name up to 16 characters) tells the watchdog which timeout applies until the next beat."""
    w = _writer
    if w is None:
        if _disabled:
            return
        w = _open()
        if w is None:
            return
    if w.pid != os.getpid():  # forked child (e.g. a DataLoader worker): not this rank's progress
        return
    w.beats += 1
    _DYNAMIC.pack_into(w.mm, 8, time.time(), w.beats, _phase_bytes(phase or DEFAULT_PHASE))


def start() -> Optional[str]:
    """Create this rank's record (no beat yet) when heartbeats are on; returns its path, else None."""
    w = _writer or _open()
    return None if w is None else w.path


def record_path(directory: str, rank: int) -> str:
    """Path of `rank`'s record inside the heartbeat directory."""
    return os.path.join(directory, f"rank{rank}")


def stack_path(directory: str, rank: int) -> str:
    """Where `rank` dumps its threads' stacks on SIGUSR1 (faulthandler, registered by launch.worker)."""
    return os.path.join(directory, f"rank{rank}.stack")


def _phase_bytes(phase: str) -> bytes:
    encoded = _phases.get(phase)
    if encoded is None:
        if not isinstance(phase, str) or not phase.isascii() or not 0 < len(phase) <= 16:
            raise ValueError(f"heartbeat phase {phase!r}: expected an ASCII name of 1 to 16 characters, e.g. 'compile'")
        encoded = _phases[phase] = phase.encode("ascii").ljust(16, b"\0")
    return encoded


def _open() -> Optional[_Writer]:
    """Create the record and map it; disables heartbeats (with one warning) when that is impossible."""
    global _writer, _disabled
    directory = os.environ.get(HEARTBEAT_DIR_ENV)
    if not directory:
        _disabled = True
        return None
    rank = int(os.environ.get("RANK", "0"))
    path = record_path(directory, rank)
    now = time.time()
    static = json.dumps(
        {
            "rank": rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "group_rank": int(os.environ.get("GROUP_RANK", "0")),
            "group_world_size": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": now,
        }
    ).encode()
    content = bytearray(RECORD_SIZE)
    content[:8] = MAGIC
    _DYNAMIC.pack_into(content, 8, now, 0, _phase_bytes(START_PHASE))
    content[_STATIC_OFFSET : _STATIC_OFFSET + len(static)] = static
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(content)
        os.replace(tmp, path)  # the watchdog never sees a half-written record
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), RECORD_SIZE)
    except (OSError, ValueError) as exc:
        # Training must not fail because of monitoring; the watchdog will see this rank as silent.
        print(f"launch.heartbeat: cannot write {path}: {exc}; this rank sends no heartbeats", file=sys.stderr)
        _disabled = True
        return None
    _writer = _Writer(os.getpid(), mm, path)
    return _writer


def read_record(path: str) -> Optional[Record]:
    """Parse one record file; None when it is missing, foreign or not complete."""
    try:
        with open(path, "rb") as f:
            data = f.read(RECORD_SIZE)
            # A beat may land while we read: the 32 dynamic bytes are re-read until two reads agree.
            for _ in range(5):
                f.seek(8)
                again = f.read(_DYNAMIC.size)
                if again == data[8 : 8 + _DYNAMIC.size]:
                    break
                data = data[:8] + again + data[8 + _DYNAMIC.size :]
    except OSError:
        return None
    if len(data) != RECORD_SIZE or data[:8] != MAGIC:
        return None
    last, beats, phase = _DYNAMIC.unpack_from(data, 8)
    try:
        static = json.loads(data[_STATIC_OFFSET:].rstrip(b"\0"))
        return Record(
            rank=int(static["rank"]),
            local_rank=int(static["local_rank"]),
            host=str(static["host"]),
            pid=int(static["pid"]),
            start=float(static["start"]),
            last=last,
            beats=beats,
            phase=phase.rstrip(b"\0").decode("ascii", "replace"),
            node=int(static.get("group_rank", 0)),
            nodes=int(static.get("group_world_size", 1)),
        )
    except (ValueError, KeyError, TypeError):
        return None


def read_records(directory: str) -> list[Record]:
    """Every rank record in the heartbeat directory, by rank."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    records = [read_record(os.path.join(directory, n)) for n in names if _RECORD_RE.match(n)]
    return sorted((r for r in records if r is not None), key=lambda r: r.rank)


def _reset_for_tests() -> None:
    """Forget the writer and the environment check (unit tests switch the env var between cases)."""
    global _writer, _disabled
    if _writer is not None:
        _writer.mm.close()
    _writer, _disabled = None, False
