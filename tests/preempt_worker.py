"""One run of the shared training loop with a checkpoint directory, for the SIGTERM tests.

    python tests/preempt_worker.py CKPT_DIR OUT_FILE SCHEDULE ENGINE [--resume]
(ENGINE "distributed" under torchrun). Prints "step N" after every mini-batch and pauses after
step PAUSE_AT, so that the test's SIGTERM lands in the middle of an epoch; the pause only waits,
it changes no numbers. Saves the summary's losses and preempted flag to OUT_FILE.rankR.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

from pipetrain.apps.training import RunConfig, run

PAUSE_AT, PAUSE_S = 8, 3.0  # 6 mini-batches per epoch: step 8 is inside the second epoch


def config(schedule: str, engine: str, **kw) -> RunConfig:
    """3 epochs x 6 mini-batches of a tiny VGG on 2 stages."""
    base = dict(model="vgg", width=4, stages=2, micro_batches=1 if schedule == "async-1f1b" else 2,
                schedule=schedule, staleness="stash" if schedule == "async-1f1b" else "none", partitioner="params",
                train_samples=96, val_samples=40, batch_size=16, epochs=3, lr=0.05, progress=False, engine=engine)
    base.update(kw)
    return RunConfig(**base)


def main() -> None:
    root, out, schedule, engine = sys.argv[1:5]
    torch.set_num_threads(1)

    def report(result):  # report progress; give the signal time to land
        print(f"step {result.step}", flush=True)
        if result.step == PAUSE_AT and "--resume" not in sys.argv:
            time.sleep(PAUSE_S)

    summary = run(config(schedule, engine, checkpoint_dir=root, resume="auto" if "--resume" in sys.argv else "never"),
                  on_step=report)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save({"losses": summary.step_losses, "preempted": summary.preempted, "pid": os.getpid()},
               f"{out}.rank{rank}")


if __name__ == "__main__":
    main()
