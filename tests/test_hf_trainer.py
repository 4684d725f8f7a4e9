"""pipetrain.hf_trainer.PipelineTrainer against transformers' Trainer on the unsplit model, with the same
TrainingArguments: AdamW with weight decay (not on biases and norms), warm-up then cosine, global gradient
clipping, gradient accumulation, evaluation and a resume. fp32: 1e-5 relative, as test_language_models."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

from dist_harness import run_world
from language_models import SEQ, VOCAB, build_language_model
from pipetrain.hf_trainer import PipelineTrainer

STEPS = 4


def samples(n: int, seed: int) -> list[dict]:
    """Fixed-length rows (every micro-batch has as many label tokens, so the Trainer's token mean over a step
    equals pipetrain's mean of micro-batch means weighted by samples)."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def arguments(out, **overrides) -> TrainingArguments:
    settings = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    per_device_eval_batch_size=3, max_steps=STEPS, learning_rate=5e-3, weight_decay=0.1,
                    lr_scheduler_type="cosine", warmup_steps=1, max_grad_norm=0.5, optim="adamw_torch",
                    logging_steps=1, eval_strategy="steps", eval_steps=2, save_strategy="no",
                    train_sampling_strategy="sequential", report_to=[], use_cpu=True, seed=0,
                    disable_tqdm=True)
    return TrainingArguments(**dict(settings, **overrides))


def history(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model = build_language_model("llama")
    trainer = Trainer(model=model, args=arguments(tmp_path_factory.mktemp("unsplit")),
                      train_dataset=samples(16, 1), eval_dataset=samples(5, 2), data_collator=default_data_collator)
    trainer.train()
    return trainer


def pipelined(out, stages: int, **overrides) -> PipelineTrainer:
    return PipelineTrainer(build_language_model("llama"), arguments(out, **overrides),
                           pipeline=dict(stages=stages, engine="local", partitioner="uniform", profile=False),
                           train_dataset=samples(16, 1), eval_dataset=samples(5, 2),
                           data_collator=default_data_collator)


def close(got: list[float], expected: list[float]) -> None:
    assert len(got) == len(expected) > 0
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("stages", [2, 4])
def test_the_trainer_arguments_train_the_pipeline_as_the_trainer_trains_the_model(tmp_path, reference, stages):
    trainer = pipelined(tmp_path, stages)
    trainer.train()
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
        close(history(trainer, key), history(reference, key))
    assert len(history(trainer, "loss")) == STEPS and len(history(trainer, "eval_loss")) == 2
    assert max(history(reference, "grad_norm")) > 0.5  # clipping took effect
    expected = reference.model.state_dict()
    got = trainer.pipe.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # Weight decay spared what the Trainer spares: every stage's optimizer has its two groups.
    groups = [[g["weight_decay"] for g in rt.optimizer.param_groups] for rt in trainer.pipe.held_stages.values()]
    assert all(g == [0.1, 0.0] for g in groups), groups


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def test_a_resumed_run_continues_as_the_uninterrupted_one(tmp_path, reference):
    first = pipelined(tmp_path, 2, save_strategy="steps", save_steps=2)
    first.add_callback(StopAt(2))  # as a preempted job: the same arguments, stopped after the save at step 2
    first.train()
    assert first.state.global_step == 2
    resumed = pipelined(tmp_path, 2, save_strategy="steps", save_steps=2)
    output = resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == STEPS
    # Steps 3 and 4 equal the uninterrupted pipeline (itself within 1e-5 of the Trainer): the scheduler and the
    # optimizer resumed; the log history of steps 1 and 2 came back with the checkpoint.
    uninterrupted = pipelined(tmp_path / "whole", 2)
    uninterrupted.train()
    assert history(resumed, "loss") == history(uninterrupted, "loss")
    assert output.training_loss == sum(history(uninterrupted, "loss")[2:]) / 2  # the mean of the steps it ran
    assert history(resumed, "learning_rate") == history(uninterrupted, "learning_rate")
    state, expected = resumed.pipe.state_dict(), uninterrupted.pipe.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_save_model_writes_what_from_pretrained_loads(tmp_path, reference):
    trainer = pipelined(tmp_path, 2, max_steps=1, eval_strategy="no")
    trainer.train()
    trainer.save_model(str(tmp_path / "model"))
    loaded = type(reference.model).from_pretrained(tmp_path / "model")
    ids = samples(2, 3)[0]["input_ids"][None]
    torch.testing.assert_close(loaded(input_ids=ids).logits, trainer.pipe.predict({"input_ids": ids, "labels": ids}).logits)


def two_ranks(rank: int, world: int, out: str, **pipeline) -> dict:
    """The 2-stage run on 2 gloo ranks, each holding one stage (every rank reads every batch); with ``pipeline``
    options (data_parallel) on more."""
    replicas = pipeline.get("data_parallel", 1)
    # Each replica takes its share of a step's samples: per device, the reference's batch over the replicas.
    trainer = PipelineTrainer(build_language_model("llama"), arguments(out, per_device_train_batch_size=2 // replicas),
                              pipeline=dict(stages=2, engine="distributed", partitioner="uniform", profile=False,
                                            **pipeline),
                              train_dataset=samples(16, 1), eval_dataset=samples(5, 2),
                              data_collator=default_data_collator)
    trainer.train()
    keys = ("loss", "grad_norm", "learning_rate", "eval_loss")
    return {"history": {k: history(trainer, k) for k in keys}, "state": trainer.pipe.state_dict()}


@pytest.mark.slow
def test_two_ranks_train_as_the_trainer_trains_the_model(tmp_path, reference):
    ranks = run_world(2, "test_hf_trainer", "two_ranks", tmp_path, str(tmp_path))
    for rank in ranks:  # every rank logs the same, summed over the ranks
        for key, values in rank["history"].items():
            close(values, history(reference, key))
    got = {**ranks[0]["state"], **ranks[1]["state"]}
    expected = reference.model.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def four_ranks(rank: int, world: int, out: str) -> dict:
    """2 stages x 2 replicas with zero=3: the labels ride inside the inputs to each replica's share."""
    return two_ranks(rank, world, out, data_parallel=2, zero=3)


@pytest.mark.slow
def test_two_replicas_with_zero3_train_as_the_trainer_trains_the_model(tmp_path, reference):
    ranks = run_world(4, "test_hf_trainer", "four_ranks", tmp_path, str(tmp_path))
    for rank in ranks:
        for key, values in rank["history"].items():
            close(values, history(reference, key))
    got = {**ranks[0]["state"], **ranks[1]["state"]}
    for name, value in reference.model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_wrap_options_that_the_arguments_set_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\['max_grad_norm', 'optimizer'\] from the TrainingArguments"):
        PipelineTrainer(build_language_model("llama"), arguments(tmp_path),
                        pipeline=dict(stages=2, optimizer=copy.copy, max_grad_norm=1.0))
