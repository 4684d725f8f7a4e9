"""Hugging Face's ``Trainer`` on a pipeline: ``PipelineTrainer`` takes a Trainer's model, arguments, datasets,
collator and callbacks, splits the model with ``pipetrain.wrap`` and trains it step by step on the pipeline.

How the ``TrainingArguments`` map (each stage gets its own optimizer and scheduler, as ``wrap`` builds them):

- ``per_device_train_batch_size`` is one micro-batch and ``gradient_accumulation_steps`` the micro-batches of
  a step, so a step sees their product (times ``data_parallel`` under torchrun: each replica its share).
- ``optim``, ``learning_rate``, ``adam_*``, ``weight_decay``: the optimizer the Trainer would build
  (``Trainer.get_optimizer_cls_and_kwargs``), without weight decay on the parameters the Trainer exempts
  (biases, norm weights), found by name with ``pipetrain.parameter_name``.
- ``lr_scheduler_type``, ``warmup_steps``, ``lr_scheduler_kwargs``: ``transformers.get_scheduler``, stepped per
  applied update and saved in pipetrain's checkpoints.
- ``max_grad_norm``: the global gradient norm over every stage (``wrap(max_grad_norm=...)``).
- ``bf16`` / ``fp16``: ``precision``.
- ``logging_*``, ``eval_*``, ``save_*`` strategies: the Trainer's own callbacks decide, as in its loop; a save
  is ``Pipeline.save`` under ``output_dir/pipeline`` (``train(resume_from_checkpoint=True)`` resumes from it)
  and ``save_model`` is ``Pipeline.save_pretrained`` (a PEFT model: its adapter).

Every rank of a torchrun job runs the same script; every rank reads the same batches (a pipeline's stages
need the same mini-batch; the replicas of hybrid mode each take their share of it). transformers is needed
only by this module.
"""
from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from transformers import Trainer, TrainerState, TrainingArguments, get_scheduler
from transformers.trainer_utils import TrainOutput

import pipetrain
from pipetrain.checkpoint import latest

CHECKPOINTS = "pipeline"        # output_dir/pipeline: pipetrain's checkpoints of the run
TRAINER_STATE = "trainer_state.json"
# Options the TrainingArguments set (see the module's docstring): given to wrap as well, they would disagree.
FROM_ARGUMENTS = ("optimizer", "lr_scheduler", "max_grad_norm", "micro_batches", "loss_fn", "precision")
SAMPLING = ("random", "sequential")


class PipelineTrainer(Trainer):
    """A ``transformers.Trainer`` that trains ``model`` split into pipeline stages.

    ``pipeline``: the options of ``pipetrain.wrap`` (``stages``, ``engine``, ``schedule``, ``data_parallel``,
    ``recompute`` ...) but those the ``TrainingArguments`` set. The model computes its own loss: the batches
    carry ``labels``, as a causal-LM collator makes them."""

    def __init__(self, model: torch.nn.Module, args: TrainingArguments, *, pipeline: dict[str, Any] | None = None,
                 **trainer_arguments: Any):
        pipeline = dict(pipeline or {})
        clash = sorted(set(pipeline) & set(FROM_ARGUMENTS))
        if clash:
            raise ValueError(f"PipelineTrainer takes {clash} from the TrainingArguments (see pipetrain.hf_trainer); "
                             "remove them from pipeline=")
        if args.train_sampling_strategy not in SAMPLING:
            raise ValueError(f"PipelineTrainer samples {SAMPLING}, not train_sampling_strategy="
                             f"{args.train_sampling_strategy!r}: every rank of a pipeline must read the same batches")
        if args.load_best_model_at_end:
            raise ValueError("PipelineTrainer does not reload the best checkpoint at the end: set "
                             "load_best_model_at_end=False and load output_dir/pipeline/step-N with Pipeline.load")
        self.pipeline_options = pipeline
        self.pipe: pipetrain.Pipeline | None = None
        super().__init__(model=model, args=args, **trainer_arguments)

    @property
    def place_model_on_device(self) -> bool:
        """The stages go where pipetrain puts them; the whole model never moves to one device."""
        return False

    @place_model_on_device.setter
    def place_model_on_device(self, _: bool) -> None:
        """The Trainer's __init__ decides it for a whole model on one device: not ours to take."""

    # ----- the pipeline ----------------------------------------------------------------------------------
    def _wrap(self, example: Any, max_steps: int) -> pipetrain.Pipeline:
        args, model = self.args, self.model
        optimizer_class, optimizer_arguments = Trainer.get_optimizer_cls_and_kwargs(args, model)
        decayed = set(self.get_decay_parameter_names(model))

        def optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            groups = [{"params": [p for p in params if pipetrain.parameter_name(p) in decayed],
                       "weight_decay": args.weight_decay},
                      {"params": [p for p in params if pipetrain.parameter_name(p) not in decayed],
                       "weight_decay": 0.0}]
            return optimizer_class(groups, **optimizer_arguments)

        def scheduler(stage_optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
            return get_scheduler(args.lr_scheduler_type, stage_optimizer,
                                 num_warmup_steps=args.get_warmup_steps(max_steps), num_training_steps=max_steps,
                                 scheduler_specific_kwargs=args.lr_scheduler_kwargs)

        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        options = dict(dict(seed=args.seed), **self.pipeline_options)
        return pipetrain.wrap(model, example, micro_batches=args.gradient_accumulation_steps,
                              loss_fn=pipetrain.model_loss, optimizer=optimizer, lr_scheduler=scheduler,
                              max_grad_norm=args.max_grad_norm or None, precision=precision, **options)

    def _loader(self, dataset: Any, batch_size: int, epoch: int, training: bool) -> DataLoader:
        """Batches of ``batch_size`` samples, every rank the same ones (the Trainer's loader would give each
        rank of a torchrun job its own). Columns the model does not take are dropped as the Trainer drops them."""
        description = "training" if training else "evaluation"
        collator = self.data_collator
        try:
            import datasets
            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        if training and self.args.train_sampling_strategy == "random":
            # Seeded per epoch: every rank draws the same order, and a resumed run the same as before.
            generator = torch.Generator().manual_seed((self.args.data_seed or self.args.seed) + epoch)
            sampler = RandomSampler(dataset, generator=generator)
        else:
            sampler = SequentialSampler(dataset)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collator,
                          drop_last=self.args.dataloader_drop_last if training else False,
                          num_workers=self.args.dataloader_num_workers)

    def _replicas(self) -> int:
        return int(self.pipeline_options.get("data_parallel", 1))

    # ----- training ------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """Train ``args.max_steps`` steps (or ``num_train_epochs`` epochs) on the pipeline, logging, evaluating
        and saving as the TrainingArguments say. ``resume_from_checkpoint``: True resumes from the newest
        checkpoint under ``output_dir/pipeline``, a path from that checkpoint directory."""
        if trial is not None:
            raise ValueError("PipelineTrainer does not run hyper-parameter searches")
        args = self.args
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * self._replicas()
        first_epoch = self._loader(self.train_dataset, batch, 0, training=True)
        steps_per_epoch = len(first_epoch)
        if steps_per_epoch == 0:
            raise ValueError(f"the training set holds fewer samples than one step's {batch}; lower "
                             "per_device_train_batch_size or gradient_accumulation_steps")
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
        if self.pipe is None:
            self.pipe = self._wrap(next(iter(first_epoch)), max_steps)
        self.state = TrainerState(stateful_callbacks=[], is_local_process_zero=self.is_local_process_zero(),
                                  is_world_process_zero=self.is_world_process_zero())
        self.state.max_steps, self.state.num_train_epochs = max_steps, math.ceil(max_steps / steps_per_epoch)
        self.state.compute_steps(args, max_steps)
        if resume_from_checkpoint:
            self._resume(resume_from_checkpoint)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        losses, total_loss, start, resumed_at = [], 0.0, time.time(), self.state.global_step
        epoch = self.state.global_step // steps_per_epoch
        while self.state.global_step < max_steps and not self.control.should_training_stop:
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            done = self.state.global_step - epoch * steps_per_epoch  # a resumed epoch: the steps it already ran
            batches = itertools.islice(self._loader(self.train_dataset, batch, epoch, training=True),
                                       done, done + max_steps - self.state.global_step)
            learning_rate = self._learning_rate()
            # One stream per epoch (an async-1f1b pipeline stays full through it); each result is a step done.
            for i, result in enumerate(self.pipe.train(batches), start=done + 1):
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                losses.append(result.loss)
                total_loss += result.loss
                self.state.global_step += 1
                self.state.epoch = epoch + i / steps_per_epoch
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                # The step's own learning rate, as the Trainer logs it: the one before its scheduler moved on.
                learning_rate, used = self._learning_rate(), learning_rate
                self._log_evaluate_save(losses, result.grad_norm, used, ignore_keys_for_eval)
                if self.control.should_epoch_stop or self.control.should_training_stop:
                    break
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._log_evaluate_save(losses, None, learning_rate, ignore_keys_for_eval)
            epoch += 1
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        steps = max(self.state.global_step - resumed_at, 1)  # the steps this call ran (total_loss sums theirs)
        metrics = {"train_runtime": time.time() - start, "train_loss": total_loss / steps, "epoch": self.state.epoch}
        self.log(metrics)
        return TrainOutput(self.state.global_step, total_loss / steps, metrics)

    def _log_evaluate_save(self, losses: list[float], grad_norm: float | None, learning_rate: float,
                           ignore_keys_for_eval: list[str] | None) -> None:
        """What the Trainer's callbacks asked for after a step or an epoch: its ``_maybe_log_save_evaluate``."""
        if self.control.should_log and losses:
            logs = {"loss": sum(losses) / len(losses), "learning_rate": learning_rate}
            if grad_norm is not None and not math.isnan(grad_norm):
                logs["grad_norm"] = grad_norm
            losses.clear()
            self.log(logs)
        if self.control.should_evaluate and self.eval_dataset is not None:
            self.evaluate(ignore_keys=ignore_keys_for_eval)
        self.control.should_evaluate = False
        if self.control.should_save:
            self._save_pipeline()
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _learning_rate(self) -> float:
        """The learning rate of the first parameter group of a stage this rank holds."""
        stage = next(rt for rt in self.pipe.held_stages.values() if rt.optimizer is not None)
        return stage.optimizer.param_groups[0]["lr"]

    # ----- checkpoints ------------------------------------------------------------------------------------
    def _checkpoints(self) -> Path:
        return Path(self.args.output_dir) / CHECKPOINTS

    def _save_pipeline(self) -> None:
        """A checkpoint of the pipeline (every rank) and the Trainer's state beside it (the first rank)."""
        step_dir = self.pipe.save(self._checkpoints())
        if self.is_world_process_zero():
            self.state.save_to_json(str(step_dir / TRAINER_STATE))

    def _resume(self, checkpoint: str | bool) -> None:
        """Load the pipeline's checkpoint and the Trainer's state of its step."""
        path = self._checkpoints() if checkpoint is True else Path(checkpoint)
        if not self.pipe.resume(path):
            raise FileNotFoundError(f"resume_from_checkpoint: no pipetrain checkpoint under {path}; train without "
                                    "it, or give the directory PipelineTrainer saved into (output_dir/pipeline)")
        step_dir = latest(path) if (path / "latest").exists() else path
        saved = step_dir / TRAINER_STATE if step_dir is not None else None
        if saved is not None and saved.exists():
            state = TrainerState.load_from_json(str(saved))
            self.state.log_history, self.state.best_metric = state.log_history, state.best_metric
        self.state.global_step = self.pipe.updates

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Pipeline.save_pretrained`` into ``output_dir`` (``args.output_dir`` by default): the model's
        Hugging Face files, or a PEFT model's adapter; every rank writes its stages' tensors."""
        self.pipe.save_pretrained(output_dir or self.args.output_dir)

    # ----- evaluation ---------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """The mean loss over ``eval_dataset`` (``self.eval_dataset`` by default), each batch's weighted by its
        samples as the Trainer weighs them; logged and handed to the callbacks."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None or self.pipe is None:
            raise ValueError("evaluate() needs an eval_dataset and a pipeline: call train() first")
        total, samples = 0.0, 0
        for batch in self._loader(dataset, self.args.per_device_eval_batch_size * self._replicas(), 0, training=False):
            n = len(next(iter(batch.values())))
            total += pipetrain.model_loss(self.pipe.predict(batch)).item() * n
            samples += n
        metrics = {f"{metric_key_prefix}_loss": total / samples}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics
