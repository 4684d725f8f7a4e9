"""Bytes communicated per training step: 4-stage pipeline vs 4-replica data parallelism.

    .venv/bin/python examples/benchmarks/bench_comm_bytes.py [--batch 64] [--micro-batches 4]

The SpecTrain paper (Chen et al. 2018) reports that pipelined model parallelism
moves 13.4x fewer bytes per step than data parallelism on average. This script
counts both with the runtime's own accounting (StepResult.comm_bytes) for our
VGG, ResNet, Transformer and LSTM examples (classifiers, DEFAULT_SIZE), one
mini-batch of `batch` samples from each family's default dataset:

* pipeline: wrap(stages=4, micro_batches=m, engine="local"); per step, summed over
  stages, activations + activation_grads + tied_grads. Point-to-point messages
  cross the wire once, so payload = wire bytes.
* data parallel: 4 gloo processes (start_local_ranks), wrap(stages=1,
  data_parallel=4, engine="distributed"). The runtime counts, per replica, the
  gradient payload it all-reduces (= its parameter bytes); StepResult sums the
  replicas. A ring all-reduce of P bytes over n ranks sends 2(n-1)/n x P bytes
  from every rank, so the wire total is n x 2(n-1)/n x P.

The ratio column compares what crosses the wire in the whole system per step:
DP ring wire bytes (all replicas) / pipeline bytes (all stages). The payload
ratio (sum of all-reduce payloads / pipeline bytes) is printed too.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import pipetrain
from pipetrain.apps.datasets import dataset_info, load_dataset
from pipetrain.apps.models import DEFAULT_DATASET, build_model
from pipetrain.comm.local_ranks import start_local_ranks

FAMILIES = ["vgg", "resnet", "transformer", "lstm"]
STAGES = REPLICAS = 4
PIPELINE_KINDS = ("activations", "activation_grads", "tied_grads")


def batch_of(name: str, size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The first `size` training samples of the family's default dataset, and its class count."""
    dataset = DEFAULT_DATASET[name]
    data = load_dataset(dataset, split="train")
    x = torch.stack([data[i][0] for i in range(size)])
    y = torch.stack([torch.as_tensor(data[i][1]) for i in range(size)])
    return x, y, dataset_info(dataset).num_classes


def model_of(name: str, classes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, num_classes=classes)


def pipeline_bytes(name: str, batch: int, micro: int) -> int:
    """Bytes the 4-stage pipeline sends in one step (all stages, all kinds but data_parallel)."""
    x, y, classes = batch_of(name, batch)
    pipe = pipetrain.wrap(model_of(name, classes), x[: batch // micro], stages=STAGES, micro_batches=micro,
                          schedule="1f1b", engine="local")
    pipe.step(x, y)
    result = pipe.last_result
    return sum(sum(result.comm_bytes[k]) for k in PIPELINE_KINDS)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dp_worker(rank: int, port: int, name: str, batch: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(REPLICAS), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(REPLICAS))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=REPLICAS)
    try:
        x, y, classes = batch_of(name, batch)
        model = model_of(name, classes)
        trained = [p for p in model.parameters() if p.requires_grad]
        numel, params = sum(p.numel() for p in trained), sum(p.numel() * p.element_size() for p in trained)
        pipe = pipetrain.wrap(model, x[: batch // REPLICAS], stages=1, micro_batches=1,
                              data_parallel=REPLICAS, engine="distributed")
        pipe.step(x, y)
        if rank == 0:
            torch.save({"comm": pipe.last_result.comm_bytes, "params": params, "numel": numel}, Path(out) / "dp.pt")
    finally:
        dist.destroy_process_group()


def data_parallel_bytes(name: str, batch: int) -> tuple[int, int, int]:
    """(payload summed over the replicas, parameter bytes, parameter count) of one DP step."""
    with tempfile.TemporaryDirectory() as out:
        start_local_ranks(_dp_worker, (_port(), name, batch, out), REPLICAS)
        got = torch.load(Path(out) / "dp.pt", weights_only=False)
    return sum(got["comm"]["data_parallel"]), got["params"], got["numel"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset of the models")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ring = 2 * (REPLICAS - 1) / REPLICAS
    print(f"one step, batch {args.batch}; pipeline: {STAGES} stages x {args.micro_batches} micro-batches (1f1b); "
          f"data parallel: {REPLICAS} replicas (gloo ring all-reduce)")
    print(f"{'model':<12} {'params':>10} {'pipeline B':>12} {'DP payload/replica':>19} {'DP payload all':>15} "
          f"{'DP wire all':>13} {'wire ratio':>11} {'payload ratio':>14}")
    ratios, payload_ratios = [], []
    for name in args.families.split(","):
        pipe = pipeline_bytes(name, args.batch, args.micro_batches)
        payload_all, params, numel = data_parallel_bytes(name, args.batch)
        per_replica = payload_all / REPLICAS
        if per_replica != params:
            raise RuntimeError(f"{name}: the runtime counted {per_replica} DP bytes per replica but the model "
                               f"has {params} parameter bytes; the accounting changed, update this script")
        wire_all = REPLICAS * ring * per_replica
        ratios.append(wire_all / pipe)
        payload_ratios.append(payload_all / pipe)
        print(f"{name:<12} {numel:>10,} {pipe:>12,} {int(per_replica):>19,} {payload_all:>15,} "
              f"{int(wire_all):>13,} {ratios[-1]:>10.2f}x {payload_ratios[-1]:>13.2f}x")
    print(f"{'mean':<12} {'':>10} {'':>12} {'':>19} {'':>15} {'':>13} {statistics.mean(ratios):>10.2f}x "
          f"{statistics.mean(payload_ratios):>13.2f}x")
    print(f"geometric mean of the wire ratio: {statistics.geometric_mean(ratios):.2f}x "
          f"(SpecTrain reports 13.4x less for pipelining, on average)")


if __name__ == "__main__":
    main()
