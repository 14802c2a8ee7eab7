import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cache entries or counters carried between tests."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture()
def pg():
    """A world-size-1 gloo process group (created once per worker process)."""
    from tests.ranks import init_single_rank_group

    init_single_rank_group()
    yield
