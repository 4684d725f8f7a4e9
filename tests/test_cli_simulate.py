"""`pipetrain simulate` prints the simulator's summary and writes trace files."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_simulate_prints_summary(capsys):
    assert main(["simulate", "--schedule", "1f1b", "--stages", "4", "--micro-batches", "8"]) == 0
    out = capsys.readouterr().out
    # default costs F=1, B=1, W=1 (full backward 2): makespan 3 * (8 + 4 - 1)
    assert "schedule 1f1b: 4 stages x 8 micro-batches" in out
    assert "makespan 33" in out and "bubble 27.27%" in out


def test_simulate_options_and_files(tmp_path, capsys):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    argv = ["simulate", "--schedule", "interleaved-1f1b", "--stages", "2", "--micro-batches", "4",
            "--chunks", "2", "--trace", str(trace)]
    pytest.importorskip("matplotlib")
    argv += ["--png", str(png)]
    assert main(argv) == 0
    assert "2 chunks per stage" in capsys.readouterr().out
    assert json.loads(trace.read_text())["traceEvents"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_async_mini_batches(capsys):
    main(["simulate", "--schedule", "async-1f1b", "--stages", "3", "--micro-batches", "1",
          "--mini-batches", "5"])
    out = capsys.readouterr().out
    assert "5 mini-batches" in out
    assert out.splitlines()[-3].split()[-1] == "0..2"  # stage 0 lag reaches p-1 = 2


def test_simulate_bad_shape_exits_with_reason():
    with pytest.raises(SystemExit, match="divisible by stages"):
        main(["simulate", "--schedule", "interleaved-1f1b", "--stages", "4", "--micro-batches", "6"])
    with pytest.raises(SystemExit, match="does not take option"):
        main(["simulate", "--schedule", "1f1b", "--chunks", "2"])


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "pipetrain.cli", "simulate", "--schedule", "gpipe",
                           "--stages", "2", "--micro-batches", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "makespan" in proc.stdout
