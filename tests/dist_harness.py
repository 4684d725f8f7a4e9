"""Run a function on a real gloo process group over loopback (fresh processes from a fork server).

Each rank's return value is saved and handed back to the test, so many checks can share
one group start-up.

The ranks are forked from a server process that has imported torch and pipetrain once (``PRELOAD``):
a spawned rank spent about 4.5 s of CPU importing them, which dominated the start-up of every world
(a 4-rank world is 18 s of CPU on 2 cores). The server holds no threads, process group or state a test
made, so each rank starts as clean as a spawned one and runs the same code.
"""
from __future__ import annotations

import gc
import importlib
import os
import random
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipetrain.comm.local_ranks import start_local_ranks

# What every rank imports (the library, the models the ranks build): the fork server imports it once.
# torch._dynamo: `import pipetrain` leaves it out, but every rank's optimizer imports it (and it must come before the
# process group: pipetrain.comm.world.ensure_process_group says why).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pipetrain", "partitioners", "schedules", "runtime_models",
           "helpers", "dist_harness", "transformers.modeling_utils"]


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range.

    A port the kernel hands out (bind to 0) is in the ephemeral range, where the many outgoing
    connections gloo opens in parallel tests can take it between this choice and rank 0's listen
    (seen in CI as EADDRINUSE); a port below that range is only ever taken by an explicit bind.
    """
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    chooser = random.SystemRandom()  # independent of any test's random.seed
    for _ in range(200):
        port = chooser.randrange(10000, ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in 10000..{ephemeral_low}")


def _worker(rank: int, world: int, port: int, module: str, function: str, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    # The preloaded libraries' objects live as long as the rank: keep them out of every garbage collection
    # (a pipeline's close() collects once, which otherwise scans ~450k objects, 0.2 s, each time).
    gc.freeze()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        result = getattr(importlib.import_module(module), function)(rank, world, *args)
        torch.save({"ok": result}, Path(out) / f"rank{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, Path(out) / f"rank{rank}.pt")
        raise
    finally:
        dist.destroy_process_group()


def run_checks(checks: dict) -> dict[str, str]:
    """Run named checks on this rank: "ok" or the traceback for each, with a barrier after each
    so one failing check does not desynchronise the collectives of the next."""
    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception:  # noqa: BLE001  (reported per check by the test)
            results[name] = traceback.format_exc()
        dist.barrier()
    return results


def start_ranks(fn, args: tuple, nprocs: int, join: bool = True):
    """``torch.multiprocessing.start_processes`` on fresh processes forked from the server that preloaded PRELOAD."""
    return start_local_ranks(fn, args, nprocs, join=join, preload=PRELOAD)


def run_world(world: int, module: str, function: str, tmp_path: Path, *args) -> list:
    """Run ``module.function(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result."""
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        try:
            start_ranks(_worker, (world, free_port(), module, function, str(tmp_path), args), world)
            break
        except mp.ProcessRaisedException as error:
            # Another test may bind the same port between our check and rank 0's listen: choose anew.
            if "EADDRINUSE" not in str(error) or attempt == 2:
                raise
    results = []
    for rank in range(world):
        saved = torch.load(Path(tmp_path) / f"rank{rank}.pt", weights_only=False)
        if "error" in saved:
            raise AssertionError(f"rank {rank} failed:\n{saved['error']}")
        results.append(saved["ok"])
    return results
