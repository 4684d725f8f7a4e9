"""Fixtures shared by the test modules (helpers the spawned ranks use too are in helpers.py)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Every test runs on one intra-op thread, as every spawned rank does: the same kernels give the same
    bits, and on a shared 2-core machine spinning thread pools slow small models many-fold (a 4-stage
    EfficientNet case took 62 s with 2 threads and 6 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
