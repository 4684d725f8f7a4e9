"""Run a command in this process with the points where its flags take effect recorded, as one comparable outcome.

What a command runs is recorded at the boundaries its flags must reach: what ``pipetrain.wrap`` receives (options,
model, example inputs; it returns a RecordedPipeline instead of training), what the training loop then does with
the pipeline (every mini-batch and validation batch it feeds, every save, resume and save_pretrained), which
comparisons `pipetrain demo` starts, what `pipetrain simulate` builds and simulates, what `pipetrain plan`
searches and what `pipetrain export` writes. What it prints and the files it writes are the outcome's other part.
The recorded pipeline computes nothing but the unsplit model's forward for predict (the loops validate with it),
so a run takes milliseconds.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import re
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

import pipetrain


@dataclass
class Outcome:
    """``ran``: the recorded events; ``shown``: what was printed (times masked) and the files written (their
    paths, TensorBoard's host- and time-stamped names masked); ``refused``: the message a refusal gave."""
    ran: list = field(default_factory=list)
    shown: tuple = ()
    refused: str | None = None


def digest(value: Any) -> Any:
    """A comparable, printable stand-in for ``value``: tensors by shape, dtype and a hash of their bits (meta
    tensors by shape), modules by their parameters and buffers, containers element by element."""
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            return ("meta", tuple(value.shape), str(value.dtype))
        bits = value.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
        return tuple(value.shape), str(value.dtype), hashlib.sha1(bits).hexdigest()[:12]
    if isinstance(value, torch.nn.Module):
        return (type(value).__name__, [(name, t.requires_grad if isinstance(t, torch.nn.Parameter) else None, digest(t))
                                       for name, t in [*value.named_parameters(), *value.named_buffers()]])
    if isinstance(value, dict):
        return {k: digest(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [digest(v) for v in value]
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))  # an object without a repr of its own: its class


def option_digest(name: str, value: Any) -> Any:
    """A wrap option as what it does: the optimizer a factory makes (class and settings), the learning rates a
    scheduler factory gives over 40 updates, a function by name."""
    if name == "optimizer" and callable(value):
        made = value([torch.nn.Parameter(torch.zeros(2))])
        return type(made).__name__, repr(sorted(made.defaults.items()))
    if name == "lr_scheduler" and callable(value):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        scheduler, rates = value(optimizer), []
        for _ in range(40):
            rates.append(round(optimizer.param_groups[0]["lr"], 9))
            optimizer.step()
            scheduler.step()
        return rates
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return digest(value)


class RecordedPipeline:
    """What pipetrain.wrap returns while recording: a Pipeline's surface that the loops use, which records each
    call in ``events``. Losses are made up (a function of the step); predict runs the unsplit model (a model on
    the meta device with zeros for its weights)."""

    def __init__(self, model: torch.nn.Module, options: pipetrain.PipelineOptions, events: list):
        self.model, self.options, self.events = model, options, events
        self.world, self.updates, self.last_result, self._callbacks = None, 0, None, []
        self.held_stages: dict = {}  # no stage runs, so no optimizer steps to time

    def on_step(self, callback: Callable[[pipetrain.StepResult], None]) -> None:
        self._callbacks.append(callback)

    def request_stop(self) -> None:
        self.events.append(("request_stop",))

    def step(self, *batch: Any) -> float:
        return self._trained(batch).loss

    def train(self, batches: Iterable[Any]) -> Iterator[pipetrain.StepResult]:
        for batch in batches:
            yield self._trained(batch)

    def predict(self, x: Any) -> Any:
        self.events.append(("predict", digest(x)))
        if any(p.is_meta for p in self.model.parameters()):  # built from a config: zeros stand in for its weights
            self.model.to_empty(device="cpu")
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                tensor.detach().zero_()
        self.model.eval()
        with torch.no_grad():
            return self.model(**x) if isinstance(x, dict) else self.model(x)

    def save(self, path: str | os.PathLike) -> None:
        self.events.append(("save", str(path), self.updates))
        (Path(path) / f"step-{self.updates}").mkdir(parents=True, exist_ok=True)
        (Path(path) / "latest").write_text(f"step-{self.updates}")

    def resume(self, path: str | os.PathLike) -> bool:
        latest = Path(path) / "latest"
        self.events.append(("resume", str(path), latest.is_file()))
        if latest.is_file():
            self.updates = int(latest.read_text().removeprefix("step-"))
        return latest.is_file()

    def save_pretrained(self, path: str | os.PathLike, **options: Any) -> None:
        self.events.append(("save_pretrained", str(path), digest(options)))
        Path(path).mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        self.events.append(("close",))

    def _trained(self, batch: Any) -> pipetrain.StepResult:
        self.events.append(("train", digest(batch)))
        self.updates += 1
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch  # (x, y), or a collator's dict
        first = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs
        stages = self.options.stages
        result = pipetrain.StepResult(self.updates, 1.0 / self.updates, len(first), 0.01, busy_fraction=[0.5] * stages,
                                      version_lag=[0.0] * stages, weight_version_bytes=[0] * stages,
                                      activation_bytes=[0] * stages, prediction_distance=[0.0] * stages,
                                      prediction_error=[float("nan")] * stages, peak_memory=[0] * stages,
                                      comm_bytes={"activations": [64] * stages})
        self.last_result = result
        for callback in self._callbacks:
            callback(result)
        return result


class InlinePool:
    """A ProcessPoolExecutor stand-in that runs each task at once in this process, where the recording is."""

    def __init__(self, events: list, max_workers: int, **_: Any):
        events.append(("pool", max_workers))

    def __enter__(self) -> InlinePool:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def submit(self, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        future.set_result(fn(*args))
        return future


@contextlib.contextmanager
def recording(events: list) -> Iterator[None]:
    """Replace the recorded entry points (see the module docstring) for the duration of the block."""
    import partitioners
    import schedules
    from partitioners.planners import layout
    from pipetrain import checkpoint
    from pipetrain.apps import compare, demo

    def wrap(model: torch.nn.Module, example_inputs: Any, **options: Any) -> RecordedPipeline:
        validated = pipetrain.PipelineOptions(**options)  # the errors wrap would raise
        events.append(("wrap", digest(model), digest(example_inputs),
                       {k: option_digest(k, v) for k, v in sorted(options.items())}))
        return RecordedPipeline(model, validated, events)

    def plot(summaries: dict, predicted: dict, cluster: Any, path: str | os.PathLike, dpi: int = 100) -> Path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).touch()  # the picture itself is matplotlib's work; which runs it shows is recorded
        events.append(("plot", list(summaries), str(path)))
        return Path(path)

    def run_compare(args: argparse.Namespace) -> tuple[dict, Path]:
        events.append(("compare", digest(vars(args))))
        return {}, Path(args.logdir) / "compare.png"

    def recorded(name: str, function: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            events.append((name, digest(args), digest(kwargs)))
            return function(*args, **kwargs)
        return call

    def trace(model: torch.nn.Module, x: torch.Tensor, profile: bool, **kwargs: Any) -> Any:
        # `pipetrain plan` captures the same model again for most flags: once per model, shapes and dtype
        key = (type(model).__name__, sum(p.numel() for p in model.parameters()), str(next(model.parameters()).dtype),
               tuple(x.shape), profile, repr(digest(kwargs)))
        events.append(("trace", key))
        if key not in _TRACES:
            _TRACES[key] = original_trace(model, x, profile=profile, **kwargs)
        return _TRACES[key]

    original_trace = partitioners.trace_for_training
    replaced = [(pipetrain, "wrap", wrap), (compare, "plot", plot), (demo, "run_compare", run_compare),
                (demo, "ProcessPoolExecutor", lambda **kw: InlinePool(events, **kw)),
                (demo, "as_completed", lambda futures: iter(list(futures))),  # done at once: in the order submitted
                (schedules, "build", recorded("build", schedules.build)),
                (schedules, "simulate", recorded("simulate", schedules.simulate)),
                (layout, "search_layouts", recorded("search_layouts", layout.search_layouts)),
                (checkpoint, "export_pretrained", recorded("export", checkpoint.export_pretrained)),
                (partitioners, "trace_for_training", trace)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
    threads = torch.get_num_threads()
    try:
        for owner, name, value in replaced:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        torch.set_num_threads(threads)  # the demo's compare sets one thread


_TRACES: dict = {}
TIMES = re.compile(r"\d[\d,.]*( s\b| samples/s)")


def run_recorded(run: Callable[[list[str]], Any], argv: list[str], cwd: Path) -> Outcome:
    """Run ``run(argv)`` in the empty directory ``cwd`` with its entry points recorded."""
    events: list = []
    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    os.chdir(cwd)
    try:
        with recording(events), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run(argv)
    except SystemExit as exit:
        if exit.code not in (0, None):  # argparse prints its message, a script's SystemExit carries it
            return Outcome(events, refused=err.getvalue().strip() if isinstance(exit.code, int) else str(exit.code))
    finally:
        os.chdir(here)
    files = sorted(re.sub(r"tfevents\.[^/]*?(\.val)?$", r"tfevents\1", str(p.relative_to(cwd)))
                   for p in cwd.rglob("*") if p.is_file())
    return Outcome(events, (TIMES.sub(r"<n>\1", out.getvalue()), tuple(files)))
