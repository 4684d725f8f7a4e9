"""Pretrain a small GPT-2- or Llama-style language model (Hugging Face transformers, from its config) on the offline text data.

Trained as language models are trained: in bf16 (``--precision`` changes it), on documents of different
lengths, each batch padded to its longest one with an attention mask, and with the loss the model computes
itself from ``labels`` (``pipetrain.model_loss``; padding is labelled -100, so it does not count). The model
is passed to pipetrain.wrap as it is: torch.export captures it (its forward takes **kwargs, which torch.fx
cannot), with the batch and sequence dimensions dynamic, so every batch length runs on the same stages.

    python examples/huggingface.py --model gpt2 --stages 2
    python examples/huggingface.py --model llama --stages 2 --schedule async-1f1b --staleness stash
    python examples/huggingface.py --model llama --stages 2 --schedule async-1f1b --staleness spectrain --precision fp32
    torchrun --standalone --nproc-per-node 2 examples/huggingface.py --stages 2 --save-pretrained out/gpt2
    torchrun --standalone --nproc-per-node 2 examples/huggingface.py --stages 2 --weights out/gpt2   # fine-tune it

With ``--weights DIR`` (a Hugging Face directory: ``config.json`` and safetensors) the model is built from the
directory's config on the meta device, as models too large for one process are: no process ever holds the
whole model, and each rank reads only its own stage's tensors from DIR.
"""
from __future__ import annotations

import argparse
import time
from typing import Iterator

import torch
import transformers
from torch.utils.data import Dataset, Subset

import pipetrain
from pipetrain.apps.datasets import dataset_info, load_dataset, make_loader
from pipetrain.apps.training import add_arguments, config_from_args, is_rank_zero, optimizer_factory

# Tiny defaults: one epoch of the text data takes seconds on 2 CPU cores (like the other examples).
DEFAULTS = {"width": 64, "depth": 2, "batch_size": 32, "epochs": 2, "lr": 0.1}


def build(name: str, vocab: int, width: int, depth: int, length: int) -> torch.nn.Module:
    """A randomly initialised causal LM from its config: GPT-2 (tied embeddings) or Llama (rotary, RMSNorm)."""
    heads = max(1, width // 32)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_positions=length, n_embd=width, n_layer=depth, n_head=heads))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=depth,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=length))


PAD = 0  # the token padding is filled with; its label is -100 and its mask 0, so it never counts


def document_length(index: int, longest: int) -> int:
    """Each sample is cut to a length of its own (a document), the same on every rank and every epoch."""
    return longest // 2 + (index * 7919) % (longest - longest // 2 + 1)


def padded_batch(dataset: Dataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """Samples cut to their document lengths and padded to the longest of this batch: the model's inputs,
    labels included (the model shifts them by one itself)."""
    texts = [dataset[i][0] for i in indices]
    lengths = [document_length(i, len(t)) for i, t in zip(indices, texts)]
    longest = max(lengths)
    ids = torch.full((len(texts), longest), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (text, n) in enumerate(zip(texts, lengths)):
        ids[row, :n], mask[row, :n] = text[:n], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def batches(dataset: Dataset, order: list[int], size: int) -> Iterator[tuple[dict, None]]:
    """(inputs, None) pairs: the labels are among the inputs."""
    for start in range(0, len(order) - size + 1, size):
        yield padded_batch(dataset, order[start:start + size]), None


@torch.no_grad()
def evaluate(pipe: pipetrain.Pipeline, dataset: Dataset, size: int) -> tuple[float, float]:
    """Per-token validation loss and next-token accuracy over the real tokens (predict runs the model in
    eval mode: no dropout; its loss is the whole batch's)."""
    loss, correct, tokens = 0.0, 0, 0
    for x, _ in batches(dataset, list(range(len(dataset))), size):
        out = pipe.predict(x)
        counted = x["labels"][:, 1:] != -100
        n = int(counted.sum())
        loss += float(out.loss) * n
        correct += int(((out.logits[:, :-1].argmax(-1) == x["labels"][:, 1:]) & counted).sum())
        tokens += n
    return loss / tokens, correct / tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, ["gpt2", "llama"])
    parser.add_argument("--save-pretrained", metavar="OUT", help="write the trained model as a Hugging Face "
                        "directory (from_pretrained loads it); every rank writes its own stage")
    parser.add_argument("--weights", metavar="DIR", help="fine-tune from this Hugging Face directory (config.json "
                        "and safetensors): the model is built on the meta device, each rank reads its own stage")
    parser.set_defaults(precision="bf16")
    args = parser.parse_args(argv)
    c = config_from_args(args)
    width, depth = c.width or DEFAULTS["width"], c.depth or DEFAULTS["depth"]
    size, epochs = c.batch_size or DEFAULTS["batch_size"], c.epochs or DEFAULTS["epochs"]
    lr = c.lr or (DEFAULTS["lr"] if c.optimizer == "sgd" else 1e-3)
    train, val = (load_dataset("text", split=split, seed=c.seed) for split in ("train", "val"))
    train = Subset(train, range(min(len(train), c.train_samples or len(train))))
    val = Subset(val, range(min(len(val), c.val_samples or len(val))))
    info = dataset_info("text")
    if args.weights:
        config = transformers.AutoConfig.from_pretrained(args.weights)
        with torch.device("meta"):  # shapes only: each rank makes and reads its own stage's tensors
            model = transformers.AutoModelForCausalLM.from_config(config)
        width, depth = config.hidden_size, config.num_hidden_layers
    else:
        torch.manual_seed(c.seed)  # the same initial weights on every rank and engine
        model = build(c.model, info.num_classes, width, depth, info.input_shape[0])
    example = padded_batch(train, list(range(max(1, size // (c.micro_batches * c.data_parallel)))))
    pipe = pipetrain.wrap(model, example, stages=c.stages, micro_batches=c.micro_batches, schedule=c.schedule,
                          staleness=c.staleness, partitioner=c.partitioner, loss_fn=pipetrain.model_loss, precision=c.precision,
                          data_parallel=c.data_parallel, logdir=c.logdir, seed=c.seed, weights=args.weights,
                          profile=c.partitioner in ("graph", "time"),
                          optimizer=optimizer_factory(c.optimizer, lr, c.momentum))
    val_log = None
    if c.logdir and is_rank_zero():
        from torch.utils.tensorboard import SummaryWriter

        val_log = SummaryWriter(c.logdir, filename_suffix=".val")
    loader = make_loader(train, size, shuffle=True, seed=c.seed, drop_last=True)
    start = time.perf_counter()
    train_losses, val_losses, accuracies = [], [], []
    for epoch in range(epochs):
        losses = [r.loss for r in pipe.train(batches(train, list(loader.sampler), size))]  # every rank, same order
        val_loss, val_accuracy = evaluate(pipe, val, size)
        train_losses.append(sum(losses) / len(losses))
        val_losses.append(val_loss)
        accuracies.append(val_accuracy)
        if val_log is not None:
            val_log.add_scalar("val/loss", val_loss, pipe.updates)
            val_log.add_scalar("val/accuracy", val_accuracy, pipe.updates)
            val_log.flush()
        if is_rank_zero() and c.progress:
            print(f"epoch {epoch + 1}/{epochs}: train loss {train_losses[-1]:.4f}, val loss {val_loss:.4f}, "
                  f"val accuracy {100 * val_accuracy:.2f}%", flush=True)
    if val_log is not None:
        val_log.close()
    if args.save_pretrained:
        pipe.save_pretrained(args.save_pretrained)
    pipe.close()
    if is_rank_zero():
        print(f"{type(model).__name__ if args.weights else c.model} ({width} wide, {depth} layers) on text, {c.describe()}, {epochs} epochs ({pipe.updates} "
              f"steps): min train loss {min(train_losses):.4f}, min val loss {min(val_losses):.4f}, max val accuracy "
              f"{100 * max(accuracies):.2f}%, {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
