"""One virtual stage at run time: its module, optimizer, staleness policy and in-flight micro-batches."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipetrain.runtime import split_backward
from pipetrain.runtime.graph_backward import GraphBackward, GraphFlight
from pipetrain.runtime.graph_split import GraphSplit
from pipetrain.runtime.live_casts import LiveCasts
from pipetrain.runtime.local_shards import gathered_bytes, is_fully_sharded, live_parameters, local
from pipetrain.runtime.loss_checks import compute_loss
from pipetrain.runtime.tensor_bytes import SavedBytes, grad_bytes, resident_bytes, storage_bytes
from pipetrain.runtime.metrics import StageReport
from pipetrain.runtime.staleness import StalenessPolicy
from pipetrain.runtime.weight_swap import WeightSwap


@dataclass
class Replay:
    """What re-running a forward needs: its inputs, target and loss weight, and its RNG seed."""

    inputs: tuple
    target: Any
    weight: float
    seed: int


@dataclass
class InFlight:
    """What a forward leaves for its backward."""

    outputs: list[torch.Tensor]          # floating outputs, in send order (the scaled loss on the last stage)
    input_leaves: list[list[torch.Tensor]]  # per input: leaves for its floating tensors (they take gradients)
    update: int                          # optimizer updates the stage had taken at forward time
    activation_bytes: int                # bytes held for it until its backward (boundary inputs when replayed)
    replay: Replay | None = None         # set when the backward recomputes the forward first
    graph: GraphFlight | None = None     # set when the forward ran the stage's derived graphs (no autograd)


def tensor_leaves(values: Any) -> list[torch.Tensor]:
    if isinstance(values, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in values):
        return list(values)  # the usual boundary, a flat sequence of tensors: no pytree walk on every action
    return [v for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor)]


def takes_grad(t: Any) -> bool:
    """Boundary tensors that carry a gradient back: floating point ones."""
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _seed(device: torch.device, seed: int) -> None:
    """Seed the CPU generator and ``device``'s only: torch.manual_seed also queues lazy seeding of every
    accelerator backend not yet initialised (CUDA, XPU, MTIA), formatting a stack trace for each, a cost
    that would be paid on every forward."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()].manual_seed(seed)


@dataclass
class StageRuntime:
    """Runs the forwards and backwards of one virtual stage."""

    index: int
    num_stages: int
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    policy: StalenessPolicy
    device: torch.device
    loss_fn: Callable | None = None
    autocast_dtype: torch.dtype | None = None
    seed: int = 0
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    # Learning-rate schedulers stepped after each applied update: the stage optimizer's, and the one of the
    # optimizer a predicting policy reads its learning rate from when that is another (ZeRO).
    schedulers: list = field(default_factory=list)
    # Split schedules with compile: the stage runs derived forward, B and W graphs (None: autograd).
    graph_backward: GraphBackward | None = None

    def __post_init__(self):
        # Bytes autograd saves per forward, by input shapes: counting them takes a Python hook per
        # saved tensor, so each shape is counted once.
        self.saved_bytes: dict[tuple, int] = {}
        self.peak_in_flight = 0
        self.peak_activation_bytes = 0
        self.peak_working_bytes = 0  # activations held plus gradients present, at their peak
        self.version_lags: dict[int, int] = {}  # micro-batch -> optimizer steps between its forward and backward
        # Zero-bubble: micro-batch -> (its W, activation bytes held until then).
        self.weight_pending: dict[int, tuple[Callable[[], None], int]] = {}
        self._held_bytes = 0  # activation bytes of in_flight and weight_pending, kept as they change
        self.is_last = self.index == self.num_stages - 1
        self._split_ok: bool | None = None  # whether this stage's graph splits into B and W (checked once)
        self.params = list(self.module.parameters())  # walked on every action and step: listed once
        # zero=3: the parameters above are the shards the optimizer steps; autograd sees all-gathered ones.
        self.fully_sharded = is_fully_sharded(self.module)
        self._buffers_before: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, its value) at step start
        self._resident: tuple[tuple[int, int], int] | None = None  # (what it was counted for, resident bytes)
        self._swap: WeightSwap | None = None  # runs the module on a staleness policy's weight set

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _seed_of(self, micro_batch: int) -> int:
        """Dropout & co. are seeded per (update, stage, micro-batch) so every engine draws the same numbers."""
        return hash((self.seed, self.policy.updates, self.index, micro_batch)) % (2 ** 63)

    def forward(self, micro_batch: int, inputs: tuple, target: Any = None, weight: float = 1.0,
                grad: bool = True, recompute: bool = False) -> Any:
        """Forward ``micro_batch``; returns the outputs to send (or the loss on the last stage).
        With ``recompute`` it keeps only the inputs and runs the forward again before the backward."""
        weights = self.policy.forward_weights(micro_batch) if grad else None
        seed = self._seed_of(micro_batch)
        if grad and self.graph_backward is not None and self.graph_backward.fallback is None:
            if weights is not None:
                self.graph_backward.fall_back(f"staleness={self.policy.name!r} swaps weight versions in")
            else:
                split = self.graph_backward.split_for(inputs, target, self.loss_fn if self.is_last else None,
                                                      self.index > 0, self._autocast())
                if split is not None:
                    return self._graph_forward(micro_batch, split, inputs, target, weight, seed, recompute)
        if grad and recompute:
            self.policy.keep_for_recompute(micro_batch)
            with torch.no_grad():
                out, loss = self._run(inputs, weights, target, seed, with_loss=True)
            held = storage_bytes(tensor_leaves(inputs))
            replay = Replay(tuple(inputs), target, weight, seed)
            self._hold(micro_batch, InFlight([], [], self.policy.updates, held, replay))
        else:
            with torch.set_grad_enabled(grad):
                out, loss, to_differentiate, leaves, counted = self._traced(inputs, weights, target, weight, seed)
            if not grad:
                return out
            self._hold(micro_batch, InFlight(to_differentiate, leaves, self.policy.updates, counted))
        return loss.detach() if self.is_last else out

    def _graph_forward(self, micro_batch: int, split: GraphSplit, inputs: tuple, target: Any, weight: float, seed: int,
                       recompute: bool) -> Any:
        """The forward through the stage's derived forward graph; keeps its saved values (or, with
        ``recompute``, only its inputs) for B."""
        graphs = self.graph_backward
        outputs, saved = graphs.forward(split, inputs, target)
        if recompute:
            self.policy.keep_for_recompute(micro_batch)
            replay = Replay(tuple(inputs), target, weight, seed)
            flight = GraphFlight(split, tuple(inputs), weight, None, None)
            self._hold(micro_batch, InFlight([], [], self.policy.updates, storage_bytes(tensor_leaves(inputs)),
                                             replay, flight))
        else:
            held = graphs.held_bytes(saved + (list(inputs) if self.index > 0 else []))
            flight = GraphFlight(split, tuple(inputs), weight, saved, outputs)
            self._hold(micro_batch, InFlight([], [], self.policy.updates, held, None, flight))
        return pytree.tree_unflatten(outputs, split.out_spec)

    def _hold(self, micro_batch: int, flight: InFlight) -> None:
        self.in_flight[micro_batch] = flight
        self._held_bytes += flight.activation_bytes
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
        self._note_peak(self.activation_bytes())

    def _note_peak(self, activations: int) -> None:
        self.peak_activation_bytes = max(self.peak_activation_bytes, activations)
        self.peak_working_bytes = max(self.peak_working_bytes, activations + self._gradient_bytes())

    def _traced(self, inputs: tuple, weights: dict | None, target: Any, weight: float, seed: int):
        """The forward with autograd recording: outputs, loss, what to differentiate, the input leaves
        and the bytes autograd saved (counted once per input shapes)."""
        leaves: list[list[torch.Tensor]] = []
        args = []
        for value in inputs:
            if torch.is_grad_enabled() and self.index > 0:
                value, value_leaves = self._as_leaves(value)
                leaves.append(value_leaves)
            else:
                leaves.append([])
            args.append(value)
        if not torch.is_grad_enabled():  # prediction: nothing is saved, nothing to count
            out, loss = self._run(tuple(args), weights, target, seed, with_loss=False)
            return out, loss, [], leaves, 0
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensor_leaves(args))
        counted = self.saved_bytes.get(shapes)
        # Autocast's copies of weights a policy rewrites before the backward: cast again when it reads them.
        casts = (LiveCasts(list(weights.values())) if weights is not None and self.autocast_dtype is not None
                 and not self.policy.keeps_forward_weights else None)
        counter: Any = casts.hooks() if casts is not None else contextlib.nullcontext()
        if counted is None:
            if self.fully_sharded:
                live_parameters(self.module)  # gathered: the weights autograd saves are these
            param_ptrs = {local(p).untyped_storage().data_ptr() for p in self.module.parameters()}
            if weights is not None:
                param_ptrs |= {w.untyped_storage().data_ptr() for w in weights.values()}
            counter = SavedBytes(param_ptrs, [leaf for ls in leaves for leaf in ls], casts)
        with counter:
            out, loss = self._run(tuple(args), weights, target, seed, with_loss=True)
        if counted is None:
            counted = self.saved_bytes[shapes] = counter.total
        to_differentiate = [loss * weight] if self.is_last else [t for t in tensor_leaves(out) if takes_grad(t)]
        return out, loss, to_differentiate, leaves, counted

    def _run(self, args: tuple, weights: dict | None, target: Any, seed: int, with_loss: bool) -> tuple[Any, Any]:
        """The stage's forward under ``seed`` (and the loss on the last stage ``with_loss``)."""
        loss = None
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self._autocast():
            _seed(self.device, seed)
            if weights is None:
                out = self.module(*args)
            else:
                if self._swap is None or self._swap.module is not self.module:
                    self._swap = WeightSwap(self.module)
                out = self._swap(weights, tuple(args))
            if self.is_last and with_loss:  # target None: the model computes its own loss (model_loss)
                loss = compute_loss(self.loss_fn, out, target)
        return out, loss

    def _replay(self, micro_batch: int, saved: InFlight) -> InFlight:
        """Run the forward of ``micro_batch`` again, on the weights and RNG seed its forward used; the
        buffers it updates (batch-norm running statistics) keep the values of the first forward."""
        replay = saved.replay
        weights = self.policy.recompute_weights(micro_batch)
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        _, _, to_differentiate, leaves, counted = self._traced(replay.inputs, weights, replay.target,
                                                               replay.weight, replay.seed)
        for b, before in buffers:
            # Copied back unconditionally: comparing first would read the device on the host per buffer.
            # Through .data: batch norm saves its running statistics for the backward (unread in
            # training mode), so a visible in-place write would fail that backward's version check.
            b.data.copy_(before)
        # The recomputed activations join the boundary inputs held for the other micro-batches.
        self._note_peak(self.activation_bytes() + counted)
        return InFlight(to_differentiate, leaves, saved.update, counted)

    @staticmethod
    def _as_leaves(value: Any) -> tuple[Any, list[torch.Tensor]]:
        """Make every floating tensor in a received value an autograd leaf so its gradient can be
        sent back (stage modules clone the inputs they modify in place, so leaves stay untouched)."""
        if isinstance(value, torch.Tensor):  # the usual case, without a tree walk
            if not takes_grad(value):
                return value, []
            t = value.detach().requires_grad_()
            return t, [t]
        created: list[torch.Tensor] = []

        def leaf(v):
            if not takes_grad(v):
                return v
            t = v.detach().requires_grad_()
            created.append(t)
            return t

        return pytree.tree_map(leaf, value), created

    def backward(self, micro_batch: int, output_grads: list[torch.Tensor] | None,
                 loss_scale: float = 1.0, split: bool = False, last: bool = True) -> list[list[torch.Tensor]]:
        """Backward ``micro_batch`` given the gradients of its floating outputs (in output order);
        returns, per input, the gradients of its floating tensors (zeros where unused). With
        ``split`` (zero-bubble B) the weight gradients wait for ``backward_weight``. ``last``: the
        mini-batch's last backward on this stage (its gradients must then be complete in ``.grad``)."""
        saved = self.in_flight.pop(micro_batch)
        self._held_bytes -= saved.activation_bytes
        if saved.graph is not None:
            return self._graph_backward(micro_batch, saved, output_grads, loss_scale, split, last)
        if saved.replay is not None:
            saved = self._replay(micro_batch, saved)
        self.policy.before_backward(micro_batch)
        self.version_lags[micro_batch] = self.policy.updates - saved.update
        if self.is_last:
            tensors = [saved.outputs[0] * loss_scale] if loss_scale != 1.0 else saved.outputs
            grads = None
        else:
            pairs = [(t, g) for t, g in zip(saved.outputs, output_grads) if t.requires_grad and g is not None]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        inputs = [leaf for leaves in saved.input_leaves for leaf in leaves]
        if tensors and split and self._splits(tensors, inputs):
            groups = split_backward.backward_input(tensors, grads, inputs, self._weights())
            self.weight_pending[micro_batch] = (lambda: split_backward.backward_weight(self._weights(), groups),
                                                saved.activation_bytes)
            self._held_bytes += saved.activation_bytes
        elif tensors:
            torch.autograd.backward(tensors, grads)
            self._note_peak(self.activation_bytes() + saved.activation_bytes)
        self.policy.after_backward(micro_batch, last)
        return [[l.grad if l.grad is not None else torch.zeros_like(l) for l in ls] for ls in saved.input_leaves]

    def _graph_backward(self, micro_batch: int, saved: InFlight, output_grads: list[torch.Tensor] | None,
                        loss_scale: float, split: bool, last: bool) -> list[list[torch.Tensor]]:
        """``backward`` through the derived B graph (after the forward graph again where it recomputes);
        W runs now, or at ``backward_weight`` with ``split``, holding only what W reads meanwhile."""
        flight, graphs = saved.graph, self.graph_backward
        outputs, values = flight.outputs, flight.saved
        if saved.replay is not None:
            outputs, values = graphs.forward(flight.split, saved.replay.inputs, saved.replay.target)
            self._note_peak(self.activation_bytes() + graphs.held_bytes(values))
        self.policy.before_backward(micro_batch)
        self.version_lags[micro_batch] = self.policy.updates - saved.update
        if self.is_last:  # the scaled, weighted loss's gradient, as autograd would start it
            tangents = [torch.full_like(outputs[0], flight.weight * loss_scale)]
        else:
            floating = [i for i, t in enumerate(outputs) if t.is_floating_point()]
            received = dict(zip(floating, output_grads or []))
            tangents = [received[i] if received.get(i) is not None else torch.zeros_like(outputs[i])
                        for i in flight.split.tangent_outputs]
        input_grads, for_w = graphs.input_grads(flight.split, values, tangents)
        del values, outputs
        if for_w:
            held = graphs.held_bytes(for_w)
            run_w = lambda: graphs.weight_grads(flight.split, for_w)  # noqa: E731 - one closure per micro-batch
            if split:
                self.weight_pending[micro_batch] = (run_w, held)
                self._held_bytes += held
                self._note_peak(self.activation_bytes())
            else:
                self._note_peak(self.activation_bytes() + held)
                run_w()
        self.policy.after_backward(micro_batch, last)
        grads = iter(input_grads)
        result = []
        for value in flight.inputs:
            if self.index > 0 and takes_grad(value):
                g = next(grads)
                result.append([g if g is not None else torch.zeros_like(value)])
            else:
                result.append([])
        return result

    def backward_weight(self, micro_batch: int) -> None:
        """Zero-bubble W of ``micro_batch``: its weight gradients (nothing if its B ran whole)."""
        pending = self.weight_pending.get(micro_batch)
        if pending is not None:
            pending[0]()
            self._note_peak(self.activation_bytes())
            del self.weight_pending[micro_batch]
            self._held_bytes -= pending[1]

    def begin_step(self) -> None:
        """Remember the buffers a forward may update (batch-norm statistics), so that a step that raises
        can put them back (``abandon``). Buffers are small beside the parameters; copying them once per
        step costs little."""
        self._buffers_before = [(b, b.detach().clone()) for b in self.module.buffers()]

    def end_step(self) -> None:
        self._buffers_before = []

    def abandon(self) -> None:
        """A step or stream raised: forget every micro-batch in flight (activations, pending weight
        gradients, the policy's versions), drop the gradients accumulated so far and put back the
        buffers of ``begin_step``: the stage is as it was before the step."""
        self.in_flight.clear()
        self.weight_pending.clear()
        self._held_bytes = 0
        self.version_lags.clear()
        self.module.zero_grad(set_to_none=True)
        self.policy.abandon()
        with torch.no_grad():
            for b, before in self._buffers_before:
                b.copy_(before)
        self._buffers_before = []

    @property
    def split_fallback(self) -> str | None:
        """Why this stage's split backward runs eager, not as compiled graphs (None when it does not fall
        back, or when no graph split was asked: a schedule without B/W, or compile=False)."""
        return None if self.graph_backward is None else self.graph_backward.fallback

    def _weights(self) -> list[nn.Parameter]:
        if self.fully_sharded:  # the all-gathered parameters, gathered again where they were freed
            return live_parameters(self.module)
        return [p for p in self.params if p.requires_grad]  # per B and W: not a walk of every submodule

    def _gradient_bytes(self) -> int:
        """Bytes of the gradients present, and under zero=3 of the parameters gathered for the step."""
        return grad_bytes(self.params) + (gathered_bytes(self.module) if self.fully_sharded else 0)

    def _splits(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
        # The graph has the same shape for every micro-batch, so one check serves them all.
        if self._split_ok is None:
            self._split_ok = split_backward.split_is_complete(outputs, inputs, self._weights())
        return self._split_ok

    def activation_bytes(self) -> int:
        """Bytes held for the micro-batches in flight (until their backward, or their W when split)."""
        return self._held_bytes

    def report(self, micro_batches: range) -> StageReport:
        """This stage's numbers for the mini-batch of ``micro_batches``; its peaks start a new period."""
        lags = [self.version_lags.pop(g) for g in micro_batches if g in self.version_lags]
        distance, error = self.policy.take_diagnostics(micro_batches)
        report = StageReport(sum(lags) / len(lags) if lags else 0.0, self.policy.extra_weight_bytes(),
                             self.peak_activation_bytes, distance, error, self._take_peak_memory())
        self.peak_activation_bytes = self.activation_bytes()
        return report

    def _take_peak_memory(self) -> int:
        """Measured peak bytes since the last call: the allocator's on CUDA, else the stage's tensors (see
        pipetrain.runtime.tensor_bytes); starts the next period."""
        working = self.peak_working_bytes
        self.peak_working_bytes = self.activation_bytes() + self._gradient_bytes()
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._resident_bytes() + working

    def _resident_bytes(self) -> int:
        """``resident_bytes``, counted again only when the optimizer created state or the policy holds another
        number of weight copies: shapes never change, and walking every state tensor each step costs."""
        key = (len(self.optimizer.state) if self.optimizer is not None else 0, self.policy.extra_weight_bytes())
        if self._resident is None or self._resident[0] != key:
            self._resident = (key, resident_bytes(self.params, self.optimizer, key[1]))
        return self._resident[1]
