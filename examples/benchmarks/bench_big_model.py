"""A Llama-style model trained on 4 gloo ranks of this machine: built on the meta device, each rank reading
only its stage's tensors from a sharded checkpoint, against the materialised path (every rank loads the whole
model with from_pretrained, as users did before ``weights=``), side by side in one run.

Per rank it prints the peak resident memory (``ru_maxrss``) against the stage's training state (weights +
gradients + optimizer state), the time ``wrap`` takes, the time reading the checkpoint takes and the time per
step. The checkpoint is written once (``save_pretrained`` of the model built from its config, random weights)
and cached under ``--cache``. The materialised path runs only where it fits: its predicted need (every rank:
the whole model, then its stage's training state) is compared with the machine's available memory first.

    python examples/benchmarks/bench_big_model.py                 # ~1 B parameters (README's figures)
    python examples/benchmarks/bench_big_model.py --layers 2 --compare-layers 1 --hidden 128 --vocab 256  # seconds
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

GIB = 2 ** 30


def config(args: argparse.Namespace):
    import transformers as hf

    return hf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                          num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 128),
                          max_position_embeddings=max(64, args.seq), tie_word_embeddings=False)


def checkpoint(args: argparse.Namespace) -> Path:
    """The model's sharded checkpoint, written once per configuration (a process of its own, so its memory
    is not the benchmark's)."""
    import transformers as hf

    cfg = config(args)
    root = Path(args.cache).expanduser() / f"llama-{args.layers}x{args.hidden}-v{args.vocab}"
    if not (root / "model.safetensors.index.json").exists() and not (root / "model.safetensors").exists():
        print(f"writing the checkpoint once: {root}", flush=True)
        torch.manual_seed(0)
        hf.LlamaForCausalLM(cfg).save_pretrained(root, max_shard_size="1GB")
    return root


def rss_gib() -> float:
    """The process's peak resident memory so far: its own (VmHWM), where Linux has it; ru_maxrss also counts
    the peak of the process it was forked from, which Linux carries across exec."""
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)", f.read())[1]) * 1024 / GIB
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def rss_now_gib() -> float:
    """The process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB


def stage_state_bytes(pipe) -> tuple[int, int]:
    """(weights, weights + gradients + optimizer state) of this rank's stage, counted from its tensors; the
    gradients as the parameters' size: they exist through each step (the step sets them to None after)."""
    (stage,) = pipe.held_stages.values()
    params = list(stage.module.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    state = stage.optimizer.state.values() if stage.optimizer is not None else []
    optimizer = sum(t.numel() * t.element_size() for s in state for t in s.values() if isinstance(t, torch.Tensor))
    return weights, weights + grads + optimizer


def worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: wrap (meta + weights=, or from_pretrained), two training steps, its figures."""
    import torch.distributed as dist
    import transformers as hf

    import pipetrain

    torch.set_num_threads(1)
    hf.logging.set_verbosity_error()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    if args.worker == "meta":
        with torch.device("meta"):
            model = hf.LlamaForCausalLM(config(args))
        weights = args.checkpoint
    else:
        model, weights = hf.LlamaForCausalLM.from_pretrained(args.checkpoint), None
    loaded = time.perf_counter()
    pipe = pipetrain.wrap(model, {"input_ids": ids[:1], "labels": ids[:1]}, stages=int(os.environ["WORLD_SIZE"]),
                          micro_batches=args.batch, loss_fn=pipetrain.model_loss, engine="distributed",
                          optimizer=lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9), weights=weights,
                          profile=False, timeout=600.0)
    del model
    wrapped = time.perf_counter()
    after_wrap = rss_gib()
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        pipe.step({"input_ids": ids, "labels": ids})
        steps.append(time.perf_counter() - t)
    weights_bytes, state = stage_state_bytes(pipe)
    figures = {"rank": dist.get_rank(), "peak": rss_gib(), "after_wrap": after_wrap, "weights": weights_bytes / GIB,
               "state": state / GIB, "load": loaded - start, "wrap": wrapped - loaded, "step": min(steps)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if dist.get_rank() == 0:
        print("FIGURES " + json.dumps(gathered), flush=True)
    pipe.close()


def run_path(args: argparse.Namespace, path: str, layers: int) -> list[dict]:
    sized = argparse.Namespace(**{**vars(args), "layers": layers})
    root = checkpoint(sized)
    passthrough = [f"--{k}={getattr(sized, k)}" for k in ("layers", "hidden", "vocab", "seq", "batch", "steps")]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
               __file__, "--worker", path, "--checkpoint", str(root), *passthrough]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"the {path} path failed:\n{done.stderr[-4000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("FIGURES "))
    return json.loads(line[len("FIGURES "):])


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
    return info["MemAvailable"] * 1024 / GIB


def model_gib(args: argparse.Namespace, layers: int) -> tuple[float, float]:
    """(parameters in billions, GiB in fp32) of the configuration with ``layers`` layers, from the meta model."""
    import transformers as hf

    with torch.device("meta"):
        meta = hf.LlamaForCausalLM(config(argparse.Namespace(**{**vars(args), "layers": layers})))
    return (sum(t.numel() for t in meta.parameters()) / 1e9,
            sum(t.numel() * t.element_size() for t in meta.parameters()) / GIB)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--compare-layers", type=int, default=6,
                   help="also run both paths on this many layers, where the materialised one fits (0: no)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="samples per step (one micro-batch each)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--cache", default="~/.cache/pipetrain/bench_big_model")
    p.add_argument("--worker", choices=["meta", "materialised"], help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    print(f"Llama-style models, hidden {args.hidden}, vocabulary {args.vocab}; {args.ranks} gloo ranks, SGD with "
          f"momentum, batch {args.batch} x {args.seq} tokens, one micro-batch per sample")
    results = {}
    for layers in dict.fromkeys(x for x in (args.layers, args.compare_layers) if x):
        billions, gib = model_gib(args, layers)
        label = f"{billions:.2f} B"
        results[(label, "meta")] = run_path(args, "meta", layers)
        # The materialised path: every rank holds the whole model, then its stage's weights, gradients, momentum.
        need = args.ranks * (gib + 3 * gib / args.ranks + 0.8)
        if need < 0.9 * available_gib():
            results[(label, "materialised")] = run_path(args, "materialised", layers)
        else:
            print(f"{label} ({layers} layers): materialised path skipped: it needs about {need:.1f} GiB (every rank "
                  f"the whole model and its stage's training state), {available_gib():.1f} GiB available")
    print(f"\n{'model':<7} {'path':<13} {'rank':>4} {'peak GiB':>9} {'after wrap':>10} {'state GiB':>9} "
          f"{'bound GiB':>9} {'model s':>7} {'wrap s':>7} {'step s':>7}")
    for (label, path), rows in results.items():
        for r in rows:
            print(f"{label:<7} {path:<13} {r['rank']:>4} {r['peak']:>9.2f} {r['after_wrap']:>10.2f} {r['state']:>9.2f} "
                  f"{1.3 * r['state'] + 1.0:>9.2f} {r['load']:>7.1f} {r['wrap']:>7.1f} {r['step']:>7.1f}")
        print(f"{label:<7} {path:<13} {'all':>4} {sum(r['peak'] for r in rows):>9.2f} {'':>10} "
              f"{sum(r['state'] for r in rows):>9.2f}")
    within = all(r["peak"] <= 1.3 * r["state"] + 1.0 for (_, path), rows in results.items() if path == "meta"
                 for r in rows)
    print(f"\nmeta path: every rank's peak within 1.3 x its stage's training state + 1 GiB: {within}")


if __name__ == "__main__":
    main()
