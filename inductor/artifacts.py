"""A compile as bytes: what one process compiled, packed so that another process (on another node)
installs it into its own Inductor cache and then gets a cache hit from its normal compile path.

Note [Shipped compiles]
-----------------------
Background: a compile leaves three kinds of files in Inductor's cache dir: the AOTAutograd entry
(forward/backward structure, pointing at FX graph entries by key), the FX graph entries (generated
Python wrapper and kernel source), and, on CPU, one C++ library per kernel. torch's mega-cache
(`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`) carries the first two (and autotune
results), but not the libraries: a node that loads it still runs the C++ compiler once per kernel
(measured: 6.3 s to load a small MLP vs 1.7 s with the libraries, 13 s to compile it cold).

Algorithm:
  * `capture(directory)` around one compile: the mega-cache records only that compile's artifacts
    (inductor/torch_inductor.py:fresh_cache_artifacts, on a cache miss and on a hit alike) and the
    kernel libraries that appeared in the cache dir meanwhile are noted;
  * `pack()` makes one blob: a magic, a JSON header (sizes, library paths, the caller's `meta`) and
    the raw bytes; `unpack()` checks it all (a library path must look like one, no `..`);
  * `install()` hands the mega-cache bytes to `torch.compiler.load_cache_artifacts` (it writes the
    entries into this process's cache dir) and writes each missing library under its relative path
    (temp file + rename: a concurrent reader never sees half a library).
The receiving process then compiles as usual: its own cache keys decide whether the entries apply.
Nothing is trusted blindly: an entry whose key the receiver does not compute itself (another
device index, a graph with another rank-specific constant) is simply never looked up.

Notes: libraries are matched by appearance during the compile: a library another process of the
node built at the same moment may come along (harmless: names are content hashes); one this process
had built before is missing from the blob (the receiver builds it, or got it with an earlier blob).
The blob is the job's own data between its ranks, as trusted as the rest of the job's traffic
(PyTorch's distributed features assume a trusted network): it contains pickles and native code.

Debugging: `unpack(blob)` shows the header; `TORCH_LOGS=+torch._functorch._aot_autograd.autograd_cache`
shows the receiver's cache decisions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import struct
from typing import Any, Iterator

import torch

from inductor.torch_inductor import KERNEL_LIBRARY, fresh_cache_artifacts, kernel_libraries

MAGIC = b"DDPCA001"
_LENGTH = struct.Struct("<Q")


@dataclasses.dataclass
class Capture:
    """What one compile left behind, filled in when the `capture` block ends."""

    cache: bytes | None = None
    """The mega-cache bytes of that compile (None: nothing recorded, e.g. a backend without caches)."""
    libraries: list[str] = dataclasses.field(default_factory=list)
    """Kernel libraries (relative paths) that appeared in the cache dir during the compile."""


@dataclasses.dataclass
class Unpacked:
    cache: bytes
    libraries: dict[str, bytes]
    meta: dict[str, Any]


@contextlib.contextmanager
def capture(directory: str) -> Iterator[Capture]:
    """Record what the compile inside leaves in the caches (see the Note)."""
    out = Capture()
    before = kernel_libraries(directory)
    with fresh_cache_artifacts() as save:
        yield out
        out.cache = save()
    out.libraries = sorted(kernel_libraries(directory) - before)


def pack(captured: Capture, directory: str, meta: dict[str, Any] | None = None) -> bytes:
    """One blob: the mega-cache bytes, the libraries (read from `directory`) and `meta` (JSON)."""
    parts, libraries = [], []
    for rel in captured.libraries:
        try:
            with open(os.path.join(directory, rel), "rb") as f:
                data = f.read()
        except OSError:
            continue  # removed meanwhile: the receiver builds it
        libraries.append([rel, len(data)])
        parts.append(data)
    cache = captured.cache or b""
    header = json.dumps(
        {"cache": len(cache), "libraries": libraries, "meta": meta or {}, "torch": torch.__version__}
    ).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(header)), header, cache, *parts])


def unpack(blob: bytes) -> Unpacked:
    """The parts of a `pack` blob; ValueError naming what is wrong with a damaged or foreign one."""
    if blob[:8] != MAGIC:
        raise ValueError(f"not a shipped compile (magic {blob[:8]!r}, expected {MAGIC!r})")
    (length,) = _LENGTH.unpack_from(blob, 8)
    start = 8 + _LENGTH.size
    try:
        header = json.loads(blob[start : start + length])
        cache_len = int(header["cache"])
        entries = [(str(rel), int(n)) for rel, n in header["libraries"]]
        meta = dict(header["meta"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"shipped compile with a damaged header: {err}") from None
    if header.get("torch") != torch.__version__:
        raise ValueError(f"shipped compile made by torch {header.get('torch')}, this is {torch.__version__}")
    pos = start + length
    cache = blob[pos : pos + cache_len]
    pos += cache_len
    libraries = {}
    for rel, n in entries:
        if not KERNEL_LIBRARY.match(rel):
            raise ValueError(f"shipped compile names a library {rel!r} that is not a kernel library path")
        libraries[rel] = blob[pos : pos + n]
        pos += n
    if pos != len(blob) or len(cache) != cache_len:
        raise ValueError(f"shipped compile is {len(blob)} bytes, its header accounts for {pos}")
    return Unpacked(cache=cache, libraries=libraries, meta=meta)


def install(unpacked: Unpacked, directory: str) -> int:
    """Put a shipped compile into this process's caches (`directory`: its Inductor cache dir);
    returns how many libraries were written (the ones already there are kept)."""
    if unpacked.cache:
        torch.compiler.load_cache_artifacts(unpacked.cache)
    written = 0
    for rel, data in unpacked.libraries.items():
        path = os.path.join(directory, rel)
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        written += 1
    return written
