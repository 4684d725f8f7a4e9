"""Issues 44 and 60's goals, cell by cell: does asynchronous 1F1B (no flush) learn as fast as sync?

A cell is one example family (VGG-11 and ResNet-20 on digits, the Transformer and the LSTM on MNIST-1D), one
optimizer (SGD with momentum 0.9, Adam, or Muon for the matrices with AdamW for the rest) and one budget (the
README's epochs, or 3x them). In each, at 4 stages, ``pipetrain compare`` trains

- the synchronous pipeline, ``1f1b`` at 8 micro-batches per mini-batch, over its learning-rate grid, and
- the asynchronous method (default ``nesterov+sm``: the Nesterov look-ahead with delay-matched momentum) over
  its own grid, fed either
  - (issue 44, the default) the synchronous pipeline's micro-batches, one per update (``+bs=<its micro-batch>``,
    the grid's rates scaled by the same factor), or
  - (issue 60, ``--same-batch``) the synchronous pipeline's whole mini-batches, one per update (m = 1, or the
    method's own ``+m=N``, e.g. ``2bw+ef+m=4``: 2bw needs m >= stages - 1) over the synchronous grid itself,

on the same seeds. Each is taken at its best rate (the highest mean best validation accuracy over the seeds),
and the cell holds the goal when the asynchronous method's mean validation curve reaches the target, the
synchronous mean curve's peak minus 1 point, in at most 1.2x the synchronous pipeline's epochs, and its best
accuracy (mean over the seeds) ends within 1 point of the synchronous one's.

The grids are those docs/results.md ran: at the README budget a grid around the family's rates, at 3x the
budget each method's best rates of the README budget, widened by one rate wherever a best rate fell on a
grid's edge. Muon's are around torch's rate (0.02) at the README budget and, at 3x, the best rates the same-batch
protocol found at the README budget (docs/results.md, issue 60). A best rate on its grid's edge is marked in the
table. It prints each cell's compare table, then one table of the cells, and writes it to
``<logdir>/goal.json``. Issue 44's whole goal (the default: 16 cells, 5 seeds) takes about 4 hours of one core here.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from pipetrain.apps.compare import MethodResult, add_arguments_compare, run_compare
from pipetrain.apps.run_config import RunConfig
from pipetrain.apps.time_to_target import MARGIN, Targets, to_target

FAMILIES = ("transformer", "lstm", "vgg", "resnet")
OPTIMIZERS = ("sgd", "adam", "muon")
BUDGETS = (1, 3)
# --sync-nesterov: the synchronous pipeline's optimizer in the Nesterov form of the cell's. The `nesterov` policy's
# look-ahead turns SGD-momentum into a Nesterov step, so heavy-ball sync alone does not separate the delay from it;
# torch's Muon takes Nesterov momentum by default already.
NESTEROV_FORM = {"sgd": "nag", "adam": "nadam", "muon": "muon"}
README_EPOCHS = {"transformer": 4, "lstm": 5, "vgg": 3, "resnet": 4}
STAGES, SYNC_MICRO_BATCHES = 4, 8
MAX_RATIO = 1.2  # the goal: at most 1.2x the synchronous pipeline's epochs to the target ...
MAX_GAP = 1.0  # ... and a best accuracy at most 1 point below its best

# (family, optimizer, budget) -> (the synchronous pipeline's grid, the asynchronous method's grid), each a rate
# for mini-batches of the family's --batch-size (compare scales the async runs' rates to their micro-batch).
GRIDS = {
    ("transformer", "sgd", 1): ((0.01, 0.03, 0.1), (0.01, 0.03, 0.1, 0.3)),
    ("transformer", "sgd", 3): ((0.03,), (0.1,)),
    ("lstm", "sgd", 1): ((0.03, 0.1, 0.3), (0.03, 0.1, 0.3, 1.0)),
    ("lstm", "sgd", 3): ((0.1,), (0.1, 0.3)),
    ("vgg", "sgd", 1): ((0.0025, 0.005, 0.01, 0.02, 0.05), (0.005, 0.01, 0.02, 0.05)),
    ("vgg", "sgd", 3): ((0.01,), (0.01,)),
    ("resnet", "sgd", 1): ((0.01, 0.02, 0.05), (0.01, 0.02, 0.05)),
    ("resnet", "sgd", 3): ((0.02,), (0.05,)),
    ("transformer", "adam", 1): ((0.001, 0.003, 0.01, 0.03), (0.001, 0.003, 0.01, 0.03)),
    ("transformer", "adam", 3): ((0.001, 0.003, 0.01), (0.003, 0.01, 0.03)),
    ("lstm", "adam", 1): ((0.003, 0.01, 0.03, 0.1), (0.003, 0.01, 0.03, 0.1)),
    ("lstm", "adam", 3): ((0.003, 0.01, 0.03), (0.01, 0.03, 0.1)),
    ("vgg", "adam", 1): ((0.0003, 0.001, 0.003, 0.01), (0.001, 0.003, 0.01)),
    ("vgg", "adam", 3): ((0.0003, 0.001, 0.003), (0.001, 0.003, 0.01)),
    ("resnet", "adam", 1): ((0.0003, 0.001, 0.003, 0.01), (0.001, 0.003, 0.01)),
    ("resnet", "adam", 3): ((0.003, 0.01, 0.03), (0.003, 0.01, 0.03)),
    **{(family, "muon", 1): ((0.005, 0.01, 0.02, 0.04), (0.005, 0.01, 0.02, 0.04)) for family in FAMILIES},
    # Muon at 3x: the best rate of the same-batch runs at the README budget, sync's and nesterov's alike but on the
    # LSTM (nesterov's; sync's 0.04 was 0.4 point above) and ResNet (sync's; nesterov's 0.04 was 0.1 point above)
    ("transformer", "muon", 3): ((0.01,), (0.01,)),
    ("lstm", "muon", 3): ((0.02,), (0.02,)),
    ("vgg", "muon", 3): ((0.01,), (0.01,)),
    ("resnet", "muon", 3): ((0.02,), (0.02,)),
}


@dataclass(frozen=True)
class Cell:
    """One cell's verdict: both methods at their best rates, the target and when each mean curve reached it."""

    family: str
    optimizer: str
    budget: int
    epochs: int
    sync_lr: float
    sync_accuracy: float  # mean over the seeds of each run's best validation accuracy, in %
    method: str
    method_lr: float
    method_accuracy: float
    target: float  # in %
    sync_epoch: int
    method_epoch: int | None  # None: its mean curve never reached the target
    seed_ratios: dict[int, str]
    sync_optimizer: str = ""  # the synchronous pipeline's optimizer where it is not `optimizer` (--sync-nesterov)
    sync_on_edge: bool = False  # the best rate is its grid's lowest or highest: a wider grid might do better
    method_on_edge: bool = False

    @property
    def ratio(self) -> float | None:
        return None if self.method_epoch is None else self.method_epoch / self.sync_epoch

    @property
    def met(self) -> bool:
        return (self.ratio is not None and self.ratio <= MAX_RATIO + 1e-9
                and self.method_accuracy >= self.sync_accuracy - MAX_GAP)


def micro_batch_of(family: str) -> int:
    """The synchronous pipeline's micro-batch: the family's default mini-batch over 8."""
    return RunConfig(model=family).resolved().batch_size // SYNC_MICRO_BATCHES


def train(family: str, optimizer: str, epochs: int, grid: Sequence[float], methods: Sequence[str], seeds: int,
          logdir: Path, extra: Sequence[str]) -> dict[str, MethodResult]:
    """``pipetrain compare`` for methods of a cell over one grid, as its command line runs it."""
    parser = argparse.ArgumentParser()
    add_arguments_compare(parser)
    args = parser.parse_args(["--model", family, "--optimizer", optimizer, "--epochs", str(epochs),
                              "--stages", str(STAGES), "--micro-batches", str(SYNC_MICRO_BATCHES),
                              "--async-micro-batches", "1", "--lr-grid", ",".join(f"{r:g}" for r in grid),
                              "--seeds", str(seeds), "--methods", ",".join(methods), "--logdir", str(logdir),
                              "--no-progress", *extra])
    results, _ = run_compare(args)
    return results


def best_accuracy(result: MethodResult) -> float:
    """The mean over the seeds of each run's best validation accuracy at the best rate, in %; a diverged run
    (NaN) counts as 0, as compare's choice of the best rate counts it."""
    return 100 * statistics.fmean(s.max_val_accuracy if math.isfinite(s.max_val_accuracy) else 0.0
                                  for s in result.best)


def judge(family: str, optimizer: str, budget: int, epochs: int, sync: MethodResult, method: str,
          candidate: MethodResult, sync_optimizer: str = "") -> Cell:
    """The cell's verdict from both methods' runs, by pipetrain.apps.time_to_target's rules."""
    targets: Targets | None = to_target({"1f1b": sync.best_by_seed, method: candidate.best_by_seed},
                                        MARGIN, baseline="1f1b")
    if targets is None:
        raise SystemExit(f"{family}/{optimizer}/{budget}x: every 1f1b run diverged before its first epoch, so the "
                         "cell has no target; lower the grid's rates")
    ours, theirs = targets.methods[method], targets.methods["1f1b"]
    return Cell(family, optimizer, budget, epochs, sync.best_lr, best_accuracy(sync), method, candidate.best_lr,
                best_accuracy(candidate), 100 * targets.goal, theirs.reach.epoch, ours.reach.epoch,
                {seed: str(r) for seed, r in ours.seeds.items()}, sync_optimizer, on_edge(sync), on_edge(candidate))


def on_edge(result: MethodResult) -> bool:
    """Whether the best rate is the lowest or the highest of a grid of several."""
    return len(result.lrs) > 1 and result.best_lr in (result.lrs[0], result.lrs[-1])


def table(cells: Sequence[Cell]) -> str:
    """The cells as a Markdown table, one row each."""
    rows = ["| family | optimizer | epochs | 1f1b: best acc (lr) | target, reached at | method | best acc (lr) | "
            "reached at | x 1f1b's epochs (seeds) | goal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        seeds = ", ".join(c.seed_ratios.values())
        sync_lr, method_lr = (f"{lr:g}{', edge' if edge else ''}"
                              for lr, edge in ((c.sync_lr, c.sync_on_edge), (c.method_lr, c.method_on_edge)))
        optimizer = f"{c.optimizer} (1f1b: {c.sync_optimizer})" if c.sync_optimizer else c.optimizer
        rows.append(f"| {c.family} | {optimizer} | {c.epochs} ({c.budget}x) | {c.sync_accuracy:.1f} ({sync_lr}) "
                    f"| {c.target:.2f} at {c.sync_epoch} | {c.method} | {c.method_accuracy:.1f} ({method_lr}) | "
                    f"{'never' if c.method_epoch is None else c.method_epoch} | "
                    f"{'never' if c.ratio is None else f'{c.ratio:.2f}'} ({seeds}) | {'met' if c.met else 'missed'} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> list[Cell]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="nesterov+sm",
                        help="the asynchronous method, or several comma-separated, each judged against the same "
                             "synchronous runs (a compare method name with its suffixes, without +bs=N: the "
                             "synchronous pipeline's micro-batch is added, or with --same-batch its mini-batch kept; "
                             "+m=N only with --same-batch)")
    parser.add_argument("--same-batch", action="store_true",
                        help="issue 60's protocol: the asynchronous method takes the synchronous pipeline's whole "
                             "mini-batch per update (m = 1 unless --method names +m=N) over the synchronous grid")
    parser.add_argument("--sync-nesterov", action="store_true",
                        help="the synchronous pipeline takes the Nesterov form of each cell's optimizer (sgd: nag, "
                             "adam: nadam; muon's is Nesterov already): the control for the nesterov policy, whose "
                             "look-ahead makes each update a Nesterov step")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--optimizers", default="sgd,adam",
                        help=f"of {', '.join(OPTIMIZERS)} (default: issue 44's two, whose cells docs/results.md ran)")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="multiples of the README's epochs")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (the goal asks for at least 3)")
    parser.add_argument("--logdir", default="runs/async-goal")
    parser.add_argument("--epochs", type=int, help="every cell's epochs instead of its budget's (small checks)")
    parser.add_argument("--lr-grid", help="one grid for every method and cell instead of GRIDS (small checks)")
    parser.add_argument("--train-samples", type=int, help="passed to compare (small checks)")
    parser.add_argument("--val-samples", type=int, help="passed to compare (small checks)")
    parser.add_argument("--width", type=int, help="passed to compare (small checks)")
    args = parser.parse_args(argv)
    if "+bs=" in args.method:
        parser.error("--method takes no +bs=N: each cell feeds the synchronous pipeline's micro-batches, or with "
                     "--same-batch its mini-batches")
    if "+m=" in args.method and not args.same_batch:
        parser.error("--method takes +m=N only with --same-batch: otherwise each update is one micro-batch")
    extra = [f"--{flag.replace('_', '-')}={value}" for flag in ("train_samples", "val_samples", "width")
             if (value := getattr(args, flag)) is not None]
    own_grid = tuple(float(r) for r in args.lr_grid.split(",")) if args.lr_grid else None
    wanted = [(family, optimizer, budget) for optimizer in args.optimizers.split(",")
              for budget in map(int, args.budgets.split(",")) for family in args.families.split(",")]
    unknown = [f"{f}/{o}/{b}x" for f, o, b in wanted if (f, o, b) not in GRIDS]
    if unknown:  # before hours of training, not after
        parser.error(f"no cell {', '.join(unknown)}; families {', '.join(FAMILIES)}, optimizers "
                     f"{', '.join(OPTIMIZERS)}, budgets {', '.join(map(str, BUDGETS))}")
    cells = []
    for family, optimizer, budget in wanted:
        epochs = args.epochs or budget * README_EPOCHS[family]
        sync_grid, method_grid = (own_grid, own_grid) if own_grid else GRIDS[(family, optimizer, budget)]
        if args.same_batch:  # the same batch per update: the rates mean what they mean for sync
            methods, method_grid = args.method.split(","), sync_grid
        else:
            methods = [f"{method}+bs={micro_batch_of(family)}" for method in args.method.split(",")]
        where = Path(args.logdir) / f"{family}-{optimizer}-{budget}x"
        sync_optimizer = NESTEROV_FORM[optimizer] if args.sync_nesterov else optimizer
        sync = train(family, sync_optimizer, epochs, sync_grid, ["1f1b"], args.seeds, where / "sync", extra)["1f1b"]
        candidates = train(family, optimizer, epochs, method_grid, methods, args.seeds, where / "async", extra)
        control = sync_optimizer if sync_optimizer != optimizer else ""
        cells += [judge(family, optimizer, budget, epochs, sync, method, candidates[method], control)
                  for method in methods]
    fed = "the same mini-batches" if args.same_batch else "its micro-batches, one per update"
    print(f"\nasync fed {fed} against the synchronous pipeline, {STAGES} stages, {args.seeds} seeds, each method at "
          f"its best rate; the goal: the target (1f1b's peak mean accuracy - {100 * MARGIN:g} point) in at most "
          f"{MAX_RATIO}x 1f1b's epochs, ending within {MAX_GAP:g} point of its best accuracy\n")
    print(table(cells) + "\n")
    for method in dict.fromkeys(c.method for c in cells):
        mine = [c for c in cells if c.method == method]
        print(f"{method}: goal met in {sum(c.met for c in mine)} of {len(mine)} cells")
    Path(args.logdir).mkdir(parents=True, exist_ok=True)
    (Path(args.logdir) / "goal.json").write_text(json.dumps(
        [{**asdict(c), "ratio": c.ratio, "met": c.met} for c in cells], indent=1))
    return cells


if __name__ == "__main__":
    main()
