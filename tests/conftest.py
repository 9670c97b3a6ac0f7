"""The suite's shared setup. Test files sit in a folder per package of ``hf_paged`` (tests of the package as a whole
here, GPU tests under gpu/); what several of them share lives in helpers/ (no tests there), which is put on the path
so that a test imports a helper by its bare name (``from tiny_models import make_models``)."""

import collections
import os
import signal
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # The modules with the most slow tests first, each kept whole (its module fixtures built once): under xdist the
    # long tests then start early, and the two workers finish together instead of one waiting on a late soak.
    slow_in = collections.Counter(item.module.__name__ for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow_in[item.module.__name__])
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (cuda marker)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def single_process_group(tmp_path):
    """A gloo process group of this process alone (world size 1, where a sum over the ranks is its input); its
    name. Skips where a group is up already."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is up in this process already")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _environment_read_afresh():
    """Each test reads the ``HF_PAGED_*`` switches afresh (``hf_paged.envs`` reads each once per process)."""
    from hf_paged import envs

    envs.refresh()
    yield
    envs.refresh()


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """Ctrl-C raises ``KeyboardInterrupt`` in every test, as in a run from a terminal. A suite started in the
    background by a shell without job control inherits SIGINT ignored, and Python then installs no handler: the tests
    that send their own process SIGINT (``tests/engine/test_engine_faults.py``, ``test_engine_interrupts.py``) would
    see nothing."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        yield
