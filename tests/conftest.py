import os
import sys
import uuid

import pytest

from tests.procs import SESSION_ENV, kill_trees, wait_for_leftovers

# Helpers whose bare asserts should explain themselves as a test's do (rewritten when first imported).
pytest.register_assert_rewrite("tests.single.train_step_helpers")

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's CPU kernels as scalar C++ (no at::vec templates): about 40% less CPU per C++ compile on CI's
# 2 cores, and no ISA probe in each process. The tests prove what our layer does with Inductor (caches,
# compiles shared between ranks, the all-reduce and update inside its graph, fallbacks), not Inductor's
# vectorizer. Every process the suite starts inherits it; export TORCHINDUCTOR_VEC_ISA_OK=1 to test with it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# One marker for the whole session, set at import time in the controller (conftest is imported before
# xdist starts its workers): every process the suite starts inherits it, so the session end can find
# whatever is still alive (see pytest_sessionfinish). Workers and ranks inherit the controller's value.
os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex)

LEFTOVER_GRACE_S = float(os.environ.get("DDP_COMPILE_TEST_LEFTOVER_GRACE_S", "15"))
"""How long processes of the session get to exit after the last test before they count as leaked."""


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cache entries or counters carried between tests.

    Tests that never import torch (launcher CLI, leak guard) do not pay for importing it here.
    """
    if "torch" in sys.modules:
        sys.modules["torch"]._dynamo.reset()
    yield
    if "torch" in sys.modules:
        sys.modules["torch"]._dynamo.reset()
        _no_hidden_torch_config()


def _no_hidden_torch_config() -> None:
    """Deleting an entry of a torch config module hides it for the rest of the worker, and every later test
    that reads it fails far from the cause. pytest's monkeypatch.setattr on a config module does exactly that
    when it undoes (pytest >= 9.2 deletes what it did not find in the module's __dict__): use config.patch."""
    for name in ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config"):
        module = sys.modules.get(name)
        hidden = sorted(k for k, entry in getattr(module, "_config", {}).items() if entry.hide)
        assert not hidden, f"{name}: entries {hidden} were deleted by this test; patch them with {name}.patch(...)"


@pytest.fixture(scope="session", autouse=True)
def _rank_resources():
    """The world-size-1 group's file store and the ranks' fork server go with the session (xdist workers
    may skip atexit)."""
    yield
    ranks = sys.modules.get("tests.ranks")  # never imported: no store was made (and no torch import now)
    if ranks is not None:
        ranks.remove_single_rank_store()
        ranks.stop_rank_server()


@pytest.fixture()
def pg():
    """A world-size-1 gloo process group (created once per worker process)."""
    from tests.ranks import init_single_rank_group

    init_single_rank_group()
    yield


GROUPED_MODULE_SUFFIX = "_multirank.py"
"""Test modules whose tests must share one xdist worker (see pytest_xdist_make_scheduler)."""


@pytest.hookimpl(optionalhook=True)  # an xdist hook: harmless when xdist is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """With -n: tests of a `*_multirank.py` module stay on one worker, every other test is load-balanced.

    Those modules launch their ranks ONCE, in a module-scoped fixture shared by all of their tests;
    spread over two workers, the fixture (and the launch) would run twice. xdist's own `--dist loadgroup`
    cannot do this with pytest 9 (xdist 3.8 renames `item._nodeid`, which pytest 9 no longer reads), and
    the controller never sees markers, so the grouping goes by file name.
    """
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None  # an explicit other --dist mode: xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(GROUPED_MODULE_SUFFIX) else nodeid

    return ModuleGroupScheduling(config, log)


@pytest.hookimpl(trylast=True)  # after xdist has shut its workers down
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if any process the suite started is still alive; kill it and say which."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller checks once, after every worker is gone
    left = wait_for_leftovers(os.environ[SESSION_ENV], LEFTOVER_GRACE_S)
    if left:
        kill_trees([p.pid for p in left])
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"  {p}" for p in left]
        if reporter is not None:
            reporter.write_sep("!", f"{len(left)} process(es) started by the test session were still alive")
            for line in lines:
                reporter.write_line(line, red=True)
            reporter.write_line("they were killed now; the test that started them must kill them itself", red=True)
        else:
            print("processes left behind by the test session:\n" + "\n".join(lines))
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
