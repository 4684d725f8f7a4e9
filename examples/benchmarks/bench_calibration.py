"""Calibrate the hybrid cost model on this machine: predicted vs measured step times (gloo, CPU).

    .venv/bin/python examples/benchmarks/bench_calibration.py [--rounds 5]

Validation runs: an MLP (8 x Linear(512) + ReLU, batch 128, 4 micro-batches, 1f1b, SGD)
trained by pipetrain.wrap on the distributed engine: world 2 = 2 stages, world 4 =
4 stages, world 4 = 2 stages x data_parallel 2 (hybrid). Measured: median step time of
rank 0 over rounds, after a barrier before every step.

Prediction: schedules.simulate_cluster_step from numbers measured by micro-benchmarks that
never time a validation step. For each world size W, W gloo processes run, at the same
time as each other (so they share the cores as the validation run's processes do):
  * message CPU (in the W = 2 spawn only, so no third process contends): rank 0 sends
    messages of 4 B..1 MB one at a time, GAP seconds apart (the runtime's batch_isend_irecv;
    each message finds its receiver asleep, as in a pipeline), rank 1 receives them (post +
    wait); time.process_time (all the process's threads: gloo's I/O too; sleeping is free)
    per message is fitted to send_cpu + n x send_cpu_byte and recv_cpu + n x recv_cpu_byte;
  * links: ping-pong of 4 B..1 MB between rank pairs (the runtime's batch_isend_irecv),
    minus the message CPU of both ends (the simulation charges that on the ranks' cores),
    fitted to one alpha (seconds per message / ring step) and beta (bytes/s) for that W;
  * gradient reduction: pipetrain's GradientReducer (flat, one fused bucket) on 4 B..4 MB
    of gradients in groups of 2 (the hybrid's groups, all reducing at once); what it takes
    beyond the 2-rank ring time of the link fit is fitted to reduce_call + bytes x reduce_byte
    (the old model's delay); for the shared-cores model, where that work occupies the rank's
    core, reduce_call and reduce_byte are fitted instead to the reducer's process_time per call
    (its CPU: packing, sums, gloo's copies; the ring transfer of the link fit follows it);
  * runtime overheads: all W processes train a TINY MLP (4 x Linear(16), not the validation
    model) on the distributed engine with each validated layout (same stages x replicas,
    same process count) at 2 and 8 micro-batches; time.process_time per step (CPU of the
    rank, so waiting is free and sharing the cores does not inflate it) is fitted per rank
    to fixed + micro-batches x slope. A micro-batch costs a rank one F, one B and its tiny
    messages (2 per neighbour stage), so action = (slope - the messages' fitted CPU) / 2 and
    step = the intercept; medians over ranks. (The local engine's per-action cost is ~10x
    smaller: the distributed engine's send/recv/wait calls and batching are Python work.)
  * stage compute: each process profiles the stage module it would run (plan.build_stage
    of the same split points) at the run's micro-batch size: forward, backward, and the
    optimizer step, timed back to back, once alone (in turn) and once all at the same time
    (for PROFILE_SECONDS, so the ranks overlap throughout). Alone gives the compute times.
    All at once, forward + backward CPU (process_time) / alone CPU is the interference of
    co-running ranks (shared caches, memory bandwidth): Cluster.interference of the layout,
    median over its ranks; all-at-once CPU / wall is the share of a core a rank got, so
    W x that share is the processors the job effectively gets (Cluster.cores; at most the
    machine's cores; less when other work runs on it). Wall all-at-once / alone (contention)
    = interference x W / cores is printed too;
  * wake-up latency (W > 2): ranks 0 and 1 ping-pong 4 B while ranks 2.. compute (so every
    core is busy when a message reaches its sleeping receiver), minus the same ping-pong
    while ranks 2.. sleep: the per-message delay Cluster.wakeup. Means, not medians: the
    simulation adds it to every message, so what a step pays is the expected delay, and the
    scheduler's delays have a long tail (median ~0.05 ms, mean ~0.3 ms here).
The prediction simulates processor sharing (schedules.cluster.shared_cores): compute and message CPU
of all ranks run at min(1, cores / running) of their alone speed, module compute taking
interference x its alone time. All measurements take turns in every
round (interleaved), and every number is a median over rounds, so background load drifts
over all of them alike. The validation runs also report StepResult.busy_fraction (wall time
inside forward/backward per step), printed against the simulated one.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import partitioners
import pipetrain
from pipetrain.allreduce.reducer import GradientReducer
from pipetrain.comm.local_ranks import start_local_ranks
from schedules.cluster import Cluster
from schedules.cluster.reductions import Reduction, ring_allreduce_time
from schedules.cluster.step import StageWork, simulate_cluster_step
from schedules.cluster.overheads import RuntimeOverheads

WIDTH, DEPTH, BATCH, MICRO = 512, 8, 128, 4
SPLITS = {2: ["8"], 4: ["4", "8", "12"]}   # module names that start stages 1.. (Sequential indices)
RUNS = {2: [(2, 1)], 4: [(4, 1), (2, 2)]}  # world -> (stages, replicas) validated in it
P2P_SIZES = [4, 64 * 1024, 1 << 20]
MESSAGE_SIZES = [4, 16 * 1024, 32 * 1024, 64 * 1024, 256 * 1024, 1 << 20]  # the runs send 32 KB and 64 KB
MESSAGES = 20  # per size and round
GAP = 1e-3     # seconds between two messages of the message-CPU benchmark
ALLREDUCE_SIZES = [4, 64 * 1024, 1 << 20, 4 << 20]
TINY_MICRO = (2, 8)
WAKE_SECONDS = 0.4
PROFILE_SECONDS = 0.3  # all-at-once stage profile: long enough that every rank co-runs (~40+ micro-batches)
SAVED_LAYOUT = (4, 4, 1)  # --save-cluster writes the cluster fitted for this (world, stages, replicas)
REPORT_KINDS = 8  # per-stage lists the runtime's step report sums (StepResult: 4 metrics + 4 byte kinds)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def make_plan(stages: int, micro: int) -> partitioners.Plan:
    """The split the validation runs use (explicit split points, so no profiling decides it)."""
    graph = partitioners.trace(make_model(), torch.randn(micro, WIDTH), profile=False)
    return partitioners.partition(graph, stages, method=SPLITS[stages])


class StageProfile:
    """Times one stage module's forward, backward and optimizer step at one micro-batch size."""

    def __init__(self, plan: partitioners.Plan, k: int, micro: int):
        x, y = batch()
        value: tuple = (x[:micro],)
        with torch.no_grad():
            for j in range(k):  # the stage's real inputs: the earlier stages' outputs
                out = plan.build_stage(j)(*value)
                value = out if isinstance(out, tuple) else (out,)
        self.inputs, self.target = value, y[:micro]
        self.module = plan.build_stage(k)
        self.last = k == plan.num_stages - 1
        self.optimizer = sgd(list(self.module.parameters()))
        self.param_bytes = [p.numel() * p.element_size() for p in self.module.parameters()][::-1]
        self.send_bytes = 0.0 if self.last else float(sum(t.numel() * t.element_size() for t in self(grad=False)))

    def __call__(self, grad: bool = True) -> tuple:
        with torch.set_grad_enabled(grad):
            out = self.module(*[t.detach().requires_grad_(grad) for t in self.inputs])
        return out if isinstance(out, tuple) else (out,)

    def time(self) -> tuple[float, ...]:
        """(forward, backward, optimizer step) seconds of one micro-batch, wall then CPU (process_time)."""
        t0, c0 = time.perf_counter(), time.process_time()
        out = self()
        if self.last:
            out = (torch.nn.functional.cross_entropy(out[0], self.target),)
        t1, c1 = time.perf_counter(), time.process_time()
        torch.autograd.backward(out, [torch.ones_like(t) for t in out])
        t2, c2 = time.perf_counter(), time.process_time()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, time.perf_counter() - t2, c1 - c0, c2 - c1, time.process_time() - c2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ping_pong(rank: int, nbytes: int, repeats: int) -> float:
    """One-way seconds of an nbytes message between rank pairs (0,1), (2,3), ..."""
    peer = rank ^ 1
    t = torch.zeros(max(1, nbytes // 4))

    def once():
        if rank % 2 == 0:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer)]):
                w.wait()
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer)]):
                w.wait()
        else:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer)]):
                w.wait()
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer)]):
                w.wait()

    once()
    return _median_time(once, repeats) / 2


def _message_cpu(rank: int, nbytes: int, count: int) -> float | None:
    """CPU seconds (all threads of the process) per nbytes message: rank 0 sending, rank 1 receiving."""
    if rank > 1:
        return None
    t = torch.zeros(max(1, nbytes // 4))
    t0 = time.process_time()
    if rank == 0:
        for _ in range(count):
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1)])
            time.sleep(GAP)  # the receiver takes it and falls asleep again before the next one
            for w in works:
                w.wait()
    else:
        for _ in range(count):
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0)]):
                w.wait()
    return (time.process_time() - t0) / count


def _wakeup_probe(rank: int, loaded: bool) -> float | None:
    """Rank 0 and 1: one-way 4 B ping-pong seconds between them while ranks 2.. compute (loaded)
    or sleep. The compute lasts WAKE_SECONDS; the pair pings for the middle part of it."""
    t0 = time.perf_counter()
    if rank >= 2:
        a = torch.randn(128, 128)
        while loaded and time.perf_counter() - t0 < WAKE_SECONDS:
            a = torch.tanh(a @ a)
        return None
    times = []
    t = torch.zeros(1)
    time.sleep(0.05 * WAKE_SECONDS)  # the compute is under way
    while t[0] == 0:
        start = time.perf_counter()
        if rank == 0:
            t[0] = float(start - t0 > 0.5 * WAKE_SECONDS)  # tells rank 1 this is the last one
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.mean(times)


TINY_SPLITS = {2: ["4"], 4: ["2", "4", "6"]}  # module names that start stages 1.. of the tiny MLP
TINY_BYTES = 4 * 16 * 4  # one tiny message: a micro-batch of 4 x 16 floats


def _tiny_pipe(stages: int, dp: int, micro: int):
    """A tiny MLP (4 x Linear(16) + ReLU, Linear(16, 10)) on the distributed engine, `stages` x `dp`."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 10))
    x, y = torch.randn(4 * micro * dp, 16), torch.randint(0, 10, (4 * micro * dp,))
    pipe = pipetrain.wrap(model, x[:4], stages=stages, micro_batches=micro, schedule="1f1b", data_parallel=dp,
                          engine="distributed", partitioner=TINY_SPLITS[stages], profile=False, optimizer=sgd)
    for _ in range(2):
        pipe.step(x, y)
    return pipe, x, y


def _step_cpu(pipe, x, y, steps: int) -> float:
    """Median process_time of one training step (all ranks step together, after a barrier)."""
    times = []
    for _ in range(steps):
        dist.barrier()
        c0 = time.process_time()
        pipe.step(x, y)
        times.append(time.process_time() - c0)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, out: str, rounds: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # The hybrid's gradient groups: stage k of every replica (ranks k, k + stages).
    half = world // 2
    pairs = [dist.new_group([r, r + half]) for r in range(half)]
    my_pair = pairs[rank % half]
    reducers = {}
    for n in ALLREDUCE_SIZES:
        grads = [torch.zeros(max(1, n // 4), requires_grad=True)]
        grads[0].grad = torch.ones_like(grads[0])
        reducers[n] = GradientReducer(grads, my_pair, bucket_bytes=25 << 20, algorithm="flat")
    tiny = {(stages, dp, m): _tiny_pipe(stages, dp, m) for stages, dp in RUNS[world] for m in TINY_MICRO}
    x, y = batch()
    pipes, profiles = {}, {}
    for stages, dp in RUNS[world]:
        micro = BATCH // (MICRO * dp)
        pipes[(stages, dp)] = pipetrain.wrap(
            make_model(), x[:micro], stages=stages, micro_batches=MICRO, schedule="1f1b", data_parallel=dp,
            engine="distributed", partitioner=SPLITS[stages], profile=False, optimizer=sgd)
        profiles[(stages, dp)] = StageProfile(make_plan(stages, micro), rank % stages, micro)
        for _ in range(2):  # warm-up: shape headers, allocator
            pipes[(stages, dp)].step(x, y)
            profiles[(stages, dp)].time()
    samples: dict[str, list] = {}

    def add(key: str, value) -> None:
        samples.setdefault(key, []).append(value)

    for _ in range(rounds):
        if world > 2:
            for loaded in (False, True):
                dist.barrier()
                add(f"wake {loaded}", _wakeup_probe(rank, loaded))
        if world == 2:
            for n in MESSAGE_SIZES:
                dist.barrier()
                add(f"cpu {n}", _message_cpu(rank, n, MESSAGES))
        for n in P2P_SIZES:
            dist.barrier()
            add(f"p2p {n}", _ping_pong(rank, n, 5))
        for n, reducer in reducers.items():
            dist.barrier()
            c0 = time.process_time()
            add(f"reduce {n}", _median_time(reducer.reduce_now, 5))
            add(f"reduce cpu {n}", (time.process_time() - c0) / 5)
        for turn in range(world):  # alone: one rank at a time, the others asleep in the barrier
            dist.barrier()
            if rank == turn:
                for key, profile in profiles.items():
                    add(f"alone {key}", [statistics.median(v) for v in zip(*(profile.time() for _ in range(5)))])
        for (stages, dp, m), (pipe, tx, ty) in tiny.items():
            add(f"tiny {(stages, dp)} {m}", _step_cpu(pipe, tx, ty, 5))
        for key, profile in profiles.items():
            dist.barrier()
            add(f"profile {key}", _timed_burst(profile, PROFILE_SECONDS))
        for key, pipe in pipes.items():
            times, busy, cpu = [], [], []
            for _ in range(3):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                pipe.step(x, y)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                busy.append(pipe.last_result.busy_fraction)
            add(f"run {key}", statistics.median(times))
            add(f"cpu run {key}", statistics.median(cpu))
            add(f"busy {key}", [statistics.median(v) for v in zip(*busy)])
    box: list = [None] * world
    dist.all_gather_object(box, samples)
    if rank == 0:
        torch.save(box, Path(out) / "samples.pt")
    dist.destroy_process_group()


def _timed_burst(profile: "StageProfile", seconds: float) -> list[float]:
    """Medians of profile.time() called back to back for `seconds` (after a barrier, so every rank's
    burst covers the same window and they co-run all along, not just for a few micro-batches)."""
    samples, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        samples.append(profile.time())
    return [statistics.median(v) for v in zip(*samples)]


def measure_world(world: int, rounds: int) -> list[dict[str, list]]:
    """Every rank's samples (key -> one value per round) from one spawn of `world` processes."""
    with tempfile.TemporaryDirectory() as out:
        start_local_ranks(_worker, (world, _port(), out, rounds), world)
        return torch.load(Path(out) / "samples.pt", weights_only=False)


def fit_line(samples: dict[int, float]) -> tuple[float, float]:
    """Least-squares t = c + n x s over (n, t) samples, weighted by 1/t (relative error); both >= 0."""
    n = np.array(list(samples), dtype=float)
    t = np.array(list(samples.values()))
    rows = np.stack([np.ones_like(n), n], axis=1)
    (c, s), *_ = np.linalg.lstsq(rows / t[:, None], np.ones_like(t), rcond=None)
    return max(float(c), 0.0), max(float(s), 0.0)


def fit_link(p2p: dict[int, float]) -> tuple[float, float]:
    """alpha (s per message), beta (bytes/s) from one-way p2p times t = alpha + n / beta."""
    alpha, inv_beta = fit_line(p2p)
    return alpha, 1.0 / max(inv_beta, 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--save-cluster", metavar="FILE",
                        help="write the fitted model of this machine (4 ranks) as a Cluster JSON for "
                             "`pipetrain plan MODEL --cluster FILE`")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(f"machine: {cores} cores; load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    measured = {w: measure_world(w, args.rounds) for w in RUNS}
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")

    def med(world: int, key: str, rank: int | None = None):
        ranks = [measured[world][rank]] if rank is not None else measured[world]
        values = [v for r in ranks for v in r.get(key, []) if v is not None]
        if isinstance(values[0], list):
            return [statistics.median(col) for col in zip(*values)]
        return statistics.median(values)

    rows = []
    saved: Cluster | None = None  # the fitted cluster of SAVED_LAYOUT
    send = {n: med(2, f"cpu {n}", rank=0) for n in MESSAGE_SIZES}
    recv = {n: med(2, f"cpu {n}", rank=1) for n in MESSAGE_SIZES}
    send_fit, recv_fit = fit_line(send), fit_line(recv)
    message_cpu = lambda n: (send_fit[0] + n * send_fit[1], recv_fit[0] + n * recv_fit[1])  # noqa: E731
    print("\nmessage CPU (2 processes; process_time per message; ms measured / fitted): "
          f"send {send_fit[0] * 1e3:.3f} ms + {send_fit[1] * 1e9:.3f} ns/B, "
          f"receive {recv_fit[0] * 1e3:.3f} ms + {recv_fit[1] * 1e9:.3f} ns/B")
    for n in MESSAGE_SIZES:
        s_fit, r_fit = message_cpu(n)
        print(f"  {n:>8} B: send {send[n] * 1e3:.3f}/{s_fit * 1e3:.3f}  receive {recv[n] * 1e3:.3f}/{r_fit * 1e3:.3f}")
    print("\nmicro-benchmarks (the fit; no validation step is timed here), medians over ranks x rounds:")
    print(f"{'W':>2} {'alpha ms':>9} {'beta GB/s':>10} {'call ms':>8} {'ns/B':>6}"
          "   samples: measured / fitted ms")
    clusters = {}
    for world in RUNS:
        p2p = {n: med(world, f"p2p {n}") for n in P2P_SIZES}
        reduce = {n: med(world, f"reduce {n}") for n in ALLREDUCE_SIZES}
        raw_alpha, raw_beta = fit_link(p2p)  # the old model's link: message CPU included
        alpha, beta = fit_link({n: max(t - sum(message_cpu(n)), 1e-9) for n, t in p2p.items()})
        call, per_byte = fit_line({n: max(t - ring_allreduce_time(n, 2, raw_beta, raw_alpha), 1e-9)
                                   for n, t in reduce.items()})
        reduce_cpu = {n: med(world, f"reduce cpu {n}") for n in ALLREDUCE_SIZES}
        cpu_call, cpu_byte = fit_line(reduce_cpu)
        links = [f"p2p {n}B {t * 1e3:.2f}/{(alpha + n / beta + sum(message_cpu(n))) * 1e3:.2f}"
                 for n, t in p2p.items()]
        links += [f"reduce {n}B {t * 1e3:.2f}/"
                  f"{(ring_allreduce_time(n, 2, raw_beta, raw_alpha) + call + n * per_byte) * 1e3:.2f}"
                  for n, t in reduce.items()]
        links += [f"reduce CPU {n}B {t * 1e3:.2f}/{(cpu_call + n * cpu_byte) * 1e3:.2f}" for n, t in reduce_cpu.items()]
        print(f"{world:>2} {alpha * 1e3:>9.3f} {beta / 1e9:>10.3f} {call * 1e3:>8.3f} {per_byte * 1e9:>6.2f}   " + ", ".join(links))
        clusters[world] = (alpha, beta, raw_alpha, raw_beta, call, per_byte, cpu_call, cpu_byte)

    print("\nruntime overheads (distributed engine, tiny MLP, CPU per step of each rank at "
          f"{TINY_MICRO} micro-batches, ms) -> action, step")
    actions = {}
    for world, runs in RUNS.items():
        for stages, dp in runs:
            fits, shown = [], []
            for rank in range(world):
                k = rank % stages
                lo, hi = (med(world, f"tiny {(stages, dp)} {m}", rank=rank) for m in TINY_MICRO)
                slope = (hi - lo) / (TINY_MICRO[1] - TINY_MICRO[0])
                # each neighbour stage: one tiny message sent and one taken per micro-batch
                messages = ((k > 0) + (k < stages - 1)) * sum(message_cpu(TINY_BYTES))
                fits.append(((slope - messages) / 2, lo - TINY_MICRO[0] * slope))
                shown.append(f"{lo * 1e3:.1f}/{hi * 1e3:.1f}")
            action = max(0.0, statistics.median(a for a, _ in fits))
            step = max(0.0, statistics.median(b for _, b in fits))
            actions[(world, stages, dp)] = (action, step)
            print(f"  W{world} {stages} stages x {dp}: ranks " + "  ".join(shown)
                  + f" -> action {action * 1e3:.3f} ms, step {step * 1e3:.3f} ms")

    wake = {False: med(4, "wake False"), True: med(4, "wake True")} if 4 in RUNS else None
    wakeup = max(0.0, wake[True] - wake[False]) if wake else 0.0
    if wake:
        print(f"wake-up: 4 B one-way {wake[False] * 1e3:.3f} ms with ranks 2.. asleep, {wake[True] * 1e3:.3f} ms "
              f"while they compute -> Cluster.wakeup = {wakeup * 1e3:.3f} ms per message")

    print(f"\nstage compute (ms per micro-batch; optimizer once per step): each rank alone (in turn) and all W "
          f"at once -> measured contention (wall); interference = all CPU / alone CPU (fwd+bwd ms); effective cores = "
          f"W x all-at-once CPU / wall (at most {cores})")
    print(f"{'run':<26} {'stage':>5} {'fwd':>7} {'bwd':>7} {'opt':>7} {'all-at-once fwd+bwd':>20} {'contention':>10} "
          f"{'alone CPU':>9} {'all CPU':>9} {'interference':>12}")
    effective: dict[int, float] = {}
    cpu_rows = []
    for world, runs in RUNS.items():
        factors = []
        for stages, dp in runs:
            for k in range(stages):
                for rank in range(k, world, stages):
                    cf, cb, _, xf, xb, _ = med(world, f"profile {(stages, dp)}", rank=rank)
                    factors.append((xf + xb) / (cf + cb))  # share of a core a co-running rank gets
        effective[world] = min(float(cores), world * statistics.median(factors))
    for world, runs in RUNS.items():
        alpha, beta, raw_alpha, raw_beta, call, per_byte, cpu_call, cpu_byte = clusters[world]
        for stages, dp in runs:
            label = f"W{world} {stages} stages x {dp}"
            work, old_work, factors, slowdowns = [], [], [], []
            for k in range(stages):
                ranks = range(k, world, stages)  # stage k of every replica
                f, b, u, af, ab, _ = [statistics.median(v) for v in zip(*(med(world, f"alone {(stages, dp)}", rank=r) for r in ranks))]
                cf, cb, cu, xf, xb, xu = [statistics.median(v) for v in zip(*(med(world, f"profile {(stages, dp)}", rank=r) for r in ranks))]
                factors.append((cf + cb) / (f + b))
                slowdowns.append((xf + xb) / (af + ab))
                print(f"{label:<26} {k:>5} {f * 1e3:>7.2f} {b * 1e3:>7.2f} {u * 1e3:>7.2f} {(cf + cb) * 1e3:>20.2f} "
                      f"{factors[-1]:>10.2f} {(af + ab) * 1e3:>9.2f} {(xf + xb) * 1e3:>9.2f} {slowdowns[-1]:>12.2f}")
                profile = StageProfile(make_plan(stages, BATCH // (MICRO * dp)), k, BATCH // (MICRO * dp))
                shape = dict(grad_bytes=tuple(profile.param_bytes), send_bytes=profile.send_bytes)
                work.append(StageWork(forward=f, backward=b, update=u, **shape))
                old_work.append(StageWork(forward=cf, backward=cb, update=cu, **shape))
            interference = max(1.0, statistics.median(slowdowns))
            print(f"{label:<26} interference (median over stages) {interference:.2f}")
            action, step = actions[(world, stages, dp)]

            def fitted_cluster(n_cores: float | None) -> Cluster:
                # with shared cores messages cost CPU on both ends and the link keeps the rest;
                # the old model (a core per rank) has only the raw ping-pong link
                shared = n_cores is not None
                overheads = RuntimeOverheads(action=action, step=step, report_bytes=8 * (2 + REPORT_KINDS * stages),
                                             reduce_call=cpu_call if shared else call,
                                             reduce_byte=cpu_byte if shared else per_byte)
                a, b = (alpha, beta) if shared else (raw_alpha, raw_beta)
                cpu = dict(send_cpu=send_fit[0], send_cpu_byte=send_fit[1], recv_cpu=recv_fit[0],
                           recv_cpu_byte=recv_fit[1]) if shared else {}
                return Cluster(nodes=1, devices_per_node=world, intra_bandwidth=b, intra_latency=a,
                               inter_bandwidth=b, inter_latency=a, name=f"this machine, {world} ranks",
                               overheads=overheads, cores=n_cores, wakeup=wakeup if shared else 0.0,
                               interference=interference if shared else 1.0, backend="gloo", **cpu)

            def predict(stage_work, n_cores):
                # The runtime's hybrid default: fused 25 MB buckets, launched during the last backward.
                return simulate_cluster_step(stage_work, fitted_cluster(n_cores), replicas=dp, micro_batches=MICRO,
                                       schedule="1f1b", reduction=Reduction(bucket_bytes=25e6, overlap=True))

            if (world, stages, dp) == SAVED_LAYOUT:
                saved = fitted_cluster(effective[world])
            pred = predict(work, effective[world])
            busy = [sum(e - s for e, s, a in zip(pred.sim.end[k], pred.sim.start[k], pred.sim.schedule.actions[k])
                        if a.kind.value in ("F", "B")) / pred.step_time for k in range(stages)]
            rows.append((label, med(world, f"run {(stages, dp)}", rank=0), pred.step_time,
                         predict(work, float(cores)).step_time, predict(old_work, None).step_time,
                         effective[world], med(world, f"busy {(stages, dp)}", rank=0), busy))
            # a diagnostic, not part of the fit: CPU a rank of each stage burns per step, measured
            # (process_time around the validation step) and what the model charges it
            charged = []
            for k, w in enumerate(work):
                sizes = ([w.send_bytes] if k < stages - 1 else []) + ([work[k - 1].send_bytes] if k else [])
                charged.append(MICRO * (w.forward + w.backward + 2 * action + sum(sum(message_cpu(n)) for n in sizes))
                               + w.update + step + (cpu_call + sum(w.grad_bytes) * cpu_byte if dp > 1 else 0.0))
            cpu_rows.append((label, [statistics.median(med(world, f"cpu run {(stages, dp)}", rank=r)
                                                       for r in range(k, world, stages)) for k in range(stages)],
                             charged))

    print(f"\nvalidation: MLP {DEPTH} x Linear({WIDTH}), batch {BATCH}, {MICRO} micro-batches, 1f1b, gloo "
          f"({args.rounds} rounds x 3 steps, median). predicted: alone times x interference, processor sharing on the effective "
          f"cores, wake-up, message CPU; also with all {cores} cores, and the old model (all-at-once times, a core "
          "per rank)")
    print(f"{'run':<26} {'cores':>5} {'measured ms':>12} {'predicted ms':>13} {'error':>7} "
          f"{f'{cores} cores ms':>11} {'error':>7} {'old ms':>7} {'error':>7}   busy per stage measured/predicted")
    for label, got, pred, full, old, n_cores, busy_got, busy_pred in rows:
        err = lambda x: f"{100 * (x / got - 1):>+6.1f}%"  # noqa: E731
        busy = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(busy_got, busy_pred))
        print(f"{label:<26} {n_cores:>5.2f} {got * 1e3:>12.2f} {pred * 1e3:>13.2f} {err(pred)} {full * 1e3:>11.2f} "
              f"{err(full)} {old * 1e3:>7.2f} {err(old)}   {busy}")
    print("\nCPU per step of one rank of each stage (ms; process_time around the validation step, median over "
          "the stage's ranks) / what the model charges it (alone compute, overheads, message CPU, reduction CPU)")
    for label, got, charged in cpu_rows:
        print(f"{label:<26} " + "  ".join(f"{a * 1e3:.1f}/{b * 1e3:.1f}" for a, b in zip(got, charged)))
    if args.save_cluster:
        Path(args.save_cluster).write_text(saved.to_json())
        print(f"\nthe fitted model of this machine ({SAVED_LAYOUT[0]} ranks) is in {args.save_cluster}; "
              f"rank layouts on it with: pipetrain plan MODEL --cluster {args.save_cluster}")


if __name__ == "__main__":
    main()
