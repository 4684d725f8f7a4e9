"""One process of a 2-stage pipeline with REPLICAS replicas on two torchrun agents ("machines",
REPLICAS / 2 replicas each).

Run by tests/test_two_nodes.py on each of two agents:
    torchrun --nnodes 2 --nproc-per-node REPLICAS --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \
        tests/two_node_worker.py OUT_DIR ALLREDUCE REPLICAS [ZERO[,ZERO...]]
Each ZERO level trains its own pipeline in turn on the same processes (one launch serves them all) and
writes OUT_DIR/zero<ZERO>/rank<RANK>.pt. The last pipeline is closed, the others stay open until the process
exits, as a script's pipeline does; OUT_DIR/threads-rank<RANK>.json records the gloo worker threads around
that close, and those left when the interpreter's teardown begins.
"""
import atexit
import json
import os
import sys
from pathlib import Path

import torch

from runtime_models import make, sgd
from test_hybrid import batches, data
from helpers import wrap_unprofiled


def gloo_workers() -> int:
    """The threads gloo process groups run their collectives on, alive in this process now."""
    return sum(Path(f"/proc/self/task/{t}/comm").read_text().strip() == "pt_gloo_runloop"
               for t in os.listdir("/proc/self/task"))


open_pipes = []  # a script's pipelines, open until the process exits


def main() -> None:
    out, allreduce, replicas = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    threads: dict[str, int] = {}
    # Registered before pipetrain starts the process group, so it runs after pipetrain's exit handler.
    atexit.register(lambda: (out / f"threads-rank{os.environ['RANK']}.json").write_text(
        json.dumps({**threads, "at_exit": gloo_workers()})))
    zeros = list(map(int, (sys.argv[4] if len(sys.argv) > 4 else "0").split(",")))
    for zero in zeros:
        threads["before_last_wrap"] = gloo_workers()
        open_pipes.append(train(out / f"zero{zero}", allreduce, replicas, zero))
    threads["last_open"] = gloo_workers()
    open_pipes.pop().close()
    threads["last_closed"] = gloo_workers()


def train(out: Path, allreduce: str, replicas: int, zero: int):
    """Train one pipeline at this ZeRO level, save what the test compares in ``out``; returns the pipeline."""
    out.mkdir(parents=True, exist_ok=True)
    pipe = wrap_unprofiled(make("convbn"), data("convbn", 2)[0], stages=2, micro_batches=2, data_parallel=replicas,
                           allreduce=allreduce, optimizer=sgd, partitioner="uniform",
                           engine="distributed", timeout=60, zero=zero)
    losses = [r.loss for r in pipe.train(batches("convbn"))]
    world = pipe.world
    reducer = pipe.gradient_reducer
    hierarchy = reducer.hierarchy
    torch.save({"losses": losses, "state": pipe.state_dict(), "replica": world.replica,
                "hierarchy": None if hierarchy is None else (hierarchy.nodes, hierarchy.per_node),
                "hierarchical_buckets": [b.hierarchical for b in reducer.buckets]},
               out / f"rank{world.rank}.pt")
    return pipe
    return pipe


if __name__ == "__main__":
    main()
