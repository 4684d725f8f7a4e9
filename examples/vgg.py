"""Train a CIFAR-style VGG with BatchNorm in a pipeline (default: VGG-11, width 8, on the offline digits set).

The whole recipe is in main(): build the model, split it with pipetrain.wrap, train it mini-batch by
mini-batch with pipe.step (async-1f1b: stream each epoch through pipe.train), validate with pipe.predict,
log to TensorBoard, checkpoint with pipe.save and resume with pipe.load. The same command line runs in one
process (every stage here) and under torchrun (one stage per process; every rank runs this script):

    python examples/vgg.py --stages 4 --schedule async-1f1b --staleness spectrain
    torchrun --standalone --nproc-per-node 4 examples/vgg.py --stages 4
    torchrun --standalone --nproc-per-node 4 examples/vgg.py --stages 2 --data-parallel 2
    python examples/vgg.py --dataset cifar10 --data-dir data --width 64 --depth 16
    python examples/vgg.py --steps 20 --checkpoint-dir ckpt --save-every 10 --logdir runs/vgg
    python examples/vgg.py --steps 40 --checkpoint-dir ckpt --resume --logdir runs/vgg   # steps 21 to 40
    tensorboard --logdir runs/vgg

`--help` lists every flag (examples/_common.py parses them).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter

import pipetrain
from _common import datasets, mini_batches, parse_args
from pipetrain.apps.training import evaluate
from pipetrain.apps.models import VGG


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, ["vgg"], argv)
    train, val, classes = datasets(args)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = VGG(args.depth, num_classes=classes, width=args.width)
    x, _ = next(mini_batches(train, args.batch_size, seed=args.seed, epoch=0))
    pipe = pipetrain.wrap(
        model, x[:args.batch_size // (args.micro_batches * args.data_parallel)],  # one micro-batch's inputs
        stages=args.stages, micro_batches=args.micro_batches, schedule=args.schedule, staleness=args.staleness,
        lookahead=args.lookahead, data_parallel=args.data_parallel, partitioner=args.partitioner,
        precision=args.precision, loss_fn=F.cross_entropy, seed=args.seed,
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),  # one per stage
        logdir=args.logdir)  # the pipeline logs train/loss and per-stage metrics at every step (rank 0)
    rank0 = pipe.world is None or pipe.world.rank == 0  # pipe.world: this process's place under torchrun
    # The newest checkpoint's weights, optimizer state and step count, whatever stage layout saved them;
    # none yet (the first start under torchrun --max-restarts) starts from scratch.
    if args.resume and pipe.resume(args.checkpoint_dir):
        if rank0:
            print(f"resumed from {args.checkpoint_dir} at step {pipe.updates}", flush=True)

    def show(result: pipetrain.StepResult) -> None:  # called after each mini-batch, by step() and train() alike
        if result.step % args.log_every == 0:
            print(f"step {result.step}: loss {result.loss:.6f}", flush=True)

    if rank0 and args.log_every:
        pipe.on_step(show)
    writer = SummaryWriter(args.logdir, filename_suffix=".val") if args.logdir and rank0 else None
    per_epoch = len(train) // args.batch_size
    last = args.steps or args.epochs * per_epoch
    history, start_time = [], time.perf_counter()
    # With a checkpoint directory, SIGTERM (a scheduler's preemption; torchrun forwards it to every rank) stops
    # the run at a mini-batch every rank agrees on, which is saved; --resume continues from there.
    with pipetrain.StopOnSigterm(pipe, enabled=bool(args.checkpoint_dir)) as stop:
        while pipe.updates < last:
            epoch, start = divmod(pipe.updates, per_epoch)  # a resumed run starts where the checkpoint stopped
            batches = stop.batches(mini_batches(train, args.batch_size, seed=args.seed, epoch=epoch, start=start,
                                                stop=min(per_epoch, last - epoch * per_epoch)))
            losses, saved = [], False
            if args.schedule == "async-1f1b":  # no flush: the pipeline stays full all epoch and drains at its end
                losses = [result.loss for result in pipe.train(batches)]
            else:
                for x, y in batches:
                    losses.append(pipe.step(x, y))
                    saved = bool(args.save_every) and pipe.updates % args.save_every == 0
                    if saved:
                        pipe.save(args.checkpoint_dir)  # every rank saves its own stages
            if not stop.stopped:  # a whole epoch (or --steps of it): validate
                val_loss, val_accuracy = evaluate(pipe, val, args.batch_size)  # pipe.predict over val, every rank
                history.append((sum(losses) / len(losses), val_loss, val_accuracy))
                if writer is not None:
                    writer.add_scalar("val/loss", val_loss, pipe.updates)
                    writer.add_scalar("val/accuracy", val_accuracy, pipe.updates)
                    writer.flush()
                if rank0 and args.log_every:
                    print(f"epoch {epoch + 1}: train loss {history[-1][0]:.4f}, val loss {val_loss:.4f}, "
                          f"val accuracy {100 * val_accuracy:.2f}%", flush=True)
            if args.checkpoint_dir and not saved:
                pipe.save(args.checkpoint_dir)
            if stop.requested():
                if rank0:
                    print(f"stopped by SIGTERM at step {pipe.updates}; saved {args.checkpoint_dir}, continue with "
                          "--resume", flush=True)
                break
    pipe.close()
    if writer is not None:
        writer.close()
    if rank0 and history:
        train_losses, val_losses, accuracies = zip(*history)
        epochs = f"{len(history)} epoch{'s' * (len(history) > 1)}"
        print(f"{args.model} on {args.dataset}, {args.schedule} {args.stages} stages x {args.micro_batches} "
              f"micro-batches, {epochs} ({pipe.updates} steps): min train loss {min(train_losses):.4f}, min val loss "
              f"{min(val_losses):.4f}, max val accuracy {100 * max(accuracies):.2f}%, "
              f"{time.perf_counter() - start_time:.1f} s", flush=True)


if __name__ == "__main__":
    main()
