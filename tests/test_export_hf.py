"""`pipetrain export --hf` writes a checkpoint as a directory Hugging Face's from_pretrained loads, reading one
stage file at a time: the loaded model's eval output equals the pipeline's predict bit for bit (the same weights;
predict runs the captured ATen calls, which give the same bits here) and its state dict equals the pipeline's,
with no key missing or unexpected. Tied tensors go in once, under the model's own first name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as hf
from safetensors import safe_open
from safetensors.torch import load_file

from dist_harness import run_world
from pipetrain.cli import main
from runtime_models import data, loss_fn, make
from test_save_pretrained import CLASSES, loaded, trained
from third_party_models import CASES
from helpers import wrap_unprofiled

hf.logging.set_verbosity_error()
SMALL_SHARDS = "4000"  # bytes: every tiny model spreads over several files


def eval_logits(name: str, model: torch.nn.Module) -> torch.Tensor:
    x, _ = CASES[name].batch(5, 3)
    with torch.no_grad():
        return model(**x).logits


def assert_same_state(state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Every name of ``state`` has the bits the loaded model holds under it."""
    theirs = model.state_dict()
    differ = [k for k, t in state.items() if not torch.equal(t, theirs[k])]
    assert not differ, differ


def stored_names(out: Path) -> list[str]:
    """The tensor names the safetensors files of ``out`` hold, with repeats."""
    names = []
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names += list(f.keys())
    return names


def assert_sharded(out: Path) -> None:
    """Several files numbered 1..N of N, all of them in the index and nothing left half-written."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, "model.safetensors.index.json", "config.json"])
    assert sorted(index["weight_map"]) == sorted(stored_names(out))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for f in files for t in load_file(out / f).values())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CLASSES))
def test_export_loads_as_the_pipeline_learned(name: str, tmp_path: Path, capsys) -> None:
    pipe = trained(name, 2, "local")
    pipe.save(tmp_path / "ckpt")
    predicted = pipe.predict(CASES[name].batch(5, 3)[0]).logits

    assert main(["export", "--hf", str(tmp_path / "ckpt"), str(tmp_path / "one")]) == 0
    one = tmp_path / "one"
    assert sorted(p.name for p in one.iterdir()) == ["config.json", "model.safetensors"]
    names = stored_names(one)
    assert len(names) == len(set(names))  # each tensor once
    if name == "gpt2":  # tied across the two stages: written once, under the name the state dict gives first
        assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    if name == "t5":
        assert [k for k in names if k.endswith(("shared.weight", "embed_tokens.weight"))] == ["shared.weight"]
    model = loaded(name, one)
    assert torch.equal(eval_logits(name, model), predicted)
    assert set(model.state_dict()) == set(pipe.state_dict())
    assert_same_state(pipe.state_dict(), model)

    assert main(["export", "--hf", str(tmp_path / "ckpt"), str(tmp_path / "shards"),
                 "--max-shard-size", SMALL_SHARDS]) == 0
    assert_sharded(tmp_path / "shards")
    assert torch.equal(eval_logits(name, loaded(name, tmp_path / "shards")), predicted)
    assert "config.json is missing" not in capsys.readouterr().out


def ranks_train_and_save(rank: int, world: int, root: str) -> dict:
    """Each of 2 ranks trains its stage of GPT-2 (the embedding tied across the stages) and saves it."""
    pipe = trained("gpt2", world, "distributed")
    pipe.save(root)
    return {"prediction": pipe.predict(CASES["gpt2"].batch(5, 3)[0]).logits, "state": pipe.state_dict()}


@pytest.mark.slow
def test_the_pipetrain_command_exports_a_checkpoint_saved_by_two_ranks(tmp_path: Path, capsys) -> None:
    from pipetrain.cli import main  # the command's entry point, run in this process

    root = tmp_path / "ckpt"
    per_rank = run_world(2, "test_export_hf", "ranks_train_and_save", tmp_path / "ranks", str(root))
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", "--hf", str(root), str(out), "--max-shard-size", SMALL_SHARDS]) == 0
    assert_sharded(out)
    assert f"to {out}" in capsys.readouterr().out
    model = loaded("gpt2", out)
    expected = eval_logits("gpt2", model)
    for result in per_rank:
        assert torch.equal(result["prediction"], expected)
        assert_same_state(result["state"], model)
    assert set(model.state_dict()) == {k for r in per_rank for k in r["state"]}


def test_a_model_without_a_config_is_exported_with_what_to_do(tmp_path: Path, capsys) -> None:
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=2, loss_fn=loss_fn("mlp"),
                           engine="local")
    pipe.step(*data("mlp", 8))
    pipe.save(tmp_path / "ckpt")
    assert main(["export", "--hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "config.json is missing" in said and f"Copy the model's config.json into {tmp_path / 'out'}" in said
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    stored = load_file(tmp_path / "out" / "model.safetensors")
    assert stored.keys() == pipe.state_dict().keys()
    assert all(torch.equal(stored[k], t) for k, t in pipe.state_dict().items())
