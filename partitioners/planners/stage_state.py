"""What one device of a pipeline stage holds at its peak, as pipetrain trains: the optimizer, the ZeRO level
and the recomputation setting are the user's choices, priced here without importing the runtime.

pipetrain keeps parameters, gradients and optimizer state in fp32 under every precision (bf16 and fp16
are autocast), so a parameter costs FP32 = 4 bytes of weights, 4 of gradient and 4 per optimizer state
copy (OPTIMIZER_STATE: Adam's two moments make the 16 bytes per parameter of the ZeRO paper). With D
replicas of a stage:

- zero=1: the optimizer state is 1/D per replica;
- zero=2: gradients too, but only after the step's last backward: they accumulate whole over the
  micro-batches, so at every moment activations are held the gradients are full (= zero=1's peak);
- zero=3: weights, gradients and state are 1/D at rest; during a step the stage's parameters are
  all-gathered once (the full copy next to the kept shard) and the gradients accumulate whole until
  one reduce-scatter after the last backward. With reshard_after_forward the full copy exists only
  while a forward or a backward runs; the peaks below are the ends of forwards and backwards, where
  it exists either way, so the peak is the same.

The moments a stage's bytes can peak come from the schedule's action lists
(schedules.held_activations): (micro-batches held whole, held as boundary inputs only, gradients
present), as the runtime's memory model reads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter

from schedules.actions import Action, ActionKind
from schedules.cluster.step import built_schedule
from schedules.held_activations import RECOMPUTE, held_activations, recomputed

FP32 = 4  # bytes per parameter of the weights, the gradients and each optimizer state copy
# fp32 parameter-sized state copies each optimizer keeps (LARS keeps a momentum buffer)
OPTIMIZER_STATE = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "lars": 1, "lamb": 2}
ZERO_LEVELS = (0, 1, 2, 3)

Moment = tuple[int, int, int]


@dataclass(frozen=True)
class StageMemory:
    """Predicted bytes one device of a stage holds at its peak, by what holds them."""

    weights: float
    gradients: float
    optimizer: float
    activations: float  # what autograd keeps for the backward, of all micro-batches held at the peak
    in_flight: int      # micro-batches held (whole or as boundary inputs) at the peak

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        """'weights 27 GB, gradients 27 GB, optimizer 54 GB, activations 2.1 GB (4 micro-batches in flight)'."""
        noun = "micro-batch" if self.in_flight == 1 else "micro-batches"
        return (f"weights {format_bytes(self.weights)}, gradients {format_bytes(self.gradients)}, "
                f"optimizer {format_bytes(self.optimizer)}, activations {format_bytes(self.activations)} "
                f"({self.in_flight} {noun} in flight)")


def format_bytes(n: float) -> str:
    """Bytes in decimal units with 4 significant digits ('26.95 GB', '13.47 kB'), as devices are sold."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.4g} B"


@lru_cache(maxsize=4096)
def schedule_moments(kind: str, stages: int, micro_batches: int, recompute: str) -> tuple[tuple[Moment, ...], ...]:
    """Per stage of a one-chunk schedule, the moments its held bytes may peak (held_activations of the
    action list the runtime executes). Stage 0's backward never splits (its input takes no gradient), so
    its W actions do nothing and its B frees the micro-batch, as the runtime runs it."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute setting {recompute!r}; choose one of {', '.join(RECOMPUTE)}")
    return tuple(_held(compute, recompute) for compute in _stage_compute(kind, stages, micro_batches))


_COMPUTE = {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT, ActionKind.STEP}
# what held_activations and recomputed read of an action; its position (the stage) is left out
_READ = attrgetter("kind._value_", "micro_batch", "chunk")


class _Compute:
    """One stage's compute actions, equal to another stage's when they read the same apart from the stage:
    1F1B's stage k of S stages runs what stage 0 of S - k stages does, so the search prices each distinct
    list once. Hashed once, on creation (a list is looked up once per recomputation setting)."""

    __slots__ = ("actions", "_key", "_hash")

    def __init__(self, actions: tuple[Action, ...]):
        self.actions = actions
        self._key = tuple(map(_READ, actions))
        self._hash = hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Compute) and self._hash == other._hash and self._key == other._key


@lru_cache(maxsize=4096)
def _stage_compute(kind: str, stages: int, micro_batches: int) -> tuple[_Compute, ...]:
    """Per stage, its compute actions (stage 0 without its W: see schedule_moments), each list that equals
    one seen before replaced by that one (_distinct), so that the lists kept in memory are few."""
    out = []
    for k, actions in enumerate(built_schedule(kind, stages, micro_batches).actions):
        drop = {ActionKind.WEIGHT} if k == 0 else set()  # and the messages: they hold nothing
        out.append(_distinct(_Compute(tuple(a for a in actions if a.kind in _COMPUTE and a.kind not in drop))))
    return tuple(out)


@lru_cache(maxsize=65536)
def _distinct(compute: _Compute) -> _Compute:
    """The first _Compute equal to `compute` (the cache returns it)."""
    return compute


@lru_cache(maxsize=65536)
def _held(compute: _Compute, recompute: str) -> tuple[Moment, ...]:
    """held_activations of one stage's compute actions, once per distinct list."""
    return _frontier(held_activations(list(compute.actions), recompute).get(0, set()))


def _frontier(moments: set[Moment]) -> tuple[Moment, ...]:
    """The moments no other moment holds at least as much as in every term (the bytes of each term are
    >= 0, so only these can be the peak)."""
    kept = []
    for grads in (1, 0):
        most_boundary = -1
        for whole, bnd, g in sorted((m for m in moments if m[2] == grads), key=lambda m: (-m[0], -m[1])):
            dominated = bnd <= most_boundary or (grads == 0 and any(w >= whole and b >= bnd for w, b, _ in kept))
            if not dominated:
                kept.append((whole, bnd, g))
            most_boundary = max(most_boundary, bnd)
    return tuple(sorted(kept))


@lru_cache(maxsize=4096)
def recomputed_share(kind: str, stages: int, micro_batches: int, recompute: str) -> tuple[float, ...]:
    """Per stage, the share of its micro-batches whose forward runs again before their backward."""
    # recomputed() reads only F and B: stage 0's list without W gives the same
    return tuple(_recomputed(compute, recompute) / micro_batches
                 for compute in _stage_compute(kind, stages, micro_batches))


@lru_cache(maxsize=65536)
def _recomputed(compute: _Compute, recompute: str) -> int:
    return len(recomputed(compute.actions, recompute))


def stage_peak(moments: tuple[Moment, ...], params: float, activations: float, boundary: float, *,
               replicas: int, zero: int, state_copies: float) -> StageMemory:
    """The largest predicted bytes of a stage over its moments. params: its parameter bytes in fp32;
    activations: what one micro-batch keeps for its backward; boundary: what a recomputed one keeps."""
    if zero not in ZERO_LEVELS:
        raise ValueError(f"zero must be one of {ZERO_LEVELS}, got {zero!r}")
    shard = 1.0 / replicas if zero else 1.0
    optimizer = params * state_copies * shard
    # zero=3 keeps its 1/D shard and, during the step, the all-gathered full copy
    weights = params * (1.0 + 1.0 / replicas) if zero == 3 and replicas > 1 else params
    best = StageMemory(weights, 0.0, optimizer, 0.0, 0)
    for whole, bnd, grads in moments:
        at = StageMemory(weights, grads * params, optimizer, whole * activations + bnd * boundary, whole + bnd)
        if at.total > best.total:
            best = at
    return best
