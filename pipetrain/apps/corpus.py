"""A fine-tuner's own text as language-model samples: read, tokenized and packed into blocks.

It prepares a corpus the way Hugging Face's run_clm.py does. Each text is tokenized: a line of a ``.txt`` file,
the "text" field of a ``.jsonl`` record or a ``.parquet`` row, or a row of a directory that ``datasets``'
``save_to_disk`` wrote (the first column where there is no "text"). The token ids are concatenated and cut into
blocks of ``seq_len`` (group_texts; the remainder is dropped), and each block is one sample, its labels its own
ids. Data without a validation split of its own (a saved DatasetDict's "validation") holds out its last blocks,
VALIDATION_PERCENT of them (run_clm.py's validation_split_percentage).
"""
from __future__ import annotations

import importlib
import itertools
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable

import torch

VALIDATION_PERCENT = 5
TEXT_COLUMN = "text"  # run_clm.py's choice; without it, the first column
FORMS = "a .txt, .jsonl or .parquet file, or a directory written by datasets' save_to_disk"


def load_corpus(path: str | os.PathLike, tokenizer: Any, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training and validation blocks of the corpus at ``path``: (n, seq_len) token ids each, from
    ``tokenizer`` (a transformers tokenizer: called on a list of texts, it returns their "input_ids")."""
    if seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2 tokens (a next-token target), got {seq_len}")
    blocks = {split: pack(tokenizer(texts)["input_ids"] if texts else [], seq_len)
              for split, texts in read_texts(path).items()}
    if "validation" not in blocks:
        train = blocks["train"]
        held = max(1, len(train) * VALIDATION_PERCENT // 100)
        blocks = {"train": train[:-held], "validation": train[-held:]}
    for split, rows in blocks.items():
        if len(rows) == 0:
            raise ValueError(f"{path}: its {split} texts make no block of --seq-len {seq_len} tokens (the last "
                             f"{VALIDATION_PERCENT}% of the blocks validate, at least one): use a shorter --seq-len "
                             "or more text")
    return blocks["train"], blocks["validation"]


def pack(ids: Iterable[list[int]], seq_len: int) -> torch.Tensor:
    """run_clm.py's group_texts: the token ids concatenated and cut into rows of ``seq_len``, the rest dropped."""
    flat = list(itertools.chain.from_iterable(ids))
    rows = len(flat) // seq_len
    return torch.tensor(flat[:rows * seq_len], dtype=torch.long).view(rows, seq_len)


def read_texts(path: str | os.PathLike) -> dict[str, list[str]]:
    """The texts at ``path`` by split: "train", and "validation" where the data has one."""
    p = Path(path)
    if p.is_dir():
        return _saved_dataset(p)
    if not p.is_file():
        raise FileNotFoundError(f"--dataset {p}: no such file or directory; give {FORMS}")
    if p.suffix == ".txt":  # a line is a text, as datasets' "text" builder reads it; blank lines carry nothing
        return {"train": [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]}
    if p.suffix == ".jsonl":
        lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        try:
            records = [json.loads(line) for line in lines]
        except json.JSONDecodeError as error:
            raise ValueError(f"{p}: not JSON lines ({error}); each line must be one JSON object") from None
        if not all(isinstance(r, dict) for r in records):
            raise ValueError(f"{p}: each line must be one JSON object, e.g. {{\"text\": \"...\"}}")
        columns = list(records[0]) if records else [TEXT_COLUMN]
        column = _text_column(columns, p)
        return {"train": _strings([r.get(column) for r in records], column, p)}
    if p.suffix == ".parquet":
        table = _optional("pyarrow.parquet", "pyarrow", "a .parquet corpus").read_table(p)
        column = _text_column(table.column_names, p)
        return {"train": _strings(table.column(column).to_pylist(), column, p)}
    raise ValueError(f"--dataset {p}: {FORMS}, not a {p.suffix or 'file without a suffix'}")


def _saved_dataset(p: Path) -> dict[str, list[str]]:
    datasets = _optional("datasets", "datasets", "a directory written by save_to_disk")
    saved = datasets.load_from_disk(str(p))
    splits = dict(saved) if isinstance(saved, datasets.DatasetDict) else {"train": saved}
    if "train" not in splits:
        raise ValueError(f"{p}: a DatasetDict without a 'train' split (it has {', '.join(splits)})")
    out = {}
    for split in ("train", "validation"):
        if split in splits:
            column = _text_column(splits[split].column_names, p)
            out[split] = _strings(splits[split][column], column, p)
    return out


def _text_column(columns: list[str], p: Path) -> str:
    if not columns:
        raise ValueError(f"{p}: no columns to read text from")
    return TEXT_COLUMN if TEXT_COLUMN in columns else columns[0]


def _strings(values: list[Any], column: str, p: Path) -> list[str]:
    if not all(isinstance(v, str) for v in values):
        raise ValueError(f"{p}: column {column!r} must hold text in every row; name the text column "
                         f"{TEXT_COLUMN!r}")
    return values


def _optional(module: str, package: str, needed_by: str) -> ModuleType:
    """Import ``module``; when it is missing, an ImportError that says what needs it and what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"reading {needed_by} needs {package}, which pipetrain does not install: "
                          f"pip install {package} (or give a .txt or .jsonl file)") from error
