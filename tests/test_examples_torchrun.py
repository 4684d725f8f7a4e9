"""Example scripts launched by torchrun itself, the way users run them: rank 0 alone prints, a real SIGTERM
stops every rank at one step with a checkpoint, and the same command with --resume continues it exactly."""
from __future__ import annotations

import pytest
import os
import subprocess
import sys
from pathlib import Path

import torch

import pipetrain
from _example_runs import CASES, COMMON, EXAMPLES, run_example
from dist_harness import run_world

HERE = Path(__file__).resolve().parent


def torchrun_vgg(args: list[str], env: dict | None = None, ranks: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node RANKS examples/vgg.py ARGS`, through tests/sigterm_at_step.py when
    ``env`` names a step to signal at (it runs the script unchanged otherwise)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    script = [str(HERE / "sigterm_at_step.py"), str(EXAMPLES / "vgg.py")] if env else [str(EXAMPLES / "vgg.py")]
    return subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(ranks), *script, *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def assert_same_parameters(a: Path, b: Path) -> None:
    first, second = pipetrain.export_state_dict(a), pipetrain.export_state_dict(b)
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)


# (schedule flags, ranks, who gets SIGTERM after step 3, the step every rank stops at). async-1f1b under
# torchrun stops at the end of the epoch (12 steps); 1f1b after the step whose report carries the request: rank
# 0 waits in step 3's callback until torchrun forwarded the signal, so step 4's report carries it.
PREEMPTED = {
    "async-1f1b": ([*CASES["vgg"]], 2, {"SIGTERM_RANK": "1"}, 12),
    "1f1b-2x2": (["--width", "4", "--schedule", "1f1b", "--micro-batches", "2", "--data-parallel", "2"], 4,
                 {"SIGTERM_RANK": "0", "SIGTERM_TO": "torchrun"}, 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", PREEMPTED)
def test_sigterm_under_torchrun_saves_every_rank_and_the_resume_is_exact(case, tmp_path, capsys):
    # The first launch, with --resume and no checkpoint yet (a first start under --max-restarts), starts from
    # scratch; SIGTERM stops it on every rank at one agreed step, saved; the same command resumes it. Its end
    # equals the uninterrupted run, bit for bit.
    flags, ranks, signal_to, stop = PREEMPTED[case]
    checkpoints = tmp_path / "ckpt"
    command = [*COMMON, *flags, "--log-every", "1", "--checkpoint-dir", str(checkpoints)]
    first = torchrun_vgg([*command, "--resume"], {"SIGTERM_STEP": "3", **signal_to}, ranks)
    # torchrun exits 1 after forwarding a signal it got itself (its own report); the ranks exited 0, or it
    # would report their failure instead.
    assert first.returncode == (1 if "SIGTERM_TO" in signal_to else 0), first.stderr[-3000:]
    assert "ChildFailedError" not in first.stderr and "resumed from" not in first.stdout
    assert f"stopped by SIGTERM at step {stop}; saved {checkpoints}" in first.stdout  # rank 0 alone prints
    assert first.stdout.count("stopped by SIGTERM") == 1
    assert (checkpoints / "latest").read_text().strip() == f"step-{stop:08d}"
    done = torchrun_vgg([*command, "--resume"], ranks=ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(f"resumed from {checkpoints} at step {stop}") == 1
    assert (checkpoints / "latest").read_text().strip() == "step-00000024"
    # The uninterrupted run on as many gloo ranks (forked by the test harness; the local engine cannot replicate).
    run_world(ranks, "test_examples_torchrun", "uninterrupted", tmp_path / "world", [*COMMON, *flags],
              str(tmp_path / "whole"))
    assert_same_parameters(checkpoints, tmp_path / "whole")


def uninterrupted(rank: int, world: int, args: list[str], checkpoints: str) -> None:
    run_example("vgg", [*args, "--no-progress", "--checkpoint-dir", checkpoints])


@pytest.mark.slow
def test_huggingface_example_fine_tunes_its_saved_model_under_torchrun(tmp_path):
    # Pretrain (one process, 1f1b) and write a Hugging Face directory; then fine-tune it under torchrun with
    # async-1f1b: the model is built on the meta device from the directory's config and every rank reads its
    # own stage; the result is written again and loads with from_pretrained.
    import transformers

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = [*COMMON, "--model", "gpt2", "--width", "16", "--depth", "1", "--micro-batches", "2", "--lr", "0.1",
              "--epochs", "1", "--train-samples", "96"]
    # the one-process runs (pretraining, LoRA) run in this process, as `python examples/huggingface.py` would
    run_example("huggingface", [*common, "--schedule", "1f1b", "--save-pretrained", str(tmp_path / "pretrained")])
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
    run_example("huggingface", [*common, "--schedule", "1f1b", "--weights", str(tmp_path / "pretrained"), "--lora",
                                "4", "--optimizer", "adam", "--save-pretrained", str(tmp_path / "adapter")])
    from peft import PeftModel

    model = PeftModel.from_pretrained(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained"),
                                      tmp_path / "adapter")
    factors = {k: v for k, v in model.state_dict().items() if ".lora_B." in k}
    assert factors and all(torch.count_nonzero(v) > 0 for v in factors.values())
