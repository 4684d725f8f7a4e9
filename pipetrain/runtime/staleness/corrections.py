"""Delay corrections: changes to a stage's optimizer step that compose with any async-1f1b weight policy.

A policy decides at which weights a gradient is computed; these decide what the step does with a gradient
that arrives D updates late (D: the mean, over the mini-batch's micro-batches, of the updates between the
weights the gradient was computed at and the weights it is applied to; StalenessPolicy.take_step_delay).
Each is a pair of hooks on the stage's optimizer, so it acts on exactly the tensors that optimizer steps,
after clipping and the data-parallel reduction, and a checkpoint of the optimizer holds its state.

- Spike compensation (Kosson et al. 2020, "Pipelined Backpropagation at Scale"). With momentum gamma,
  a gradient that arrives on time contributes gamma^j to the j-th update from its computation on. Arriving
  D updates late it has missed 1 + gamma + ... + gamma^(D-1) of that, which momentum never makes up.
  The step instead applies a * buf + b * c * d (buf: the momentum buffer, d: the gradient, c: its
  coefficient in buf) with a = gamma^D and b = (1 - gamma^D) / (1 - gamma): the gradient's whole missed
  share at once, and every gradient's later contributions exactly those of an on-time run. SGD (with
  Nesterov momentum: a scales gamma * buf, the gradient's own term grows by gamma * b) and Adam/AdamW
  (numerator gamma^D m + (1 - gamma^D) g, gamma = beta1).
- Delay-compensated gradients (DC-ASGD-a, Zheng et al. 2017): g + lambda_t * g * g * (W - W_stale), with
  W_stale the weights the micro-batches' gradients were computed at (the stashed versions, averaged over
  the mini-batch) and the adaptive lambda_t = lambda_0 / sqrt(MeanSquare(g)), MeanSquare an exponential
  average (0.95) of g * g kept in the optimizer state as ``dc_mean_square``. A first-order Taylor
  correction of the gradient to the weights it is applied to, g * g standing in for the Hessian's diagonal.
- Per-stage learning rates (PipeMare, Yang et al. 2021): stage k steps with lr / (1 + D)^(1 - min(t/T, 1))
  for its first T updates t, so a delayed stage starts at a rate its delay keeps stable and reaches the
  full rate after T updates; the last stage (D = 0) is unchanged. Learning-rate schedulers and checkpoints
  see the unscaled rate; weight prediction extrapolates with the scaled one.
- Delay-matched momentum (``stage_momentum``): stage k averages its gradients over a momentum window
  1 / (1 - beta_k) that grows with the square of its steady delay D_k, beta_k = 1 - (1 - beta) / (1 + D_k)^2,
  at the same effective rate. Why the square: on a direction of curvature lambda, heavy ball with window W
  and effective rate lr / (1 - beta) oscillates with frequency omega = sqrt(lr * lambda), i.e. about
  sqrt(lr_eff * lambda / W) per update; a gradient D updates late lags that oscillation by the phase
  omega * D, which stays the same where W grows like D^2. With a look-ahead along the momentum (the nesterov
  and spectrain policies) the window's slowly turning direction is also what the prediction extrapolates
  (PipeNAG's high-momentum recipe, Ajanthan et al. 2025, made per stage). SGD keeps lr / (1 - beta) through
  its dampening, (1 - dampening_k) = (1 - dampening) (1 - beta_k) / (1 - beta), so the rate and any
  learning-rate schedule are untouched; Adam/AdamW's beta1 and Muon's momentum become beta_k (their steps are
  normalised, Muon's orthogonalised: no rate to keep). The last stage (D = 0) keeps the optimizer's own values. Each group keeps the values it was
  built with under ``BASE_KEY``, so a checkpoint resumed at another stage count derives its own (at the
  start of the next stream).
- Error feedback on the update (``error_feedback``), for PipeDream-2BW's one-update delay after Zmushko et al.
  2026 ("One-Step Gradient Delay is Not a Barrier", an optimizer-agnostic correction; their text was not
  available offline, so this is our reading of it). The update u_t the optimizer computes at step t comes
  from a gradient D updates old; step t - 1 applied u_{t-1} where, as step t now shows, u_t was due. That
  error is fed back, extrapolated over the delay: W(t+1) = W(t) + u_t + D (u_t - u_{t-1}). It acts on
  whatever the optimizer (and the other corrections) moved the weights by, so it holds for any optimizer;
  the previous update is kept in the optimizer state as ``ef_previous_update`` (checkpointed with it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipetrain.optim.combined import CombinedOptimizer
from pipetrain.optim.muon import is_muon_group, orthogonalises
from pipetrain.runtime.staleness.base import StalenessPolicy, StashPolicy

DC_AVERAGE = 0.95  # DC-ASGD-a's MeanSquare decay (the paper's m)
DC_EPS = 1e-7  # keeps 1 / sqrt(MeanSquare) finite where a gradient entry has always been 0
SPIKE_OPTIMIZERS = "torch.optim.SGD (momentum > 0, Nesterov or not), torch.optim.Adam or torch.optim.AdamW"
STAGE_MOMENTUM_OPTIMIZERS = ("torch.optim.SGD (momentum > 0, nesterov=False), torch.optim.Adam, torch.optim.AdamW, "
                             "torch.optim.Muon or a pipetrain.optim.CombinedOptimizer of them")
BASE_KEY = "stage_momentum_base"  # a parameter group's own momentum (and dampening) under stage_momentum
PREVIOUS_UPDATE_KEY = "ef_previous_update"  # error_feedback: the update the optimizer made at the last step


@dataclass(frozen=True)
class DelayCorrections:
    """Which corrections a stage's step applies (all off by default)."""

    spike_compensation: bool = False
    dc_lambda: float = 0.0  # DC-ASGD-a's lambda_0; 0: off
    lr_warmup: int = 0  # PipeMare's T in updates; 0: off
    stage_momentum: bool = False  # delay-matched momentum per stage
    error_feedback: bool = False  # the last update's error, extrapolated over the delay

    @property
    def any(self) -> bool:
        return (self.spike_compensation or self.dc_lambda > 0 or self.lr_warmup > 0 or self.stage_momentum
                or self.error_feedback)


def delay_matched_momentum(momentum: float, delay: float) -> float:
    """beta_k = 1 - (1 - beta) / (1 + D)^2: the momentum whose window grows with the square of the delay D."""
    return 1.0 - (1.0 - momentum) / (1.0 + delay) ** 2


def check_delay_corrections(corrections: DelayCorrections, policy: str) -> None:
    """Refuse, naming what works, a correction the policy cannot take (the optimizer is checked when the stage
    builds it: CorrectedStep)."""
    if corrections.dc_lambda > 0 and policy in ("vanilla", "spectrain"):  # policy names: "spectrain" is the paper's
        raise ValueError(f"dc_lambda needs the weights each gradient was computed at, and staleness={policy!r} "
                         "computes the backward at other weights than the forward: use staleness='stash', '2bw', "
                         "'nesterov' or 'spectrain' with spectrain_variant='forward-only'")


def _spike_kind(optimizer: torch.optim.Optimizer) -> str:
    """"sgd" or "adam": the update rules spike compensation knows (exact types: a subclass may step otherwise)."""
    if orthogonalises(optimizer):
        raise ValueError("spike_compensation adds a gradient's missed share to the momentum's update after the step, "
                         "and Muon steps along its momentum orthogonalised (Newton-Schulz is not linear, so the "
                         "share cannot be added afterwards): with Muon use error_feedback, stage_momentum, dc_lambda "
                         f"or stage_lr_warmup; spike_compensation takes {SPIKE_OPTIMIZERS}")
    if type(optimizer) is torch.optim.SGD:
        if any(g["momentum"] == 0 for g in optimizer.param_groups):
            raise ValueError("spike_compensation re-weights the momentum buffer: torch.optim.SGD needs momentum > 0")
        return "sgd"
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return "adam"
    raise ValueError(f"spike_compensation is defined for {SPIKE_OPTIMIZERS}, not {type(optimizer).__name__}")


def _check_stage_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, naming what works, an optimizer whose momentum stage_momentum cannot re-time."""
    if isinstance(optimizer, CombinedOptimizer):
        for inner in optimizer.optimizers:
            _check_stage_momentum(inner)
        return
    # Muon's momentum is an exponential average like Adam's beta1, and its step is normalised (orthogonalised),
    # so a longer window has no rate to keep.
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) or isinstance(optimizer, torch.optim.Muon):
        return
    if type(optimizer) is not torch.optim.SGD:
        raise ValueError(f"stage_momentum is defined for {STAGE_MOMENTUM_OPTIMIZERS}, not {type(optimizer).__name__}")
    if any(g["momentum"] == 0 for g in optimizer.param_groups):
        raise ValueError("stage_momentum lengthens the momentum's window: torch.optim.SGD needs momentum > 0")
    if any(g["nesterov"] for g in optimizer.param_groups):
        raise ValueError("stage_momentum keeps SGD's effective rate through its dampening, which torch's Nesterov "
                         "SGD does not take: use nesterov=False with staleness='nesterov', whose look-ahead is the "
                         "Nesterov step")


def match_momentum(optimizer: torch.optim.Optimizer, delay: float) -> None:
    """Set each group's momentum to the delay-matched one from the group's own values (kept under BASE_KEY on
    the first call; a checkpoint's groups bring theirs). SGD also starts zero momentum buffers where it has none:
    its first step would otherwise take a gradient whole into a buffer that now decays slower."""
    for group in optimizer.param_groups:
        if "betas" in group:
            base = group.setdefault(BASE_KEY, {"beta1": float(group["betas"][0])})
            group["betas"] = (delay_matched_momentum(base["beta1"], delay), group["betas"][1])
            continue
        if is_muon_group(group):  # an average from a zero buffer (no dampening): only the window changes
            base = group.setdefault(BASE_KEY, {"momentum": group["momentum"]})
            group["momentum"] = delay_matched_momentum(base["momentum"], delay)
            continue
        base = group.setdefault(BASE_KEY, {"momentum": group["momentum"], "dampening": group["dampening"]})
        momentum = delay_matched_momentum(base["momentum"], delay)
        group["momentum"] = momentum
        group["dampening"] = 1.0 - (1.0 - base["dampening"]) * (1.0 - momentum) / (1.0 - base["momentum"])
        if momentum == base["momentum"]:
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class CorrectedStep:
    """The hooks that apply ``corrections`` around every step of ``optimizer`` (one stage's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, policy: StalenessPolicy, corrections: DelayCorrections):
        self.optimizer, self.policy, self.corrections = optimizer, policy, corrections
        self.kind = _spike_kind(optimizer) if corrections.spike_compensation else None
        if corrections.stage_momentum:
            _check_stage_momentum(optimizer)
        self.delay = 0.0
        self._lrs: list[float] = []
        self._gradients: dict[torch.Tensor, torch.Tensor] = {}  # what the step puts into momentum, where not .grad
        self._fresh: set[torch.Tensor] = set()  # parameters whose momentum buffer this step creates
        self._new_state: dict[torch.Tensor, torch.Tensor] = {}  # DC-ASGD's first MeanSquare, stored after the step
        self._before: dict[torch.Tensor, torch.Tensor] = {}  # error feedback: the weights the step starts from
        if corrections.dc_lambda > 0:
            if not isinstance(policy, StashPolicy):
                raise ValueError(f"dc_lambda needs a stashing policy, not {policy.name!r}")
            policy.keep_stale_mean()
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.before())
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after())
        policy.records_delays = True
        self.steady_delay = policy.steady_delay()
        if corrections.lr_warmup > 0:
            policy.scale_learning_rate(self.lr_scale)
        if corrections.stage_momentum:
            match_momentum(optimizer, self.steady_delay)
            policy.stream_hooks.append(lambda: match_momentum(optimizer, self.steady_delay))

    def lr_scale(self) -> float:
        """PipeMare's factor for the next update: 1 / (1 + D)^(1 - min(t / T, 1)), D the stage's delay past
        the warm-up, t the updates it has applied (checkpointed with the policy)."""
        t, warmup = self.policy.updates, self.corrections.lr_warmup
        return (1.0 + self.steady_delay) ** -(1.0 - min(t / warmup, 1.0))

    def before(self) -> None:
        self.delay = self.policy.take_step_delay()
        if self.corrections.dc_lambda > 0:
            self._compensate_gradients()
        if self.corrections.lr_warmup > 0:
            scale = self.lr_scale()
            self._lrs = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * scale
        if self.kind is not None and self.delay > 0:
            self._keep_gradients()
            # torch's SGD sets a new momentum buffer to the gradient itself, without dampening
            self._fresh = {p for g in self.optimizer.param_groups for p in g["params"]
                           if self.optimizer.state.get(p, {}).get("momentum_buffer") is None}
        if self.corrections.error_feedback:
            self._before = {p: p.detach().clone() for g in self.optimizer.param_groups for p in g["params"]
                            if p.grad is not None}

    def after(self) -> None:
        if self.kind is not None and self.delay > 0:
            self._spike()
        if self._before:
            self._feed_back()
        self._gradients.clear()
        self._fresh.clear()
        for p, mean_square in self._new_state.items():
            self.optimizer.state[p]["dc_mean_square"] = mean_square
        self._new_state.clear()
        for g, lr in zip(self.optimizer.param_groups, self._lrs):
            g["lr"] = lr
        self._lrs = []

    # -- DC-ASGD-a ---------------------------------------------------------------------------------

    def _compensate_gradients(self) -> None:
        stale = self.policy.take_stale_mean()
        if stale is None:
            return
        lam = self.corrections.dc_lambda
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None or id(p) not in stale:
                        continue
                    g = p.grad
                    state = self.optimizer.state[p]
                    mean_square = state.get("dc_mean_square")
                    square = g * g
                    if mean_square is None:  # the optimizer builds its state at its first step, from an empty one
                        mean_square = self._new_state[p] = torch.zeros_like(g)
                    mean_square.mul_(DC_AVERAGE).add_(square, alpha=1 - DC_AVERAGE)
                    g.addcmul_(square / (mean_square.sqrt() + DC_EPS), p.detach() - stale[id(p)], value=lam)

    # -- spike compensation ------------------------------------------------------------------------

    def _keep_gradients(self) -> None:
        """The gradient each parameter's momentum takes in this step, where it is not ``.grad`` itself:
        with weight decay coupled into it (it reads the weights before the step) or with ``maximize``."""
        for group in self.optimizer.param_groups:
            decoupled = self.kind == "adam" and group.get("decoupled_weight_decay",
                                                          isinstance(self.optimizer, torch.optim.AdamW))
            decay = 0.0 if decoupled else group["weight_decay"]
            if decay == 0 and not group.get("maximize", False):
                continue
            for p in group["params"]:
                if p.grad is not None:
                    d = -p.grad if group.get("maximize", False) else p.grad
                    self._gradients[p] = d + decay * p.detach() if decay else d.clone()

    def _spike(self) -> None:
        D = self.delay
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    d = self._gradients.get(p, p.grad)
                    state = self.optimizer.state[p]
                    if self.kind == "sgd":
                        gamma, lr = group["momentum"], group["lr"]
                        c = 1.0 if p in self._fresh else 1.0 - group["dampening"]
                        # heavy ball: (1 - gamma^D)(buf - c d / (1 - gamma)); Nesterov: gamma times that
                        scale = lr * (1 - gamma ** D) * (gamma if group["nesterov"] else 1.0)
                        p.add_(state["momentum_buffer"], alpha=scale).add_(d, alpha=-scale * c / (1 - gamma))
                    else:
                        beta1, beta2 = group["betas"]
                        step = float(state["step"])
                        second = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
                        denominator = (second / (1 - beta2 ** step)).sqrt().add_(group["eps"])
                        scale = group["lr"] * (1 - beta1 ** D) / (1 - beta1 ** step)
                        p.addcdiv_(state["exp_avg"] - d, denominator, value=scale)


    # -- error feedback ----------------------------------------------------------------------------

    def _feed_back(self) -> None:
        """W += D (u_t - u_{t-1}), u_t what this step moved W by; u_t is kept for the next step. On the first
        step (no u_{t-1}) and with no delay nothing is added."""
        D = self.delay
        with torch.no_grad():
            for p, before in self._before.items():
                update = before.neg_().add_(p)  # in place: the snapshot becomes u_t
                state = self.optimizer.state[p]
                previous = state.get(PREVIOUS_UPDATE_KEY)
                if previous is not None and D > 0:
                    p.add_(update - previous, alpha=D)
                state[PREVIOUS_UPDATE_KEY] = update
        self._before = {}
