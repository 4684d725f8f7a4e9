"""Durable writes: a file is written under a temporary name, fsynced and renamed, so a crash (even a power cut)
leaves either the old file or the whole new one; ``fsync_dir`` makes a directory's new names durable."""
from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch


def atomic_save(obj: Any, path: Path) -> str:
    """``torch.save`` ``obj`` to ``path`` atomically and durably; returns "<sha256> <bytes>" of the file."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getbuffer()
    _write_durably(data, path)
    return f"{hashlib.sha256(data).hexdigest()} {len(data)}"


def atomic_write_text(text: str, path: Path) -> None:
    """Write ``text`` to ``path`` atomically and durably."""
    _write_durably(text.encode(), path)


def _write_durably(data: bytes | memoryview, path: Path) -> None:
    # fsync before the rename: otherwise a power cut can leave the new name pointing at an empty file.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)  # a full disk keeps no half-written file
        if isinstance(error, OSError) and error.filename is None:  # a failed write names no file: name it
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
