"""Tensor parallelism inside each stage (``tensor_parallel=T``) trains exactly like the unsplit model.

Each scenario trains on real gloo ranks and is compared with the unsplit model trained in this process on the same
mini-batches, accumulated over the same micro-batches, with AdamW (lr 0.01, three steps). Two models: a tiny
Llama with grouped-query attention (4 heads, 2 key/value heads: each of 2 tensor ranks holds 2 heads and 1 kv
head), split by the plan the model declares (its ``tp_plan``: attention and MLP colwise/rowwise pairs, the
embedding by vocabulary rows, the head colwise then gathered); and a plain MLP, split by the automatic plan
(pairs of consecutive linear layers).

Both sides train in float64 (EXACT), so that the tolerance follows from the operations and not from one CPU's
kernels. A split takes the same sums in another order (partial products summed over the ranks instead of inside one
matmul; which order depends on the BLAS kernel: MKL's AVX-512 sgemm differs from its AVX2 one). In float32 that
reordering moves a gradient by ~1e-7 of its terms' scale, and AdamW, whose step is lr * m / (sqrt(v) + eps), turns
it into a weight difference of up to lr (1e-2) wherever a gradient is near zero: no float32 tolerance below lr is
true on every kernel. In float64 (unit roundoff u = 1.1e-16) a sum of n <= 64 terms of scale <= 1 moves by at most
n * u ~ 1e-14; AdamW amplifies a gradient difference by at most lr / eps = 1e6, so a step moves a weight by at most
~1e-8, three steps by ~3e-8: TOL = 1e-7 holds on any kernel. A collective missing or doubled (a gradient not
summed over the ranks, a row-parallel output summed twice) changes a loss or a weight by 1e-3 or more, far outside
it. The bf16/fp16 variants train in float32 (LOW): autocast leaves float64 alone.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers as hf
from safetensors.torch import save_file
from torch import nn

import pipetrain
from dist_harness import run_world
from helpers import capture_once, optimizer_collectives, wrap_unprofiled
from runtime_models import data, make
from pipetrain.runtime.local_shards import local
from pipetrain.tensor_parallel import TensorParallelError
from pipetrain.tensor_parallel.parameters import is_split
from pipetrain.tensor_parallel.randomness import LaneDraws

pytestmark = pytest.mark.slow  # spawns gloo ranks in its module fixture (see pyproject: slow)

EXACT = torch.float64  # what every "equal to the unsplit model" scenario trains in (the module docstring says why)
LOW = torch.float32  # the weights under bf16/fp16 autocast, which casts float32 (not float64) to 16 bits
TOL = 1e-7  # float64: the module docstring derives it
MICRO = 2
STEPS = 3
VOCAB, SEQ = 64, 8
LLAMA_CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)




def llama(dtype: torch.dtype = EXACT) -> nn.Module:
    torch.manual_seed(0)
    return hf.LlamaForCausalLM(hf.LlamaConfig(**LLAMA_CONFIG)).to(dtype)


def in_dtype(batch, dtype: torch.dtype):
    """``batch`` (a tensor, a dict or tuple of them) with its floating tensors in ``dtype`` (token ids stay ids)."""
    if isinstance(batch, dict):
        return {k: in_dtype(v, dtype) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(in_dtype(v, dtype) for v in batch)
    return batch.to(dtype) if batch.is_floating_point() else batch


def steps_in(name: str, dtype: torch.dtype = EXACT) -> list:
    """Model ``name``'s mini-batches of (inputs, targets), their floating values in ``dtype``."""
    return [in_dtype(batch, dtype) for batch in MODELS[name][2]]


def token_loss(out, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def lars(params):
    return pipetrain.optim.LARS(params, lr=0.1, momentum=0.9, weight_decay=1e-4)


def lamb(params):
    return pipetrain.optim.LAMB(params, lr=0.01, weight_decay=0.01)


TRUST_RATIO = {"lars": lars, "lamb": lamb}  # the optimizers that read whole tensors' norms


def muon(params):
    """Muon over the matrices (orthogonalised whole), AdamW over the biases."""
    return pipetrain.optim.muon_with_adamw(lr=0.02, adamw_lr=0.01, weight_decay=0.01)(list(params))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


MODELS = {  # name -> (builder taking a dtype, loss, mini-batches of (inputs, targets) in float32: see steps_in)
    "llama": (llama, token_loss,
              [({"input_ids": ids}, ids) for ids in torch.randint(0, VOCAB, (STEPS + 2, 4, SEQ),
                                                                  generator=torch.Generator().manual_seed(1))]),
    "mlp": (lambda dtype=EXACT: make("mlp").to(dtype), F.cross_entropy,
            [data("mlp", 8, seed=1 + i) for i in range(STEPS + 2)]),
}


SEQUENCE_NORMS = {"model.layers.*.input_layernorm": "sequence_parallel",  # the Llama's, for sequence parallelism
                  "model.layers.*.post_attention_layernorm": "sequence_parallel", "model.norm": "sequence_parallel"}


MAX_NORM = 0.2  # below the MLP's gradient norms in these steps (0.4 and more): every step clips
# The MLP under every other synchronous schedule, split backward (B and W apart) and recomputation included,
# clipped by the global norm over both stages and both tensor ranks, and in low precision.
SCHEDULES = ("gpipe", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev", "interleaved-zb")
VARIANTS = {**{s: dict(schedule=s) for s in SCHEDULES},
            "clipped": dict(max_grad_norm=MAX_NORM),
            "zb-h1-recompute": dict(schedule="zb-h1", recompute="always"),
            # SGD: AdamW's normalised steps turn a 16-bit rounding of a tiny gradient into a full step of either sign
            "bf16": dict(precision="bf16", optimizer=sgd, dtype=LOW), "fp16": dict(precision="fp16", optimizer=sgd, dtype=LOW)}


GQA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=32)
FAMILIES = {  # more decoder families, each split by its own plan (OPT: the automatic one), one SGD step each
    # per-head q/k RMSNorms: whole weights reading split heads, their gradients summed over the ranks
    "qwen3": lambda: hf.Qwen3ForCausalLM(hf.Qwen3Config(**GQA, head_dim=8)),
    # fused qkv and gate_up, gathered; o_proj and down_proj cut their whole inputs (rowwise_split_input)
    "phi3": lambda: hf.Phi3ForCausalLM(hf.Phi3Config(**GQA, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                     attention_dropout=0.0)),
    # fused per-head qkv cut into q, k, v (chunk), vocabulary-split embedding
    "gpt-neox": lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)),
    # no plan of its own: fc1/fc2 pairs; the head tied to the embedding on the other stage stays whole
    "opt": lambda: hf.OPTForCausalLM(hf.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)),
}


def family_step(name: str, ids: torch.Tensor, pipeline: bool) -> dict[str, torch.Tensor]:
    """Family ``name`` after one SGD step on ``ids``: split (2 stages x T=2) or unsplit."""
    torch.manual_seed(0)
    model = FAMILIES[name]().to(EXACT)
    optimizer = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
    if pipeline:
        pipe = wrap_unprofiled(model, {"input_ids": ids}, stages=2, micro_batches=1, tensor_parallel=2,
                               engine="distributed", loss_fn=token_loss, optimizer=optimizer)
        pipe.step({"input_ids": ids}, ids)
        state = pipe.state_dict()
        pipe.close()
        return state
    opt = optimizer(model.parameters())
    token_loss(model(input_ids=ids), ids).backward()
    opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


FAMILY_IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
PADDING = torch.tensor([[1] * SEQ, [1] * (SEQ - 3) + [0] * 3])  # the second sequence padded: a real attention mask


def padded_llama_step(pipeline: bool) -> dict[str, torch.Tensor]:
    """The Llama after one SGD step on FAMILY_IDS with PADDING as its attention mask (the causal-and-padding mask the
    model builds on stage 0 reaches the attention of stage 1 across the boundary): split (2 stages x T=2) or not."""
    model = llama()
    inputs = {"input_ids": FAMILY_IDS, "attention_mask": PADDING}
    optimizer = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
    if pipeline:
        pipe = wrap_unprofiled(model, inputs, stages=2, micro_batches=1, tensor_parallel=2, engine="distributed",
                               loss_fn=token_loss, optimizer=optimizer)
        pipe.step(inputs, FAMILY_IDS)
        state = pipe.state_dict()
        pipe.close()
        return state
    opt = optimizer(model.parameters())
    token_loss(model(**inputs), FAMILY_IDS).backward()
    opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


CAPTURES: dict = {}  # each model is captured once per process (torch.export takes most of a tiny Llama's wrap)


def wrap(name: str, dtype: torch.dtype = EXACT, **options) -> pipetrain.Pipeline:
    build, loss, steps = MODELS[name]
    settings = dict(stages=2, micro_batches=MICRO, tensor_parallel=2, optimizer=adamw, loss_fn=loss,
                    engine="distributed")
    settings.update(options)
    with pytest.MonkeyPatch.context() as patch, capture_once(patch, CAPTURES, ("tensor-parallel", name, dtype)):
        return wrap_unprofiled(build(dtype), _first_micro_batch(in_dtype(steps[0][0], dtype)), **settings)


def _first_micro_batch(x):
    return {k: v[: len(v) // MICRO] for k, v in x.items()} if isinstance(x, dict) else x[: len(x) // MICRO]


def held_fraction(pipe: pipetrain.Pipeline) -> float:
    """This rank's bytes of its stage's parameters over the whole stage's."""
    params = [p for rt in pipe.held_stages.values() for p in rt.module.parameters()]
    local = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in params)
    return local / sum(p.nbytes for p in params)


class DroppingMLP(nn.Module):
    """Two MLP blocks with dropout on their split hidden features, and on the whole output of the first."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down, self.up2, self.down2 = nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 64), nn.Linear(64, 4)
        self.hidden_drop, self.out_drop, self.hidden_drop2 = nn.Dropout(0.5), nn.Dropout(0.25), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out_drop(self.down(self.hidden_drop(F.gelu(self.up(x)))))
        return self.down2(self.hidden_drop2(F.gelu(self.up2(h))))  # GELU: no zeros but those dropout makes


DROPOUT_BATCH = (torch.randn(8, 16, generator=torch.Generator().manual_seed(3)),
                 torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(4)))


def dropout_runs() -> dict:
    """The dropping MLP at 2 stages x T=2, two SGD steps, with and without recomputation: its state, and the masks
    (zeros of the output) of the dropouts on split values in this rank's stage, in the order they ran."""
    out = {}
    x, y = DROPOUT_BATCH
    for recompute in ("none", "always"):
        pipe = wrap_unprofiled(DroppingMLP(), x[:4], stages=2, micro_batches=2, tensor_parallel=2, recompute=recompute,
                               engine="distributed", loss_fn=F.cross_entropy, optimizer=sgd)
        masks: list[torch.Tensor] = []
        for rt in pipe.held_stages.values():
            for layer in rt.module.modules():
                if isinstance(layer, LaneDraws):
                    layer.register_forward_hook(lambda layer, args, output: masks.append(output.detach() == 0))
        for _ in range(2):
            pipe.step(x, y)
        out[recompute] = {"state": pipe.state_dict(), "masks": masks}
        pipe.close()
    return out


def meta_build(weights: str, **options) -> dict:
    """The Llama built on the meta device and read from ``weights`` at 2 stages x T=2: what its rank allocated
    while its stage was made (peak bytes of floating tensors), against its own blocks, the largest whole tensor and
    the whole stage; then its state after the same steps as the other scenarios."""
    from test_zero3 import PeakBytes

    with torch.device("meta"):
        model = hf.LlamaForCausalLM(hf.LlamaConfig(**LLAMA_CONFIG)).to(EXACT)
    steps = MODELS["llama"][2]
    with PeakBytes() as counter:
        pipe = wrap_unprofiled(model, _first_micro_batch(steps[0][0]), stages=2, micro_batches=MICRO,
                               tensor_parallel=2, optimizer=adamw, loss_fn=token_loss, engine="distributed",
                               weights=weights, **options)
    tensors = [*(p for rt in pipe.held_stages.values() for p in rt.module.parameters()),
               *(b for rt in pipe.held_stages.values() for b in rt.module.buffers())]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    made = {"peak": counter.peak, "own": sum(t.nbytes for t in local), "whole": sum(t.nbytes for t in tensors),
            "largest": max(t.nbytes for t in tensors)}
    for x, y in steps[:STEPS]:
        pipe.step(x, y)
    state = pipe.state_dict()
    pipe.close()
    return {"made": made, "state": state}


def scenarios(rank: int, world: int, root: str) -> dict:
    out: dict = {"meta": meta_build(str(Path(root) / "llama.safetensors")), "dropout": dropout_runs()}
    for name in MODELS:
        steps = steps_in(name)
        pipe = wrap(name)
        out[name, "fraction"] = held_fraction(pipe)
        out[name, "losses"] = [pipe.step(x, y) for x, y in steps[:STEPS]]
        out[name, "state"] = pipe.state_dict()
        out[name, "bytes"] = pipe.last_result.comm_bytes
        pipe.save(Path(root) / f"{name}-t2")
        pipe.close()
        # Resume across T: the T=2 checkpoint at T=1 (2 stages x 2 replicas on the same 4 ranks), and a T=1 one
        # (4 stages) at T=2.
        resumed = wrap(name, tensor_parallel=1, data_parallel=2)
        resumed.load(Path(root) / f"{name}-t2")
        resumed.step(*steps[STEPS])
        out[name, "t2 -> t1"] = resumed.state_dict()
        resumed.close()
        pipe = wrap(name, tensor_parallel=1, stages=4)
        for x, y in steps[:STEPS]:
            pipe.step(x, y)
        pipe.save(Path(root) / f"{name}-t1")
        pipe.close()
        resumed = wrap(name)
        resumed.load(Path(root) / f"{name}-t1")
        resumed.step(*steps[STEPS])
        out[name, "t1 -> t2"] = resumed.state_dict()
        resumed.close()
    for variant, options in VARIANTS.items():
        pipe = wrap("mlp", **options)
        for x, y in steps_in("mlp", options.get("dtype", EXACT))[:STEPS]:
            pipe.step(x, y)
        out[variant] = pipe.state_dict(), pipe.last_result.grad_norm
        pipe.close()
    for name in FAMILIES:
        out["family", name] = family_step(name, FAMILY_IDS, pipeline=True)
    out["padded"] = padded_llama_step(pipeline=True)
    try:
        gpt2 = hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32))
        wrap_unprofiled(gpt2, {"input_ids": FAMILY_IDS}, stages=2, micro_batches=1, tensor_parallel=2,
                        engine="distributed", loss_fn=token_loss)
        out["nothing split"] = None
    except TensorParallelError as error:
        out["nothing split"] = str(error)
    try:
        wrap("llama", tp_plan={"layers.*.self_attn.q_proj": "colwise"})
        out["refused"] = None
    except TensorParallelError as error:
        out["refused"] = str(error)
    return out


def held_fractions(pipe: pipetrain.Pipeline) -> tuple[float, float]:
    """Elements of its stage's parameters, and of AdamW's first moments, this rank keeps, over those of its lane's
    blocks (1/T of a split tensor, a whole one)."""
    params = [p for rt in pipe.held_stages.values() for p in rt.module.parameters()]
    blocks = sum(p.numel() // 2 if is_split(p) else p.numel() for p in params)
    kept = sum(local(state["exp_avg"]).numel() for rt in pipe.held_stages.values()
               for state in rt.optimizer.state.values() if "exp_avg" in state)
    return sum(local(p).numel() for p in params) / blocks, kept / blocks


def hybrid_scenarios(rank: int, world: int, root: str) -> dict:
    """2 stages x 2 replicas x 2 tensor ranks (8 ranks); ZeRO-1 and ZeRO-2 over each lane's replicas, and
    checkpoints between them and unsplit pipelines."""
    out = {}
    for name in MODELS:
        steps = steps_in(name)
        for zero in (0, 1, 2, 3):
            pipe = wrap(name, data_parallel=2, zero=zero)
            out[name, "losses", zero] = [pipe.step(x, y) for x, y in steps[:STEPS]]
            out[name, "state", zero] = pipe.state_dict()
            out[name, "fractions", zero] = held_fractions(pipe)
            if zero >= 2:
                pipe.save(Path(root) / f"{name}-zero{zero}")
            pipe.close()
        resumed = wrap(name, tensor_parallel=1, stages=4, data_parallel=2, zero=1)
        resumed.load(Path(root) / f"{name}-zero3")
        resumed.step(*steps[STEPS])
        out[name, "zero3 t2 -> t1"] = resumed.state_dict()
        resumed.close()
        # The ZeRO-2 tensor-parallel checkpoint resumed without either (4 stages x 2 replicas), and an unsplit
        # one resumed with both.
        resumed = wrap(name, tensor_parallel=1, stages=4, data_parallel=2)
        resumed.load(Path(root) / f"{name}-zero2")
        resumed.step(*steps[STEPS])
        resumed.save(Path(root) / f"{name}-plain")
        out[name, "zero2 t2 -> t1"] = resumed.state_dict()
        resumed.close()
        resumed = wrap(name, data_parallel=2, zero=1)
        resumed.load(Path(root) / f"{name}-plain")
        resumed.step(*steps[STEPS + 1])
        out[name, "t1 -> zero1 t2"] = resumed.state_dict()
        resumed.close()
        # HSDP x TP: one stage, 4 replicas on 2 nodes of 2, T=2: FSDP2 shards each lane's blocks over a node's
        # replicas and all-reduces them across the nodes (a (node, replica, lane) mesh)
        pipe = wrap(name, stages=1, data_parallel=4, micro_batches=1, zero=3, hierarchy=(2, 2))
        out[name, "losses", "hsdp"] = [pipe.step(x, y) for x, y in steps[:STEPS]]
        out[name, "state", "hsdp"] = pipe.state_dict()
        out[name, "fractions", "hsdp"] = held_fractions(pipe)
        pipe.close()
    out["meta zero3"] = meta_build(str(Path(root) / "llama.safetensors"), data_parallel=2, zero=3)
    pipe = wrap("mlp", data_parallel=2, zero=2, optimizer=lars)  # whole tensors (blocks) owned by one replica each
    for x, y in steps_in("mlp")[:STEPS]:
        pipe.step(x, y)
    out["lars zero2"] = pipe.state_dict()
    pipe.close()
    # The trust ratios of blocks (zero=0: DTensors on the lanes' mesh) and of FSDP2's shards of blocks (zero=3: a
    # (replica, lane) mesh): whole tensors' norms, and the all-reduces each optimizer step runs.
    for optimizer, factory in TRUST_RATIO.items():
        for zero in (0, 3):
            pipe = wrap("mlp", data_parallel=2, zero=zero, optimizer=factory)
            collectives = optimizer_collectives(pipe)
            for x, y in steps_in("mlp")[:STEPS]:
                pipe.step(x, y)
            out[optimizer, "trust", zero] = pipe.state_dict(), collectives
            pipe.close()
    # Muon on blocks (zero=0) and on FSDP2's shards of blocks (zero=3): each update orthogonalised whole.
    for zero in (0, 3):
        pipe = wrap("mlp", data_parallel=2, zero=zero, optimizer=muon)
        for x, y in steps_in("mlp")[:STEPS]:
            pipe.step(x, y)
        split = [p for rt in pipe.held_stages.values() for g in rt.optimizer.param_groups if "ns_steps" in g
                 for p in g["params"] if local(p).shape != p.shape]
        out["muon", zero] = pipe.state_dict(), len(split)
        pipe.close()
    # sequence parallelism with replicas and ZeRO-1: the norms' weights, whole, summed over the lanes, then averaged
    pipe = wrap("llama", data_parallel=2, zero=1, tp_plan={**llama().tp_plan, **SEQUENCE_NORMS})
    out["llama", "losses", "sequence"] = [pipe.step(x, y) for x, y in steps_in("llama")[:STEPS]]
    out["llama", "state", "sequence"] = pipe.state_dict()
    pipe.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("tensor_parallel")
    # what the meta-device build reads, tensor by tensor (safetensors: no whole file loaded at once)
    save_file({k: v.contiguous() for k, v in llama().state_dict().items()}, str(root / "llama.safetensors"))
    return run_world(4, "test_tensor_parallel", "scenarios", root, str(root))


@pytest.fixture(scope="module")
def hybrid_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("tensor_parallel_hybrid")
    save_file({k: v.contiguous() for k, v in llama().state_dict().items()}, str(root / "llama.safetensors"))
    return run_world(8, "test_tensor_parallel", "hybrid_scenarios", root, str(root))


def reference(name: str, steps: int, max_norm: float | None = None, autocast: torch.dtype | None = None,
              optimizer=adamw, dtype: torch.dtype = EXACT) -> tuple[dict[str, torch.Tensor], list[float], float]:
    """The unsplit model's state after ``steps`` mini-batches, each accumulated over MICRO micro-batches (clipped
    to ``max_norm``, under ``autocast``), its losses, and its last gradient norm, trained in ``dtype``."""
    build, loss, _ = MODELS[name]
    batches = steps_in(name, dtype)
    model = build(dtype)
    optimizer = optimizer(model.parameters())
    losses, norm = [], 0.0
    for x, y in batches[:steps]:
        optimizer.zero_grad()
        total = 0.0
        for part in range(MICRO):
            xs = {k: v.tensor_split(MICRO)[part] for k, v in x.items()} if isinstance(x, dict) else \
                x.tensor_split(MICRO)[part]
            ys = y.tensor_split(MICRO)[part]
            with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
                value = loss(model(**xs) if isinstance(xs, dict) else model(xs), ys).to(dtype) / MICRO
            value.backward()
            total += value.item()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm else float("inf")))
        optimizer.step()
        losses.append(total)
    return {k: v.detach() for k, v in model.state_dict().items()}, losses, norm


def gathered(ranks: list[dict], key, index: int | None = None, key_in: str | None = None) -> dict[str, torch.Tensor]:
    """The pipeline's whole state from the ranks (``result[key][index]`` when it is a tuple, ``result[key][key_in]``
    when a dict), after checking that every rank of a stage holds the same."""
    state: dict[str, torch.Tensor] = {}
    for result in ranks:
        found = result[key] if index is None else result[key][index]
        for k, v in (found if key_in is None else found[key_in]).items():
            if k in state:
                assert torch.equal(state[k], v), (key, k)
            state[k] = v
    return state


def assert_close_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) >= {k for k in want if not k.endswith("inv_freq")}
    for k, v in want.items():
        if k in got:
            torch.testing.assert_close(got[k], v, rtol=0, atol=TOL, msg=k)


def assert_trained_like_the_unsplit_model(results: list[dict], name: str, *zero: int) -> None:
    """Every rank's losses, and the ranks' parameters together, are the unsplit model's after STEPS steps."""
    want, losses, _ = reference(name, STEPS)
    assert_close_states(gathered(results, (name, "state", *zero)), want)
    for result in results:
        assert result[(name, "losses", *zero)] == pytest.approx(losses, abs=TOL)


@pytest.mark.parametrize("name", MODELS)
def test_three_adamw_steps_equal_the_unsplit_model(ranks, name):
    assert_trained_like_the_unsplit_model(ranks, name)


@pytest.mark.parametrize("name", MODELS)
def test_boundary_values_cross_once_per_stage_pair(ranks, name):
    """Each lane sends 1/T of a boundary value and the receiving lanes all-gather it: the bytes between the stages,
    summed over the lanes, are the unsplit pipeline's (the local engine's count), not T times them."""
    local = wrap(name, engine="local", tensor_parallel=1)
    for x, y in steps_in(name)[:STEPS]:
        local.step(x, y)
    whole = local.last_result.comm_bytes
    for kind in ("activations", "activation_grads"):
        assert sum(whole[kind]) > 0
        assert ranks[0][name, "bytes"][kind] == whole[kind], kind


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_with_data_parallel_replicas_and_zero_too(hybrid_ranks, name, zero):
    """2 x 2 x 2: each replica's half of the mini-batch, its gradients averaged over the replicas lane by lane;
    under ZeRO each replica steps an even half of its lane's blocks and keeps AdamW's state for that half alone
    (the split tensors' blocks are what ZeRO cuts, not the whole tensors), and under zero=3 (FSDP2 over the
    replica dimension of the stage's (replica, lane) mesh) half of the blocks themselves."""
    assert_trained_like_the_unsplit_model(hybrid_ranks, name, zero)
    params, moments = zip(*(result[name, "fractions", zero] for result in hybrid_ranks))
    assert moments == pytest.approx([1.0 if zero == 0 else 0.5] * len(moments), abs=0.02), moments
    assert params == pytest.approx([0.5 if zero == 3 else 1.0] * len(params), abs=0.02), params


def test_a_meta_device_build_under_zero3_makes_only_each_ranks_shards_and_trains_exactly(hybrid_ranks):
    """Built on the meta device and read from a file at 2 x 2 x 2 with zero=3: each rank cuts its lane's blocks, FSDP2
    shards them over the replicas, then only the rank's shards are made and read, one whole tensor in host memory at
    a time: its peak is its shards, plus that tensor and the pieces cut from it (its lane's block, then the shard of
    that), below its whole stage's bytes."""
    want, _, _ = reference("llama", STEPS)
    assert_close_states(gathered(hybrid_ranks, "meta zero3", key_in="state"), want)
    for rank, result in enumerate(hybrid_ranks):
        made = result["meta zero3"]["made"]
        assert made["own"] <= made["peak"] <= made["own"] + 3 * made["largest"] + 1024 < made["whole"], (rank, made)
        assert made["own"] <= made["whole"] // 4 + 1024, (rank, made)  # a quarter: 1/T of the blocks, 1/D of those


def test_zero_with_an_optimizer_reading_whole_tensors(hybrid_ranks):
    """LARS's trust ratio reads a tensor's norm: ZeRO gives each replica whole blocks to step, and the norm of a
    split tensor is taken over its blocks on every lane."""
    want, _, _ = reference("mlp", STEPS, optimizer=lars)
    assert_close_states(gathered(hybrid_ranks, "lars zero2"), want)


@pytest.mark.parametrize("zero", [0, 3])
@pytest.mark.parametrize("optimizer", list(TRUST_RATIO))
def test_trust_ratios_of_split_and_sharded_tensors_are_the_whole_tensors(hybrid_ranks, optimizer, zero):
    """LARS and LAMB on blocks of split tensors (zero=0) and on FSDP2 shards of them (zero=3) step as on the unsplit
    model. The squared norms are summed over each group of mesh dimensions in one all-reduce per dimension: the
    lanes' (zero=0), and for zero=3 the replicas' and lanes' of the split tensors plus the replicas' of the others,
    3 at most, where DTensor's own norms take one per tensor and norm."""
    want, _, _ = reference("mlp", STEPS, optimizer=TRUST_RATIO[optimizer])
    assert_close_states(gathered(hybrid_ranks, (optimizer, "trust", zero), index=0), want)
    for result in hybrid_ranks:
        counts = result[optimizer, "trust", zero][1]
        assert len(counts) == STEPS and all(1 <= n <= (1 if zero == 0 else 3) for n in counts), counts


@pytest.mark.parametrize("zero", [0, 3])
def test_muon_orthogonalises_split_and_sharded_matrices_whole(hybrid_ranks, zero):
    """Muon on a rank's block of a matrix (zero=0) or its FSDP2 shard of one (zero=3) gathers the update, runs
    Newton-Schulz on the whole matrix and keeps its part: the unsplit model's steps. The model's matrices run in
    float64 and Newton-Schulz in bfloat16 (torch's Muon), whose inputs the reordered float64 sums do not change."""
    want, _, _ = reference("mlp", STEPS, optimizer=muon)
    assert_close_states(gathered(hybrid_ranks, ("muon", zero), index=0), want)
    assert all(result["muon", zero][1] > 0 for result in hybrid_ranks)  # every rank stepped part of a matrix


def test_sequence_parallelism_with_replicas_and_zero(hybrid_ranks):
    assert_trained_like_the_unsplit_model(hybrid_ranks, "llama", "sequence")


@pytest.mark.parametrize("name", MODELS)
def test_hsdp_across_nodes_with_tensor_parallelism(hybrid_ranks, name):
    assert_trained_like_the_unsplit_model(hybrid_ranks, name, "hsdp")
    for result in hybrid_ranks:  # each lane's blocks cut in 2 (a node's replicas), not 4: the other node repeats them
        params, state = result[name, "fractions", "hsdp"]
        assert 0.45 <= params <= 0.55 and 0.45 <= state <= 0.55, (params, state)


@pytest.mark.parametrize("name", MODELS)
def test_zero_checkpoints_resume_across_tensor_parallel_sizes(hybrid_ranks, name):
    """ZeRO-2 at T=2 saved, resumed at T=1 without ZeRO on twice the stages, saved again, resumed at T=2 with
    ZeRO-1: the replicas' slices of each lane's blocks are put together whole, and cut again, exactly; and ZeRO-3
    at T=2 resumed at T=1 with ZeRO-1."""
    want, _, _ = reference(name, STEPS + 1)
    assert_close_states(gathered(hybrid_ranks, (name, "zero2 t2 -> t1")), want)
    assert_close_states(gathered(hybrid_ranks, (name, "zero3 t2 -> t1")), want)
    want, _, _ = reference(name, STEPS + 2)
    assert_close_states(gathered(hybrid_ranks, (name, "t1 -> zero1 t2")), want)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in ("bf16", "fp16")])
def test_every_synchronous_schedule_clipping_and_recompute(ranks, variant):
    clipped = variant == "clipped"
    want, _, norm = reference("mlp", STEPS, max_norm=MAX_NORM if clipped else None)
    assert_close_states(gathered(ranks, variant, index=0), want)
    if clipped:  # the norm over every stage and tensor rank, the whole (unsplit) tensors counted once
        assert norm > MAX_NORM
        assert ranks[0][variant][1] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_errs_no_more_than_the_unsplit_model_does(ranks, precision):
    """Under autocast the split model rounds partial sums and all-reduces them in 16 bits: its distance from the
    float32 reference must stay within twice the unsplit autocast model's own (a missing or doubled collective
    is off by whole gradients, far beyond)."""
    exact, _, _ = reference("mlp", STEPS, optimizer=sgd, dtype=LOW)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    rounded, _, _ = reference("mlp", STEPS, autocast=dtype, optimizer=sgd, dtype=LOW)
    got = gathered(ranks, precision, index=0)
    own = max((rounded[k] - exact[k]).abs().max().item() for k in exact)
    split = max((got[k] - exact[k]).abs().max().item() for k in exact)
    assert 0 < split <= 2 * own + TOL, (split, own)


@pytest.mark.parametrize("name", MODELS)
def test_each_tensor_rank_holds_about_half_its_stage(ranks, name):
    fractions = [result[name, "fraction"] for result in ranks]
    assert max(fractions) <= 0.55, fractions
    assert min(fractions) >= 0.45, fractions  # and not less: nothing is left out


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("direction", ["t2 -> t1", "t1 -> t2"])
def test_a_checkpoint_resumes_at_another_tensor_parallel_size(ranks, name, direction):
    want, _, _ = reference(name, STEPS + 1)
    assert_close_states(gathered(ranks, (name, direction)), want)


@pytest.mark.parametrize("name", FAMILIES)
def test_other_decoder_families_split_by_their_own_plans(ranks, name):
    assert_close_states(gathered(ranks, ("family", name)), family_step(name, FAMILY_IDS, pipeline=False))


def test_an_attention_mask_received_from_the_previous_stage(ranks):
    """The mask a stage receives enters its graph detached: its shape (broadcast over heads) is its input's."""
    assert_close_states(gathered(ranks, "padded"), padded_llama_step(pipeline=False))


def test_a_model_with_nothing_to_split_is_refused_with_what_to_pass(ranks):
    """GPT-2's projections are Conv1D, not nn.Linear, and it declares no plan: nothing would be split."""
    messages = {result["nothing split"] for result in ranks}
    assert len(messages) == 1
    (message,) = messages
    assert message is not None and "splits no layer" in message and "tp_plan=" in message, message


def test_a_meta_device_build_makes_only_each_ranks_blocks_and_trains_exactly(ranks):
    """Each rank cut its stage's meta parameters first, then made and read only its blocks, one whole tensor in
    host memory at a time: its peak is its blocks and buffers, plus the whole tensor being read and the block cut
    from it before it is copied in (1/T of it), below its whole stage's bytes (which the build would hold at once
    if it made the stage before cutting it)."""
    want, _, _ = reference("llama", STEPS)
    assert_close_states(gathered(ranks, "meta", index=None, key_in="state"), want)
    for rank, result in enumerate(ranks):
        made = result["meta"]["made"]
        bound = made["own"] + made["largest"] + made["largest"] // 2 + 1024
        assert made["own"] <= made["peak"] <= bound < made["whole"], (rank, made)


def test_dropout_on_split_values_draws_its_own_mask_on_each_lane(ranks):
    """A dropout on split hidden features drops each lane's block by a mask of its own (the same mask on every block
    would correlate what the unsplit model drops independently), while the dropout on the whole output draws alike
    on both lanes (`gathered` checks that the lanes of a stage hold the same whole weights, which a lane-dependent
    mask there would break); a recomputed forward draws the same masks again, so training with recomputation is
    bit for bit training without it."""
    for stage in (0, 1):  # ranks 2 * stage and 2 * stage + 1: lanes 0 and 1 of the stage
        lanes = [ranks[2 * stage + lane]["dropout"]["none"]["masks"] for lane in (0, 1)]
        assert len(lanes[0]) == len(lanes[1]) == 4  # 2 steps x 2 micro-batches, one split dropout per stage
        for first, second in zip(*lanes):
            assert first.shape == second.shape == (4, 32)
            assert not torch.equal(first, second)
            assert 0.25 < first.float().mean().item() < 0.75  # p = 0.5: 128 elements, 4 standard deviations
    states = {recompute: gathered([r["dropout"][recompute] for r in ranks], "state") for recompute in ("none", "always")}
    assert states["none"].keys() == states["always"].keys()
    for name, value in states["none"].items():
        assert torch.equal(value, states["always"][name]), name


def test_a_plan_that_leaves_a_split_unpaired_is_refused_on_every_rank(ranks):
    messages = {result["refused"] for result in ranks}
    assert len(messages) == 1
    (message,) = messages
    assert message is not None and "q_proj" in message and "tp_plan" in message, message
