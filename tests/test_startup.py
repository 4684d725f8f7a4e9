"""What a process pays to start: ``import pipetrain`` (every CLI command, every rank) leaves out the parts of
torch only some features use. FSDP2 and DTensor (zero=3) and torch._dynamo (the compiled graph split) took
~3 s of CPU together, more than torch itself; a training process imports torch._dynamo anyway (torch.optim's
constructors do), but `pipetrain plan`, `export` and `--help` never need it."""
import subprocess
import sys

HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.pipelining",
         "transformers", "torchvision")


def test_importing_pipetrain_leaves_out_what_only_some_features_use():
    code = ("import sys, pipetrain, pipetrain.cli, partitioners.planners; "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"
