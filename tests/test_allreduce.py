"""Fused / hierarchical / hybrid gradient reduction against one plain all_reduce per tensor.

All distributed checks run inside ONE spawned gloo group of 4 processes (spawning
is the expensive part); each check records its outcome and the test functions
below report them one by one.
"""


import pytest
import torch
import torch.distributed as dist

from dist_harness import run_checks, run_world
from pipetrain.allreduce.reducer import GradientReducer
from pipetrain.allreduce.buckets import assign_buckets
from pipetrain.allreduce.hierarchy import build_hierarchy_groups
from pipetrain.allreduce.sharded import ShardedReducer
from pipetrain.allreduce.slices import source_of
from pipetrain.comm.reporting import SumExchange

pytestmark = pytest.mark.slow  # spawns gloo ranks in its module fixture (see pyproject: slow)

WORLD = 4
SHAPES = [(7,), (3, 5), (1,), (13, 3), (2, 2, 3), (31,), (5, 1), (9,), (4, 4)]
DTYPES = [torch.float32, torch.float64, torch.float32, torch.bfloat16, torch.float32, torch.float64, torch.float32,
          torch.bfloat16, torch.float32]
TOL = {torch.float32: 1e-6, torch.float64: 1e-6, torch.bfloat16: 1e-2}


def _params(rank, with_grads=True):
    gen = torch.Generator().manual_seed(100 + rank)
    params = []
    for shape, dtype in zip(SHAPES, DTYPES):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        if with_grads:
            p.grad = torch.randn(shape, generator=gen).to(dtype)
        params.append(p)
    return params


def _reference(params, group):
    """One plain all_reduce per tensor, then the mean."""
    out = []
    for p in params:
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        out.append(g / dist.get_world_size(group))
    return out


def _assert_grads(params, expected, tol=None):
    for p, e in zip(params, expected):
        t = tol if tol is not None else TOL[p.dtype]
        torch.testing.assert_close(p.grad.float(), e.float(), rtol=t, atol=t)


def _check_reduce_now(rank, algorithm, group=None, **kw):
    params = _params(rank)
    expected = _reference(params, group)
    reducer = GradientReducer(params, group, bucket_bytes=96, first_bucket_bytes=24, algorithm=algorithm, **kw)
    reducer.reduce_now()
    _assert_grads(params, expected)
    return reducer


class _Net(torch.nn.Module):
    """Odd-sized layers, one float64 layer: 10 parameter tensors of 2 dtypes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # identical replicas
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 9)
        self.c = torch.nn.Linear(9, 3).double()
        self.n = torch.nn.LayerNorm(3).double()
        self.d = torch.nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.d(self.n(self.c(h.double())).float())


def _micro_batches(rank, count=3):
    gen = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(4, 5, generator=gen) for _ in range(count)]


def _check_overlap(rank, algorithm, use_no_sync, **kw):
    net, ref_net = _Net(), _Net()
    batches = _micro_batches(rank)
    for x in batches:  # reference: plain accumulation, then one all_reduce per tensor
        ref_net(x).square().sum().backward()
    expected = _reference(list(ref_net.parameters()), None)
    reducer = GradientReducer(net.parameters(), None, bucket_bytes=64, first_bucket_bytes=16,
                              algorithm=algorithm, **kw)
    reducer.enable_overlap()
    for step in range(2):  # two optimizer steps: the reducer must reset between rounds
        net.zero_grad(set_to_none=True)
        for i, x in enumerate(batches):
            last = i == len(batches) - 1
            if use_no_sync and not last:
                with reducer.no_sync():
                    net(x).square().sum().backward()
            else:
                reducer.prepare(final=last)
                net(x).square().sum().backward()
                assert (reducer.buckets[0].launched > 0) == last, "the first bucket must launch during the final backward only"
        reducer.finish()
        _assert_grads(list(net.parameters()), expected)


def _check_double_final_backward_raises(rank):
    net = _Net()
    reducer = GradientReducer(net.parameters(), None, algorithm="flat")
    reducer.enable_overlap()
    x = _micro_batches(rank, 1)[0]
    net(x).sum().backward()
    try:
        net(x).sum().backward()
    except RuntimeError as e:
        assert "no_sync" in str(e)
    else:
        raise AssertionError("second final backward should raise")
    reducer.finish()  # every rank is in the same state, so clean-up is consistent


def _check_uneven_weights(rank, overlap, algorithm, **kw):
    """Replica r holds r+1 samples; the result must be the gradient of the mean over all 10 samples."""
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(r + 1, 5, generator=gen) for r in range(WORLD)]
    ys = [torch.randn(r + 1, 2, generator=gen) for r in range(WORLD)]
    torch.manual_seed(1)
    model = torch.nn.Linear(5, 2)
    whole = torch.nn.Linear(5, 2)
    whole.load_state_dict(model.state_dict())
    torch.nn.functional.mse_loss(whole(torch.cat(xs)), torch.cat(ys), reduction="sum").div(sum(len(x) for x in xs)).backward()
    reducer = GradientReducer(model.parameters(), None, algorithm=algorithm, **kw)
    local_loss = lambda: torch.nn.functional.mse_loss(model(xs[rank]), ys[rank], reduction="sum") / len(xs[rank])  # noqa: E731
    if overlap:
        reducer.enable_overlap()
        reducer.prepare(final=True, weight=len(xs[rank]))
        local_loss().backward()
        reducer.finish()
    else:
        local_loss().backward()
        reducer.reduce_now(weight=len(xs[rank]))
    for p, q in zip(model.parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def _check_compressed(rank, compress, algorithm, **kw):
    params = [p for p in _params(rank) if p.dtype != torch.bfloat16]
    expected = _reference(params, None)
    reducer = GradientReducer(params, None, bucket_bytes=128, algorithm=algorithm, compress=compress, **kw)
    assert any(b.comm.dtype == compress for b in reducer.buckets)
    reducer.reduce_now()
    tol = 2 ** -7 if compress == torch.bfloat16 else 2 ** -10  # a few ulps of the sum of 4 unit normals
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad.float(), e.float(), rtol=4 * tol, atol=4 * tol)
        assert p.grad.dtype == p.dtype


def _check_missing_grad(rank):
    params = _params(rank)
    if rank == 0:
        params[2].grad = None  # this replica did not use the tensor: it contributes zeros
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    expected = []
    for g in grads:
        dist.all_reduce(g)
        expected.append(g / WORLD)
    GradientReducer(params, None, bucket_bytes=96).reduce_now()
    _assert_grads(params, expected)


def checks_on_rank(rank, world):
    # every rank builds every group in the same order: hierarchy (2 nodes x 2) of the world,
    # then two data-parallel groups of 2 like a 2-stage pipeline with 2 replicas
    world_h = build_hierarchy_groups(range(WORLD), nodes=2, per_node=2)
    pairs = [[0, 2], [1, 3]]
    pair_groups = [dist.new_group(r) for r in pairs]
    pair_h = [build_hierarchy_groups(r, nodes=1, per_node=2) for r in pairs]
    mine = rank % 2
    report_groups = (dist.new_group(list(range(WORLD))), dist.new_group(list(range(WORLD))))
    checks = {
        "fused_flat_w4": lambda: _check_reduce_now(rank, "flat"),
        "per_tensor_w4": lambda: _check_reduce_now(rank, "per-tensor"),
        "hierarchical_2x2": lambda: _check_reduce_now(rank, "hierarchical", hierarchy=world_h),
        "hierarchical_tuple_2x2": lambda: _check_reduce_now(rank, "hierarchical", hierarchy=(2, 2)),
        "hybrid_2x2": lambda: _check_hybrid(rank, world_h),
        "fused_flat_w2_subgroups": lambda: _check_reduce_now(rank, "flat", group=pair_groups[mine]),
        "hierarchical_w2_subgroups": lambda: _check_reduce_now(rank, "hierarchical", group=pair_groups[mine], hierarchy=pair_h[mine]),
        "overlap_flat_prepare": lambda: _check_overlap(rank, "flat", use_no_sync=False),
        "overlap_hybrid_no_sync": lambda: _check_overlap(rank, "hybrid", use_no_sync=True, hierarchy=world_h, choose_hierarchical=lambda n: n >= 100),
        "overlap_hierarchical": lambda: _check_overlap(rank, "hierarchical", use_no_sync=True, hierarchy=world_h),
        "overlap_per_tensor": lambda: _check_overlap(rank, "per-tensor", use_no_sync=False),
        "double_final_backward_raises": lambda: _check_double_final_backward_raises(rank),
        "uneven_weights_reduce_now": lambda: _check_uneven_weights(rank, False, "flat"),
        "uneven_weights_overlap_hierarchical": lambda: _check_uneven_weights(rank, True, "hierarchical", hierarchy=world_h),
        "compress_bf16_flat": lambda: _check_compressed(rank, torch.bfloat16, "flat"),
        "compress_fp16_hierarchical": lambda: _check_compressed(rank, torch.float16, "hierarchical", hierarchy=world_h),
        "missing_grad_contributes_zeros": lambda: _check_missing_grad(rank),
        "report_sums_in_flight": lambda: _check_report_sums(rank, report_groups),
        "report_with_maximised_part": lambda: _check_maximised_part(rank, report_groups),
        "even_shards_flat": lambda: _check_even_shards(rank, "flat"),
        "even_shards_hierarchical_2x2": lambda: _check_even_shards(rank, "hierarchical", hierarchy=world_h),
    }
    return run_checks(checks)


def _check_report_sums(rank, groups):
    """Three step reports in flight at once (as in an async-1f1b stream), finished in order by
    polling the oldest: each is the exact sum (integers in float64) on every rank."""
    vectors = [torch.tensor([rank + 1.0, 10.0 * rank + step, 2.0 ** rank], dtype=torch.float64) for step in range(3)]
    pending = [SumExchange(v.clone(), *groups) for v in vectors]
    totals = []
    while pending:
        if pending[0].is_completed() or rank != 0:  # rank 0 (the root) polls; the others block
            totals.append(pending.pop(0).wait())
    for step, total in enumerate(totals):
        expected = torch.tensor([sum(r + 1.0 for r in range(WORLD)), sum(10.0 * r + step for r in range(WORLD)),
                                 sum(2.0 ** r for r in range(WORLD))], dtype=torch.float64)
        assert torch.equal(total, expected), (step, total, expected)


def _check_maximised_part(rank, groups):
    """A sync step's report carrying the skip-or-step flags: the last entries are the maximum over
    ranks (the first rank that raised a flag wins: its code W - rank is the largest), the rest sums."""
    codes = {0: [0.0, 0.0], 1: [0.0, WORLD - 1.0], 2: [WORLD - 2.0, WORLD - 2.0]}.get(rank, [0.0, 0.0])
    mine = torch.tensor([rank + 0.5, 3.0 * rank] + codes, dtype=torch.float64)
    total = SumExchange(mine, groups[0], groups[0], maximised=2).wait()
    expected = torch.tensor([sum(r + 0.5 for r in range(WORLD)), sum(3.0 * r for r in range(WORLD)),
                             WORLD - 2.0, WORLD - 1.0], dtype=torch.float64)
    assert torch.equal(total, expected), (total, expected)


def _check_even_shards(rank, algorithm, **kw):
    """ZeRO-2 even ranges (cutting tensors, mixed dtypes, one tensor alone in its bucket): every rank's slices
    hold the mean gradient of their range and together cover each tensor once; after the step the all-gather
    gives every rank each owner's values."""
    params = _params(rank)
    expected = _reference(params, None)
    alone = params[3]
    reducer = ShardedReducer(params, None, bucket_bytes=96, first_bucket_bytes=24, algorithm=algorithm,
                             alone=[alone], free_unowned=True, **kw)
    assert [len(b.params) for b in reducer.buckets if any(q is alone for q in b.params)] == [1]
    reducer.reduce_now()
    assert all(p.grad is None for p in params if p is not alone) and alone.grad is not None
    covered, stepped = torch.zeros(len(params)), reducer.stepped()
    for t, p in stepped:
        k = next(i for i, q in enumerate(params) if q is p)
        source, start = source_of(t)
        assert source is p and t.dim() == 1
        tol = TOL[p.dtype]
        torch.testing.assert_close(t.grad.float(), expected[k].reshape(-1)[start:start + t.numel()].float(),
                                   rtol=tol, atol=tol)
        covered[k] += t.numel()
        t.fill_(rank + 1)  # this replica's step
    dist.all_reduce(covered)
    assert covered.tolist() == [p.numel() for p in params], covered
    assert reducer.padding_bytes() < sum(WORLD * b.dtype.itemsize for b in reducer.buckets)
    reducer.gather()
    assert all(bool((t == rank + 1).all()) for t, _ in stepped)  # this rank's range came back as it stepped it
    for p in params:
        values = p.detach().float().reshape(-1)
        assert set(values.tolist()) <= {1.0, 2.0, 3.0, 4.0}, values  # each element its owner's
        same = values.clone()
        dist.all_reduce(same, op=dist.ReduceOp.MAX)
        assert torch.equal(same, values)


def _check_hybrid(rank, hierarchy):
    reducer = _check_reduce_now(rank, "hybrid", hierarchy=hierarchy, choose_hierarchical=lambda n: n >= 90)
    kinds = {len(b.steps) for b in reducer.buckets}
    assert kinds == {1, 3}, f"hybrid should mix flat (1 step) and hierarchical (3 steps) buckets, got {kinds}"


CHECKS = [
    "fused_flat_w4", "per_tensor_w4", "hierarchical_2x2", "hierarchical_tuple_2x2", "hybrid_2x2",
    "fused_flat_w2_subgroups", "hierarchical_w2_subgroups", "overlap_flat_prepare", "overlap_hybrid_no_sync",
    "overlap_hierarchical", "overlap_per_tensor", "double_final_backward_raises", "uneven_weights_reduce_now",
    "uneven_weights_overlap_hierarchical", "compress_bf16_flat", "compress_fp16_hierarchical",
    "missing_grad_contributes_zeros", "report_sums_in_flight", "report_with_maximised_part", "even_shards_flat",
    "even_shards_hierarchical_2x2",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(WORLD, "test_allreduce", "checks_on_rank", tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize("name", CHECKS)
def test_distributed_check(results, name):
    for rank, res in enumerate(results):
        assert res.get(name) == "ok", f"rank {rank}: {res.get(name, 'not run')}"


def test_buckets_reverse_order_per_dtype_and_first_bucket_cap():
    params = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(10), torch.zeros(2), torch.zeros(3)]
    specs = assign_buckets(params, bucket_bytes=40, first_bucket_bytes=8)
    # reverse order: 3-float (12 B >= 8: first fp32 bucket closes), then 2+10 floats, then 4
    assert [s.indices for s in specs] == [(4,), (3, 2), (1,), (0,)]
    assert [s.dtype for s in specs] == [torch.float32, torch.float32, torch.float64, torch.float32]
    assert [s.numel for s in specs] == [3, 12, 4, 4]
    assert [s.indices for s in assign_buckets(params, 0, 0)] == [(4,), (3,), (2,), (1,), (0,)]
    # A tensor alone (a tied copy under ZeRO's even ranges) takes a bucket of its own, in its place in the order.
    assert [s.indices for s in assign_buckets(params, 48, 8, alone={3})] == [(4,), (3,), (2, 0), (1,)]


def test_hierarchy_layout_errors_name_the_fix():
    with pytest.raises(ValueError, match="must equal the group size"):
        build_hierarchy_groups(range(4), nodes=3, per_node=2)
