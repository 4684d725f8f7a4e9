"""Where to cut a Chain: balanced prefixes (uniform, params) and the optimal min-max
dynamic program (time, graph).

The dynamic program is exact over the chain's topological order. It pushes from every
stage start i to every end j at once with numpy, using two facts to stay fast:
  * the bytes a segment [i, j) receives / sends, for all j at once, come from the
    values live at i (precomputed "next consumer" lists) and a bincount of last uses;
  * no stage of an optimal split computes longer than any known split's bottleneck U,
    so j only runs while compute(i, j) <= U. If the answer exceeds U, U doubles.
Long skip connections only add one live value per position they span: no antichains.
"""
from __future__ import annotations

import numpy as np

from .chain import Chain, allreduce_time
from .errors import PartitionError
from .memory_model import MemoryModel


def balanced_cuts(weights: np.ndarray, stages: int, cuttable: np.ndarray) -> list[int]:
    """Cuts whose prefix weights are closest to k/stages of the total (ties: earliest)."""
    n = len(weights)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    allowed = [c for c in range(1, n) if cuttable[c]]
    cuts, lo = [0], 0
    for k in range(1, stages):
        hi = len(allowed) - (stages - 1 - k)  # leave a start for every later stage
        options = allowed[lo:hi]
        target = prefix[n] * k / stages
        best = min(range(len(options)), key=lambda t: (abs(prefix[options[t]] - target), t))
        cuts.append(options[best])
        lo += best + 1
    return cuts + [n]


class SegmentCosts:
    """Vectorised segment costs from one start i to every end in (i, jmax]."""

    def __init__(self, chain: Chain):
        n = chain.n
        self.compute = np.concatenate([[0.0], np.cumsum(chain.time)])
        self.params = np.concatenate([[0.0], np.cumsum(chain.params)])
        self.acts = np.concatenate([[0.0], np.cumsum(chain.acts)])
        self.born = np.concatenate([[0.0], np.cumsum(chain.out_bytes)])
        self.out_bytes = chain.out_bytes
        self.last = chain.last
        self.saved = np.concatenate([[0.0], np.cumsum(chain.saved)])
        self.inputs = np.concatenate([[0.0], np.cumsum(chain.inputs)])
        self.first_saver = chain.first_saver
        self.value_bytes = chain.acts
        # For every start i: (next consumer at or after i, bytes) of each value produced
        # before i and still needed at i.
        rows, nxts, sizes = [], [], []
        for v in range(n):
            b = chain.out_bytes[v]
            prev = v
            for q in chain.consumers[v] if b > 0 else ():
                if q > prev:
                    rows.append(np.arange(prev + 1, q + 1))
                    nxts.append(np.full(q - prev, q))
                    sizes.append(np.full(q - prev, b))
                    prev = q
        row = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        order = np.argsort(row, kind="stable")
        self.nxt = np.concatenate(nxts)[order] if rows else np.zeros(0, np.int64)
        self.size = np.concatenate(sizes)[order] if rows else np.zeros(0)
        self.ptr = np.searchsorted(row[order], np.arange(n + 2))

    def _received(self, i: int, w: int) -> np.ndarray:
        a, b = self.ptr[i], self.ptr[i + 1]
        idx = self.nxt[a:b] - i
        keep = idx < w
        return np.cumsum(np.bincount(idx[keep], weights=self.size[a:b][keep], minlength=w)[:w])

    def costs(self, i: int, jmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """compute, communicated bytes, parameter bytes, memory of [i, j), j = i+1..jmax."""
        w = jmax - i
        ends = np.arange(i + 1, jmax + 1)
        recv = self._received(i, w)
        dead_at = self.last[i:jmax] - i
        keep = dead_at < w
        dead = np.cumsum(np.bincount(dead_at[keep], weights=self.out_bytes[i:jmax][keep],
                                     minlength=w)[:w])
        sent = self.born[ends] - self.born[i] - dead
        params = self.params[ends] - self.params[i]
        memory = params + self.acts[ends] - self.acts[i] + recv
        return self.compute[ends] - self.compute[i], recv + sent, params, memory

    def activations(self, i: int, jmax: int) -> tuple[np.ndarray, np.ndarray]:
        """Per end j = i+1..jmax: one micro-batch's activation bytes and boundary bytes of [i, j) (chain.py)."""
        w = jmax - i
        ends = np.arange(i + 1, jmax + 1)
        recv = self._received(i, w)
        saved_at = self.first_saver[i:jmax] - i
        keep = saved_at < w
        kept = np.cumsum(np.bincount(saved_at[keep], weights=self.value_bytes[i:jmax][keep], minlength=w)[:w])
        return recv + self.saved[ends] - self.saved[i] + kept, recv + self.inputs[ends] - self.inputs[i]


def optimal_cuts(chain: Chain, stages: int, *, bandwidth: float, replicas: list[int],
                 allreduce_bandwidth: float | None = None,
                 memory_limit: float | None = None, memory: MemoryModel | None = None,
                 rows: SegmentCosts | None = None) -> list[int]:
    """Cuts minimising the slowest stage's time (chain.py's cost model), exactly.

    With ``memory``, a stage fits memory_limit when its predicted peak (memory_model.py) does; without,
    when its parameters, output activations and received bytes do. ``rows``: SegmentCosts(chain), for a
    caller that splits one chain into several stage counts (made here when not given).
    Raises PartitionError when no split satisfies memory_limit."""
    rows = SegmentCosts(chain) if rows is None else rows
    total = rows.compute[-1]
    lower = max(total / stages, float(chain.time.max(initial=0.0))) / max(replicas)
    # A known split's bottleneck bounds every stage of the optimum: start the window there.
    guess = balanced_cuts(chain.time, stages, chain.cuttable)
    bound = max(_evaluate(rows, guess, bandwidth, replicas, allreduce_bandwidth, memory_limit, memory),
                lower)
    if not np.isfinite(bound):
        bound = 1.25 * lower
    bound = bound if bound > 0 else 1.0
    while True:
        cuts, best = _dp(chain, rows, stages, bandwidth, replicas, allreduce_bandwidth,
                         memory_limit, bound, memory)
        if best <= bound:
            return cuts
        if bound * max(replicas) >= total:  # the window already held every segment
            if np.isfinite(best):
                return cuts
            if memory_limit is None:
                raise PartitionError(f"no split into {stages} stages exists at the allowed cut "
                                     "positions; fix: use fewer stages")
            what = ("its predicted peak (weights, optimizer state, gradients and the activations the "
                    "schedule keeps in flight)" if memory is not None else
                    "(parameters + activations + received tensors)")
            fix = ("recompute='always' or 'auto', " if memory is not None and memory.recompute != "auto" else "")
            raise PartitionError(
                f"memory_limit={memory_limit:.4g} bytes: no split into {stages} stages keeps "
                f"every stage {what} under it; fix: raise memory_limit, use {fix}more stages, "
                "or use a smaller micro-batch")
        bound *= 2.0


def _over_limit(rows: SegmentCosts, i: int, jmax: int, stages: range, params: np.ndarray,
                memory: np.ndarray, memory_limit: float | None, model: MemoryModel | None) -> np.ndarray:
    """Per stage index in ``stages`` and end j = i+1..jmax: whether [i, j) breaks memory_limit."""
    if memory_limit is None:
        return np.zeros((len(stages), len(params)), bool)
    if model is None:
        return np.broadcast_to(memory > memory_limit, (len(stages), len(params)))
    activations, boundary = rows.activations(i, jmax)
    return np.stack([model.least_bytes(k, params, activations, boundary) > memory_limit for k in stages])


def _evaluate(rows: SegmentCosts, cuts: list[int], bandwidth: float, replicas: list[int],
              allreduce_bandwidth: float | None, memory_limit: float | None,
              model: MemoryModel | None = None) -> float:
    """Bottleneck of one split under the DP's cost model (inf if it breaks memory_limit)."""
    worst = 0.0
    for k in range(len(cuts) - 1):
        i, j = cuts[k], cuts[k + 1]
        compute, moved, params, memory = rows.costs(i, j)
        if _over_limit(rows, i, j, range(k, k + 1), params, memory, memory_limit, model)[0, -1]:
            return np.inf
        compute, moved, params = compute[-1], moved[-1], params[-1]
        r = replicas[k]
        ring = allreduce_time(params, r, allreduce_bandwidth)
        worst = max(worst, max(compute + moved / bandwidth, ring) / r)
    return worst


def _dp(chain: Chain, rows: SegmentCosts, p: int, bandwidth: float, replicas: list[int],
        allreduce_bandwidth: float | None, memory_limit: float | None,
        bound: float, model: MemoryModel | None = None) -> tuple[list[int], float]:
    """Min-max DP over segments whose compute fits the window; f[s, j] = best bottleneck
    of the first s stages covering positions [0, j)."""
    n = chain.n
    r = np.asarray(replicas, float)[:, None]
    ring = np.array([allreduce_time(1.0, int(k), allreduce_bandwidth) for k in replicas])[:, None]  # s/byte
    span = bound * float(r.max())
    f = np.full((p + 1, n + 1), np.inf)
    f[0, 0] = 0.0
    parent = np.full((p + 1, n + 1), -1, dtype=np.int64)
    for i in range(n):
        if not chain.cuttable[i]:
            continue
        live = np.flatnonzero(np.isfinite(f[:p, i]))
        if not len(live):
            continue
        lo, hi = int(live[0]), int(live[-1]) + 1  # only stage counts that can reach i
        done = f[lo:hi, i]
        jmax = max(i + 1, min(n, int(np.searchsorted(rows.compute, rows.compute[i] + span,
                                                       side="right")) - 1))
        compute, moved, params, memory = rows.costs(i, jmax)
        busy = compute + moved / bandwidth
        cost = np.maximum(busy[None, :], ring[lo:hi] * params[None, :]) / r[lo:hi]
        cost[:, ~chain.cuttable[i + 1:jmax + 1]] = np.inf
        cost[_over_limit(rows, i, jmax, range(lo, hi), params, memory, memory_limit, model)] = np.inf
        cand = np.maximum(done[:, None], cost)
        cur = f[lo + 1:hi + 1, i + 1:jmax + 1]
        better = cand < cur
        f[lo + 1:hi + 1, i + 1:jmax + 1] = np.where(better, cand, cur)
        parent[lo + 1:hi + 1, i + 1:jmax + 1][better] = i
    best = float(f[p, n])
    if not np.isfinite(best):
        return [], best
    cuts, j = [n], n
    for s in range(p, 0, -1):
        j = int(parent[s, j])
        cuts.append(j)
    return cuts[::-1], best
