"""Waiting on other ranks: a collective that another rank never joins ends, after wrap's ``timeout``
(every process group pipetrain makes carries it), in one error that says what was waited for."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch.distributed as dist

from pipetrain.comm.failures import PeerFailure


@contextlib.contextmanager
def peers_answer(what: str, hint: str = "raise wrap(..., timeout=...) if that rank is only slow") -> Iterator[None]:
    """Turn a time-out or a lost connection inside the block into a PeerFailure naming ``what`` (a
    phrase such as "the plan broadcast from rank 0") and this rank; torch's own error is appended."""
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as error:  # gloo/NCCL time-outs, DistStoreError, DistNetworkError
        rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")  # torchrun sets RANK
        raise PeerFailure(
            f"rank {rank}: {what} did not complete: another rank died, hangs or never got there; see the other "
            f"ranks' logs ({hint}). {error}") from error
