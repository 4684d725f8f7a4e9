"""pipe.save_pretrained writes a directory Hugging Face's from_pretrained loads: the loaded model's eval output
equals the pipeline's predict bit for bit (the same weights; predict runs the captured ATen calls, which give the
same bits here), with no key missing or unexpected. Tied parameters go in once, under the model's own first
name; every rank writes only its stages' tensors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as hf

import pipetrain
from dist_harness import run_world
from third_party_models import CASES, build
from helpers import wrap_unprofiled

hf.logging.set_verbosity_error()
CLASSES = {"gpt2": hf.GPT2LMHeadModel, "t5": hf.T5ForConditionalGeneration, "llama": hf.LlamaForCausalLM}


def trained(name: str, stages: int, engine: str) -> pipetrain.Pipeline:
    case = CASES[name]
    pipe = wrap_unprofiled(build(name), case.batch(2, 0)[0], stages=stages, micro_batches=2, loss_fn=case.loss_fn,
                           engine=engine)
    for seed in (1, 2):
        pipe.step(*case.batch(8, seed))
    return pipe


def loaded(name: str, path: Path) -> torch.nn.Module:
    model, info = CLASSES[name].from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _assert_predicts_alike(name: str, pipe: pipetrain.Pipeline, model: torch.nn.Module) -> None:
    x, _ = CASES[name].batch(5, 3)
    with torch.no_grad():
        expected = model(**x).logits
    assert torch.equal(pipe.predict(x).logits, expected)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", list(CLASSES))
def test_from_pretrained_loads_what_the_pipeline_learned(name: str, stages: int, tmp_path: Path) -> None:
    pipe = trained(name, stages, "local")
    pipe.save_pretrained(tmp_path, max_shard_size=4000)  # small shards: an index over several files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((tmp_path / f).exists() for f in files)
    assert (tmp_path / "config.json").exists()
    if name == "gpt2":  # tied: written once, under the name the model's state dict gives first
        assert "transformer.wte.weight" in index["weight_map"] and "lm_head.weight" not in index["weight_map"]
    if name == "t5":
        assert [k for k in index["weight_map"] if k.endswith(("shared.weight", "embed_tokens.weight"))] == [
            "shared.weight"]
    _assert_predicts_alike(name, pipe, loaded(name, tmp_path))


def test_one_file_without_an_index_when_the_model_fits_a_shard(tmp_path: Path) -> None:
    pipe = trained("llama", 2, "local")
    pipe.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "model.safetensors.index.json").exists()
    _assert_predicts_alike("llama", pipe, loaded("llama", tmp_path))


def ranks_save(rank: int, world: int, out: str) -> dict:
    """Each of 2 ranks trains its stage of GPT-2 (embedding tied across the stages) and writes its own shards."""
    pipe = trained("gpt2", world, "distributed")
    pipe.save_pretrained(Path(out, "hf"), max_shard_size=4000)
    x, _ = CASES["gpt2"].batch(5, 3)
    # The local engine under the same thread settings as the ranks: the same bits (sums over threads differ).
    local = trained("gpt2", world, "local").state_dict() if rank == 0 else None
    return {"prediction": pipe.predict(x).logits, "state": pipe.state_dict(), "local": local}


@pytest.mark.slow
def test_every_rank_writes_its_own_stage_and_the_directory_loads_whole(tmp_path: Path) -> None:
    per_rank = run_world(2, "test_save_pretrained", "ranks_save", tmp_path, str(tmp_path))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    model = loaded("gpt2", tmp_path / "hf")
    x, _ = CASES["gpt2"].batch(5, 3)
    with torch.no_grad():
        expected = model(**x).logits
    for result in per_rank:
        assert torch.equal(result["prediction"], expected)
    # The shards of rank 0 and rank 1 hold disjoint names; together, the model's whole state dict.
    names = {k for r in per_rank for k in r["state"]}
    assert set(index["weight_map"]) == names - {"lm_head.weight"}
    local = per_rank[0]["local"]
    differ = [k for k in index["weight_map"] if not torch.equal(local[k], model.state_dict()[k])]
    assert not differ, differ
