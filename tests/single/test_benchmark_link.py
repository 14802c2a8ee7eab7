"""The benchmark's shaped link (benchmarks/link.py, --link-gbit): the availability check that names every
missing tool and missing root privilege in one line, the trial namespace and its failure reason, the exit
code 2 before any job when the link cannot be shaped, and (with root and the tools) that the shaped network
namespace rate-limits its own loopback and leaves nothing behind."""

from __future__ import annotations

import pytest


def _fake_tools(folder, **scripts: str) -> str:
    """A PATH folder with shell scripts of the link's tool names (body per name; missing names: no file)."""
    folder.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return str(folder)


def test_link_check_names_every_missing_tool_and_root_in_one_line(tmp_path):
    from benchmarks.link import LinkShape, unavailable_reason

    shape = LinkShape(rate_gbit=5)
    msg = unavailable_reason(shape, path=_fake_tools(tmp_path / "bin", ip="exit 0", sh='exec /bin/sh "$@"'), euid=1000)
    assert msg.startswith("--link-gbit 5 cannot shape the link: not on PATH: unshare, nsenter, tc ")
    assert "not running as root (euid 1000)" in msg and "drop --link-gbit" in msg and "\n" not in msg
    assert "ip," not in msg.split("cannot shape the link:")[1].split("(")[0]  # ip was found
    everything = unavailable_reason(shape, path=str(tmp_path / "empty"), euid=0)
    assert "not on PATH: unshare, nsenter, ip, tc, sh" in everything and "not running as root" not in everything


def test_link_check_runs_a_trial_namespace_and_reports_why_it_failed(tmp_path):
    from benchmarks.link import LinkShape, unavailable_reason

    # every tool there, but unshare is refused (as in an unprivileged container): the trial says why
    path = _fake_tools(
        tmp_path / "bin",
        unshare="echo 'unshare: unshare failed: Operation not permitted' >&2; exit 1",
        nsenter="exit 0",
        ip="exit 0",
        tc="exit 0",
        sh='exec /bin/sh "$@"',
    )
    msg = unavailable_reason(LinkShape(rate_gbit=5), path=path, euid=0)
    assert "the trial namespace failed" in msg and "Operation not permitted" in msg and "code 1" in msg


def test_link_unavailable_exits_2_with_one_error_before_any_job(monkeypatch, capsys, tmp_path):
    from benchmarks import cli, link, suite

    monkeypatch.setenv("PATH", str(tmp_path))  # none of unshare, nsenter, ip, tc, sh
    monkeypatch.setattr(suite, "run_suite", lambda *a, **k: pytest.fail("a job ran on an unavailable link"))
    assert link.find_tools()[1] == list(link.TOOLS)
    assert cli.main(["--smoke", "--no-plot", "--link-gbit", "5", "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--link-gbit 5 cannot shape the link: not on PATH: unshare" in err


def test_shaped_namespace_shapes_lo_and_leaves_nothing_behind():
    import os
    import subprocess

    from benchmarks.link import LinkShape, ShapedNamespace, unavailable_reason

    shape = LinkShape(rate_gbit=5)
    why = unavailable_reason(shape)
    if why:
        pytest.skip(f"needs root, unshare, nsenter, ip and tc: {why}")
    with ShapedNamespace(shape) as ns:
        inside = subprocess.run(
            [*ns.prefix(), "tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, check=True
        ).stdout
        links = subprocess.run([*ns.prefix(), "ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        holder = ns.prefix()[1].split("/")[2]
    assert "tbf" in inside and "rate 5Gbit" in inside
    assert [line.split(": ")[1] for line in links.splitlines()] == ["lo"]  # a fresh namespace: lo only
    outside = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, check=True).stdout
    assert "tbf" not in outside  # the machine's own loopback was never touched
    assert not os.path.exists(f"/proc/{holder}")  # the holder is gone, and with it the namespace
