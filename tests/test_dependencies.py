"""The library works without the packages of the ``examples`` extra (scikit-learn, mnist1d, matplotlib), and
what needs one of them says how to install it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRA = ("sklearn", "mnist1d", "matplotlib")

# Runs in a fresh interpreter where importing any package of the extra fails, as where it is not installed.
WITHOUT_THE_EXTRA = f"""
import importlib.abc, math, sys

# The interpreter's finders, blind to the extra's packages: as if not installed, importlib.util.find_spec
# (which torch asks of some packages) says None and an import raises ModuleNotFoundError.
class NotInstalled(importlib.abc.MetaPathFinder):
    def __init__(self, finders):
        self.finders = finders

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {EXTRA!r}:
            return None
        return next(filter(None, (f.find_spec(name, path, target) for f in self.finders
                                  if hasattr(f, "find_spec"))), None)

    def find_distributions(self, context=None):  # importlib.metadata: installed versions, not the extra's
        for f in self.finders:
            for dist in getattr(f, "find_distributions", lambda context: [])(context):
                if dist.metadata["Name"].lower().replace("-", "_") not in {EXTRA!r} + ("scikit_learn",):
                    yield dist

sys.meta_path[:] = [NotInstalled(list(sys.meta_path))]
try:
    import sklearn
    raise SystemExit("the finder did not block sklearn")
except ImportError:
    pass

import torch
import pipetrain, pipetrain.cli, partitioners, schedules

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
pipe = pipetrain.wrap(model, torch.randn(2, 4), stages=2, micro_batches=2, engine="local", partitioner="uniform",
                      profile=False)
losses = [pipe.step(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]
assert all(math.isfinite(loss) for loss in losses), losses
assert pipe.updates == 3

from pipetrain.apps.datasets import load_dataset
assert len(load_dataset("text")) > 0  # the standard library's text needs no extra
for name in ("digits", "mnist1d"):
    try:
        load_dataset(name)
        raise SystemExit(f"{{name}} loaded without its package")
    except ImportError as error:
        print(f"{{name}}: {{error}}")
try:
    schedules.write_png(schedules.simulate(schedules.build("1f1b", 2, 2), schedules.Costs(1, 1)), "never.png")
    raise SystemExit("write_png drew without matplotlib")
except ImportError as error:
    print(f"write_png: {{error}}")
from pipetrain.apps.compare import compare_figure
try:
    compare_figure({{}}, {{}}, None)
    raise SystemExit("compare_figure drew without matplotlib")
except ImportError as error:
    print(f"compare_figure: {{error}}")
print("imported:", sorted(m for m in sys.modules if m.partition(".")[0] in {EXTRA!r}))
"""


def test_the_library_trains_without_the_examples_extra_and_its_users_name_it():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_THE_EXTRA], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    for needed_by, package in (("digits", "scikit-learn"), ("mnist1d", "mnist1d"), ("write_png", "matplotlib"),
                                ("compare_figure", "matplotlib")):
        assert "pip install 'pipetrain[examples]'" in lines[needed_by] and package in lines[needed_by], lines
    assert lines["imported"] == "[]"
