"""No flag is parsed and then ignored: every flag of every example script and `pipetrain` subcommand changes what
runs, or is refused with a message.

The flags are read from the commands' own argparse parsers, so a new flag is covered at once: it fails here until
OWN (or SHARED, for the flags of every training command) says how to give it a value other than its default. Each
case runs the command twice in this process, its baseline argv with and without the flag, with the points where
flags take effect recorded (tests/_recorded_runs.py: what pipetrain.wrap receives, the mini-batches and validation
batches the loop feeds the pipeline, its saves and resumes, what simulate, plan, export and demo hand on), and the
two records must differ.
What a command prints or writes counts only for the flags whose purpose that is (``shows``): a summary line that
echoes a flag proves nothing about the run.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from _example_runs import run_example
from _recorded_runs import Outcome, run_recorded
from test_corpus import LINES, save_tokenizer
from pipetrain import cli


@dataclass(frozen=True)
class Case:
    """How to give one flag another value than its default: ``args`` appended to the command's baseline (or to
    ``baseline``, which replaces it) after ``context``, which both runs get. ``refused``: a pattern of the message
    that must refuse it there; ``shows``: its purpose is what the command prints or writes, which then counts as
    a change; ``fixed``: the flag has a single value (a script that trains one model)."""
    args: tuple[str, ...] = ()
    context: tuple[str, ...] = ()
    refused: str | None = None
    shows: bool = False
    baseline: tuple[str, ...] | None = None
    fixed: bool = False


def flag(*args: str, **kw: Any) -> Case:
    return Case(tuple(args), **{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})


@dataclass(frozen=True)
class Command:
    run: Callable[[list[str]], Any]
    parser: Callable[[], argparse.ArgumentParser]
    baseline: tuple[str, ...]


class _Parsed(Exception):
    """Raised by parse_args while a script's parser is being read: its parser, complete, without running."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def script_parser(name: str) -> argparse.ArgumentParser:
    """The parser examples/<name>.py builds, caught when it parses."""
    def caught(self: argparse.ArgumentParser, *args: Any, **kwargs: Any):
        raise _Parsed(self)

    original, argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_args, caught
    try:
        run_example(name, [])
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"examples/{name}.py did not parse a command line")


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def subcommand(name: str) -> Command:
    return Command(lambda argv: cli.main([name, *argv]), functools.partial(subcommand_parser, name), BASELINES[name])


# One epoch of 4 mini-batches of 8 on 2 stages, async-1f1b (so that the delay corrections apply).
TRAINING = ("--stages", "2", "--micro-batches", "2", "--schedule", "async-1f1b", "--partitioner", "params",
            "--train-samples", "32", "--val-samples", "8", "--batch-size", "8", "--epochs", "1")
SCRIPTS = ("vgg", "resnet", "transformer", "lstm", "huggingface")
BASELINES = {
    "compare": ("--methods", "1f1b,stash", *TRAINING[:4], *TRAINING[6:]),  # compare has no --schedule
    "demo": ("--logdir", "runs/demo"),  # the default is a new directory each time
    "simulate": (),
    "plan": ("{plan_config}", "--cluster", "gloo-local4", "--batch-size", "16", "--max-stages", "2", "--top", "2",
             "--seq-len", "32"),
    "export": ("--hf", "{checkpoint}", "out"),
}
COMMANDS = {**{f"examples/{name}.py": Command(functools.partial(run_example, name),
                                              functools.partial(script_parser, name), TRAINING) for name in SCRIPTS},
            **{f"pipetrain {name}": subcommand(name) for name in BASELINES}}
TRAINERS = [*(f"examples/{name}.py" for name in SCRIPTS), "pipetrain compare"]  # RunConfig's flags

SYNC = ["--schedule", "1f1b"]  # tensor parallelism: not with async-1f1b yet
CORPUS = ["--dataset", "{corpus}", "--tokenizer", "{tokenizer}", "--seq-len", "8"]
IMAGES = ["--dataset", "imagefolder", "--data-dir", "{images}"]
# The flags of pipetrain.apps.run_config, which every training command takes (by command where values differ).
SHARED = {
    "--model": {"examples/vgg.py": Case(fixed=True), "examples/resnet.py": flag("--model", "resnet18"),
                "examples/transformer.py": flag("--model", "transformer-lm"),
                "examples/lstm.py": flag("--model", "lstm-lm"), "examples/huggingface.py": flag("--model", "llama"),
                "pipetrain compare": flag("--model", "lstm")},
    "--dataset": {"examples/vgg.py": flag(*IMAGES), "examples/resnet.py": flag(*IMAGES),
                  "examples/transformer.py": flag("--dataset", "digits", refused="trains on sequence data"),
                  "examples/lstm.py": flag("--dataset", "digits", refused="trains on sequence data"),
                  "examples/huggingface.py": flag(*CORPUS), "pipetrain compare": flag(*IMAGES)},
    "--data-dir": {"examples/vgg.py": flag("--data-dir", "{images2}", context=IMAGES),
                   "examples/resnet.py": flag("--data-dir", "{images2}", context=IMAGES),
                   "examples/transformer.py": flag("--data-dir", "{images}", refused="drop --data-dir"),
                   "examples/lstm.py": flag("--data-dir", "{images}", refused="drop --data-dir"),
                   "pipetrain compare": flag("--data-dir", "{images2}", context=IMAGES)},
    "--download": flag("--download", refused="drop --download"),  # the offline datasets: cifar needs the network
    "--width": flag("--width", "16"),
    "--depth": {"examples/vgg.py": flag("--depth", "13"), "examples/resnet.py": flag("--depth", "8"),
                "pipetrain compare": flag("--depth", "13"), None: flag("--depth", "1")},
    "--stages": flag("--stages", "3"),
    "--micro-batches": flag("--micro-batches", "4"),
    "--schedule": flag("--schedule", "1f1b"),
    "--staleness": flag("--staleness", "stash"),
    "--lookahead": flag("--lookahead", "2"),
    "--spectrain-variant": flag("--spectrain-variant", "forward-only"),
    "--spike-compensation": flag("--spike-compensation"),
    "--dc-lambda": flag("--dc-lambda", "1.5", context=["--staleness", "stash"]),  # needs the forward's weights
    "--stage-lr-warmup": flag("--stage-lr-warmup", "5"),
    "--stage-momentum": flag("--stage-momentum"),
    "--error-feedback": flag("--error-feedback"),
    "--data-parallel": flag("--data-parallel", "2"),
    "--checkpoint-dir": flag("--checkpoint-dir", "ckpt"),
    "--resume": flag("--resume", context=["--checkpoint-dir", "ckpt"]),
    "--precision": {"examples/huggingface.py": flag("--precision", "fp32"), None: flag("--precision", "bf16")},
    "--partitioner": flag("--partitioner", "uniform"),
    "--epochs": flag("--epochs", "2"),
    "--batch-size": flag("--batch-size", "16"),
    "--optimizer": flag("--optimizer", "adam"),
    "--lr": flag("--lr", "0.01"),
    # huggingface.py decays on a cosine by default: none is the other schedule there (warmup-poly's 10 updates of
    # warm-up would outlast its 4).
    "--lr-schedule": {"examples/huggingface.py": flag("--lr-schedule", "none"),
                      None: flag("--lr-schedule", "warmup-poly")},
    "--warmup": {"examples/huggingface.py": flag("--warmup", "3"),
                 None: flag("--warmup", "2", context=["--lr-schedule", "warmup-poly"])},
    "--poly-power": flag("--poly-power", "1", context=["--lr-schedule", "warmup-poly", "--warmup", "2"]),
    "--seed": flag("--seed", "1"),
    "--train-samples": flag("--train-samples", "24"),
    "--val-samples": flag("--val-samples", "4"),
    "--logdir": flag("--logdir", "runs/other"),
    "--no-progress": flag("--no-progress", shows=True),
}
# Each command's own flags.
OWN = {
    **{f"examples/{name}.py": {
        "--steps": flag("--steps", "2"),
        "--log-every": flag("--log-every", "1", shows=True),
        "--save-every": flag("--save-every", "2", context=["--schedule", "1f1b", "--checkpoint-dir", "ckpt"]),
    } for name in ("vgg", "resnet", "transformer", "lstm")},
    "examples/huggingface.py": {
        "--tokenizer": flag("--tokenizer", "{tokenizer2}", context=CORPUS),
        "--seq-len": flag("--seq-len", "6", context=CORPUS),
        "--save-pretrained": flag("--save-pretrained", "out"),
        "--weights": flag("--weights", "{weights}"),
        "--lora": flag("--lora", "2"),
        "--max-grad-norm": flag("--max-grad-norm", "0.5"),
        "--tensor-parallel": flag("--tensor-parallel", "2", context=SYNC),
        "--sequence-parallel": flag("--sequence-parallel",
                                    context=[*SYNC, "--model", "llama", "--tensor-parallel", "2"]),
        "--zero": flag("--zero", "1", context=["--data-parallel", "2"]),
    },
    "pipetrain compare": {
        "--methods": flag("--methods", "1f1b,nesterov"),
        "--lr-grid": flag("--lr-grid", "0.01,0.02"),
        "--seeds": flag("--seeds", "2"),
        "--async-micro-batches": flag("--async-micro-batches", "1"),
        "--png": flag("--png", "curves.png"),
        "--target-gap": flag("--target-gap", "5", shows=True),
        "--baseline": flag("--baseline", "data-parallel", context=["--methods", "data-parallel,1f1b,stash"],
                           shows=True),
    },
    "pipetrain demo": {
        "--logdir": flag("--logdir", "runs/other"),
        "--models": flag("--models", "vgg"),
        "--jobs": flag("--jobs", "1"),
        "--epochs": flag("--epochs", "1"),
        "--train-samples": flag("--train-samples", "32"),
        "--optimizer": flag("--optimizer", "lars"),
        "--no-progress": flag("--no-progress", context=["--jobs", "1"]),  # the parallel workers show no progress
    },
    "pipetrain simulate": {
        "--schedule": flag("--schedule", "gpipe"),
        "--stages": flag("--stages", "2"),
        "--micro-batches": flag("--micro-batches", "4"),
        "--chunks": flag("--chunks", "4", context=["--schedule", "interleaved-1f1b"]),
        "--mini-batches": flag("--mini-batches", "3", context=["--schedule", "async-1f1b"]),
        "--forward": flag("--forward", "2"),
        "--backward": flag("--backward", "2"),
        "--weight": flag("--weight", "2"),
        "--comm": flag("--comm", "0.5"),
        "--trace": flag("--trace", "trace.json", shows=True),
        "--png": flag("--png", "timeline.png", shows=True),
    },
    "pipetrain plan": {
        "--cluster": flag("--cluster", "nvlink8-100g"),
        "--batch-size": flag("--batch-size", "32"),
        "--nodes": flag("--nodes", "2"),
        "--bucket-mb": flag("--bucket-mb", "1"),
        "--allreduce": flag("--allreduce", "flat"),
        "--no-overlap": flag("--no-overlap"),
        "--max-stages": flag("--max-stages", "1"),
        "--zero": flag("--zero", "1"),
        "--recompute": flag("--recompute", "none"),
        "--tensor-parallel": flag("--tensor-parallel", "2"),
        "--sequence-parallel": flag("--sequence-parallel", context=["--tensor-parallel", "2"]),
        "--optimizer": flag("--optimizer", "sgd"),
        "--profile": flag("--profile", refused="meta device"),  # a config builds no values to time
        "--seq-len": flag("--seq-len", "16"),
        "--dtype": flag("--dtype", "bf16"),
        "--top": flag("--top", "1", shows=True),
    },
    "pipetrain export": {
        "--hf": flag(refused="required: --hf", baseline=["{checkpoint}", "out"]),  # the one format, and required
        "--max-shard-size": flag("--max-shard-size", "100"),
    },
}


def setting(command: str, name: str) -> Case | None:
    """The case for ``name`` of ``command``: its own (OWN), else the shared one (SHARED: by command, else for all)."""
    if name in OWN.get(command, {}):
        return OWN[command][name]
    shared = SHARED.get(name) if command in TRAINERS else None
    if isinstance(shared, dict):
        return shared.get(command, shared.get(None))
    return shared


@functools.cache
def flags_of(command: str) -> dict[str, argparse.Action]:
    """The command's flags by their long name (positional arguments are not flags)."""
    actions = [a for a in COMMANDS[command].parser()._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction)]
    return {next(o for o in a.option_strings if o.startswith("--")): a for a in actions}


ALL_FLAGS = [(command, name) for command in COMMANDS for name in flags_of(command)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """What the flags point at, made offline: two image folders, two tokenizers, a text corpus, a Hugging Face
    model directory, a model config to plan and a pipetrain checkpoint to export."""
    import transformers
    from PIL import Image

    root = tmp_path_factory.mktemp("flag-files")
    made = {}
    for name, seed in (("images", 0), ("images2", 1)):
        generator = torch.Generator().manual_seed(seed)
        for split, count in (("train", 16), ("val", 4)):
            for label in ("a", "b"):
                (root / name / split / label).mkdir(parents=True)
                for i in range(count):
                    pixels = torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8)
                    Image.fromarray(pixels.numpy()).save(root / name / split / label / f"{i}.png")
        made[name] = root / name
    made["tokenizer"], made["tokenizer2"] = root / "tokenizer", root / "tokenizer2"
    save_tokenizer(made["tokenizer"], LINES)
    save_tokenizer(made["tokenizer2"], [line.replace("cat", "bird") for line in LINES])  # other words, other ids
    made["corpus"] = root / "corpus.txt"
    made["corpus"].write_text("\n".join(LINES))
    made["weights"] = root / "gpt2"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=16, n_layer=1,
                                                         n_head=1)).save_pretrained(made["weights"])
    made["plan_config"] = root / "llama.json"
    made["plan_config"].write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}))
    made["checkpoint"] = root / "checkpoint"
    import pipetrain  # the real wrap: the recording is not on yet

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    pipe = pipetrain.wrap(model, torch.randn(2, 4), stages=2, micro_batches=1, partitioner="uniform", engine="local")
    pipe.save(made["checkpoint"])
    pipe.close()
    return {k: str(v) for k, v in made.items()}


class Runs:
    """Outcomes of command lines, each run once (the baselines serve many flags), each in a fresh directory."""

    def __init__(self, root: Path, files: dict[str, str]):
        self.root, self.files, self.done, self.started = root, files, {}, 0

    def outcome(self, command: str, argv: tuple[str, ...]) -> Outcome:
        argv = tuple(a.format(**self.files) for a in argv)
        if (command, argv) not in self.done:
            self.started += 1
            cwd = self.root / f"run{self.started}"
            cwd.mkdir()
            self.done[command, argv] = run_recorded(COMMANDS[command].run, list(argv), cwd)
        return self.done[command, argv]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, files) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"), files)


@pytest.mark.parametrize("command, name", ALL_FLAGS, ids=[f"{c} {n}" for c, n in ALL_FLAGS])
def test_every_flag_changes_what_runs_or_is_refused(command, name, runs):
    case = setting(command, name)
    if case is None:
        pytest.fail(f"{command} {name} is in neither OWN nor SHARED of tests/test_flags.py: say how to give it another "
                    "value than its default and what it must change (every flag must change what runs, or be refused)")
    if case.fixed:
        action = flags_of(command)[name]
        assert action.choices is not None and list(action.choices) == [action.default], "more than one value"
        return
    baseline = (*(COMMANDS[command].baseline if case.baseline is None else case.baseline), *case.context)
    given = runs.outcome(command, (*baseline, *case.args))
    if case.refused:
        assert given.refused is not None and re.search(case.refused, given.refused), (
            f"{name} should be refused with {case.refused!r}; got {given.refused or 'no refusal'}")
        return
    assert given.refused is None, f"{command} {' '.join(case.args)} was refused: {given.refused}"
    without = runs.outcome(command, baseline)
    assert without.refused is None, f"the baseline of {command} was refused: {without.refused}"
    if case.shows:
        assert given.shown != without.shown or given.ran != without.ran, f"{name} changed nothing {command} printed"
    else:
        assert given.ran != without.ran, (f"{command} {' '.join(case.args)} changed nothing that runs: the same "
                                          "options reached pipetrain.wrap, the same data and loop followed")


def test_settings_name_only_flags_that_exist():
    for name, by_command in SHARED.items():
        assert any(name in flags_of(command) for command in TRAINERS), name
        assert set(by_command if isinstance(by_command, dict) else {}) - {None} <= set(TRAINERS), name
    for command, own in OWN.items():
        assert set(own) <= set(flags_of(command)), (command, set(own) - set(flags_of(command)))


@pytest.mark.parametrize("command", COMMANDS)
def test_the_same_command_line_records_the_same_outcome(command, runs, tmp_path, files):
    # Without this, a record that differs between two runs of one command line would let every flag pass.
    argv = [a.format(**files) for a in COMMANDS[command].baseline]
    once = runs.outcome(command, tuple(argv))
    again = run_recorded(COMMANDS[command].run, argv, tmp_path)
    assert once.refused is None and (again.ran, again.shown) == (once.ran, once.shown)


def test_compare_staleness_takes_the_flags_of_pipetrain_compare():
    # examples/compare_staleness.py is `pipetrain compare` (add_arguments_compare): its flags are covered above.
    script, command = script_parser("compare_staleness"), subcommand_parser("compare")
    assert [a.option_strings for a in script._actions] == [a.option_strings for a in command._actions]
