"""The `pipetrain` command. Each subcommand is a pair of small functions:
`_add_<name>(subparsers)` declares its arguments and `_run_<name>(args)` runs it (`_app` makes
the pair for an application in pipetrain.apps); list a new subcommand in SUBCOMMANDS."""
from __future__ import annotations

import argparse
import importlib
from types import ModuleType
from typing import Callable, Sequence


def _add_simulate(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    import schedules

    p = sub.add_parser("simulate", help="simulate a pipeline schedule and print its summary")
    p.add_argument("--schedule", default="1f1b", choices=list(schedules.BUILDERS))
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--chunks", type=int, help="virtual stages per device (interleaved-1f1b, interleaved-zb)")
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
        schedules.write_chrome_trace(result, args.trace)
        print(f"wrote Chrome trace {args.trace}")
    if args.png:
        schedules.write_png(result, args.png)
        print(f"wrote timeline {args.png}")
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    import schedules.cluster
    from partitioners.planners.stage_state import OPTIMIZER_STATE, RECOMPUTE

    p = sub.add_parser("plan", help="rank pipeline x data-parallel layouts of a model on a cluster")
    p.add_argument("model", help="a torchvision model name (resnet50, vgg16, ...), a pipetrain.apps.models name, "
                                 "a Hugging Face config.json or a directory holding one, or a transformers model "
                                 "type (llama, gpt2, mistral, qwen2, ...: its default config). A Hugging Face "
                                 "language model is built on the meta device: shapes only, nothing allocated or "
                                 "downloaded, so a 70 B model plans on a laptop")
    p.add_argument("--cluster", required=True,
                   help=f"cluster JSON file or preset ({', '.join(schedules.cluster.PRESETS)})")
    p.add_argument("--batch-size", type=int, required=True, help="global mini-batch size")
    p.add_argument("--nodes", type=int, help="override the cluster's node count")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="tensor fusion bucket (0: per tensor)")
    p.add_argument("--allreduce", default="hybrid", choices=["hybrid", "flat", "hierarchical"],
                   help="as wrap(allreduce=...): hybrid (default) takes per bucket the cheaper of a flat ring "
                        "and a hierarchical all-reduce")
    p.add_argument("--no-overlap", action="store_true", help="reduce only after the backward")
    p.add_argument("--max-stages", type=int, help="largest pipeline depth to consider")
    p.add_argument("--zero", choices=("0", "1", "2", "3", "auto"), default="0",
                   help="ZeRO: 1 shards the optimizer state over each stage's replicas, 2 the gradients too (after "
                        "the last backward: no lower peak), 3 the parameters too (FSDP2: gathered whole during the "
                        "step); auto tries 0-3 per layout and takes the least sharding that fits")
    p.add_argument("--recompute", choices=(*RECOMPUTE, "auto"), default="auto",
                   help="activation recomputation of every stage, as wrap(recompute=...); auto (default) tries none, "
                        "except-last, always per layout and takes the fastest that fits")
    p.add_argument("--tensor-parallel", type=_tensor_parallel, default=1, metavar="auto|T",
                   help="T: ranks each stage's matrices are split over Megatron-style, as wrap(tensor_parallel=T), "
                        "on one node (T divides its devices; 1, 2, 4, 8 with 8 per node); auto searches every such "
                        "T (default 1: none)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tensor-parallel: price sequence parallelism (a tp_plan naming the norms "
                        "'sequence_parallel'): the activations between the split blocks cut along the sequence too, "
                        "1/T of them on each rank instead of (10 + 24/T) / 34")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATE), default="adam",
                   help="the optimizer whose state is priced: fp32 copies per parameter sgd 0, sgd-momentum 1, "
                        "lars 1, adam, adamw and lamb 2 (default adam: 16 bytes per parameter with weights and "
                        "gradients)")
    p.add_argument("--profile", action="store_true",
                   help="time each node here instead of estimating (not for a model on the meta device)")
    p.add_argument("--seq-len", type=int,
                   help="tokens per sample of a Hugging Face language model (default 2048, or its "
                        "max_position_embeddings when shorter)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help="dtype a Hugging Face language model's activations are sized in (wrap's precision; default "
                        "fp32); parameters, gradients and optimizer state are fp32 under every precision, as "
                        "pipetrain keeps them")
    p.add_argument("--top", type=int, default=10, help="rows of the ranking to print")
    return p


def _tensor_parallel(text: str) -> int | str:
    """--tensor-parallel's value: "auto" or a whole number >= 1 (the search checks it divides the devices per node)."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number >= 1 of ranks, got {text!r}")
    return int(text)


def _plan_model(args: argparse.Namespace):
    """(model, example input of 2 samples) for args.model: a torchvision or pipetrain.apps.models name
    (built with data) or a Hugging Face config (built on the meta device)."""
    import torch
    import torchvision

    from pipetrain.apps.models import DEFAULT_DATASET, MODELS, build_model

    name = args.model
    config = None
    if name not in MODELS and name not in torchvision.models.list_models(module=torchvision.models):
        from pipetrain.apps import hf_config  # imports transformers: only for a name that may be a config

        config = hf_config.find_config(name)
        if config is None:
            raise ValueError(f"unknown model {name!r}: not a torchvision classification model, one of "
                             f"pipetrain.apps.models {MODELS}, a config.json or a directory holding one, nor a "
                             "transformers model type (llama, gpt2, ...)")
    if config is None:
        for option in ("--seq-len", "--dtype"):
            if getattr(args, option[2:].replace("-", "_")) is not None:
                raise ValueError(f"{option} applies to Hugging Face language models and {name!r} is not one; "
                                 f"fix: drop {option}")
        if name not in MODELS:
            return torchvision.models.get_model(name, weights=None), torch.randn(2, 3, 224, 224)
        from pipetrain.apps.datasets import dataset_info

        info = dataset_info(DEFAULT_DATASET[name])
        shape = (2, *info.input_shape)
        x = torch.zeros(shape, dtype=torch.long) if info.kind == "text" else torch.randn(shape)
        return build_model(name, num_classes=info.num_classes), x
    if args.profile:
        raise ValueError(f"--profile times every node on data, but {name!r} is built on the meta device from its "
                         "config (shapes only, no data to run); fix: drop --profile to estimate the costs from "
                         "FLOPs and bytes, or profile a model built with weights (partitioners.trace(model, x))")
    tokens = hf_config.example_tokens(config, args.seq_len)
    return hf_config.build_on_meta(config, hf_config.DTYPES[args.dtype or "fp32"]), tokens


def _run_plan(args: argparse.Namespace) -> int:
    import dataclasses

    import partitioners
    from partitioners.errors import TraceError
    from partitioners.meta import holds_meta_tensors
    from partitioners.planners.layout import (SEARCHED_ZERO, describe_no_fit, explain_choice, format_bytes, format_ranking,
                                              format_stage_memory, search_layouts)
    from partitioners.planners.stage_state import FP32, RECOMPUTE
    from schedules.cluster import load_cluster
    from schedules.cluster.reductions import Reduction

    if args.sequence_parallel and args.tensor_parallel == 1:
        raise SystemExit("pipetrain plan: --sequence-parallel splits activations over tensor-parallel ranks; add "
                         "--tensor-parallel T (or auto)")
    cluster = load_cluster(args.cluster)
    if args.nodes is not None:
        cluster = dataclasses.replace(cluster, nodes=args.nodes)
    model, x = _plan_model(args)
    meta = holds_meta_tensors(model)
    params = list(model.parameters())  # a tied parameter once
    # printed before the capture, which takes a while for a large model
    print(f"{args.model}: {type(model).__name__}{' on the meta device' if meta else ''}, "
          f"{sum(p.numel() for p in params):,} parameters ({format_bytes(sum(p.nbytes for p in params))} in "
          f"{str(params[0].dtype).removeprefix('torch.')}){f', {x.shape[1]} tokens per sample' if meta else ''}",
          flush=True)
    try:
        graph = partitioners.trace_for_training(model, x, profile=args.profile)
    except TraceError as exc:
        raise SystemExit(f"pipetrain plan: {exc}") from None
    reduction = Reduction(bucket_bytes=args.bucket_mb * 1e6 if args.bucket_mb > 0 else None,
                          hierarchical={"hybrid": None, "flat": False, "hierarchical": True}[args.allreduce],
                          overlap=not args.no_overlap)
    layouts = search_layouts(graph, cluster, batch_size=args.batch_size, profiled_batch=x.shape[0],
                             reduction=reduction, max_stages=args.max_stages, optimizer=args.optimizer,
                             param_scale=FP32 / params[0].element_size(),  # fp32 under every precision
                             zeros=SEARCHED_ZERO if args.zero == "auto" else (int(args.zero),),
                             recomputes=RECOMPUTE if args.recompute == "auto" else (args.recompute,),
                             tensor_parallel=args.tensor_parallel, sequence_parallel=args.sequence_parallel)
    how = "measured here" if args.profile else "estimated (profile=False)"
    print(f"global batch {args.batch_size}, costs {how}; cluster {cluster.name}: "
          f"{cluster.nodes} x {cluster.devices_per_node} devices, speed {cluster.speed:g}; "
          f"reduction {reduction.label()}; optimizer {args.optimizer}, zero {args.zero}, recompute {args.recompute}"
          f"{f', tensor parallel {args.tensor_parallel}' if args.tensor_parallel != 1 else ''}"
          f"{' with sequence parallelism' if args.sequence_parallel else ''}; "
          f"best of {len(layouts)} shapes (stages x replicas x micro-batches x schedule"
          f"{' x T' if args.tensor_parallel != 1 else ''})")
    if not layouts[0].fits:  # fitting layouts rank first: none fits
        fixes = ["more devices (--nodes)", "a smaller --batch-size"]
        if args.recompute != "auto":
            fixes.append("--recompute auto")
        if args.zero != "auto":
            fixes.append("--zero auto")
        if args.tensor_parallel != "auto":
            fixes.append("--tensor-parallel auto")
        if meta:  # a language model from its config
            fixes += ["a shorter --seq-len"] + (["--dtype bf16"] if args.dtype in (None, "fp32") else [])
        raise SystemExit(f"pipetrain plan: {describe_no_fit(layouts, cluster)}; fix: {', '.join(fixes[:-1])} "
                         f"or {fixes[-1]}")
    print(format_ranking(layouts, args.top))
    print(explain_choice(layouts, cluster))
    best = layouts[0]
    tp = f", tensor parallel {best.tensor_parallel}" if best.tensor_parallel > 1 else ""
    print(f"\nbest layout (stages {best.stages}, replicas {best.replicas}{tp}, micro-batches {best.micro_batches}, "
          f"{best.schedule}, zero={best.zero}, recompute={best.recompute}): predicted memory per device of each stage")
    print(format_stage_memory(best, cluster))
    return 0


def _add_export(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face directory that from_pretrained loads, "
                                      "one stage file at a time")
    p.add_argument("--hf", action="store_true", required=True,
                   help="as safetensors shards, their index and config.json (the one format so far)")
    p.add_argument("checkpoint", help="a checkpoint directory (its newest checkpoint, as pipe.load takes) "
                                      "or one step directory")
    p.add_argument("out", help="the directory to write")
    p.add_argument("--max-shard-size", type=int, default=5 * 10 ** 9, metavar="BYTES",
                   help="largest safetensors file; a larger tensor gets a file of its own (default 5e9)")
    return p


def _run_export(args: argparse.Namespace) -> int:
    from pipetrain.checkpoint import export_pretrained

    if args.max_shard_size <= 0:
        raise ValueError(f"--max-shard-size must be a positive number of bytes, not {args.max_shard_size}")
    export = export_pretrained(args.checkpoint, args.out, args.max_shard_size)
    print(f"wrote {len(export.shards)} safetensors file(s) to {export.directory}")
    if not export.has_config:
        print(f"config.json is missing: the checkpoint records no Hugging Face config (the model has none, or it "
              f"was saved by an older pipetrain). Copy the model's config.json into {export.directory} before "
              f"from_pretrained({str(export.directory)!r}).")
    return 0


def _app(name: str, module: str, add: str, run: str,
         help: str | Callable[[ModuleType], str]) -> tuple[Callable, Callable[[argparse.Namespace], int]]:
    """A subcommand whose arguments and body live in pipetrain.apps.<module> (imported when used); ``help`` may
    be read from that module (a function of it), so that it says what the code does."""
    def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
        app = importlib.import_module(f"pipetrain.apps.{module}")
        p = sub.add_parser(name, help=help(app) if callable(help) else help)
        getattr(app, add)(p)
        return p

    def run_app(args: argparse.Namespace) -> int:
        outcome = getattr(importlib.import_module(f"pipetrain.apps.{module}"), run)(args)
        return outcome if isinstance(outcome, int) else 0  # an exit status, or the app's results

    return add_parser, run_app


SUBCOMMANDS: dict[str, tuple[Callable, Callable[[argparse.Namespace], int]]] = {
    "simulate": (_add_simulate, _run_simulate),
    "plan": (_add_plan, _run_plan),
    "export": (_add_export, _run_export),
    "compare": _app("compare", "compare", "add_arguments_compare", "run_compare",
                    lambda app: "train one model by each staleness method on the same data and seed (default "
                                f"--methods: {', '.join(app.METHODS)}); TensorBoard runs, PNG and table"),
    "demo": _app("demo", "demo", "add_arguments", "run_demo",
                 lambda app: f"`pipetrain compare` of {len(app.METHODS)} methods ({', '.join(app.METHODS)}) on "
                             f"offline datasets ({', '.join(app.ORDER)}) in a few minutes (make demo)"),
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
    except (ValueError, FileNotFoundError) as exc:  # bad shapes, options or missing data: say why, no traceback
        raise SystemExit(f"pipetrain {args.command}: {exc}") from None


if __name__ == "__main__":
    raise SystemExit(main())
