"""Tensor parallelism on this machine: the two ways to run a split stage, side by side on 2 gloo ranks.

One captured stage (pipetrain's graph of the model) runs a forward and backward per step three ways:

- ``whole``: every rank runs the stage unsplit (the reference, and the time without tensor parallelism);
- ``inserted``: pipetrain's rewrite (pipetrain.tensor_parallel): each rank holds its blocks as local tensors and
  the graph calls Megatron-LM's all-reduces where the plan's layers need them;
- ``dtensor``: the same blocks as DTensor parameters and the captured graph unchanged, DTensor's sharding
  propagation choosing every operation's layout and collective (``implicit_replication`` for the graph's plain
  tensors), as torch's ``parallelize_module`` would run an eager model;
- ``sequence`` (the Llama): ``inserted`` with sequence parallelism, its norms named 'sequence_parallel'.

Printed per model: ms per step (median of ``--steps``), the ratio to ``whole``, the largest difference of the
loss from ``whole``'s, and the activation bytes autograd saves for the backward on rank 0 (each storage once,
parameters left out); an error where a way does not run.

    python examples/benchmarks/bench_tensor_parallel.py            # docs/tensor-parallel.md's figures (~1 min)
    python examples/benchmarks/bench_tensor_parallel.py --steps 1 --models mlp --width 256  # seconds
"""
from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.comm.local_ranks import start_local_ranks

WAYS = ("whole", "inserted", "dtensor", "sequence")
NORMS = {"layers.*.input_layernorm": "sequence_parallel", "layers.*.post_attention_layernorm": "sequence_parallel",
         "norm": "sequence_parallel"}


def models(chosen: list[str], width: int) -> dict[str, tuple[str, nn.Module, Any]]:
    """The chosen models: what each is, the model and one micro-batch of its inputs (transformers, seconds to
    import in every rank, only when the Llama is chosen)."""
    out = {}
    torch.manual_seed(0)
    if "mlp" in chosen:
        mlp = nn.Sequential(*[layer for _ in range(4)
                              for layer in (nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))])
        out["mlp"] = (f"4 pairs, {width} -> {4 * width} -> {width}", mlp, torch.randn(64, width))
    if "llama" in chosen:
        import transformers as hf

        llama = hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024,
                                                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                                   max_position_embeddings=128, tie_word_embeddings=False))
        out["llama"] = ("hidden 256, 8 heads, 4 kv heads", llama, torch.randint(0, 512, (8, 128)))
    return out


def stage_of(model: nn.Module, x: Any) -> tuple[nn.Module, Any]:
    """The model captured by pipetrain as one stage (a graph of ATen or module calls) and its traced graph."""
    import pipetrain

    pipe = pipetrain.wrap(model, x, stages=1, micro_batches=1, engine="local", profile=False,
                          loss_fn=lambda out, y: out.float().square().mean())
    return copy.deepcopy(pipe.held_stages[0].module), pipe.plan.graph.module


def dtensor_stage(stage: nn.Module, plan, lanes: int) -> nn.Module:
    """``stage`` with the plan's layers as DTensor parameters (Shard(0) colwise, Shard(1) rowwise), graph unchanged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (lanes,))
    placed = copy.deepcopy(stage)
    for name, p in list(placed.named_parameters()):
        style = plan.style_of(name.rpartition(".")[0])
        placement = {"colwise": Shard(0), "colwise_gather_output": Shard(0), "embedding_rowwise": Shard(0),
                     "rowwise": Shard(1) if name.endswith("weight") else Replicate()}.get(style, Replicate())
        owner, _, attr = name.rpartition(".")
        setattr(placed.get_submodule(owner), attr,
                nn.Parameter(distribute_tensor(p.detach(), mesh, [placement], src_data_rank=None)))
    return placed


def one_step(stage: nn.Module, x: Any) -> float:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        out = stage(x)
        out = out[0] if isinstance(out, tuple) else out
        out = getattr(out, "logits", out)
        if isinstance(out, DTensor):
            out = out.full_tensor()
        loss = out.float().square().mean()
        loss.backward()
    return loss.item()


def saved_activation_bytes(stage: nn.Module, x: Any) -> int:
    """Bytes of the storages one step saves tensors in for its backward, parameters (and blocks of them) left out."""
    from pipetrain.runtime.local_shards import local

    params = {local(p).untyped_storage().data_ptr() for p in stage.parameters()}
    saved: dict[int, torch.Tensor] = {}  # kept alive to the end, so no address is used twice

    def pack(t: torch.Tensor) -> torch.Tensor:
        block = local(t)  # a DTensor's own block
        if block.untyped_storage().data_ptr() not in params:
            saved[block.untyped_storage().data_ptr()] = block
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        one_step(stage, x)
    return sum(t.untyped_storage().nbytes() for t in saved.values())


def rank_main(rank: int, world: int, port: int, steps: int, chosen: list[str], width: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from pipetrain.tensor_parallel import Lanes, TensorParallelPlan, choose_plan, split_module
    from pipetrain.tensor_parallel.automatic import linear_pairs
    from pipetrain.tensor_parallel.shapes import whole_shapes

    for name, (what, model, x) in models(chosen, width).items():
        whole, graph = stage_of(model, x)
        plan = choose_plan(model, None) or linear_pairs(whole, world)  # one stage: nothing tied to another
        lanes, shapes = Lanes(dist.group.WORLD, world, rank), whole_shapes(graph, x)
        inserted = copy.deepcopy(whole)
        split_module(inserted, plan, lanes, shapes, "stage 0", torch.device("cpu"))
        sequence = None
        if name == "llama":
            sequence = copy.deepcopy(whole)
            split_module(sequence, TensorParallelPlan({**plan.patterns, **NORMS}, "the plan and its norms"), lanes,
                         shapes, "stage 0", torch.device("cpu"))
        row = {}
        reference = None
        for way, stage in (("whole", whole), ("inserted", inserted), ("dtensor", None), ("sequence", sequence)):
            if way == "sequence" and stage is None:
                continue
            try:
                stage = stage if stage is not None else dtensor_stage(whole, plan, world)
                loss = one_step(stage, x)
                saved = saved_activation_bytes(stage, x)
                reference = loss if reference is None else reference
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    one_step(stage, x)
                    times.append(time.perf_counter() - start)
                row[way] = (statistics.median(times) * 1e3, abs(loss - reference), saved)
            except Exception as error:  # noqa: BLE001 - a way that does not run is a result, printed
                where = error.__traceback__
                while where.tb_next is not None:
                    where = where.tb_next
                row[way] = (f"{type(error).__name__} {(str(error).splitlines() or [''])[0][:110]} "
                            f"(in {where.tb_frame.f_code.co_name} of "
                            f"{os.path.basename(where.tb_frame.f_code.co_filename)})")
        if rank == 0:
            print(f"\n{name} ({what})")
            base = row["whole"][0]
            for way in (w for w in WAYS if w in row):
                value = row[way]
                print(f"  {way:9s} " + (f"{value[0]:8.1f} ms/step  x{value[0] / base:5.2f}  |loss - whole| "
                                        f"{value[1]:.1e}  saved {value[2] / 2**20:6.2f} MiB"
                                        if isinstance(value, tuple) else f"does not run: {value}"))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per way (the median is printed)")
    parser.add_argument("--models", nargs="+", choices=("mlp", "llama"), default=["mlp", "llama"])
    parser.add_argument("--width", type=int, default=1024, help="the MLP's width (its hidden layers are 4x)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print("2 gloo ranks on this machine (T=2), one thread each; a step = one forward and backward of one micro-batch")
    start_local_ranks(rank_main, (2, port, args.steps, args.models, args.width), 2)


if __name__ == "__main__":
    main()
