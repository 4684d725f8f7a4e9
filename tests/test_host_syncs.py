"""Host synchronisations per step: only the known ones, as often as listed in README.

On the CPU a device read costs nothing, so the test watches the calls that would synchronise on a
GPU (``.item()``, ``float()``, ``int()``, ``bool()``, ``.tolist()``, ``.cpu()``, ``.numpy()``) made
from pipetrain's own code while it trains, and the marked points (pipetrain.runtime.host_sync).
A new read on the hot path fails it. On a GPU, ``torch.cuda.set_sync_debug_mode`` counts them all.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import pipetrain
from pipetrain.runtime import host_sync
from runtime_models import data, make, sgd
from test_nonfinite import poison
from helpers import batches, wrap_unprofiled

PACKAGE = str(Path(pipetrain.__file__).resolve().parent)
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
# The functions allowed to read device values on the host during training, each a point README lists.
ALLOWED = {("runner.py", "_loss_sum"), ("overflow_agreement.py", "agree"), ("overflow_agreement.py", "result"),
           ("reporting.py", "collect"), ("reporting.py", "_read_on_host"), ("transport.py", "exchange"),
           ("wire.py", "decode_header")}


@pytest.fixture
def host_reads(monkeypatch):
    """(file, function) -> calls of every host read of a tensor made directly by pipetrain's code."""
    seen: Counter = Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def watched(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                seen[(Path(caller.f_code.co_filename).name, caller.f_code.co_name)] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, watched)
    return seen


@pytest.mark.parametrize("schedule,staleness", [("1f1b", "none"), ("gpipe", "none"), ("zb-h1", "none"),
                                                ("interleaved-1f1b", "none"), ("async-1f1b", "stash"),
                                                ("async-1f1b", "spectrain")])
def test_training_reads_the_device_only_at_the_known_points(one_thread, host_reads, schedule, staleness):
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=4, schedule=schedule,
                           staleness=staleness, optimizer=sgd, partitioner="uniform", engine="local")
    steps = 3
    with host_sync.counting() as marked:
        results = list(pipe.train(batches("mlp", steps)))
    assert len(results) == steps
    # One loss report per step (the last stage's micro-batch losses summed on the device, read once)
    # and one skip-or-step decision per step, read once for every device of the process; async-1f1b
    # reads its staleness diagnostics (every stage's prediction error) once per step, with the report.
    expected = {"loss report": steps, "skip-or-step decision": steps}
    if staleness != "none":
        expected["staleness diagnostics"] = steps
    assert marked == expected
    unexpected = {where: n for where, n in host_reads.items() if where not in ALLOWED}
    assert not unexpected, f"new host reads on the hot path: {unexpected}"
    assert host_reads[("runner.py", "_loss_sum")] == steps


def test_the_watch_sees_a_read_outside_the_known_points(one_thread, host_reads):
    # The check above can fail: naming the first non-finite gradient reads every gradient on the host
    # (fine there: it happens only on the way to an error), and the watch reports where.
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=4, optimizer=sgd,
                           partitioner="uniform", engine="local")
    poison(pipe, 1, lambda micro_batch: True)
    with pytest.raises(pipetrain.NonFiniteError):
        pipe.step(*batches("mlp", 1)[0])
    assert ("nonfinite.py", "first_nonfinite") in host_reads
    assert ("nonfinite.py", "first_nonfinite") not in ALLOWED
