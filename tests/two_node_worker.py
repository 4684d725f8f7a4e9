"""One process of a 2-stage pipeline with REPLICAS replicas on two torchrun agents ("machines",
REPLICAS / 2 replicas each).

Run by tests/test_two_nodes.py on each of two agents:
    torchrun --nnodes 2 --nproc-per-node REPLICAS --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \
        tests/two_node_worker.py OUT_DIR ALLREDUCE REPLICAS [ZERO[,ZERO...]]
Each ZERO level trains its own pipeline in turn on the same processes (one launch serves them all) and
writes OUT_DIR/zero<ZERO>/rank<RANK>.pt.
"""
import sys
from pathlib import Path

import torch

from runtime_models import make, sgd
from test_hybrid import batches, data
from helpers import wrap_unprofiled


def main() -> None:
    out, allreduce, replicas = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    for zero in map(int, (sys.argv[4] if len(sys.argv) > 4 else "0").split(",")):
        train(out / f"zero{zero}", allreduce, replicas, zero)


def train(out: Path, allreduce: str, replicas: int, zero: int) -> None:
    """Train one pipeline at this ZeRO level and save what the test compares in ``out``."""
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


if __name__ == "__main__":
    main()
