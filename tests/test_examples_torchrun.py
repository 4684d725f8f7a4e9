"""An example script launched by torchrun itself (2 processes), the way users run it: it trains, rank 0
alone prints, the per-epoch checkpoint is written and the same command with --resume continues it."""
from __future__ import annotations

import pytest
import os
import subprocess
import sys
from pathlib import Path

import torch

from _example_runs import CASES, COMMON, EXAMPLES


@pytest.mark.slow
def test_script_under_torchrun(tmp_path):
    # The first epoch, checkpointed; then the same command with --resume trains the second: each rank loads
    # its own stage and the data continues where the checkpoint stopped.
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "vgg.py"), *COMMON,
               *CASES["vgg"], "--checkpoint-dir", str(tmp_path / "ckpt")]
    # --resume with no checkpoint yet (a first start under --max-restarts) starts from scratch.
    first = subprocess.run([*command, "--epochs", "1", "--resume"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resumed from" not in first.stdout
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000012"
    done = subprocess.run([*command, "--resume"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("resumed from") == 1  # printed by rank 0 only
    summary = [line for line in done.stdout.splitlines() if "max val accuracy" in line]
    assert len(summary) == 1 and "1 epoch (24 steps)" in summary[0]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000024"


@pytest.mark.slow
def test_huggingface_example_fine_tunes_its_saved_model_under_torchrun(tmp_path):
    # Pretrain (one process, 1f1b) and write a Hugging Face directory; then fine-tune it under torchrun with
    # async-1f1b: the model is built on the meta device from the directory's config and every rank reads its
    # own stage; the result is written again and loads with from_pretrained.
    import transformers

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = [*COMMON, "--model", "gpt2", "--width", "16", "--depth", "1", "--micro-batches", "2", "--lr", "0.1",
              "--epochs", "1", "--train-samples", "96"]
    first = subprocess.run([sys.executable, str(EXAMPLES / "huggingface.py"), *common, "--schedule", "1f1b",
                            "--save-pretrained", str(tmp_path / "pretrained")],
                           capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    torchrun = Path(sys.executable).with_name("torchrun")
    tuned = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "huggingface.py"), *common,
         "--schedule", "async-1f1b", "--staleness", "stash", "--weights", str(tmp_path / "pretrained"),
         "--save-pretrained", str(tmp_path / "tuned")], capture_output=True, text=True, env=env, timeout=300)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    summary = [line for line in tuned.stdout.splitlines() if "max val accuracy" in line]
    assert len(summary) == 1 and summary[0].startswith("GPT2LMHeadModel"), tuned.stdout[-2000:]
    before = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained").state_dict()
    after = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "tuned").state_dict()
    assert set(before) == set(after) and any(not torch.equal(before[k], after[k]) for k in before)
    # LoRA on the same pretrained model (built on meta, its base tensors read from the directory): the adapter it
    # writes loads with peft onto the pretrained model, trained (B moved from its zeros).
    adapted = subprocess.run([sys.executable, str(EXAMPLES / "huggingface.py"), *common, "--schedule", "1f1b",
                              "--weights", str(tmp_path / "pretrained"), "--lora", "4", "--optimizer", "adam",
                              "--save-pretrained", str(tmp_path / "adapter")],
                             capture_output=True, text=True, env=env, timeout=300)
    assert adapted.returncode == 0, adapted.stderr[-3000:]
    from peft import PeftModel

    model = PeftModel.from_pretrained(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained"),
                                      tmp_path / "adapter")
    factors = {k: v for k, v in model.state_dict().items() if ".lora_B." in k}
    assert factors and all(torch.count_nonzero(v) > 0 for v in factors.values())
