"""compile_core/progress.py: the library's progress reports reach listeners it does not know by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from compile_core import progress
from launch import worker


def test_subscribed_listener_sees_each_report_and_can_leave():
    seen = []
    leave = progress.subscribe(seen.append)
    progress.report()
    progress.report("compile")
    leave()
    progress.report()
    assert seen == ["step", "compile"]
    with pytest.raises(TypeError, match="not callable"):
        progress.subscribe("launch.heartbeat:beat")


def test_a_listener_that_raises_is_dropped_and_training_goes_on(caplog):
    calls = []

    def broken(phase):
        calls.append(phase)
        raise OSError("disk full")

    progress.subscribe(broken)
    progress.report()
    progress.report()
    assert calls == ["step"] and "disk full" in caplog.text


def test_the_launcher_subscribes_by_name_through_the_environment(tmp_path):
    # A fresh process: the listener named in the environment is imported at the first report.
    module = tmp_path / "listener_mod.py"
    module.write_text("seen = []\ndef on(phase):\n    seen.append(phase)\n")
    code = (
        "from compile_core import progress\nimport listener_mod\n"
        "progress.report(); progress.report('compile')\nprint(listener_mod.seen)"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{sys.path[0]}", progress.LISTENERS_ENV: "listener_mod:on, nowhere:nothing"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['step', 'compile']"
    assert "cannot load 'nowhere:nothing'" in out.stderr


def test_the_launcher_names_the_librarys_variable_without_importing_the_library():
    assert worker.PROGRESS_LISTENERS_ENV == progress.LISTENERS_ENV
    module, _, name = worker.HEARTBEAT_LISTENER.partition(":")
    assert module == "launch.heartbeat" and callable(getattr(__import__(module, fromlist=[name]), name))
