"""Per-rank trampoline: ``python -m launch.worker script PATH ARGS...`` or ``... module NAME ARGS...``.

torchrun starts this instead of the user's script so that every rank runs the script under torchelastic's
``@record``: an uncaught exception is written to the rank's torchelastic error file, and torchrun's
failure summary then carries the real traceback rather than "To enable traceback see ...". It also drops
a small ``launch_failure.json`` next to that error file with the global rank, so ``python -m launch`` can
say *which* rank failed first even on multi-node jobs (the error file path only knows the local rank).

Two more records, for what a rank cannot say once it is dead or stuck:

* ``launch_rank.json`` (same directory, written at start): global rank, local rank, host and pid, so a rank
  later killed by a signal (SIGKILL, OOM) is named with its real host name.
* with hang detection on (``DDP_LAUNCH_HEARTBEAT_DIR`` set): the rank's heartbeat record
  (``launch.heartbeat.start()``), and faulthandler registered on SIGUSR1 into ``rank<R>.stack`` in that
  directory, so the watchdog can fetch the Python stack of a stuck rank (faulthandler dumps from its C
  signal handler, even while the rank blocks inside a collective).

The script sees the same ``sys.argv``, ``sys.path[0]`` and ``__name__ == "__main__"`` as under
``python script.py`` / ``python -m module``. This module imports nothing of the compile stack.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback

FAILURE_FILE = "launch_failure.json"
RANK_FILE = "launch_rank.json"
_USAGE = "usage: python -m launch.worker {script PATH | module NAME} [ARGS...]"


def _rank_info() -> dict:
    return {
        "rank": int(os.environ.get("RANK", "-1")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
        "group_rank": int(os.environ.get("GROUP_RANK", "-1")),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }


def per_pid(name: str, pid: int) -> str:
    """`launch_rank.json` -> `launch_rank.<pid>.json`: a copy no later attempt overwrites. A node whose
    agent restarts for another node's failure reuses its attempt directory (launch/restarts.py)."""
    stem, ext = os.path.splitext(name)
    return f"{stem}.{pid}{ext}"


def _write_record(name: str, info: dict) -> None:
    """`info` as `name` and as its per-pid copy, beside the torchelastic error file."""
    directory = os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])
    os.makedirs(directory, exist_ok=True)
    for file_name in (name, per_pid(name, os.getpid())):
        with open(os.path.join(directory, file_name), "w") as f:
            json.dump(info, f)


def _write_rank_file() -> None:
    """Who this rank is, beside the torchelastic error file (only when run under torchrun)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    try:
        _write_record(RANK_FILE, {**_rank_info(), "time": time.time()})
    except OSError:
        pass  # a convenience for the failure report; never stop the rank over it


PROGRESS_LISTENERS_ENV = "COMPILE_CORE_PROGRESS_LISTENERS"
"""compile_core.progress.LISTENERS_ENV (a unit test checks that they are equal; we import nothing of the library)."""
HEARTBEAT_LISTENER = "launch.heartbeat:beat"
"""Our listener: each progress report of the library is a heartbeat (its phase picks the watchdog's grace)."""

_stack_file = None  # kept open for the process lifetime: faulthandler writes to its descriptor


def _start_heartbeat() -> None:
    """With hang detection on: create the heartbeat record and let SIGUSR1 dump every thread's stack."""
    global _stack_file
    from launch import heartbeat

    directory = os.environ.get(heartbeat.HEARTBEAT_DIR_ENV)
    if not directory or heartbeat.start() is None:
        return
    # The compile library reports its progress (and the start of each long compile) to the listeners this
    # variable names; we never import the library, it never imports us (compile_core/progress.py).
    listeners = [s for s in os.environ.get(PROGRESS_LISTENERS_ENV, "").split(",") if s.strip()]
    if HEARTBEAT_LISTENER not in listeners:
        os.environ[PROGRESS_LISTENERS_ENV] = ",".join([*listeners, HEARTBEAT_LISTENER])
    try:
        _stack_file = open(heartbeat.stack_path(directory, int(os.environ.get("RANK", "0"))), "w")
    except OSError as exc:
        print(f"launch.worker: no stack dumps for the hang report: {exc}", file=sys.stderr)
        return
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def _write_failure(exc: BaseException) -> None:
    """Record rank + exception beside the torchelastic error file (only when run under torchrun)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    info = {
        **_rank_info(),
        "time": time.time(),
        "exception": f"{type(exc).__name__}: {exc}",
        "traceback": _user_traceback(exc),
    }
    try:
        _write_record(FAILURE_FILE, info)
    except OSError:
        pass  # the report is a convenience; never mask the user's exception with our own


def _user_traceback(exc: BaseException) -> str:
    """The traceback from the user's first frame on: our trampoline and runpy frames are noise."""
    tb = exc.__traceback__
    ours = os.path.abspath(__file__)
    while tb is not None and tb.tb_next is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename != ours and "runpy" not in os.path.basename(filename):
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _run(kind: str, target: str, args: list[str]) -> None:
    if kind == "script":
        # `python script.py` puts the script's directory first on sys.path; `python -m launch.worker` put
        # the cwd there instead.
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        sys.argv = [target, *args]
        runpy.run_path(target, run_name="__main__")
    else:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] not in ("script", "module"):
        raise SystemExit(f"launch.worker: got {argv[:2]!r}; {_USAGE}")
    kind, target, args = argv[0], argv[1], argv[2:]
    _write_rank_file()
    _start_heartbeat()  # before the torch import below: the record exists within milliseconds of the start

    # Imported here, not at module level: keeps `import launch.worker` free of torch for tooling.
    from torch.distributed.elastic.multiprocessing.errors import record

    def run_recorded() -> None:
        try:
            _run(kind, target, args)
        except Exception as exc:  # same scope as @record: SystemExit/KeyboardInterrupt are not failures
            _write_failure(exc)
            raise

    record(run_recorded)()


if __name__ == "__main__":
    main()
