"""Weight sources: every form a checkpoint comes in loads into a fresh model bit for bit (tied names included),
each problem raises one WeightsError that names the keys or file and the fix, and reading goes tensor by tensor.

The reference is the model that wrote the checkpoint: after ``copy_into`` a model built from the same config
with another seed has its state dict exactly (the copy moves bits; only the bf16 case converts, compared
with torch's own conversion)."""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file

from language_models import VOCAB, build_language_model, lm_loss, token_batch
from pipetrain.weights import WeightsError, copy_into, match_names, open_weights
from helpers import wrap_unprofiled

hf.logging.set_verbosity_error()
MIB = 2 ** 20


def build(name: str, seed: int) -> torch.nn.Module:
    """Family ``name`` with the weights seed ``seed`` draws (T5: encoder-decoder, four names for one embedding)."""
    if name != "t5":
        return build_language_model(name, seed)
    torch.manual_seed(seed)
    return hf.T5ForConditionalGeneration(hf.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                                     num_heads=2, dropout_rate=0.0))


def model_names(model: torch.nn.Module) -> tuple[dict, list[list[str]], set[str]]:
    """What the model expects: its state dict's names with shapes and dtypes, the names that are one tensor,
    and its non-persistent buffers."""
    state = model.state_dict(keep_vars=True)  # tied names give the same Parameter object
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    recomputed = {name for name, _ in model.named_buffers(remove_duplicate=False)} - set(state)
    return {k: (t.shape, t.dtype) for k, t in state.items()}, list(groups.values()), recomputed


def once_per_tensor(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each tied tensor under its first name only, as Hugging Face saves it."""
    _, aliases, _ = model_names(model)
    state = model.state_dict()
    return {group[0]: state[group[0]].contiguous() for group in aliases}


def hf_shards(model: torch.nn.Module, out: Path) -> Path:
    model.save_pretrained(out, max_shard_size="20KB")
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    return out


def hf_single(model: torch.nn.Module, out: Path) -> Path:
    model.save_pretrained(out)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    return out


def safetensors_file(model: torch.nn.Module, out: Path) -> Path:
    save_file(once_per_tensor(model), out.with_suffix(".safetensors"))
    return out.with_suffix(".safetensors")


def torch_file(model: torch.nn.Module, out: Path) -> Path:
    torch.save(model.state_dict(), out.with_suffix(".pt"))  # tied names all present, one storage
    return out.with_suffix(".pt")


def bin_shards(model: torch.nn.Module, out: Path) -> Path:
    """Hugging Face's older layout, written by hand: two torch.save'd halves and their index."""
    out.mkdir()
    state = model.state_dict()
    names = list(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[:len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for file, part in halves.items():
        torch.save({k: state[k] for k in part}, out / file)
    weight_map = {k: file for file, part in halves.items() for k in part}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def pipetrain_checkpoint(model: torch.nn.Module, out: Path) -> Path:
    if isinstance(model, hf.T5ForConditionalGeneration):
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
        inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    else:
        inputs = token_batch(2, 0)[0]
    pipe = wrap_unprofiled(model, inputs, stages=2, engine="local", loss_fn=lm_loss,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    pipe.save(out)
    return out


FORMS: dict[str, Callable[[torch.nn.Module, Path], Path]] = {
    "hf-shards": hf_shards, "hf-single": hf_single, "safetensors-file": safetensors_file, "torch-file": torch_file,
    "bin-shards": bin_shards, "pipetrain": pipetrain_checkpoint}
ONE_NAME_PER_TENSOR = {"hf-shards", "hf-single", "safetensors-file"}


@pytest.mark.slow
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_every_form_loads_into_a_fresh_model_exactly(family: str, form: str, tmp_path: Path, one_thread) -> None:
    model = build(family, seed=0)
    saved = {k: t.clone() for k, t in model.state_dict().items()}
    source = open_weights(FORMS[form](model, tmp_path / "ckpt"))
    expected, aliases, recomputed = model_names(model)
    if form in ONE_NAME_PER_TENSOR:  # the tied tensors are found under one of their names
        assert all(sum(name in source.names() for name in group) == 1 for group in aliases)
    keys = match_names(source.names(), expected, aliases, recomputed, source=source.describe())

    fresh = build(family, seed=1)
    assert not all(torch.equal(fresh.state_dict()[k], t) for k, t in saved.items())  # there is something to copy
    copy_into(source, fresh.state_dict(keep_vars=True), keys)
    loaded = fresh.state_dict()
    assert set(loaded) == set(saved)
    for name, t in saved.items():
        assert torch.equal(loaded[name], t), name
    if family == "gpt2":
        assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied after the copy


def test_bf16_weights_convert_to_the_fp32_targets(tmp_path: Path) -> None:
    model = build("llama", seed=0)
    half = {k: t.to(torch.bfloat16) for k, t in model.state_dict().items()}
    save_file(half, tmp_path / "bf16.safetensors")
    source = open_weights(tmp_path / "bf16.safetensors")
    assert {info[1] for info in source.names().values()} == {torch.bfloat16}
    expected, aliases, recomputed = model_names(model)
    keys = match_names(source.names(), expected, aliases, recomputed)  # a dtype difference is no error

    fresh = build("llama", seed=1)
    copy_into(source, fresh.state_dict(keep_vars=True), keys)
    for name, t in fresh.state_dict().items():
        assert t.dtype == torch.float32 and torch.equal(t, half[name].float()), name  # bf16 -> fp32 is exact


def test_recomputed_buffers_in_the_file_are_ignored(tmp_path: Path) -> None:
    model = build("llama", seed=0)
    expected, aliases, recomputed = model_names(model)
    assert recomputed  # rotary inv_freq: not in the state dict
    buffers = dict(model.named_buffers())
    save_file({**once_per_tensor(model), **{k: buffers[k] for k in recomputed}}, tmp_path / "w.safetensors")
    source = open_weights(tmp_path / "w.safetensors")
    assert recomputed <= set(source.names())
    assert match_names(source.names(), expected, aliases, recomputed) == {k: k for k in expected}


def test_missing_and_unexpected_keys_are_one_error(tmp_path: Path) -> None:
    model = build("gpt2", seed=0)
    state = once_per_tensor(model)
    del state["transformer.wte.weight"], state["transformer.ln_f.bias"]  # lm_head.weight is tied to wte
    state["classifier.weight"] = torch.zeros(2, 16)
    save_file(state, tmp_path / "w.safetensors")
    source = open_weights(tmp_path / "w.safetensors")
    with pytest.raises(WeightsError) as error:
        match_names(source.names(), *model_names(model), source=source.describe())
    message = str(error.value)
    assert f"safetensors file {tmp_path / 'w.safetensors'} does not fit the model" in message
    assert "2 tensors of the model missing" in message
    assert "transformer.wte.weight = lm_head.weight" in message and "transformer.ln_f.bias" in message
    assert "1 unexpected keys, no name of the model: classifier.weight" in message
    assert "shape" not in message
    assert "save it from the model you pass to wrap, or build the model with from_pretrained" in message


def test_a_checkpoint_of_another_size_lists_the_shape_mismatches(tmp_path: Path) -> None:
    wider = hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               max_position_embeddings=32, tie_word_embeddings=False))
    wider.save_pretrained(tmp_path)
    model = build("llama", seed=0)
    expected, aliases, recomputed = model_names(model)
    mismatching = sum(1 for k, t in wider.state_dict().items() if t.shape != expected[k][0])
    assert mismatching > 10
    with pytest.raises(WeightsError) as error:
        match_names(open_weights(tmp_path).names(), expected, aliases, recomputed)
    message = str(error.value)
    assert f"{mismatching} shape mismatches" in message
    assert "model.embed_tokens.weight: (64, 16) in the model, (64, 32) in the checkpoint" in message
    assert f"and {mismatching - 10} more" in message  # ten listed, the rest counted
    assert "missing" not in message and "unexpected" not in message
    assert "another model or another config" in message


def test_copy_into_refuses_a_tensor_of_another_shape(tmp_path: Path) -> None:
    save_file({"w": torch.ones(16)}, tmp_path / "w.safetensors")
    target = torch.zeros(4, 16)  # copy_ alone would broadcast the row into every row
    with pytest.raises(WeightsError, match=r"w in safetensors file .* has shape \(16,\), but layer.weight here "
                                           r"has \(4, 16\); check the names with match_names"):
        copy_into(open_weights(tmp_path / "w.safetensors"), {"layer.weight": target}, {"layer.weight": "w"})
    assert not target.any()


def test_paths_that_are_no_checkpoint(tmp_path: Path) -> None:
    accepted = "weights= takes a Hugging Face checkpoint directory"
    with pytest.raises(WeightsError, match=f"{tmp_path / 'nowhere'} does not exist. {accepted}"):
        open_weights(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match=f"{tmp_path / 'empty'} is a directory without a checkpoint "
                                           f"\\(it is empty\\). {accepted}"):
        open_weights(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(WeightsError, match=r"without a checkpoint \(it holds empty, notes.txt\)"):
        open_weights(tmp_path)
    with pytest.raises(WeightsError, match=f"notes.txt is not a checkpoint pipetrain reads: torch.load cannot "
                                           f"read it .*{accepted}"):
        open_weights(tmp_path / "notes.txt")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(WeightsError, match="bad.safetensors is not a readable safetensors file .* Save or "
                                           "download it again"):
        open_weights(tmp_path / "bad.safetensors")


def test_torch_files_that_are_no_state_dict(tmp_path: Path) -> None:
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    with pytest.raises(WeightsError, match=r"list.pt holds a list, not a state dict: expected a flat dict of "
                                           r"tensor name -> tensor, as torch.save\(model.state_dict\(\), path\)"):
        open_weights(tmp_path / "list.pt")
    state = build("llama", seed=0).state_dict()
    torch.save({"model": state, "step": 3}, tmp_path / "training.pt")
    with pytest.raises(WeightsError, match=r"training.pt holds a dict whose entries 'model', 'step' are not tensors "
                                           r"\(OrderedDict, int\).* torch.save\(checkpoint\['model'\], path\)"):
        open_weights(tmp_path / "training.pt")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")  # unpickling it would run the class's code
    with pytest.raises(WeightsError, match=r"module.pt holds Python objects, not only tensors \(a pickled "
                                           r"torch.nn.modules.linear.Linear\).*weights_only=True"):
        open_weights(tmp_path / "module.pt")


def _write_index(directory: Path, shard: str) -> None:
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"inside.weight": "inside.safetensors", "other.weight": shard}}))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "ABSOLUTE", "link.safetensors"])
def test_an_index_naming_a_file_outside_its_directory_is_refused(shard: str, tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    save_file({"other.weight": torch.ones(2)}, outside)  # it exists: only where it is makes it wrong
    directory = tmp_path / "ckpt"
    directory.mkdir()
    save_file({"inside.weight": torch.ones(2)}, directory / "inside.safetensors")
    (directory / "link.safetensors").symlink_to(outside)
    shard = str(outside) if shard == "ABSOLUTE" else shard
    _write_index(directory, shard)
    with pytest.raises(WeightsError) as error:
        open_weights(directory)
    message = str(error.value)
    assert f"names the shard {shard!r}, which is outside {directory}, so nothing was read" in message
    assert "put the shards beside it and name them relative to it" in message


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    build("llama", seed=0).save_pretrained(tmp_path, max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    gone = sorted(set(weight_map.values()))[-1]
    (tmp_path / gone).unlink()
    users = sum(1 for f in weight_map.values() if f == gone)
    with pytest.raises(WeightsError, match=f"the shard {tmp_path / gone} is missing: .* names it for {users} "
                                           f"tensors .* fetch {gone} again"):
        open_weights(tmp_path)


def test_an_index_listing_a_tensor_its_shard_lacks(tmp_path: Path) -> None:
    save_file({"inside.weight": torch.ones(2)}, tmp_path / "inside.safetensors")
    _write_index(tmp_path, "inside.safetensors")  # other.weight is listed in the shard that lacks it
    with pytest.raises(WeightsError, match=r"lists 1 tensors that its shards do not hold: other.weight \(in "
                                           r"inside.safetensors\).*from different saves"):
        open_weights(tmp_path)


class CountingReads:
    """A weight source that records the names read and the file of each read."""

    def __init__(self, source) -> None:
        self.source, self.reads, self.files = source, Counter(), []

    def read(self, name: str) -> torch.Tensor:
        self.reads[name] += 1
        self.files.append(self.source.file_of(name))
        return self.source.read(name)

    def file_of(self, name: str) -> Path:
        return self.source.file_of(name)

    def describe(self) -> str:
        return self.source.describe()


def test_copy_into_reads_each_distinct_tensor_once_file_by_file(tmp_path: Path) -> None:
    model = build("gpt2", seed=0)
    source = open_weights(hf_shards(model, tmp_path))
    keys = match_names(source.names(), *model_names(model))
    fresh = build("gpt2", seed=1)
    state = fresh.state_dict(keep_vars=True)
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    names = list(state)  # first and last alternately: the targets' order jumps between the first and last shard
    targets = {name: state[name] for pair in zip(names, reversed(names)) for name in pair}

    counting = CountingReads(source)
    read = copy_into(counting, targets, keys)
    distinct = {id(t) for t in targets.values()}
    assert sum(counting.reads.values()) == len(distinct) and set(counting.reads.values()) == {1}
    assert "lm_head.weight" not in counting.reads  # read once, under the name the file has
    changes = sum(1 for a, b in zip(counting.files, counting.files[1:]) if a != b)
    assert changes == len(set(counting.files)) - 1  # each file's tensors read together
    info = source.names()
    assert read == sum(info[k][0].numel() * info[k][1].itemsize for k in counting.reads)


def test_copy_into_a_stage_reads_only_its_tensors(tmp_path: Path) -> None:
    model = build("llama", seed=0)
    source = open_weights(hf_shards(model, tmp_path))
    keys = match_names(source.names(), *model_names(model))
    fresh = build("llama", seed=1)
    before = {k: t.clone() for k, t in fresh.state_dict().items()}
    stage = {k: t for k, t in fresh.state_dict(keep_vars=True).items() if k.startswith("model.layers.1.")}

    counting = CountingReads(source)
    copy_into(counting, stage, keys)
    assert set(counting.reads) == set(stage)
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, model.state_dict()[name] if name in stage else before[name]), name


def _peak_rss_growth(action: Callable[[], object]) -> int:
    """How far the process's resident memory rose above its level before ``action``, at the peak (Linux:
    writing 5 to clear_refs resets the peak to the current level)."""
    def status(field: str) -> int:
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
        return int(line.split()[1]) * 1024

    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS:")
    action()
    return status("VmHWM:") - before


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS")
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_names_reads_no_tensor_data(suffix: str, tmp_path: Path) -> None:
    """Opening a file and listing its names leave its data on disk; reading one tensor pages in just that."""
    big = torch.zeros(32 * MIB // 4)  # zeros: the pages the read touches are what counts, not their values
    tensors = {"big": big, "small": torch.arange(4.0)}
    file = tmp_path / f"w{suffix}"
    save_file(tensors, file) if suffix == ".safetensors" else torch.save(tensors, file)
    del big, tensors

    sources = []
    assert _peak_rss_growth(lambda: sources.append(open_weights(file).names())) < 8 * MIB
    source = open_weights(file)
    assert torch.equal(source.read("small"), torch.arange(4.0))
    assert _peak_rss_growth(lambda: source.read("big").sum()) > 24 * MIB  # the measure sees a read
