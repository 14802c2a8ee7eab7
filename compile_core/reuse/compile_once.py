"""Compile once: identical pieces share one compile, ranks share compiles, every piece is reported.

Note [Compile once]
-------------------
Background: the first step of a compiled DDP model is dominated by compiling its pieces, and most
of that work is repeated: the pieces of a model that repeats a block are the same graph with other
parameters; every rank of a node compiles the same pieces; a second run of the same job compiles
them again unless the compile caches can answer.

Algorithm, for a batch of graphs (the pieces of one split graph, or one whole graph):
  1. Key. Each graph gets a structural key (aot/structure.py: its nodes without names, its inputs'
     metadata) extended by what else decides the code: backend, Inductor options, partitioner uuid,
     grad and autocast mode. Parameters are graph inputs, so equal keys mean one compiled callable
     can run every such piece with its own parameters.
  2. Reuse. Pieces whose key was compiled before in this model (in this batch or an earlier one)
     reuse that callable: `graph_0.piece_3 reused from graph_0.piece_1`.
  3. Claims (Inductor with its disk caches on). The distinct keys are compiled under a claim per
     key. In a distributed job the claims are job-wide, in the default process group's store
     (compile_core/reuse/store_claims.py): one rank of the whole job compiles a key and ships the compile
     through the store (inductor/artifacts.py), the others, on any node, install it into their own
     cache dir. Without a process group, processes sharing the cache dir claim through files there
     (compile_core/reuse/claims.py). Each rank starts at its own offset in the list and first compiles what
     nobody else has claimed; then it waits for the claims others hold, bounded by
     `DDP_COMPILE_CLAIM_TIMEOUT_S` (default 300 s), saying for whom it waits, and loads their result
     (an AOTAutograd cache hit: no trace, no lowering). If the holder failed or died (store claims: no
     liveness for `DDP_COMPILE_LEADER_DEAD_S`, default 60 s), or the wait timed out, it compiles the
     piece itself. A key this node compiled or installed before is marked in its cache dir
     (`ddp_compile/local/<key>`) and taken from there without a claim (a restart, a second run).
     The key includes the inputs' devices with their index: Inductor's own keys do.
  4. Caches. Pieces compile without Dynamo's "fakify first call" (which makes AOTAutograd bypass its
     cache; the splitter propagates metadata itself) and with the backward compiled together with
     the forward (aot/torch_aot.py:non_lazy_backward), so the cache entry of every piece, forward
     and backward, is complete and saved during the first forward. A second run of the same job
     (same cache directory) takes every piece from the AOTAutograd cache.
  5. Report. Each compile is one `PieceRecord`: reused from which piece, cache outcome
     (`aot cache hit`, `aot cache miss, fx cache 2 miss`, `aot cache bypass (reason)`), seconds,
     who it waited for and how that went, and its `source`: compiled here, from rank N, from the
     local cache, or reused. Rank 0 logs one INFO line per piece as it is done (other
     ranks at DEBUG, the wait lines at INFO on every rank). On a cache hit AOTAutograd never hands
     us the graphs, so the forward/backward sizes of each pair are kept in a small JSON file next to
     the claims when compiled and read back on a hit.

Notes: backends other than Inductor have no disk cache: no claims (there is nothing to load), but
reuse still applies to aot_eager. A custom backend callable and the eager backend are never reused.
A piece compiled with a fallback backend is reused with that fallback.

Debugging: `report().to_dict()["piece_compiles"]`; `TORCH_LOGS=+torch._functorch._aot_autograd.autograd_cache`
prints AOTAutograd's cache decisions; `ls $TORCHINDUCTOR_CACHE_DIR/ddp_compile/claims/`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from aot.structure import reads_tensor_values, structural_key
from aot.torch_dynamo_cache import AotCache
from compile_core import progress
from compile_core.reuse.claims import CompileClaims, Holder, WaitEnd
from compile_core.reuse.idle_work import IdleWork
from compile_core.reuse.piece_records import Compiled, Job, PieceRecord, Wait
from compile_core.reuse.store_claims import StoreClaims
from ddp import torch_ddp
from ddp.agreement import env_seconds
from inductor.torch_inductor import cache_dir

log = logging.getLogger(__name__)

CLAIM_TIMEOUT_ENV = "DDP_COMPILE_CLAIM_TIMEOUT_S"
DEFAULT_CLAIM_TIMEOUT_S = 300.0
LEADER_DEAD_ENV = "DDP_COMPILE_LEADER_DEAD_S"
DEFAULT_LEADER_DEAD_S = 60.0


def claim_timeout_s() -> float:
    """How long a rank waits for another rank's compile (`DDP_COMPILE_CLAIM_TIMEOUT_S`, default 300)."""
    return env_seconds(CLAIM_TIMEOUT_ENV, DEFAULT_CLAIM_TIMEOUT_S)


def leader_dead_s() -> float:
    """How long a compiling rank may go without a liveness bump before another takes over its compile
    (`DDP_COMPILE_LEADER_DEAD_S`, default 60)."""
    return env_seconds(LEADER_DEAD_ENV, DEFAULT_LEADER_DEAD_S)


def job_rank() -> tuple[int, int]:
    """(rank, world size) of this process in the job: the default process group's, else torchrun's variables."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def rank_offset(n: int) -> int:
    """Where this rank starts in a list of `n` things to compile, so the ranks of the job start apart
    (claims are job-wide: each rank first compiles its own share)."""
    rank, world = job_rank()
    world = max(world, 1)
    return ((rank % world) * n) // world if n else 0


def say(message: str, *args: Any) -> None:
    """A progress line: INFO on rank 0, DEBUG on the other ranks (they compile the same things)."""
    level = logging.INFO if job_rank()[0] == 0 else logging.DEBUG
    log.log(level, "compile_core: " + message, *args)


class CompileOnce:
    """Reuse, claims and records for one compiled model (see the Note)."""

    def __init__(
        self,
        *,
        reuse: bool,
        claims: bool,
        records: list[PieceRecord],
        lock: threading.Lock,
        idle_work: IdleWork | None = None,
    ) -> None:
        self.reuse = reuse
        self.idle_work = idle_work or IdleWork()
        """What this rank may compile while it waits for another rank's compile."""
        self.use_claims = claims
        self.records = records
        self.lock = lock
        self._done: dict[str, tuple[str, Compiled]] = {}  # key -> (first piece's name, its compile)
        self._claims: CompileClaims | StoreClaims | None = None

    def compile_all(
        self, jobs: Sequence[Job], extra: tuple, compile_fn: Callable[[Job], Compiled], *, reuse: bool = True
    ) -> list[Compiled]:
        """Compile `jobs` (the pieces of one graph, in forward order); equal keys compile once
        (unless `reuse=False` for this batch)."""
        start = time.perf_counter()
        with self.lock:
            first_record = len(self.records)
        reuse = reuse and self.reuse
        keys = [self._key(job, extra, reuse) for job in jobs]
        results: list[Compiled | None] = [None] * len(jobs)
        first: dict[str, int] = {}
        todo: list[int] = []
        for i, key in enumerate(keys):
            if not reuse or key is None or (key not in first and key not in self._done):
                todo.append(i)
            if key is not None:
                first.setdefault(key, i)
        claims = self._claims_dir() if self.use_claims and any(keys[i] for i in todo) else None
        if claims is None:
            for i in todo:
                results[i] = self._compile(jobs[i], keys[i], compile_fn)
        else:
            self._compile_claimed(jobs, keys, todo, results, compile_fn, claims)
        for i, key in enumerate(keys):
            if results[i] is not None:
                continue
            source, compiled = self._done[key]
            results[i] = compiled
            self._record(
                PieceRecord(
                    name=jobs[i].name,
                    key=key,
                    cache="reused",
                    seconds=0.0,
                    backend=compiled.backend,
                    reused_from=source,
                    source="reused",
                )
            )
        order = {job.name: i for i, job in enumerate(jobs)}
        with self.lock:  # the report lists this batch's pieces in forward order, whatever the compile order
            self.records[first_record:] = sorted(self.records[first_record:], key=lambda r: order.get(r.name, -1))
        if len(jobs) > 1:
            compiled_here = len(todo)
            hits = sum(1 for i in todo if results[i].cache.aot is AotCache.HIT)
            say(
                "%s: %d pieces, %d compiled or loaded (%d aot cache hits), %d reused; %.2f s",
                jobs[0].name.rsplit(".", 1)[0],
                len(jobs),
                compiled_here,
                hits,
                len(jobs) - compiled_here,
                time.perf_counter() - start,
            )
        return results  # type: ignore[return-value]

    # -- one compile -------------------------------------------------------------------------------

    def _compile(
        self,
        job: Job,
        key: str | None,
        compile_fn: Callable[[Job], Compiled],
        *,
        wait: Wait | None = None,
        local: bool = False,
    ) -> Compiled:
        """Compile one job; `wait`: how waiting for another rank's claim ended; `local`: this node
        compiled it before (Note [Compile once], step 3)."""
        progress.report("compile")  # a launcher watching for hangs gives compiles their long grace
        if wait is not None and wait.meta.get("pair") is not None and key is not None:
            self._write_pair_sizes(key, wait.meta["pair"])  # shipped with the compile: kept for the cache hit
        start = time.perf_counter()
        compiled = compile_fn(job)
        seconds = time.perf_counter() - start
        self._pair_sizes(key, compiled)
        if key is not None:
            self._done.setdefault(key, (job.name, compiled))
        record = PieceRecord(
            name=job.name,
            key=key,
            cache=compiled.cache.describe(),
            seconds=seconds,
            backend=compiled.backend,
            aot_cache=compiled.cache.aot,
        )
        hit = compiled.cache.aot is AotCache.HIT
        if wait is not None:
            record.waited_for = wait.holder.describe() if wait.holder is not None else "another process"
            record.leader, record.waited_s, record.received_bytes = wait.outcome, wait.seconds, wait.received_bytes
            if wait.end is WaitEnd.DONE and hit:
                record.source = f"from {wait.holder.who}" if wait.holder is not None else "from another process"
            elif wait.end is WaitEnd.DONE:
                log.warning(
                    "compile_core: rank %d: %s's compile of %s is not a cache hit here (its cache key "
                    "differs: a rank-specific value such as the device index); compiled it here",
                    job_rank()[0],
                    record.waited_for,
                    job.name,
                )
        if record.source == "compiled here" and hit:
            record.source = "from the local cache"
        if key is not None and self.use_claims and compiled.backend == "inductor":
            self._mark_local(key)  # in this node's cache now: a restart takes it from there, no claim
        self._record(record)
        return compiled

    def _record(self, record: PieceRecord) -> None:
        with self.lock:
            self.records.append(record)
        say("%s", record.line())

    def _compile_claimed(
        self,
        jobs: Sequence[Job],
        keys: list,
        todo: list[int],
        results: list,
        compile_fn: Callable[[Job], Compiled],
        claims: CompileClaims | StoreClaims,
    ) -> None:
        rank, _ = job_rank()
        offset = rank_offset(len(todo))
        order = todo[offset:] + todo[:offset]
        deferred = []
        for i in order:
            if keys[i] is None:
                results[i] = self._compile(jobs[i], None, compile_fn)
                continue
            if isinstance(claims, StoreClaims) and self._is_local(keys[i]):
                # This node compiled it before (a restart, a second run): its own cache answers, no claim.
                results[i] = self._compile(jobs[i], keys[i], compile_fn, local=True)
                continue
            claim = claims.try_claim(keys[i])
            if claim is None:
                deferred.append(i)
                continue
            results[i] = self._compile_holding(claim, jobs[i], keys[i], compile_fn)
        if deferred:
            for name in self.idle_work.run_offered():  # about to wait: use the idle core for what this rank needs next
                say("%s compiled while rank %d waited for another rank's compile", name, rank)
        for i in deferred:
            job = jobs[i]

            def waiting(holder: Holder | None, job: Job = job) -> None:
                who = holder.describe() if holder is not None else "another process"
                log.info(
                    "compile_core: rank %d waiting for %s compiling %s (up to %.0f s, %s)",
                    rank,
                    who,
                    job.name,
                    claims.timeout_s,
                    CLAIM_TIMEOUT_ENV,
                )

            claim, raw = claims.wait_claim(keys[i], on_wait=waiting)
            wait = Wait.of(raw)
            if wait.end is not WaitEnd.DONE:
                log.warning(
                    "compile_core: rank %d: %s %s %s after %.1f s; compiling it here",
                    rank,
                    wait.holder.describe() if wait.holder else "the holder",
                    wait.outcome,
                    job.name,
                    wait.seconds,
                )
            if claim is None:
                results[i] = self._compile(job, keys[i], compile_fn, wait=wait)
            else:
                results[i] = self._compile_holding(claim, job, keys[i], compile_fn, wait=wait)

    def _compile_holding(
        self, claim: Any, job: Job, key: str, compile_fn: Callable[[Job], Compiled], *, wait: Wait | None = None
    ) -> Compiled:
        try:
            with claim.capturing():
                compiled = self._compile(job, key, compile_fn, wait=wait)
        except BaseException as exc:
            claim.failed(f"{type(exc).__name__}: {exc}")
            raise
        else:
            if compiled.backend == "inductor":
                pair = compiled.pair
                claim.done({"pair": pair.sizes() if pair is not None and pair.forward is not None else None})
            else:  # fell back: nothing in the cache for the others to load
                claim.failed(f"fell back to {compiled.backend}")
            return compiled
        finally:
            claim.release()

    # -- keys, claims, pair sizes ------------------------------------------------------------------

    def _key(self, job: Job, extra: tuple, reuse: bool) -> str | None:
        if (not reuse and not self.use_claims) or reads_tensor_values(job.gm):
            # A graph that reads a tensor's value may compile to code for that value (Note
            # [Structural keys]): nothing shares its compile, and every rank compiles it itself.
            return None
        autocast = tuple(
            (device, torch.is_autocast_enabled(device), str(torch.get_autocast_dtype(device)))
            for device in ("cpu", "cuda")
        )
        # Devices with their index: Inductor's cache keys include it, so ranks on other device indices
        # could not use each other's compile; they share with the ranks on their own index instead.
        devices = tuple(sorted({str(t.device) for t in job.inputs if isinstance(t, torch.Tensor)}))
        full = (*extra, torch.is_grad_enabled(), autocast, devices)
        key = structural_key(job.gm, job.inputs, extra=full)
        if not reuse:
            # Claims only: make the key unique to this piece, so nothing is reused in-process.
            key = structural_key(job.gm, job.inputs, extra=(*full, job.name))
        return key

    def _claims_dir(self) -> CompileClaims | StoreClaims | None:
        """Job-wide claims through the process group's store when there is one (every node), else file
        claims in the cache dir (the processes sharing it)."""
        if self._claims is None:
            rank, world = job_rank()
            if dist.is_available() and dist.is_initialized() and world > 1:
                self._claims = StoreClaims(
                    torch_ddp.default_store(),
                    rank=rank,
                    directory=cache_dir(),
                    timeout_s=claim_timeout_s(),
                    dead_after_s=leader_dead_s(),
                )
            else:
                directory = os.path.join(cache_dir(), "ddp_compile", "claims")
                self._claims = CompileClaims(directory, me=f"rank {rank}", timeout_s=claim_timeout_s())
        return self._claims

    def _local_marker(self, key: str) -> str:
        return os.path.join(cache_dir(), "ddp_compile", "local", key)

    def _is_local(self, key: str) -> bool:
        return os.path.exists(self._local_marker(key))

    def _mark_local(self, key: str) -> None:
        path = self._local_marker(key)
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w"):
                pass

    def _pair_sizes(self, key: str | None, compiled: Compiled) -> None:
        """Keep (or restore, on a cache hit) the forward/backward sizes of the compiled pair."""
        pair = compiled.pair
        if key is None or pair is None or compiled.backend != "inductor":
            return
        path = os.path.join(cache_dir(), "ddp_compile", "pairs", f"{key}.json")
        if compiled.cache.aot is AotCache.HIT:
            pair.cache = "hit"
            try:
                with open(path) as f:
                    pair.restore(json.load(f))
            except (OSError, ValueError, TypeError, KeyError) as err:
                # compiled by a version that kept no sizes: the pair says it came from the cache, no sizes
                log.debug("compile_core: no forward/backward sizes kept for %s (%s)", key, err)
            return
        pair.cache = compiled.cache.aot.value or None
        if pair.forward is not None:
            self._write_pair_sizes(key, pair.sizes())

    def _write_pair_sizes(self, key: str, sizes: dict) -> None:
        path = os.path.join(cache_dir(), "ddp_compile", "pairs", f"{key}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(sizes, f)
        os.replace(tmp, path)
