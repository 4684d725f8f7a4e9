"""The `pipetrain` command. Each subcommand is a pair of small functions:
`_add_<name>(subparsers)` declares its arguments and `_run_<name>(args)` runs it;
add a new subcommand by writing the pair and listing it in SUBCOMMANDS."""
from __future__ import annotations

import argparse
from typing import Callable, Sequence


def _add_simulate(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    import schedules

    p = sub.add_parser("simulate", help="simulate a pipeline schedule and print its summary")
    p.add_argument("--schedule", default="1f1b", choices=list(schedules.BUILDERS))
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--chunks", type=int, help="virtual stages per device (interleaved-1f1b)")
    p.add_argument("--mini-batches", type=int, help="mini-batches in the stream (async-1f1b)")
    p.add_argument("--forward", type=float, default=1.0, help="forward time per micro-batch")
    p.add_argument("--backward", type=float, default=1.0,
                   help="input-gradient backward time (full backward = backward + weight)")
    p.add_argument("--weight", type=float, default=1.0, help="weight-gradient backward time")
    p.add_argument("--comm", type=float, default=0.0, help="latency of one message between stages")
    p.add_argument("--trace", help="write a Chrome trace (Perfetto, chrome://tracing) here")
    p.add_argument("--png", help="write a timeline picture here (needs matplotlib)")
    return p


def _run_simulate(args: argparse.Namespace) -> int:
    import schedules

    options = {}
    if args.chunks is not None:
        options["chunks"] = args.chunks
    if args.mini_batches is not None:
        options["mini_batches"] = args.mini_batches
    try:
        schedule = schedules.build(args.schedule, args.stages, args.micro_batches, **options)
    except TypeError as exc:  # an option this schedule kind does not take
        raise SystemExit(f"pipetrain simulate: {exc}") from None
    costs = schedules.Costs(args.forward, args.backward, args.weight, args.comm)
    result = schedules.simulate(schedule, costs)
    print(result.summary())
    if args.trace:
        result.to_chrome_trace(args.trace)
        print(f"wrote Chrome trace {args.trace}")
    if args.png:
        result.to_png(args.png)
        print(f"wrote timeline {args.png}")
    return 0


SUBCOMMANDS: dict[str, tuple[Callable, Callable[[argparse.Namespace], int]]] = {
    "simulate": (_add_simulate, _run_simulate),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand in SUBCOMMANDS."""
    parser = argparse.ArgumentParser(prog="pipetrain", description="pipeline-parallel training")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add, run) in SUBCOMMANDS.items():
        add(sub).set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pipetrain` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as exc:  # bad shapes or options: say why, no traceback
        raise SystemExit(f"pipetrain {args.command}: {exc}") from None


if __name__ == "__main__":
    raise SystemExit(main())
