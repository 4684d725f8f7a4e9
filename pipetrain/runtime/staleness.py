"""Which weights a stage's forward and backward use: the staleness policies.

With a synchronous schedule nothing changes between a micro-batch's forward and
backward, so the stage module is called with its own parameters. With async-1f1b
the optimizer steps while micro-batches are in flight; each policy then hands the
forward an explicit set of weight tensors (``torch.func.functional_call``) and decides
what those tensors hold when the backward runs:

- vanilla: tensors that alias the live weights, so the backward sees whatever the
  optimizer has made of them by then (PipeDream without stashing);
- stash: a copy per weight version, kept until the last backward that used it;
- spectrain: one scratch copy overwritten with W - s*lr*v before every forward and
  every backward (s_fwd before the forward, s_bwd before the backward).

Writes into tensors that autograd saved go through ``.data`` on purpose: they must not
bump the version counter, because the point is that the backward reads new values.
"""
from __future__ import annotations

import torch
from torch import nn

from pipetrain.optim import smoothed_update

WeightSet = dict[str, torch.Tensor]


def _named_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _accumulate(params: list[tuple[str, nn.Parameter]], weights: WeightSet) -> None:
    """Move the gradients autograd left on ``weights`` into the live parameters' ``.grad``."""
    for name, p in params:
        g = weights[name].grad
        if g is None:
            continue
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.add_(g)
        weights[name].grad = None


class StalenessPolicy:
    """Synchronous schedules: forward and backward both use the live parameters."""

    name = "none"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, stage: int, stages: int):
        self.module = module
        self.optimizer = optimizer
        self.stage = stage
        self.stages = stages
        self.params = _named_params(module)
        self.updates = 0  # optimizer steps taken by this stage

    def forward_weights(self, micro_batch: int) -> WeightSet | None:
        """Weights for the forward of ``micro_batch``; None means the module's own."""
        return None

    def before_backward(self, micro_batch: int) -> None:
        """Make the weights the backward of ``micro_batch`` must see current."""

    def after_backward(self, micro_batch: int) -> None:
        """Release what the backward of ``micro_batch`` held; gradients go to ``.grad``."""

    def on_step(self) -> None:
        self.updates += 1

    def extra_weight_bytes(self) -> int:
        """Bytes held in weight copies beyond the live parameters."""
        return 0

    def versions_held(self) -> int:
        return 0


class VanillaPolicy(StalenessPolicy):
    """Latest weights in the forward and in the backward (PipeDream without stashing)."""

    name = "vanilla"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Aliases share storage with the live weights but not their version counter,
        # so in-place optimizer steps are visible to the backward without tripping autograd.
        self.alias = {n: p.data.requires_grad_() for n, p in self.params}

    def forward_weights(self, micro_batch: int) -> WeightSet:
        return self.alias

    def after_backward(self, micro_batch: int) -> None:
        _accumulate(self.params, self.alias)


class StashPolicy(StalenessPolicy):
    """PipeDream weight stashing: the backward uses exactly the forward's weight version."""

    name = "stash"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.versions: dict[int, tuple[WeightSet, int]] = {}  # update count -> (weights, users)
        self.of_micro_batch: dict[int, int] = {}
        self.peak_versions = 0

    def _make_version(self) -> WeightSet:
        return {n: p.detach().clone().requires_grad_() for n, p in self.params}

    def forward_weights(self, micro_batch: int) -> WeightSet:
        weights, users = self.versions.get(self.updates, (None, 0))
        if weights is None:
            weights = self._make_version()
        self.versions[self.updates] = (weights, users + 1)
        self.of_micro_batch[micro_batch] = self.updates
        self.peak_versions = max(self.peak_versions, len(self.versions))
        return weights

    def after_backward(self, micro_batch: int) -> None:
        version = self.of_micro_batch.pop(micro_batch)
        weights, users = self.versions[version]
        _accumulate(self.params, weights)
        if users == 1:
            del self.versions[version]
        else:
            self.versions[version] = (weights, users - 1)

    def extra_weight_bytes(self) -> int:
        per_version = sum(p.numel() * p.element_size() for _, p in self.params)
        return per_version * len(self.versions)

    def versions_held(self) -> int:
        return len(self.versions)


def require_smoothed_update(optimizer: torch.optim.Optimizer | None) -> None:
    """Fail now, naming the optimizers that work, if ``optimizer`` has no smoothed update for SpecTrain."""
    if optimizer is None:  # a stage without parameters predicts nothing
        return
    for group in optimizer.param_groups:
        for p in group["params"][:1]:
            smoothed_update(optimizer, p)


def predicted_weight(optimizer: torch.optim.Optimizer, p: nn.Parameter, steps: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """SpecTrain's prediction W - steps * lr * v of ``p``; W itself before the first step.
    With ``out`` it is written there (no temporary) and ``out`` is returned."""
    v = smoothed_update(optimizer, p) if steps else None
    if v is None:
        return p.detach() if out is None else out.copy_(p.detach())
    lr = next(g["lr"] for g in optimizer.param_groups if any(q is p for q in g["params"]))
    return torch.add(p.detach(), v, alpha=-(steps * lr), out=out)


def spectrain_steps(stage: int, stages: int, forward_only: bool = False) -> tuple[int, int]:
    """SpecTrain's prediction distances (s_fwd, s_bwd) for ``stage`` of ``stages`` (0-based).

    The paper's version predicts floor(k/2) + N-k-1 updates ahead in the forward and
    floor(k/2) in the backward; the forward-only variant predicts N-k-1 in the forward and
    reuses that prediction in the backward.
    """
    if forward_only:
        return stages - stage - 1, stages - stage - 1
    return stage // 2 + stages - stage - 1, stage // 2


class SpecTrainPolicy(StalenessPolicy):
    """SpecTrain: forward and backward use W_hat = W - s * lr * v (v: the optimizer's smoothed update).

    One scratch copy of the weights serves every in-flight micro-batch: it is rewritten
    with the forward prediction before each forward and with the backward prediction
    before each backward, so memory stays at one extra version whatever the depth.
    """

    name = "spectrain"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.s_fwd, self.s_bwd = spectrain_steps(self.stage, self.stages)
        require_smoothed_update(self.optimizer)
        # Predicting 0 updates ahead in both passes (the last stage) means W as it is at forward and
        # at backward time: aliases of the live weights (as in vanilla) give exactly that, copy-free.
        self.predicts = (self.s_fwd, self.s_bwd) != (0, 0)
        self.scratch = ({n: torch.empty_like(p).requires_grad_() for n, p in self.params} if self.predicts
                        else {n: p.data.requires_grad_() for n, p in self.params})

    def _load(self, weights: WeightSet, steps: int) -> None:
        with torch.no_grad():
            for name, p in self.params:
                predicted_weight(self.optimizer, p, steps, out=weights[name].data)

    def forward_weights(self, micro_batch: int) -> WeightSet:
        if self.predicts:
            self._load(self.scratch, self.s_fwd)
        return self.scratch

    def before_backward(self, micro_batch: int) -> None:
        if self.predicts:
            self._load(self.scratch, self.s_bwd)

    def after_backward(self, micro_batch: int) -> None:
        _accumulate(self.params, self.scratch)

    def extra_weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.params) if self.predicts else 0

    def versions_held(self) -> int:
        return 1 if self.predicts else 0


class SpecTrainForwardOnlyPolicy(StashPolicy):
    """SpecTrain's forward-only variant: predict N-k-1 updates ahead in the forward and keep
    that prediction for the backward (one version per in-flight weight version, like stash)."""

    name = "spectrain-forward"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.s_fwd, self.s_bwd = spectrain_steps(self.stage, self.stages, forward_only=True)
        require_smoothed_update(self.optimizer)

    def _make_version(self) -> WeightSet:
        return {n: predicted_weight(self.optimizer, p, self.s_fwd).clone().requires_grad_()
                for n, p in self.params}


POLICIES = {
    "none": StalenessPolicy,
    "vanilla": VanillaPolicy,
    "stash": StashPolicy,
    "spectrain": SpecTrainPolicy,
    "spectrain-forward": SpecTrainForwardOnlyPolicy,
}
