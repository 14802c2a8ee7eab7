"""Checkpoints that are either whole or ignored: rank 0 writes them atomically, every rank resumes from the
latest complete one.

Note [Atomic checkpoints]
-------------------------
Background: a job that restarts after a rank died (`python -m launch --max-restarts K`) must resume from
what it had, and nothing else: a checkpoint cut short by the death (or by a full disk, or a second
failure during the write) must never be loaded, or the job continues from garbage without a word.

Algorithm:
  * save (rank 0 only): the state goes to `step_<N>.pt.tmp`, is flushed and fsynced, renamed to
    `step_<N>.pt`; then a marker `step_<N>.done` (JSON: step, size, sha256 of the file) is written the
    same way, and the directory is fsynced. The marker is the commit: a checkpoint without one, or whose
    file does not match its marker's size and hash, is torn. Older complete checkpoints beyond `keep`
    are removed after the new one is committed.
  * latest: markers newest first; the first whose file matches is the one; every torn one on the way
    is reported (`skipped`), never loaded.
  * resume: rank 0 reads it and broadcasts it to the other ranks (`torch.distributed.broadcast_object_list`),
    so nodes need no shared filesystem; only rank 0's node keeps checkpoints.
Notes: the state is a dict of tensors and plain values, loaded with `weights_only=True`. A rank-0 file
is enough for DDP (every rank holds the same model and optimizer state); sharded states would need
`torch.distributed.checkpoint`.

Debugging: `ls <dir>`; each `.done` is one JSON line; `python -c "import examples.checkpoint as c;
print(c.latest('<dir>'))"`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
from typing import Any

import torch
import torch.distributed as dist

_NAME = re.compile(r"^step_(\d{8})\.done$")


@dataclasses.dataclass(frozen=True)
class Found:
    """The latest complete checkpoint, and the torn ones passed over to find it."""

    step: int | None
    """Its step (None: no complete checkpoint)."""
    path: str | None
    skipped: tuple[str, ...] = ()
    """`path: why` for each torn or partial checkpoint newer than it."""


def _paths(directory: str, step: int) -> tuple[str, str]:
    stem = os.path.join(directory, f"step_{step:08d}")
    return f"{stem}.pt", f"{stem}.done"


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str, step: int, state: dict[str, Any], *, keep: int = 2) -> str:
    """Write `state` as the checkpoint of `step` (call on rank 0 only); returns its path."""
    if keep < 1:
        raise ValueError(f"keep={keep!r}: keep at least the checkpoint just written (keep >= 1)")
    os.makedirs(directory, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path, marker = _paths(directory, step)
    _write_atomically(path, data)
    _fsync_dir(directory)  # the file's rename is durable before the marker claims it
    _write_atomically(
        marker, json.dumps({"step": step, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}).encode()
    )
    _fsync_dir(directory)
    for old in sorted(_steps(directory))[:-keep]:
        for p in _paths(directory, old)[::-1]:  # marker first: never a marker without its file
            try:
                os.remove(p)
            except FileNotFoundError:
                pass
    return path


def _steps(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [int(m.group(1)) for n in names if (m := _NAME.match(n))]


def latest(directory: str) -> Found:
    """The newest checkpoint whose file matches its marker (see the Note)."""
    skipped = []
    for step in sorted(_steps(directory), reverse=True):
        path, marker = _paths(directory, step)
        try:
            with open(marker) as f:
                meta = json.load(f)
            with open(path, "rb") as f:
                data = f.read()
        except (OSError, ValueError) as err:
            skipped.append(f"{path}: {err}")
            continue
        if len(data) != meta.get("bytes") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            skipped.append(
                f"{path}: {len(data)} bytes that do not match its marker "
                f"({meta.get('bytes')} bytes, sha256 {str(meta.get('sha256'))[:12]}...): torn"
            )
            continue
        return Found(step=step, path=path, skipped=tuple(skipped))
    return Found(step=None, path=None, skipped=tuple(skipped))


def load(path: str) -> dict[str, Any]:
    """A checkpoint's state (found by `latest`)."""
    with open(path, "rb") as f:
        return torch.load(f, weights_only=True)


def resume(directory: str | None, *, say: Any = print) -> tuple[int | None, dict[str, Any] | None]:
    """(step, state) of the latest complete checkpoint, read by rank 0 and sent to every rank;
    (None, None) without one. Torn checkpoints passed over are reported through `say` on rank 0."""
    payload: list[Any] = [None]
    if directory is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        found = latest(directory)
        for line in found.skipped:
            say(f"checkpoint: skipping a torn or partial checkpoint, never loaded: {line}")
        if found.path is not None:
            payload[0] = (found.step, found.path, load(found.path))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    if payload[0] is None:
        return None, None
    step, path, state = payload[0]
    say(f"checkpoint: resuming from step {step} ({path})")
    return step, state
