"""pipetrain.apps.corpus: a fine-tuner's text files, tokenized and packed into blocks as run_clm.py packs them."""
from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path

import pytest
import torch

from pipetrain.apps.corpus import VALIDATION_PERCENT, load_corpus, pack, read_texts

LINES = [f"the {animal} number {i} is {'odd' if i % 2 else 'even'}" for i in range(40) for animal in ("cat", "dog")]


def save_tokenizer(path: Path, lines: list[str]):
    """A word-level tokenizer trained on ``lines`` offline (the tokenizers package), saved as save_pretrained
    saves one, so that AutoTokenizer.from_pretrained(path) loads it."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"), LINES)


def test_pack_concatenates_then_cuts_whole_blocks():
    assert pack([[1, 2, 3], [4], [5, 6, 7, 8]], 3).tolist() == [[1, 2, 3], [4, 5, 6]]  # 7, 8: too few for a block
    assert pack([[1]], 2).shape == (0, 2)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_file_is_tokenized_packed_and_its_last_blocks_validate(suffix, tokenizer, tmp_path):
    path = tmp_path / f"corpus{suffix}"
    if suffix == ".txt":
        path.write_text("\n\n".join(LINES))  # blank lines carry no text
    else:  # the "text" field, wherever it stands
        path.write_text("\n".join(json.dumps({"id": i, "text": line}) for i, line in enumerate(LINES)))
    train, val = load_corpus(path, tokenizer, 8)
    ids = [i for line in LINES for i in tokenizer(line)["input_ids"]]
    blocks = torch.tensor(ids[:len(ids) // 8 * 8]).view(-1, 8)
    held = len(blocks) * VALIDATION_PERCENT // 100
    assert torch.equal(torch.cat([train, val]), blocks) and len(val) == held > 0


def test_jsonl_without_a_text_field_reads_its_first_field(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"body": "a b", "n": 1}\n{"body": "c", "n": 2}\n')
    assert read_texts(path) == {"train": ["a b", "c"]}


@pytest.mark.parametrize("content, message", [('{"text": 3}\n', "must hold text"), ("[1, 2]\n", "one JSON object"),
                                              ("not json\n", "not JSON lines")])
def test_bad_jsonl_says_what_each_line_must_be(content, message, tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_texts(path)


def test_too_little_text_for_one_block_says_what_to_change(tokenizer, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(LINES[0])
    with pytest.raises(ValueError, match="no block of --seq-len 64 tokens.*shorter --seq-len or more text"):
        load_corpus(path, tokenizer, 64)


@pytest.mark.parametrize("name, message", [("corpus.csv", r"\.txt, \.jsonl or \.parquet file.*not a \.csv"),
                                           ("missing.txt", "no such file or directory")])
def test_other_paths_are_refused_with_the_forms_taken(name, message, tmp_path):
    if name.endswith(".csv"):
        (tmp_path / name).write_text("text\nhello\n")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        read_texts(tmp_path / name)


@pytest.mark.parametrize("module, make", [("pyarrow", lambda p: (p / "corpus.parquet").write_bytes(b"PAR1")),
                                          ("datasets", lambda p: (p / "saved").mkdir())])
def test_parquet_and_saved_datasets_without_their_package_say_what_to_install(module, make, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def without(name, *args, **kwargs):  # as on a machine where the package is not installed
        if name.split(".")[0] == module:
            raise ImportError(f"No module named {module!r}")
        return real_import(name, *args, **kwargs)

    make(tmp_path)
    monkeypatch.setattr(builtins, "__import__", without)
    monkeypatch.delitem(sys.modules, module, raising=False)
    path = next(p for p in tmp_path.iterdir())
    with pytest.raises(ImportError, match=f"needs {module}.*pip install {module}"):
        read_texts(path)


def test_parquet_and_saved_datasets_read_their_text_column(tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")  # with pyarrow
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.table({"n": list(range(len(LINES))), "text": LINES}), tmp_path / "c.parquet")
    assert read_texts(tmp_path / "c.parquet") == {"train": LINES}
    saved = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": LINES[:60]}),
                                  "validation": datasets.Dataset.from_dict({"content": LINES[60:]})})
    saved.save_to_disk(tmp_path / "d")
    assert read_texts(tmp_path / "d") == {"train": LINES[:60], "validation": LINES[60:]}
    train, val = load_corpus(tmp_path / "d", tokenizer, 4)
    assert len(val) == len(pack(tokenizer(LINES[60:])["input_ids"], 4))  # its own split validates
