"""Fixtures shared by the test modules."""
import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread, as every spawned rank uses: the same kernels give the same bits, and on a
    shared 2-core machine spinning thread pools slow small models many-fold."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
