"""Train a CIFAR-style VGG with BatchNorm in a pipeline (default: VGG-11, width 8, on the offline digits set).

The whole recipe is in main(): build the model, split it with pipetrain.wrap, train it mini-batch by
mini-batch with pipe.step (async-1f1b: stream each epoch through pipe.train), validate with pipe.predict,
log to TensorBoard, checkpoint with pipe.save and resume with pipe.load. The same command line runs in one
process (every stage here) and under torchrun (one stage per process; every rank runs this script):

    python examples/vgg.py --stages 4 --schedule async-1f1b --staleness spectrain
    python examples/vgg.py --schedule async-1f1b --staleness nesterov --stage-momentum --micro-batches 1 \\
        --batch-size 8 --lr 0.00625   # one micro-batch of 8 samples per update, the rate scaled by 8 / 64
    torchrun --standalone --nproc-per-node 4 examples/vgg.py --stages 4
    torchrun --standalone --nproc-per-node 4 examples/vgg.py --stages 2 --data-parallel 2
    python examples/vgg.py --dataset cifar10 --data-dir data --width 64 --depth 16
    python examples/vgg.py --steps 20 --checkpoint-dir ckpt --save-every 10 --logdir runs/vgg
    python examples/vgg.py --steps 40 --checkpoint-dir ckpt --resume --logdir runs/vgg   # steps 21 to 40
    tensorboard --logdir runs/vgg

`--help` lists every flag: those of every training entry point (pipetrain.apps.run_config, as `pipetrain
compare` and examples/huggingface.py take them: --optimizer, the delay corrections of async-1f1b such as
--stage-momentum, --resume, ...) and the loop's --steps, --log-every and --save-every (examples/_common.py).
"""
from __future__ import annotations

import time

import torch
from torch.utils.tensorboard import SummaryWriter

import pipetrain
from _common import datasets, mini_batches, parse_args, updates
from pipetrain.apps.training import evaluate
from pipetrain.apps.models import VGG

MODELS = ["vgg"]  # --model's choices, the first the default


def main(argv: list[str] | None = None) -> None:
    c, loop = parse_args(__doc__, MODELS, argv)  # c: the run (RunConfig), loop: --steps, --log-every, --save-every
    train, val, classes = datasets(c)
    torch.manual_seed(c.seed)  # the same initial weights on every rank
    model = VGG(c.depth, num_classes=classes, width=c.width)
    x, _ = next(mini_batches(train, c.batch_size, seed=c.seed, epoch=0))
    per_epoch = len(train) // c.batch_size
    last = updates(c, loop, train)  # --steps, else --epochs of them
    # c.wrap_options(last) holds every pipetrain.wrap option the command line sets, so none can be left out: stages,
    # micro_batches, schedule, staleness and its delay corrections, partitioner, precision, data_parallel, seed,
    # the --optimizer factory at --lr, the --lr-schedule over the run's `last` updates, loss_fn (cross-entropy) and
    # logdir (the pipeline logs train/loss and per-stage metrics at every step, on rank 0).
    pipe = pipetrain.wrap(model, x[:c.batch_size // (c.micro_batches * c.data_parallel)],  # one micro-batch's inputs
                          **c.wrap_options(last))
    rank0 = pipe.world is None or pipe.world.rank == 0  # pipe.world: this process's place under torchrun
    # The newest checkpoint's weights, optimizer state and step count, whatever stage layout saved them;
    # none yet (the first start under torchrun --max-restarts) starts from scratch.
    if c.resume == "auto" and pipe.resume(c.checkpoint_dir):
        if rank0:
            print(f"resumed from {c.checkpoint_dir} at step {pipe.updates}", flush=True)

    def show(result: pipetrain.StepResult) -> None:  # called after each mini-batch, by step() and train() alike
        if result.step % loop.log_every == 0:
            print(f"step {result.step}: loss {result.loss:.6f}", flush=True)

    if rank0 and c.progress and loop.log_every:
        pipe.on_step(show)
    writer = SummaryWriter(c.logdir, filename_suffix=".val") if c.logdir and rank0 else None
    history, start_time = [], time.perf_counter()
    # With a checkpoint directory, SIGTERM (a scheduler's preemption; torchrun forwards it to every rank) stops
    # the run at a mini-batch every rank agrees on, which is saved; --resume continues from there.
    with pipetrain.StopOnSigterm(pipe, enabled=bool(c.checkpoint_dir)) as stop:
        while pipe.updates < last:
            epoch, start = divmod(pipe.updates, per_epoch)  # a resumed run starts where the checkpoint stopped
            batches = stop.batches(mini_batches(train, c.batch_size, seed=c.seed, epoch=epoch, start=start,
                                                stop=min(per_epoch, last - epoch * per_epoch)))
            losses, saved = [], False
            if c.schedule == "async-1f1b":  # no flush: the pipeline stays full all epoch and drains at its end
                losses = [result.loss for result in pipe.train(batches)]
            else:
                for x, y in batches:
                    losses.append(pipe.step(x, y))
                    saved = bool(loop.save_every) and pipe.updates % loop.save_every == 0
                    if saved:
                        pipe.save(c.checkpoint_dir)  # every rank saves its own stages
            if not stop.stopped:  # a whole epoch (or --steps of it): validate
                val_loss, val_accuracy = evaluate(pipe, val, c.batch_size)  # pipe.predict over val, every rank
                history.append((sum(losses) / len(losses), val_loss, val_accuracy))
                if writer is not None:
                    writer.add_scalar("val/loss", val_loss, pipe.updates)
                    writer.add_scalar("val/accuracy", val_accuracy, pipe.updates)
                    writer.flush()
                if rank0 and c.progress:
                    print(f"epoch {epoch + 1}: train loss {history[-1][0]:.4f}, val loss {val_loss:.4f}, "
                          f"val accuracy {100 * val_accuracy:.2f}%", flush=True)
            if c.checkpoint_dir and not saved:
                pipe.save(c.checkpoint_dir)
            if stop.requested():
                if rank0:
                    print(f"stopped by SIGTERM at step {pipe.updates}; saved {c.checkpoint_dir}, continue with "
                          "--resume", flush=True)
                break
    pipe.close()
    if writer is not None:
        writer.close()
    if rank0 and history:
        train_losses, val_losses, accuracies = zip(*history)
        epochs = f"{len(history)} epoch{'s' * (len(history) > 1)}"
        print(f"{c.model} on {c.dataset}, {c.describe()}, {epochs} ({pipe.updates} steps): min train loss "
              f"{min(train_losses):.4f}, min val loss {min(val_losses):.4f}, max val accuracy "
              f"{100 * max(accuracies):.2f}%, {time.perf_counter() - start_time:.1f} s", flush=True)


if __name__ == "__main__":
    main()
