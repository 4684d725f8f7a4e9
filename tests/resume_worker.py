"""Trains under torchrun with a checkpoint after every step; on the first attempt one rank dies mid-run.

Run by tests/test_resume_torchrun.py as:
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/resume_worker.py CKPT_DIR OUT_FILE [--no-crash]
"""
import os
import sys

import torch

from runtime_models import data, make, sgd
from helpers import wrap_unprofiled

STEPS, CRASH_AT = 6, 4


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    crash = "--no-crash" not in sys.argv
    torch.set_num_threads(1)
    x, y = data("mlp", STEPS * 8)
    batches = [(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]) for i in range(STEPS)]
    pipe = wrap_unprofiled(make("mlp"), x[:2], stages=2, micro_batches=2, optimizer=sgd, partitioner="uniform",
                           engine="distributed", timeout=10)
    pipe.resume(root)  # --resume: continue from the newest checkpoint when there is one
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for x_b, y_b in batches[pipe.updates:]:
        pipe.step(x_b, y_b)
        pipe.save(root)
        if crash and first_attempt and pipe.updates == CRASH_AT and pipe.world.rank == 1:
            os._exit(9)  # killed mid-training, right after the checkpoint of step 4
    torch.save({"state": pipe.state_dict(), "restarts": os.environ.get("TORCHELASTIC_RESTART_COUNT")},
               f"{out}.rank{pipe.world.rank}")


if __name__ == "__main__":
    main()
