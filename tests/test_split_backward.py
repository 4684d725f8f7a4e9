"""Zero-bubble B/W split of a stage's backward against one full backward of the same graph."""
import torch
from torch import nn

from pipetrain.runtime.split_backward import backward_input, backward_weight, split_is_complete


class Block(nn.Module):
    """Weights joining the input's path in several ways: a chain, a learned offset, a residual."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.offset = nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = torch.tanh(self.a(x) + self.offset)
        return self.b(h) + h


def grads(module, x, grad_out, split):
    leaf = x.detach().requires_grad_()
    out = module(leaf)
    params = list(module.parameters())
    if split:
        assert split_is_complete([out], [leaf], params)
        groups = backward_input([out], [grad_out], [leaf], params)
        assert all(p.grad is None for p in params)  # B leaves the weights for W
        input_grad = leaf.grad.clone()
        backward_weight(params, groups)
    else:
        out.backward(grad_out)
        input_grad = leaf.grad.clone()
    result = [input_grad] + [p.grad.clone() for p in params]
    module.zero_grad(set_to_none=True)
    return result


def test_b_then_w_equals_the_full_backward():
    module, x, g = Block(), torch.randn(5, 6), torch.randn(5, 6)
    for full, split in zip(grads(module, x, g, split=False), grads(module, x, g, split=True)):
        torch.testing.assert_close(split, full, atol=0, rtol=0)  # same kernels, same order per tensor


def test_a_weight_on_a_path_of_its_own_cannot_be_split():
    module = Block()
    leaf = torch.randn(5, 6).requires_grad_()
    bias_only = module.offset * 2  # an output made of parameters alone: no node that the input reaches
    assert not split_is_complete([module(leaf), bias_only], [leaf], list(module.parameters()))
    assert not split_is_complete([module(leaf), module.offset], [leaf], list(module.parameters()))
    assert not split_is_complete([module(leaf)], [], list(module.parameters()))  # nothing to split off
    unused = nn.Linear(6, 6)  # weights the outputs do not depend on do not stop a split
    assert split_is_complete([module(leaf)], [leaf], [*module.parameters(), *unused.parameters()])
