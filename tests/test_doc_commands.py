"""Every shell command README.md and docs/*.md show runs in the suite (```python blocks: test_docs.py).

A command is a line of a non-python fenced or 4-space indented block, or an inline code span, that starts with
one of PREFIXES. COMMANDS says how the suite runs each one: as written, or with small-size flags the command
documents in its --help appended and placeholders substituted (Run), by pointing at a test that already runs
it (Covered), or as part of another entry that runs the same script with more flags (Within). A command the suite
cannot run is in NOT_RUN with its reason, and a ```python block the suite only compiles in BLOCKS_NOT_RUN: the
pages themselves carry no such notes, so a reader sees the command alone.
"""
from __future__ import annotations

import ast
import os
import re
import runpy
import shlex
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from schedules.cluster import PRESETS
from test_docs import PAGES, ROOT, block_sources, python_blocks

PREFIXES = ("python ", "torchrun ", "pipetrain ", "make ", "pytest ", "tensorboard ", "pip ")
SPAN = re.compile(r"`([^`]+)`")
# The forms the pages' own notes took (`<!-- not run: ... -->`, `# not run: ...`); the registries below hold them now.
NOTE = re.compile(r"(<!--|#|;)\s*not run\s*:", re.I)
# Small sizes for the training commands: one epoch on a few samples of a narrow model.
TINY_TRAINING = "--epochs 1 --train-samples 32 --val-samples 16 --batch-size 16 --width 4 --no-progress"
PLAN_SMALL = "--max-stages 4 --top 3"  # `pipetrain plan` ranks every depth up to the cluster's devices otherwise


@dataclass(frozen=True)
class Run:
    """Run the documented text with ``substitute`` applied and ``append`` added (argparse: the last value wins);
    it must exit 0 and print ``expect``. In this process unless ``process`` (torchrun and make need one)."""
    expect: str
    append: str = ""
    substitute: tuple[tuple[str, str], ...] = ()
    process: bool = False
    slow: bool = False


@dataclass(frozen=True)
class Covered:
    """Already run by the test ``node`` (file::name); its file names the command's script, subcommand and flags."""
    node: str


@dataclass(frozen=True)
class Within:
    """Run as part of the entry ``command``, a Run whose text has every word of this one (the same script, with
    flags added): one launch runs both."""
    command: str


# Placeholders in substitutions: {tmp} is the case's temporary directory, {cluster} a Cluster JSON written there
# (a preset: a real calibration is bench_calibration's test), {quickstart} README's quick start saved as a script.
COMMANDS: dict[str, Run | Covered | Within] = {
    # README.md
    "make demo": Run("-m pipetrain.cli demo", append="--dry-run", process=True),  # what it runs: `pipetrain demo`
    "torchrun --standalone --nproc-per-node 4 train.py": Run(
        "epoch 4: loss", substitute=(("train.py", "{quickstart}"),), process=True, slow=True),
    "python examples/vgg.py": Run("max val accuracy", append=TINY_TRAINING + " --stages 2"),
    "pipetrain plan": Run("usage: pipetrain plan", append="--help"),  # names the command: it exists
    "pipetrain compare": Run("max val accuracy", append=TINY_TRAINING + " --methods 1f1b --logdir {tmp}/runs"),
    # docs/README.md, schedules.md
    "pipetrain simulate": Run("bubble"),
    "pipetrain simulate --schedule zb-h1 --stages 4 --micro-batches 8 --png out.png": Run("bubble"),
    # api.md, hybrid-and-zero.md, options.md: a command named with a flag; its --help lists the flag
    "pipetrain export --hf": Run("--hf", append="--help"),
    "pipetrain plan --zero auto": Run("--zero {0,1,2,3,auto}", append="--help"),
    "pipetrain plan --optimizer adamw": Run("--optimizer {sgd,sgd-momentum,adam,adamw,lars,lamb}", append="--help"),
    "pipetrain plan --recompute auto": Run("--recompute {none,except-last,always,auto}", append="--help"),
    "pipetrain plan --tensor-parallel auto --sequence-parallel": Run("--sequence-parallel", append="--help"),
    "pipetrain plan --cluster": Run("--cluster CLUSTER", substitute=(("--cluster", "--cluster {cluster}"),),
                                    append="--help"),
    # checkpoints.md (its commands change with the preemption rework; it carries no markers of its own)
    "torchrun --max-restarts": Run("--max-restarts", substitute=(("--max-restarts", "--max-restarts 0"),),
                                   append="--help"),
    "pipetrain export --hf dir out": Covered("tests/test_export_hf.py::test_export_loads_as_the_pipeline_learned"),
    "pytest tests/test_failures.py -s": Covered("tests/test_failures.py"),
    "python examples/benchmarks/soak.py": Covered(
        "tests/test_benchmarks.py::test_soak_counts_every_step_and_prints_rss_per_rank"),
    # [--ranks 2] is optional: one process (the torchrun path is the SIGTERM tests' of test_examples_torchrun.py)
    "python examples/benchmarks/bench_preemption.py [--ranks 2]": Run(
        "s after SIGTERM", substitute=((" [--ranks 2]", ""),), append="--repeats 1", slow=True),
    # cli.md
    "python -m pipetrain.cli": Run("usage: pipetrain", append="--help"),
    "pipetrain COMMAND --help": Run("--lr-grid", substitute=(("COMMAND", "compare"),)),
    "pipetrain simulate --schedule 1f1b --stages 4 --micro-batches 8 --trace out.json --png out.png": Run("bubble"),
    "pipetrain plan resnet50 --cluster nvlink8-100g --batch-size 256": Run(
        "predicted memory per device", append=PLAN_SMALL),
    "pipetrain export --hf checkpoints/run1 out/hf": Covered(
        "tests/test_export_hf.py::test_export_loads_as_the_pipeline_learned"),
    "pipetrain plan llama --cluster nvlink8-100g --batch-size 64 --seq-len 2048 --dtype bf16": Covered(
        "tests/test_cli_plan.py::test_llama_default_config_plans_on_meta_in_little_memory"),
    "pipetrain plan path/to/config.json --cluster my_cluster.json --batch-size 256": Covered(
        "tests/test_cli_plan.py::test_tiny_config_plans_and_stage_weights_sum_to_the_model"),
    "pipetrain compare --model vgg --stages 4 --logdir runs/vgg": Run("max val accuracy", append=TINY_TRAINING),
    # every model and method of the demo, for one epoch on a few samples, in its two worker processes
    "pipetrain demo": Run("demo wall time", append="--no-progress --epochs 1 --train-samples 128 --logdir {tmp}/runs",
                          slow=True),
    # compile.md
    "python examples/benchmarks/bench_compile.py": Within("python examples/benchmarks/bench_compile.py --schedules zb-h1"),
    "python examples/benchmarks/bench_compile.py --schedules zb-h1": Run(
        "eager/compiled", append="--rounds 1 --steps 1 --width 16 --depth 1 --length 8", slow=True),
    # distributed.md
    "torchrun --standalone --nproc-per-node 4 examples/vgg.py --stages 4": Within(
        "torchrun --standalone --nproc-per-node 4 --max-restarts 3 examples/vgg.py --stages 4 --checkpoint-dir ckpt "
        "--save-every 50 --resume"),
    "torchrun --standalone --nproc-per-node 4 --max-restarts 3 examples/vgg.py --stages 4 --checkpoint-dir ckpt "
    "--save-every 50 --resume": Run("max val accuracy", append=TINY_TRAINING, process=True, slow=True),
    # hybrid-and-zero.md, README.md: the large-batch recipe, on a few samples (a warm-up shorter than their updates)
    "python examples/resnet.py --optimizer lars --lr-schedule warmup-poly --warmup 5 --precision fp16 --batch-size 512 "
    "--epochs 30": Run("max val accuracy", append=TINY_TRAINING + " --warmup 1 --stages 2 --micro-batches 2"),
    "pipetrain compare --optimizer lars --lr-schedule warmup-poly --warmup 40 --methods "
    "data-parallel,data-parallel+bs=512": Run("max val accuracy", substitute=(("+bs=512", "+bs=32"),),
                                              append=TINY_TRAINING + " --warmup 1 --epochs 3 --logdir {tmp}/runs"),
    # hybrid-and-zero.md
    "python examples/benchmarks/bench_zero.py": Run(
        "all ranks' wire bytes per step", append="--width 32 --depth 1 --seq 4 --batch 4 --steps 1 --replicas 1",
        slow=True),
    # tensor-parallel.md
    "python examples/benchmarks/bench_tensor_parallel.py": Run(
        "inserted", append="--steps 1 --models mlp --width 256", slow=True),
    "torchrun --standalone --nproc-per-node 4 examples/huggingface.py --model llama --stages 2 --tensor-parallel 2":
        Within("torchrun --standalone --nproc-per-node 4 examples/huggingface.py --model llama --stages 2 "
               "--tensor-parallel 2 --sequence-parallel"),
    "torchrun --standalone --nproc-per-node 4 examples/huggingface.py --model llama --stages 2 --tensor-parallel 2 "
    "--sequence-parallel": Run(
        "max val accuracy", append="--epochs 1 --train-samples 64 --val-samples 16 --batch-size 16 --no-progress",
        process=True, slow=True),
    # language-models.md
    "python examples/huggingface.py --weights DIR --lora 8 --optimizer adam --save-pretrained out/adapter": Covered(
        "tests/test_examples_torchrun.py::test_huggingface_example_fine_tunes_its_saved_model_under_torchrun"),
    # results.md; $M is the doc's own M="..." line
    "python examples/benchmarks/bench_partitioners.py": Run(
        "graph: solved in", append="--estimate --repeats 1", slow=True),
    "python examples/benchmarks/bench_schedules.py": Run(
        "p=8, m=16: CPU seconds", append="--stages 8 --micro-batches 16 --repeats 1"),
    "python examples/benchmarks/bench_zero_bubble.py --batch-size 256 --width 1024 --compile": Covered(
        "tests/test_benchmarks.py::test_zero_bubble_benchmark_prints_simulated_and_measured_bubbles_and_each_stages_memory"),
    "python examples/benchmarks/bench_runtime.py": Covered(
        "tests/test_benchmarks.py::test_runtime_benchmark_times_the_local_engine_against_the_unsplit_model"),
    **{f"pipetrain compare --model {model} --stages 4 --micro-batches 8 --epochs {epochs} --seeds 3 --lr-grid {grid} "
       "--methods $M": Run("max val accuracy", substitute=(("$M", "{M}"),),
                           append=TINY_TRAINING + " --seeds 1 --lr-grid 0.05 --logdir {tmp}/runs", slow=True)
       for model, epochs, grid in (("vgg", 3, "0.01,0.02,0.05,0.1"), ("resnet", 4, "0.01,0.02,0.05"),
                                   ("transformer", 4, "0.01,0.03,0.1"), ("lstm", 5, "0.03,0.1,0.3"))},
    "python examples/benchmarks/bench_plan_memory.py": Covered(
        "tests/test_plan_memory.py::test_predicted_peak_is_within_ten_percent_of_the_measured_one_per_rank"),
    "python examples/benchmarks/bench_memory.py": Covered(
        "tests/test_benchmarks.py::test_memory_benchmark_predicts_every_stage_within_ten_percent"),
    "python examples/benchmarks/bench_delay.py": Run(
        "D = 1:", append="--delays 0,1 --epochs 1 --train-samples 128", slow=True),
    "python examples/benchmarks/bench_async_goal.py --seeds 5": Covered(
        "tests/test_async_goal.py::test_a_tiny_cell_is_judged_by_the_issues_rules"),
    **{f"python examples/benchmarks/bench_async_goal.py --same-batch --method {rest}": Covered(
        "tests/test_async_goal.py::test_same_batch_feeds_the_async_method_syncs_mini_batches_at_syncs_rates")
       for rest in ("nesterov+m=8,nesterov+m=4,2bw+ef+m=4 --families transformer,lstm --optimizers sgd,adam,muon "
                    "--budgets 1 --seeds 3",
                    "nesterov+m=8,nesterov+m=4 --families vgg --optimizers sgd,adam,muon --budgets 1 --seeds 3",
                    "nesterov+m=8 --families resnet --optimizers sgd,adam,muon --budgets 1 --seeds 3",
                    "nesterov+m=8,nesterov+m=4 --families transformer --optimizers sgd,adam,muon --budgets 3 --seeds 3",
                    "nesterov+m=8,nesterov+m=4 --families lstm --optimizers sgd --budgets 3 --seeds 3",
                    "nesterov+m=8 --families lstm --optimizers adam --budgets 3 --seeds 3 --lr-grid 0.01",
                    "nesterov+m=8 --families lstm --optimizers muon --budgets 3 --seeds 3",
                    "nesterov+m=8 --families vgg --optimizers sgd,adam,muon --budgets 3 --seeds 3",
                    "nesterov+m=8 --families resnet --optimizers sgd,muon --budgets 3 --seeds 3",
                    "nesterov+m=8 --families resnet --optimizers adam --budgets 3 --seeds 3 --lr-grid 0.01",
                    "nesterov+sm+m=8 --families lstm --optimizers muon --budgets 3 --seeds 3",
                    "nesterov+sm+m=8 --families resnet --optimizers muon --budgets 3 --seeds 3")},
    **{f"python examples/benchmarks/bench_async_goal.py --same-batch --sync-nesterov --method {method} --families "
       f"{families} --optimizers {optimizers} --budgets {budget} --seeds 3{grid}": Covered(
           "tests/test_async_goal.py::test_the_nesterov_control_trains_sync_with_the_nesterov_form_of_the_cells_optimizer")
       for method, families, optimizers, budget, grid in (
           ("nesterov+m=8", "transformer,lstm,vgg", "sgd", 1, ""), ("nesterov+m=8", "resnet", "sgd", 1, ""),
           ("nesterov+sm+m=8", "transformer,vgg", "sgd", 1, ""), ("nesterov+sm+m=8", "lstm", "sgd", 1, ""),
           ("nesterov+sm+m=8", "resnet", "sgd", 1, ""), ("nesterov+m=8", "transformer,lstm", "adam", 1, ""),
           ("nesterov+m=8", "vgg,resnet", "adam", 1, ""),
           ("nesterov+m=8,nesterov+sm+m=8", "transformer,lstm,vgg", "sgd", 3, ""),
           ("nesterov+sm+m=8", "resnet", "sgd", 3, ""),
           ("nesterov+m=8", "transformer", "adam", 3, " --lr-grid 0.003"),
           ("nesterov+m=8", "lstm", "adam", 3, " --lr-grid 0.01"),
           ("nesterov+m=8", "vgg", "adam", 3, " --lr-grid 0.001,0.003"),
           ("nesterov+m=8", "resnet", "adam", 3, " --lr-grid 0.01"), ("nesterov+m=8", "resnet", "sgd", 3, ""))},
    "python examples/benchmarks/bench_stage_delays.py": Run(
        "delays 3,2,1,0:", append="--delays 3,2,1,0 0,0,0,0 --epochs 1 --train-samples 256 --seeds 1", slow=True),
    "python examples/benchmarks/bench_stage_delays.py --delays 3,2,1,0 --hessian-correction 0.5": Run(
        "Hessian correction x0.5", append="--epochs 1 --train-samples 256 --seeds 1", slow=True),
    "python examples/benchmarks/bench_precision.py": Run(
        "bytes ratio fp32 / bf16", append="--rounds 1 --width 8", slow=True),
    "python examples/benchmarks/bench_comm_bytes.py": Run(
        "geometric mean of the wire ratio", append="--batch 8 --families vgg", slow=True),
    "python examples/benchmarks/bench_allreduce.py": Run(
        "step time, DDP / fused overlapped", append="--blocks 2 --rounds 1 --steps 1", slow=True),
    **{f"torchrun --nnodes 2 --nproc-per-node 2 --node-rank {node} --master-addr 127.0.0.1 --master-port 29511 "
       "examples/benchmarks/bench_hierarchical_allreduce.py": Covered(
           "tests/test_benchmarks.py::test_hierarchical_allreduce_benchmark_counts_each_variants_bytes_and_prices_it")
       for node in (1, 0)},
    "python examples/benchmarks/bench_calibration.py": Covered(
        "tests/test_benchmarks.py::test_calibration_runs_predicts_every_layout_and_saves_a_plannable_cluster"),
    "python examples/benchmarks/bench_calibration.py --save-cluster this_machine.json": Covered(
        "tests/test_benchmarks.py::test_calibration_runs_predicts_every_layout_and_saves_a_plannable_cluster"),
    "pipetrain plan vgg --cluster this_machine.json --batch-size 64 --profile": Run(
        "predicted memory per device", substitute=(("this_machine.json", "{cluster}"),), append=PLAN_SMALL),
    "python examples/benchmarks/bench_big_model.py": Covered(
        "tests/test_benchmarks.py::test_big_model_benchmark_runs_both_paths_and_checks_the_bound"),
    "python examples/benchmarks/reproduce_jia.py": Covered(
        "tests/test_benchmarks.py::test_jia_reproduction_matches_the_readme"),
    "python examples/benchmarks/large_batch_study.py --families cnn1d --jobs 2": Covered(
        "tests/test_benchmarks.py::test_large_batch_study_prints_each_rows_best_rate_and_its_gap_to_the_baseline"),
    "python examples/benchmarks/large_batch_study.py --families lstm --jobs 3": Covered(
        "tests/test_benchmarks.py::test_large_batch_study_prints_each_rows_best_rate_and_its_gap_to_the_baseline"),
    "python examples/benchmarks/large_batch_study.py --families transformer --jobs 2": Covered(
        "tests/test_benchmarks.py::test_large_batch_study_prints_each_rows_best_rate_and_its_gap_to_the_baseline"),
    # results.md's time to target on real ranks: the table's measured columns, from torchrun's processes
    "torchrun --standalone --nproc-per-node 2 -m pipetrain.cli compare --model lstm --stages 2 --micro-batches 8 "
    "--async-micro-batches 1 --epochs 5 --seeds 3 --lr-grid 0.1,0.3 --methods 1f1b,1f1b+m=4,1f1b+m=2,nesterov+sm+bs=8 "
    "--no-progress": Run("measured time to target", append=TINY_TRAINING + " --seeds 1 --lr-grid 0.1 --logdir {tmp}/runs",
                         process=True, slow=True),
}


# Commands the suite does not run, each with why. The pages show the command alone; a measurement's wall time
# stays on its page as a plain comment where it helps a reader (results.md).
SUITE = "is the test suite itself"
INSTALLS = "installs packages"
COMPARE_TINY = "a long measurement; tests/test_compare.py runs compare's methods and suffixes at a tiny size"
STAGE_DELAYS = ("a long measurement; `python examples/benchmarks/bench_stage_delays.py` (in COMMANDS) runs the script "
                "at a small size")
NOT_RUN: dict[str, str] = {
    # README.md
    "make test": SUITE,
    "make test-fast": SUITE,
    "make test-kernels": "the suite's exact tests three times, under each CPU kernel path (docs/exactness.md)",
    "tensorboard --logdir runs/demo-...": "a long-running service",
    "pipetrain demo --epochs N --train-samples N": "the suite runs `pipetrain demo` with these flags (COMMANDS)",
    "pip install -e .": INSTALLS,
    "pip install .": INSTALLS,
    "pip install -e '.[examples]'": INSTALLS,
    # big-models.md
    "pipetrain plan llama3-8b --cluster nvlink8-100g --nodes 8 --batch-size 1024 --seq-len 4096 --dtype bf16 "
    "--zero auto --top 5": "42 s here; tests/test_cli_plan.py plans a tiny config",
    "pipetrain plan llama3-70b --cluster cluster-80gb.json --batch-size 1024 --seq-len 4096 --dtype bf16 --zero auto "
    "--top 5": "57 s here; tests/test_cli_plan.py plans a tiny config",
    "pipetrain plan llama3-70b --cluster cluster-80gb.json --batch-size 1024 --seq-len 4096 --dtype bf16 --zero auto "
    "--tensor-parallel auto --top 5": "60 s here; tests/test_layout_tensor_parallel.py plans small graphs",
    "pipetrain plan llama3-70b --cluster cluster-80gb.json --batch-size 1024 --seq-len 4096 --dtype bf16 --zero auto "
    "--tensor-parallel auto --sequence-parallel --top 5":
        "about a minute here, as the plan without --sequence-parallel; tests/test_layout_tensor_parallel.py prices "
        "it by hand",
    # distributed.md
    "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/resnet.py "
    "--stages 4 --data-parallel 2": "needs several machines",
    # gpus.md, language-models.md
    "pytest -m cuda": SUITE,
    "pytest tests/test_language_models.py": SUITE,
    # tensor-parallel.md
    "python examples/benchmarks/bench_tensor_parallel.py --models llama":
        "a minute of the suite; the same script runs on the MLP (COMMANDS), and tests/test_sequence_parallel.py "
        "checks the Llama's saved bytes shrink",
    # results.md: measurements of minutes each
    **{f"pipetrain compare --model transformer-lm --stages 4 --batch-size 32 --micro-batches 4 --async-micro-batches 1 "
       f"--epochs 3 --seeds 1 --optimizer {rest}": "a long measurement; tests/test_training.py trains --optimizer muon "
                                                   "with nesterov+sm, tests/test_compare.py the methods and suffixes"
       for rest in ("adam --lr-grid 0.001,0.003 --methods 1f1b,nesterov+sm", "muon --lr-grid 0.01,0.02 --methods "
                    "1f1b,nesterov+sm", "adam --lr 0.003 --methods stash,2bw+ef+m=4",
                    "muon --lr 0.01 --methods stash,2bw+ef+m=4")},
    **{f"pipetrain compare --model transformer-lm --stages 4 --batch-size 32 --micro-batches 4 --async-micro-batches 1 "
       f"--epochs 3 --seeds 3 --optimizer {rest}": "a long measurement; tests/test_compare.py runs the methods and "
                                                   "suffixes, tests/test_training.py trains --optimizer muon"
       for rest in ("adam --lr 0.003 --methods 1f1b,2bw+ef+m=4,stash+ef",
                    "muon --lr 0.01 --methods 1f1b,2bw+ef+m=4,stash+ef,nesterov@0.5+sm",
                    "muon --lr 0.01 --methods 2bw+ef+sm+m=4", "muon --lr 0.005 --methods 1f1b,2bw+ef+m=4",
                    "muon --lr 0.02 --methods 1f1b,2bw+ef+m=4", "adam --lr 0.006 --methods 1f1b,2bw+ef+m=4")},
    "pipetrain compare --model transformer-lm --stages 4 --batch-size 32 --micro-batches 8 --epochs 3 --seeds 3 "
    "--optimizer adam --lr-grid 0.003 --methods 1f1b,nesterov,nesterov+m=4":
        "a long measurement; tests/test_compare.py runs the methods and +m=N",
    "torchrun --standalone --nproc-per-node 2 -m pipetrain.cli compare --model transformer --stages 2 "
    "--micro-batches 8 --async-micro-batches 1 --epochs 4 --seeds 3 --lr-grid 0.03,0.1 "
    "--methods 1f1b,1f1b+m=4,1f1b+m=2,nesterov+sm+bs=8 --no-progress":
        "9 minutes here; the LSTM's line beside it runs under torchrun at a tiny size (COMMANDS)",
    **{f"torchrun --standalone --nproc-per-node 2 -m pipetrain.cli compare --model {model} --stages 2 --micro-batches 8 "
       f"--async-micro-batches 4 --epochs {epochs} --seeds 3 --lr-grid {grid} "
       "--methods 1f1b,1f1b+m=4,1f1b+m=2,nesterov,nesterov+m=8 --no-progress":
           f"{minutes} minutes here; the table above's LSTM line runs compare under torchrun at a tiny size (COMMANDS), "
           "tests/test_compare.py runs nesterov and +m=N"
       for model, epochs, grid, minutes in (("lstm", 5, "0.1,0.3", 4.6), ("transformer", 4, "0.03,0.1", 4.1))},
    **{f"torchrun --standalone --nproc-per-node 4 examples/lstm.py --stages 2 --data-parallel 2 --epochs 2 "
       f"--no-progress --schedule {flags}":
           "a measurement of a minute; tests/test_examples_torchrun.py trains this example under torchrun at 2 stages "
           "x 2 replicas" for flags in (
               "1f1b --micro-batches 4 --batch-size 64 --lr 0.1",
               "async-1f1b --staleness nesterov --stage-momentum --micro-batches 1 --batch-size 8 --lr 0.0375")},
    "pipetrain compare --model lstm --stages 4 --async-micro-batches 1 --epochs 4 --train-samples 1024 --no-progress "
    "--val-samples 512 --seeds 2 --lr-grid 0.03,0.1 --methods 1f1b,spectrain,nesterov --logdir runs/ttt":
        "6.5 minutes here; tests/test_time_to_target.py runs compare with these columns at a tiny size",
    # results.md, the same-batch goal's two cells nearest the line on 10 seeds
    "pipetrain compare --model lstm --stages 4 --micro-batches 8 --epochs 5 --seeds 10 --lr-grid 0.1 --optimizer nag "
    "--methods 1f1b": COMPARE_TINY,
    "pipetrain compare --model lstm --stages 4 --micro-batches 8 --epochs 5 --seeds 10 --lr-grid 0.1 "
    "--methods nesterov,nesterov+sm,nesterov+sc": COMPARE_TINY,
    "pipetrain compare --model transformer --stages 4 --micro-batches 8 --epochs 4 --seeds 10 --lr-grid 0.003 "
    "--optimizer nadam --methods 1f1b": COMPARE_TINY,
    "pipetrain compare --model transformer --stages 4 --micro-batches 8 --epochs 4 --seeds 10 --lr-grid 0.003 "
    "--optimizer adam --methods nesterov,nesterov+sm": COMPARE_TINY,
    "pipetrain compare --model lstm --stages 4 --async-micro-batches 1 --epochs 5 --seeds 2 --lr-grid 0.03,0.1 "
    "--methods $M": "a long measurement; tests/test_delay_corrections.py checks each rule, tests/test_compare.py the "
                    "suffixes",
    "pipetrain compare --model transformer --stages 4 --async-micro-batches 1 --epochs 4 --seeds 2 --lr-grid 0.01,0.03 "
    "--methods $M": COMPARE_TINY,
    "pipetrain compare --model lstm --stages 4 --async-micro-batches 1 --epochs 5 --seeds 2 --optimizer adam "
    "--lr-grid 0.001,0.003,0.01 --methods 1f1b,stash,nesterov,spectrain": COMPARE_TINY,
    "pipetrain compare --model transformer --stages 4 --async-micro-batches 1 --epochs 4 --seeds 2 --optimizer adam "
    "--lr-grid 0.001,0.003 --methods 1f1b,stash,nesterov,spectrain": COMPARE_TINY,
    "pipetrain compare --model lstm --stages 4 --async-micro-batches 1 --epochs 5 --seeds 3 --lr-grid 0.03,0.1,0.3 "
    "--methods 1f1b,nesterov,nesterov+sm": "a long measurement; tests/test_delay_corrections.py checks the rule, "
                                           "tests/test_compare.py the suffixes",
    "pipetrain compare --model transformer --stages 4 --async-micro-batches 1 --epochs 4 --seeds 3 "
    "--lr-grid 0.01,0.03,0.1 --methods 1f1b,nesterov,nesterov+sm": COMPARE_TINY,
    "pipetrain compare --model vgg --stages 4 --async-micro-batches 1 --epochs 3 --seeds 3 --lr-grid 0.01,0.02,0.05 "
    "--methods 1f1b,nesterov,nesterov+sm": COMPARE_TINY,
    "pipetrain compare --model resnet --stages 4 --async-micro-batches 1 --epochs 4 --seeds 3 --lr-grid 0.01,0.02,0.05 "
    "--methods 1f1b,nesterov,nesterov+sm": COMPARE_TINY,
    "python examples/benchmarks/bench_stage_delays.py --model lstm --lr 0.1 --epochs 5":
        STAGE_DELAYS + "; tests/test_stage_delays.py checks the mirror",
    "python examples/benchmarks/bench_stage_delays.py --delays 3,2,1,0 --window-powers 1 3 4": STAGE_DELAYS,
    "python examples/benchmarks/bench_stage_delays.py --delays 0,0,0,0 --matched-to 3,2,1,0": STAGE_DELAYS,
    "python examples/benchmarks/bench_stage_delays.py --model lstm --lr 0.1 --epochs 5 --delays 3,2,1,0 "
    "--hessian-correction 0.5": STAGE_DELAYS + "; the Hessian correction's path runs in COMMANDS",
    "python examples/benchmarks/bench_stage_delays.py --delays 1,1,1,1 3,3,3,3": STAGE_DELAYS,
    "python examples/benchmarks/bench_stage_delays.py --lr 0.01 --delays 0,0,0,0 3,2,1,0": STAGE_DELAYS,
    "python examples/benchmarks/bench_stage_delays.py --batch-size 8 --lr 0.00375 --delays 0,0,0,0 3,2,1,0":
        STAGE_DELAYS,
    "python examples/benchmarks/bench_stage_delays.py --batch-size 8 --lr 0.0125 --delays 0,0,0,0 3,2,1,0":
        STAGE_DELAYS,
    "python examples/benchmarks/bench_stage_delays.py --model lstm --batch-size 8 --lr 0.0375 --epochs 5 "
    "--delays 0,0,0,0 3,2,1,0": STAGE_DELAYS,
    "pipetrain compare --model transformer --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 4 --seeds 3 "
    "--lr-grid 0.01,0.03,0.1,0.3 --methods $M": COMPARE_TINY + " (+bs=N included)",
    "pipetrain compare --model lstm --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 5 --seeds 3 "
    "--lr-grid 0.03,0.1,0.3,1 --methods $M": COMPARE_TINY,
    "pipetrain compare --model vgg --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 3 --seeds 3 "
    "--lr-grid 0.01,0.02,0.05 --methods 1f1b,nesterov+sm+bs=8,data-parallel+bs=8": COMPARE_TINY,
    "pipetrain compare --model resnet --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 4 --seeds 3 "
    "--lr-grid 0.01,0.02,0.05 --methods 1f1b,nesterov+sm+bs=4,data-parallel+bs=4": COMPARE_TINY,
    "pipetrain compare --model transformer --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 12 --seeds 3 "
    "--lr-grid 0.1 --methods nesterov+sm+bs=8": COMPARE_TINY,
    "pipetrain compare --model transformer --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 12 --seeds 3 "
    "--lr-grid 0.03 --methods 1f1b,data-parallel+bs=8": COMPARE_TINY,
    "pipetrain compare --model lstm --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 15 --seeds 3 "
    "--lr-grid 0.1,0.3 --methods nesterov+sm+bs=8,data-parallel+bs=8": COMPARE_TINY,
    "pipetrain compare --model lstm --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 15 --seeds 3 "
    "--lr-grid 0.1 --methods 1f1b": COMPARE_TINY,
    "pipetrain compare --model vgg --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 9 --seeds 3 "
    "--lr-grid 0.01 --methods 1f1b,nesterov+sm+bs=8,data-parallel+bs=8": COMPARE_TINY,
    "pipetrain compare --model resnet --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 12 --seeds 3 "
    "--lr-grid 0.02 --methods 1f1b,data-parallel+bs=4": COMPARE_TINY,
    "pipetrain compare --model resnet --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 12 --seeds 3 "
    "--lr-grid 0.05 --methods nesterov+sm+bs=4": COMPARE_TINY,
    "pipetrain compare --model transformer --stages 8 --micro-batches 8 --async-micro-batches 1 --epochs 4 --seeds 3 "
    "--lr-grid 0.01,0.03,0.1 --methods 1f1b,nesterov+sm+bs=8": COMPARE_TINY,
    "pipetrain compare --model transformer-lm --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 3 "
    "--seeds 3 --optimizer adam --lr-grid 0.001,0.003,0.01,0.03 --methods 1f1b,nesterov+sm+bs=8": COMPARE_TINY,
    "pipetrain compare --model lstm-lm --stages 4 --micro-batches 8 --async-micro-batches 1 --epochs 3 --seeds 3 "
    "--lr-grid 0.03,0.1,0.3,1 --methods 1f1b,nesterov+sm+bs=8": COMPARE_TINY,
    "pipetrain compare --model lstm --stages 4 --micro-batches 4 --epochs 5 --seeds 3 --lr-grid 0.03,0.1 "
    "--methods 1f1b,2bw,2bw+ef": "a long measurement; tests/test_delay_corrections.py checks the rule, "
                                 "tests/test_compare.py the suffix",
    "pipetrain compare --model transformer --stages 4 --micro-batches 4 --epochs 4 --seeds 3 --lr-grid 0.01,0.03 "
    "--methods 1f1b,2bw,2bw+ef": COMPARE_TINY,
}

# ```python blocks the suite compiles but does not run, by (page, the block's first line), each with why.
BLOCKS_NOT_RUN: dict[tuple[str, str], str] = {
    ("docs/hybrid-and-zero.md", "pipe = pipetrain.wrap(model, x[:4], stages=4, data_parallel=2, zero=1,"):
        "needs torchrun with 8 processes; tests/test_zero.py trains zero=1 on gloo ranks",
    ("docs/language-models.md", "from pipetrain.hf_trainer import PipelineTrainer"):
        "needs your model, datasets and collator, and a long run; tests/test_hf_trainer.py trains the Trainer path",
    ("docs/tensor-parallel.md", 'plan = {**model.tp_plan, "layers.*.input_layernorm": "sequence_parallel",'):
        "needs stages x T = 4 processes under torchrun; tests/test_sequence_parallel.py trains this plan",
}

# ----- finding the commands -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Documented:
    """One command as a page shows it: where, and its text (whitespace and continuations normalised)."""
    where: str
    text: str


def _is_code_line(line: str, fence: str | None) -> bool:
    """A line of a non-python fenced block, or of a 4-space indented block outside fences."""
    return fence not in (None, "python") or (fence is None and line.startswith("    ") and line.strip() != ""
                                             and not line.lstrip().startswith(("-", "*", "|")))


def documented_commands(page: Path) -> list[Documented]:
    """Every command of ``page``, in order."""
    lines, found, fence = page.read_text().splitlines(), [], None
    name = str(page.relative_to(ROOT))
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            fence = None if fence is not None else line.strip()[3:]
        elif _is_code_line(line, fence):
            start = i
            while line.rstrip().endswith("\\") and i + 1 < len(lines):  # a continued shell line
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            text = " ".join(line.partition(" #")[0].split())
            if text.startswith(PREFIXES):
                found.append(Documented(f"{name}:{start + 1}", text))
        elif fence is None:
            for span in SPAN.finditer(line):
                text = " ".join(span.group(1).split())
                if text.startswith(PREFIXES):
                    found.append(Documented(f"{name}:{i + 1}", text))
        i += 1
    return found


ALL = [command for page in PAGES for command in documented_commands(page)]


def test_every_documented_command_is_run_or_listed_with_a_reason():
    unaccounted = [f"{c.where}: {c.text}" for c in ALL if c.text not in COMMANDS and c.text not in NOT_RUN]
    assert not unaccounted, (
        "documented commands the suite does not run:\n  " + "\n  ".join(unaccounted) + "\nadd each to COMMANDS in "
        "tests/test_doc_commands.py (as written, or with small flags from its --help), or to NOT_RUN with its reason")
    assert not [text for text, reason in NOT_RUN.items() if not reason.strip()], "say why each is not run"
    assert not set(COMMANDS) & set(NOT_RUN), "a command is either run or not"
    stale = (set(COMMANDS) | set(NOT_RUN)) - {c.text for c in ALL}
    assert not stale, f"entries no page shows: {sorted(stale)}"


def test_no_page_carries_a_not_run_note():
    # a reader sees the command alone: why the suite leaves one out is NOT_RUN's and BLOCKS_NOT_RUN's business
    notes = [f"{page.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for page in PAGES
             for i, line in enumerate(page.read_text().splitlines(), 1) if NOTE.search(line)]
    assert not notes, "move each into NOT_RUN or BLOCKS_NOT_RUN (tests/test_doc_commands.py):\n  " + "\n  ".join(notes)


def test_every_block_not_run_is_a_block_of_its_page_with_a_reason():
    blocks = Counter((str(page.relative_to(ROOT)), source.splitlines()[0]) for page in PAGES
                     for _, source in block_sources(page))
    assert not [key for key in BLOCKS_NOT_RUN if blocks[key] != 1], (
        f"each key must name one block of its page: {[key for key in BLOCKS_NOT_RUN if blocks[key] != 1]}")
    assert all(reason.strip() for reason in BLOCKS_NOT_RUN.values())


# ----- commands another test runs -------------------------------------------------------------------------
def argv_words(text: str) -> list[str]:
    """What a test running ``text`` must name: the script's file name, the pipetrain subcommand, every flag."""
    words = shlex.split(text.replace("[", "").replace("]", ""))
    named = [w for w in words if w.startswith("--")] + [Path(w).name for w in words if w.endswith(".py")]
    if words[0] == "pipetrain":
        named.append(words[1])
    return named


@pytest.mark.parametrize("text", [t for t, how in COMMANDS.items() if isinstance(how, Covered)])
def test_a_covering_test_exists_and_runs_the_command(text):
    node = COMMANDS[text].node
    path, _, name = node.partition("::")
    source = (ROOT / path).read_text()
    if name:
        assert name in {f.name for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef)}, node
    if text.startswith("pytest "):  # the command runs the suite's own file
        assert path in text.split(), (text, node)
    else:
        missing = [w for w in argv_words(text) if f'"{w}"' not in source and f'/ "{w}' not in source]
        assert not missing, f"{node} does not run {text!r}: its file never names {missing}"


@pytest.mark.parametrize("text", [t for t, how in COMMANDS.items() if isinstance(how, Within)])
def test_a_command_within_another_is_its_subset_and_that_one_runs(text):
    command = COMMANDS[text].command
    assert isinstance(COMMANDS.get(command), Run), f"{text!r} is within {command!r}, which the suite must run"
    words, within = shlex.split(text), shlex.split(command)
    assert words[0] == within[0] and not set(words) - set(within), f"{command!r} does not have every word of {text!r}"
    scripts = [w for w in words if w.endswith(".py")]
    assert scripts == [w for w in within if w.endswith(".py")], (text, command)


# ----- running the rest -----------------------------------------------------------------------------------
def _values(tmp: Path) -> dict[str, str]:
    """The real values of COMMANDS' placeholders, created under ``tmp``."""
    (tmp / "cluster.json").write_text(PRESETS["nvlink8-100g"].to_json())
    quickstart = tmp / "train.py"
    quickstart.write_text("".join(source for _, source, _ in python_blocks(ROOT / "README.md")))
    results = (ROOT / "docs" / "results.md").read_text()
    return {"tmp": str(tmp), "cluster": str(tmp / "cluster.json"), "quickstart": str(quickstart),
            "M": re.search(r'^\s+M="([^"]+)"$', results, re.M).group(1)}


def to_run(text: str, how: Run, tmp: Path) -> list[str]:
    """The argv the suite runs for ``text``."""
    for placeholder, value in how.substitute:
        assert placeholder in text, (text, placeholder)
        text = text.replace(placeholder, value, 1)
    values = _values(tmp)
    return [w.format(**values) if "{" in w else w for w in shlex.split(f"{text} {how.append}")]


def run_in_process(argv: list[str]) -> None:
    """Run argv in this process as its program would (a script with its folder on sys.path, as python does).
    What a script sets for its own process (sys.argv, sys.path, torch's thread count) is put back."""
    old_argv, old_path, threads = sys.argv, list(sys.path), torch.get_num_threads()
    try:
        if argv[0] == "pipetrain":
            from pipetrain.cli import main

            assert main(argv[1:]) == 0
        elif argv[0] == "torchrun":
            from torch.distributed.run import main as torchrun

            torchrun(argv[1:])
        elif argv[:2] == ["python", "-m"]:
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            assert argv[0] == "python", argv
            sys.argv = argv[1:]
            sys.path.insert(0, str(Path(argv[1]).resolve().parent))
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as done:  # --help, or a script that exits
        assert done.code in (0, None), f"{argv}: exit {done.code}"
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
        torch.set_num_threads(threads)


def run_in_a_process(argv: list[str], cwd: Path) -> str:
    """Run argv as a new process (python, torchrun and pipetrain from this virtualenv); its output."""
    bin_dir = Path(sys.executable).parent
    program = str(bin_dir / argv[0]) if (bin_dir / argv[0]).exists() else argv[0]
    done = subprocess.run([program, *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def _run_params():
    for text, how in COMMANDS.items():
        if isinstance(how, Run):
            yield pytest.param(text, id=text[:80], marks=[pytest.mark.slow] if how.slow else [])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("text", list(_run_params()))
def test_documented_command_runs(text, tmp_path, monkeypatch, capfd):
    how = COMMANDS[text]
    argv = to_run(text, how, tmp_path)
    # from a directory of its own that has the repository's examples/, so files it writes land there
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    if how.process:
        out = run_in_a_process(argv, ROOT if argv[0] == "make" else tmp_path)
    else:
        monkeypatch.chdir(tmp_path)
        run_in_process(argv)
        out = "".join(capfd.readouterr())
    assert how.expect in out, f"{argv} did not print {how.expect!r}:\n{out[-3000:]}"
