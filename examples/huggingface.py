"""Pretrain or fine-tune a small GPT-2- or Llama-style language model (Hugging Face transformers) on text.

Trained as language models are trained: in bf16 (``--precision`` changes it), on documents of different
lengths that a collator pads to the longest of each batch (attention mask; padding labelled -100, so it does
not count), with the loss the model computes itself from ``labels`` (``pipetrain.model_loss``), the global
gradient norm clipped (``--max-grad-norm``) and the learning rate warmed up then decayed on a cosine
(``--warmup``; ``--lr-schedule`` chooses another). The model is passed to pipetrain.wrap as it is:
torch.export captures it (its forward takes **kwargs, which torch.fx cannot), with the batch and sequence
dimensions dynamic, so every batch length runs on the same stages. ``--lora R`` fine-tunes LoRA adapters of
rank R (peft) on the frozen model instead, and ``--save-pretrained`` then writes the adapter, which
``PeftModel.from_pretrained`` loads.

    python examples/huggingface.py --model gpt2 --stages 2
    python examples/huggingface.py --model llama --stages 2 --schedule async-1f1b --staleness stash
    python examples/huggingface.py --model llama --stages 2 --schedule async-1f1b --staleness spectrain --precision fp32
    torchrun --standalone --nproc-per-node 2 examples/huggingface.py --stages 2 --save-pretrained out/gpt2
    torchrun --standalone --nproc-per-node 2 examples/huggingface.py --stages 2 --weights out/gpt2   # fine-tune it
    torchrun --standalone --nproc-per-node 8 examples/huggingface.py --model llama --stages 2 --data-parallel 2 \
        --tensor-parallel 2 --zero 3
    torchrun --standalone --nproc-per-node 4 examples/huggingface.py --model llama --stages 2 --tensor-parallel 2 \
        --sequence-parallel
    python examples/huggingface.py --stages 2 --weights out/gpt2 --lora 8 --optimizer adam --save-pretrained out/adapter

With ``--weights DIR`` (a Hugging Face directory: ``config.json`` and safetensors) the model is built from the
directory's config on the meta device, as models too large for one process are: no process ever holds the
whole model, and each rank reads only its own stage's tensors from DIR.

The data is the offline text of pipetrain.apps.datasets (characters as tokens, documents of different lengths)
unless ``--dataset PATH`` names your own: a ``.txt`` (a line a text), ``.jsonl`` or ``.parquet`` file (the
"text" field) or a directory written by ``datasets``' ``save_to_disk``. It is tokenized by the tokenizer saved
beside ``--weights`` (or ``--tokenizer DIR``) and packed into blocks of ``--seq-len`` tokens as Hugging Face's
run_clm.py does (pipetrain.apps.corpus):

    python examples/huggingface.py --stages 2 --weights out/gpt2 --dataset notes.jsonl --seq-len 128

The flags besides this script's own are those of every training entry point (pipetrain.apps.run_config, shared
with the other examples and `pipetrain compare`), and every one reaches pipetrain.wrap, the data or the loop:
the delay corrections of async-1f1b (--stage-momentum, --spike-compensation, ...) included.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import time

import torch
import transformers
from torch.utils.data import DataLoader, Dataset, Subset

import pipetrain
from pipetrain.apps.corpus import load_corpus
from pipetrain.apps.datasets import dataset_info, load_dataset
from pipetrain.apps.run_config import add_arguments, config_from_args, default_lr
from pipetrain.apps.training import is_rank_zero

MODELS = ["gpt2", "llama"]  # --model's choices, the first the default

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
# Sequence parallelism (--sequence-parallel): the Llama's norms named in its tp_plan, which turns it on
SEQUENCE_PARALLEL_NORMS = {"layers.*.input_layernorm": "sequence_parallel",
                           "layers.*.post_attention_layernorm": "sequence_parallel", "norm": "sequence_parallel"}


def document_length(index: int, longest: int) -> int:
    """Each sample is cut to a length of its own (a document), the same on every rank and every epoch."""
    return longest // 2 + (index * 7919) % (longest - longest // 2 + 1)


class Documents(Dataset):
    """Sample i of ``texts`` (the offline text) cut to its document length: one row of token ids, as a
    tokenizer gives them."""

    def __init__(self, texts: Dataset):
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        text = self.texts[index][0]
        return {"input_ids": text[:document_length(index, len(text))]}


class Blocks(Dataset):
    """The rows of a packed corpus (pipetrain.apps.corpus), all ``--seq-len`` tokens long."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index]}


def text_data(args: argparse.Namespace, seed: int, config: transformers.PretrainedConfig | None
              ) -> tuple[Dataset, Dataset, int, int]:
    """The training and validation rows, the vocabulary size and the longest row: the offline text, or the
    --dataset corpus tokenized by --tokenizer (default: the one beside --weights, whose ``config`` it is)."""
    if args.dataset is None:
        train, val = (load_dataset("text", split=split, seed=seed) for split in ("train", "val"))
        info = dataset_info("text")
        return Documents(train), Documents(val), info.num_classes, info.input_shape[0]
    where = args.tokenizer or args.weights
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as error:
        raise ValueError(f"no tokenizer in {where} ({error}); name the one --dataset is tokenized with: "
                         "--tokenizer DIR (a directory save_pretrained wrote, or a Hub name)") from None
    positions = max_positions(config) if config is not None else None
    seq_len = args.seq_len or min(1024, tokenizer.model_max_length, positions or 1024)  # run_clm.py's block_size
    if positions is not None and seq_len > positions:
        raise ValueError(f"--seq-len {seq_len} is longer than the {positions} positions of --weights' model: "
                         f"use --seq-len {positions} or less")
    train, val = load_corpus(args.dataset, tokenizer, seq_len)
    vocab = config.vocab_size if config is not None else len(tokenizer)
    top = int(max(train.max(), val.max()))
    if top >= vocab:
        raise ValueError(f"the tokenizer gives ids up to {top}, beyond the model's vocabulary of {vocab}: use the "
                         "tokenizer the --weights model was trained with")
    return Blocks(train), Blocks(val), vocab, seq_len


def max_positions(config: transformers.PretrainedConfig) -> int:
    """The longest sequence a model of ``config`` takes (Llama: max_position_embeddings; GPT-2: n_positions)."""
    return getattr(config, "max_position_embeddings", None) or config.n_positions


def collate(rows: list[dict[str, torch.Tensor]], multiple: int = 1) -> dict[str, torch.Tensor]:
    """A causal-LM collator: rows padded to the longest of the batch (rounded up to a ``multiple``: sequence
    parallelism cuts the sequence in T), with their attention mask and labels (the model shifts them by one itself;
    padding is -100)."""
    longest = -(-max(len(r["input_ids"]) for r in rows) // multiple) * multiple
    ids = torch.full((len(rows), longest), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], mask[i, :n] = r["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loader(rows: Dataset, size: int, seed: int | None, multiple: int = 1) -> DataLoader:
    """Batches of ``size`` rows, shuffled by ``seed`` and all full (None: in order, and the last one as short as
    it comes, so that validation sees every row): the same on every rank; their length a ``multiple``."""
    order = torch.Generator().manual_seed(seed) if seed is not None else None
    return DataLoader(rows, batch_size=size, shuffle=order is not None, generator=order,
                      collate_fn=functools.partial(collate, multiple=multiple), drop_last=order is not None)


def with_lora(model: torch.nn.Module, rank: int, family: str) -> torch.nn.Module:
    """LoRA adapters of rank ``rank`` on the attention projections; everything else frozen."""
    import peft

    targets = ["c_attn"] if family == "gpt2" else ["q_proj", "v_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))


@torch.no_grad()
def evaluate(pipe: pipetrain.Pipeline, dataset: Dataset, size: int, multiple: int = 1) -> tuple[float, float]:
    """Per-token validation loss and next-token accuracy over the real tokens (predict runs the model in
    eval mode: no dropout; its loss is the whole batch's)."""
    loss, correct, tokens = 0.0, 0, 0
    for x in loader(dataset, size, seed=None, multiple=multiple):
        out = pipe.predict(x)
        counted = x["labels"][:, 1:] != -100
        n = int(counted.sum())
        loss += float(out.loss) * n
        correct += int(((out.logits[:, :-1].argmax(-1) == x["labels"][:, 1:]) & counted).sum())
        tokens += n
    return loss / tokens, correct / tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The flags every training entry point shares (pipetrain.apps.run_config), but --dataset, which here names a
    # corpus to tokenize, and the image datasets' --data-dir and --download.
    add_arguments(parser, MODELS, omit=("dataset", "data_dir", "download"))
    parser.add_argument("--dataset", metavar="PATH", help="train on this text: a .txt, .jsonl or .parquet file or a "
                        "directory written by datasets' save_to_disk (default: the offline text)")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenize --dataset with this tokenizer (a directory "
                        "save_pretrained wrote, or a Hub name; default: the one saved beside --weights)")
    parser.add_argument("--seq-len", type=int, help="tokens per sample --dataset is packed into (default: 1024, or "
                        "fewer where the model or tokenizer takes fewer)")
    parser.add_argument("--save-pretrained", metavar="OUT", help="write the trained model as a Hugging Face "
                        "directory (from_pretrained loads it); every rank writes its own stage")
    parser.add_argument("--weights", metavar="DIR", help="fine-tune from this Hugging Face directory (config.json "
                        "and safetensors): the model is built on the meta device, each rank reads its own stage")
    parser.add_argument("--lora", type=int, default=0, metavar="R", help="train LoRA adapters of rank R on the "
                        "frozen model (peft); --save-pretrained then writes the adapter")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm to this "
                        "(0: no clipping)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T", help="split each stage's attention "
                        "and MLP over T ranks by the model's own tp_plan (torchrun: stages x data-parallel x T "
                        "processes)")
    parser.add_argument("--sequence-parallel", action="store_true", help="with --tensor-parallel (Llama): also cut "
                        "the norms, residual adds and dropout along the sequence (the plan names the norms "
                        "'sequence_parallel'); batches are padded to a multiple of T")
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="shard optimizer state (1), "
                        "gradients (2) and parameters (3, FSDP2) over the --data-parallel replicas")
    # --model: gpt2, unless --weights brings its own; the rate warms up (over 10 updates unless --warmup says, and
    # --lr-schedule none has none), then decays on a cosine.
    parser.set_defaults(precision="bf16", model=None, lr_schedule="warmup-cosine", warmup=None)
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = 0 if args.lr_schedule == "none" else 10
    try:
        c = config_from_args(args)
    except ValueError as error:  # flags that contradict each other: it says which
        parser.error(str(error))
    if args.dataset is None and (args.tokenizer or args.seq_len):
        parser.error("--tokenizer and --seq-len prepare a --dataset corpus; the offline text is characters already: "
                     "add --dataset PATH or drop them")
    if args.dataset and not (args.tokenizer or args.weights):
        parser.error("--dataset needs a tokenizer: --tokenizer DIR, or --weights DIR with one saved beside it")
    name, width, depth = c.model or MODELS[0], c.width or DEFAULTS["width"], c.depth or DEFAULTS["depth"]
    size, epochs = c.batch_size or DEFAULTS["batch_size"], c.epochs or DEFAULTS["epochs"]
    c = dataclasses.replace(c, lr=c.lr or default_lr(c.optimizer, DEFAULTS["lr"]))
    config = transformers.AutoConfig.from_pretrained(args.weights) if args.weights else None
    if config is not None:  # its architecture is config.json's: a flag that says otherwise would be overridden
        given = {"--model": (c.model, config.model_type), "--width": (c.width, config.hidden_size),
                 "--depth": (c.depth, config.num_hidden_layers)}
        clash = [f"{flag} {mine} (it has {theirs})" for flag, (mine, theirs) in given.items()
                 if mine not in (None, theirs)]
        if clash:
            parser.error(f"--weights {args.weights} brings its model's architecture (config.json): drop "
                         f"{', '.join(clash)}")
    try:
        train, val, vocab, length = text_data(args, c.seed, config)
    except (ValueError, FileNotFoundError, ImportError) as error:  # each says what to do
        parser.error(str(error))
    train = Subset(train, range(min(len(train), c.train_samples or len(train))))
    val = Subset(val, range(min(len(val), c.val_samples or len(val))))
    if config is not None:
        with torch.device("meta"):  # shapes only: each rank makes and reads its own stage's tensors
            model = transformers.AutoModelForCausalLM.from_config(config)
        width, depth = config.hidden_size, config.num_hidden_layers
    else:
        torch.manual_seed(c.seed)  # the same initial weights on every rank and engine
        model = build(name, vocab, width, depth, length)
    family = "gpt2" if "GPT2" in type(model).__name__ else "llama"
    if args.lora:
        model = with_lora(model, args.lora, family)
    tp_plan, multiple = None, 1
    if args.sequence_parallel:
        if family != "llama" or args.tensor_parallel == 1:
            parser.error("--sequence-parallel takes --tensor-parallel T > 1 and the llama model")
        tp_plan, multiple = {**model.tp_plan, **SEQUENCE_PARALLEL_NORMS}, args.tensor_parallel
    example = collate([train[i] for i in range(max(1, size // (c.micro_batches * c.data_parallel)))], multiple)
    updates = epochs * (len(train) // size)
    # c.wrap_options(updates): every pipetrain.wrap option of the shared flags (stages, schedule, staleness and its
    # delay corrections, optimizer, --lr-schedule over the run's updates, precision, partitioner, seed, logdir, ...),
    # so none can be left out; the loss is the one the model computes from the labels in the batch.
    pipe = pipetrain.wrap(model, example, **{**c.wrap_options(updates), "loss_fn": pipetrain.model_loss},
                          weights=args.weights, max_grad_norm=args.max_grad_norm or None,
                          tensor_parallel=args.tensor_parallel, tp_plan=tp_plan, zero=args.zero)
    val_log = None
    if c.logdir and is_rank_zero():
        from torch.utils.tensorboard import SummaryWriter

        val_log = SummaryWriter(c.logdir, filename_suffix=".val")
    start = time.perf_counter()
    train_losses, val_losses, accuracies = [], [], []
    per_epoch, stopped = len(train) // size, False
    # With --checkpoint-dir, SIGTERM (a scheduler's preemption; torchrun forwards it to every rank) stops the run
    # at a mini-batch every rank agrees on, which is saved; --resume continues from there.
    with pipetrain.StopOnSigterm(pipe, enabled=bool(c.checkpoint_dir)) as stop:
        if c.resume == "auto" and pipe.resume(c.checkpoint_dir) and is_rank_zero():
            print(f"resumed from {c.checkpoint_dir} at step {pipe.updates}", flush=True)
        while pipe.updates < updates:
            epoch, done = divmod(pipe.updates, per_epoch)  # a resumed run starts where the checkpoint stopped
            batches = itertools.islice(loader(train, size, seed=c.seed + epoch, multiple=multiple), done, None)  # every rank, same order
            losses = [r.loss for r in pipe.train(stop.batches(batches))]
            if not stop.stopped:  # a whole epoch: validate
                val_loss, val_accuracy = evaluate(pipe, val, size, multiple)
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
            if c.checkpoint_dir:
                pipe.save(c.checkpoint_dir)
            stopped = stop.requested()
            if stopped:
                if is_rank_zero():
                    print(f"stopped by SIGTERM at step {pipe.updates}; saved {c.checkpoint_dir}, continue with "
                          "--resume", flush=True)
                break
    if val_log is not None:
        val_log.close()
    if args.save_pretrained and not stopped:  # the trained model, once training has finished
        pipe.save_pretrained(args.save_pretrained)
    if is_rank_zero() and accuracies:
        print(f"{type(model).__name__ if args.weights else name} ({width} wide, {depth} layers) on "
              f"{args.dataset or 'text'}, {c.describe()}, {epochs} epochs ({pipe.updates} steps): min train loss "
              f"{min(train_losses):.4f}, min val loss {min(val_losses):.4f}, max val accuracy "
              f"{100 * max(accuracies):.2f}%, {time.perf_counter() - start:.1f} s", flush=True)
    pipe.close()


if __name__ == "__main__":
    main()
