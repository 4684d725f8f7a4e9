"""Random operations on split values draw per lane (Megatron-LM's model-parallel RNG tracker, as a graph call).

Every lane of a stage runs the stage under the same seed, which keeps the random draws on whole tensors (a
dropout on the residual stream) equal on every lane, as they must be: the lanes hold the same whole values. A
dropout on a split value (attention probabilities split by heads, the MLP's split hidden features) must not draw
the same: each lane holds another block of the tensor, and the same mask on every block would correlate elements
the unsplit model drops independently. `LaneDraws` runs such an operation under a generator state of the lane's
own, derived from one draw of the stage's stream (the same draw on every lane, so the stream stays in step), then
restores the stream: the stage's other draws are those of a stage without it, and a recomputed forward, reseeded
alike, draws the same masks again.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

# Dropout's ATen and functional names and its module classes.
DROPOUTS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
                      "dropout1d", "dropout2d", "dropout3d", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d",
                      "AlphaDropout", "FeatureAlphaDropout"})
# Attention, which draws inside when its dropout_p is not 0 (argument 4).
ATTENTIONS = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                        "_scaled_dot_product_efficient_attention"})

_GOLDEN = 0x9E3779B97F4A7C15  # an odd constant far from small multiples: lanes' seeds far apart
_SEEDS = 1 << 62


class LaneDraws(nn.Module):
    """``operation(*args, **kwargs)`` drawing its random numbers from a state of lane ``lane``'s own."""

    def __init__(self, operation: Callable, lane: int):
        super().__init__()
        self.operation = operation  # a module is registered as a child: train() and eval() reach it
        self.lane = lane

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # From the CPU stream, which every lane seeds alike: the same draw on every lane, read without a device sync.
        drawn = int(torch.randint(_SEEDS, (1,)))
        seed = (drawn + self.lane * _GOLDEN) % _SEEDS
        device = next((t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)),
                      torch.device("cpu"))
        accelerators = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=accelerators):
            torch.default_generator.manual_seed(seed)
            if accelerators:
                index = device.index if device.index is not None else torch.cuda.current_device()
                torch.cuda.default_generators[index].manual_seed(seed)
            return self.operation(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"lane={self.lane}"
