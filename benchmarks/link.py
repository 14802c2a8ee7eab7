"""`--link-gbit X`: every benchmark job runs in a network namespace of its own whose loopback is shaped.

Why: on one machine the ranks of a job talk over the loopback, which moves gigabytes per second with
microseconds of latency, so communication is nearly free and overlap hardly matters. A token-bucket
filter (`tc qdisc ... tbf`) on the loopback of a private namespace gives the job a link of X Gbit/s
without touching the machine's own network (other jobs, other users).

How, per job: a holder process is started under `unshare -n` (a fresh network namespace, root only);
it brings `lo` up, adds the qdisc, prints "ready" and then blocks reading its stdin. Every rank of the
job is started through `nsenter --net=/proc/<holder>/ns/net`, so both ranks share the namespace and
rendezvous on 127.0.0.1 inside it. nsenter execs the rank (no fork for a network namespace): the
runner's process handles stay the ranks themselves. At the end of the job the runner closes the
holder's stdin; if the runner dies first, the pipe closes anyway, the holder exits and the namespace
goes with its last process: nothing is left behind in either case.

`netem` (delay, loss) is not available on every kernel (it is not on our dev machines); `tbf` is, so the
link is shaped by rate only. `unavailable_reason` checks all of this before the first job of a run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import select
import shlex
import shutil
import signal
import subprocess
import time
from typing import Self

TOOLS = ("unshare", "nsenter", "ip", "tc", "sh")
"""Executables the link needs (util-linux: unshare, nsenter; iproute2: ip, tc)."""

READY = "ready"
"""What the holder prints once the namespace's loopback is up and shaped."""


class LinkError(RuntimeError):
    """The shaped namespace of a job could not be set up (the message says why)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkShape:
    """The loopback every job of a run gets."""

    rate_gbit: float
    """Rate of the tbf qdisc in Gbit/s (> 0)."""
    burst: str = "256kb"
    """tbf bucket size (tc syntax; kb = kilobytes)."""
    latency: str = "100ms"
    """Longest a packet may wait in the tbf queue (tc syntax)."""

    def __post_init__(self) -> None:
        rate = self.rate_gbit
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or not rate > 0:
            raise ValueError(f"--link-gbit {rate!r}: pass a finite number of Gbit/s > 0, e.g. --link-gbit 5")
        if self.rate_bits() < 1000:
            raise ValueError(f"--link-gbit {rate!r}: below 1 kbit/s no benchmark job would finish; pass e.g. 0.5 or 5")

    def rate_bits(self) -> int:
        """The rate in bit/s, as an integer (tc reads '<n>bit' exactly)."""
        return round(self.rate_gbit * 1e9)

    def qdisc_args(self) -> list[str]:
        """Arguments of `tc` that add the qdisc to `lo`."""
        return [
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            f"{self.rate_bits()}bit",
            "burst",
            self.burst,
            "latency",
            self.latency,
        ]

    def describe(self) -> str:
        return (
            f"loopback shaped to {self.rate_gbit:g} Gbit/s (tc tbf rate {self.rate_gbit:g}gbit burst {self.burst} "
            f"latency {self.latency}) in a fresh network namespace per job"
        )


def find_tools(path: str | None = None) -> tuple[dict[str, str], list[str]]:
    """(name -> absolute path of every tool found, names not found) on `path` (None: $PATH)."""
    found, missing = {}, []
    for name in TOOLS:
        where = shutil.which(name, path=path)
        if where:
            found[name] = where
        else:
            missing.append(name)
    return found, missing


def unavailable_reason(
    shape: LinkShape, *, path: str | None = None, euid: int | None = None, trial_timeout_s: float = 20.0
) -> str | None:
    """None when jobs can run on the shaped link; otherwise one line naming what is missing.

    Checks the tools on `path` ($PATH), root, then makes a trial namespace exactly as a job does and
    reads the qdisc back from inside it.
    """
    euid = os.geteuid() if euid is None else euid
    tools, missing = find_tools(path)
    problems = []
    if missing:
        problems.append(f"not on PATH: {', '.join(missing)} (util-linux gives unshare and nsenter, iproute2 ip and tc)")
    if euid != 0:
        problems.append(f"not running as root (euid {euid}): a network namespace and a qdisc need root")
    if not problems:
        try:
            with ShapedNamespace(shape, tools=tools, start_timeout_s=trial_timeout_s) as ns:
                shown = subprocess.run(
                    [*ns.prefix(), tools["tc"], "qdisc", "show", "dev", "lo"],
                    check=False,
                    capture_output=True,
                    text=True,
                    timeout=trial_timeout_s,
                )
            if shown.returncode != 0 or " tbf " not in f" {shown.stdout} ":
                problems.append(
                    f"the trial namespace shows no tbf qdisc on lo: {(shown.stdout + shown.stderr).strip()!r}"
                )
        except (LinkError, OSError, subprocess.TimeoutExpired) as err:
            problems.append(f"the trial namespace failed: {err}")
    if not problems:
        return None
    return (
        f"--link-gbit {shape.rate_gbit:g} cannot shape the link: "
        + "; ".join(problems)
        + ". Each job runs in its own network namespace (unshare -n) with a tc tbf qdisc on its loopback; "
        "run as root with those tools, or drop --link-gbit."
    )


class ShapedNamespace:
    """A network namespace with a shaped loopback, alive while the context is open (see the module doc)."""

    def __init__(self, shape: LinkShape, *, tools: dict[str, str] | None = None, start_timeout_s: float = 20.0) -> None:
        self.shape = shape
        if tools is None:
            tools, missing = find_tools()
            if missing:
                raise LinkError(f"not on PATH: {', '.join(missing)}")
        self._tools = tools
        self._start_timeout_s = start_timeout_s
        self._holder: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        t = self._tools
        script = " && ".join(
            [
                f"{shlex.quote(t['ip'])} link set lo up",
                shlex.join([t["tc"], *self.shape.qdisc_args()]),
                f"echo {READY}",
                "exec cat >/dev/null",  # hold the namespace until the runner closes our stdin (or dies)
            ]
        )
        self._holder = subprocess.Popen(
            [t["unshare"], "-n", "--", t["sh"], "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self._stop()
            raise
        return self

    def _wait_ready(self) -> None:
        holder = self._holder
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LinkError(f"the namespace holder did not report '{READY}' within {self._start_timeout_s:.0f} s")
            readable, _, _ = select.select([holder.stdout], [], [], left)
            if not readable:
                continue
            line = holder.stdout.readline()
            if line.strip() == READY:
                return
            if not line:  # the holder exited: its stderr says why (unshare not permitted, unknown qdisc, ...)
                holder.wait(timeout=5)
                err = " ".join(holder.stderr.read().split())
                raise LinkError(f"unshare -n / ip / tc exited with code {holder.returncode}: {err or 'no message'}")

    def prefix(self) -> list[str]:
        """Command prefix that runs a program inside this namespace."""
        if self._holder is None or self._holder.poll() is not None:
            raise LinkError("the shaped namespace is not running")
        return [self._tools["nsenter"], f"--net=/proc/{self._holder.pid}/ns/net", "--"]

    def _stop(self) -> None:
        holder, self._holder = self._holder, None
        if holder is None:
            return
        for stream in (holder.stdin, holder.stdout, holder.stderr):
            stream.close()  # closing stdin ends the holder's `cat`
        try:
            holder.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait(timeout=5)

    def __exit__(self, *exc: object) -> None:
        self._stop()
