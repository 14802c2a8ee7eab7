"""The launcher's hang options: the --hang-timeout and --hang-first-step-timeout flags of `python -m launch`
(parsed, bad values refused as one-line usage errors with exit code 2, shown in a dry run), and the torchx
component's hang options, which run torchrun under the watchdog only when asked and are validated."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launch import cli, components, heartbeat

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)  # the slowest starts a worker (imports torch) or `python -m launch`


@pytest.fixture
def script(tmp_path):
    s = tmp_path / "s.py"
    s.write_text("")
    return str(s)


def test_hang_flags_are_parsed(script):
    cfg = cli.parse_args(["--hang-timeout", "30", "--hang-first-step-timeout", "900", script])
    assert (cfg.hang_timeout, cfg.hang_first_step_timeout) == (30.0, 900.0)
    assert cli.parse_args([script]).hang_timeout is None  # off by default


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hang-timeout", "0"], "--hang-timeout 0: expected a number of seconds > 0"),
        (["--hang-timeout", "-5"], "--hang-timeout -5: expected a number of seconds > 0"),
        (["--hang-timeout", "soon"], "--hang-timeout 'soon': expected a number of seconds > 0"),
        (["--hang-timeout", "inf"], "--hang-timeout inf: expected a number of seconds > 0"),
        (
            ["--hang-timeout", "60", "--hang-first-step-timeout", "30"],
            "--hang-first-step-timeout 30: expected seconds >= --hang-timeout (60)",
        ),
        (["--hang-first-step-timeout", "30"], "needs --hang-timeout"),
    ],
)
def test_bad_hang_values_are_usage_errors(script, flags, message):
    with pytest.raises(cli.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cli.parse_args([*flags, script])


def test_bad_hang_value_is_one_line_and_exit_2(script):
    res = subprocess.run(
        [sys.executable, "-m", "launch", "--hang-timeout", "0", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == ["launch: error: --hang-timeout 0: expected a number of seconds > 0 (e.g. 300)"]


def test_component_runs_torchrun_under_the_watchdog_only_when_asked():
    plain = components.trainer(script="a.py")
    assert "launch.watchdog" not in plain.roles[0].args[1]
    assert components.HEARTBEAT_DIR_ENV not in plain.roles[0].env
    app = components.trainer(script="a.py", hang_timeout=30, heartbeat_dir="/tmp/hb")
    cmd = app.roles[0].args[1]
    assert "exec python3 -m launch.watchdog --hang-timeout 30.0 -- torchrun " in cmd
    assert app.roles[0].env[components.HEARTBEAT_DIR_ENV] == "/tmp/hb"
    first = components.trainer(script="a.py", hang_timeout=30, hang_first_step_timeout=1200)
    assert "--hang-timeout 30.0 --first-step-timeout 1200.0 -- torchrun" in first.roles[0].args[1]
    assert components.HEARTBEAT_DIR_ENV == heartbeat.HEARTBEAT_DIR_ENV  # the component keeps its own copy
    # `torchx run ... --hang_timeout 30` hands the value over as the string "30" (torchx 0.7.0)
    assert "--hang-timeout 30.0 --" in components.trainer(script="a.py", hang_timeout="30").roles[0].args[1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hang_timeout": 0.0}, "hang_timeout=0.0: expected a number of seconds > 0"),
        (
            {"hang_timeout": 10.0, "hang_first_step_timeout": 1.0},
            "hang_first_step_timeout=1.0: expected seconds >= hang_timeout",
        ),
        ({"hang_timeout": "soon"}, "hang_timeout='soon': expected a number of seconds > 0"),
        ({"heartbeat_dir": "/tmp/hb"}, "need hang_timeout"),
    ],
)
def test_component_rejects_bad_hang_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        components.trainer(script="a.py", **kwargs)


def test_dry_run_shows_the_watchdog(script):
    res = subprocess.run(
        [sys.executable, "-m", "launch", "--dry-run", "--hang-timeout", "20", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "python3 -m launch.watchdog --hang-timeout 20.0 -- torchrun " in res.stdout
