"""Run a script (an example) as `python SCRIPT ARGS...` would, with a real SIGTERM sent at a chosen step:

    SIGTERM_STEP=N [SIGTERM_RANK=R] [SIGTERM_TO=self|torchrun] python tests/sigterm_at_step.py SCRIPT ARGS...

Right after step N's result (Pipeline.on_step, on rank R only; default 0) the signal goes to this process, or to
its parent, the torchrun agent, which forwards it to every rank. The signal is sent from the training loop
itself, so where it lands does not depend on timing: sent to this process, its handler runs before the next
line; sent to torchrun, this rank waits until the forwarded one has arrived. The other ranks get it whenever
torchrun forwards it, which is what the agreement on where to stop is for.
"""
import os
import runpy
import signal
import sys
import time

import pipetrain

STEP, RANK = int(os.environ["SIGTERM_STEP"]), int(os.environ.get("SIGTERM_RANK", "0"))
TO_TORCHRUN = os.environ.get("SIGTERM_TO", "self") == "torchrun"
FORWARD_WAIT_S = 60.0  # a bound on torchrun's forwarding, only so that a broken launch fails instead of hanging


def send(result: pipetrain.StepResult) -> None:
    if result.step != STEP:
        return
    if not TO_TORCHRUN:
        os.kill(os.getpid(), signal.SIGTERM)
        return
    os.kill(os.getppid(), signal.SIGTERM)
    handler = signal.getsignal(signal.SIGTERM)
    deadline = time.monotonic() + FORWARD_WAIT_S
    while not handler.signalled:  # the script's StopOnSigterm records the forwarded signal
        if time.monotonic() > deadline:
            raise RuntimeError(f"torchrun did not forward SIGTERM within {FORWARD_WAIT_S} s")
        time.sleep(0.01)


def wrap_and_watch(*args, **kwargs) -> pipetrain.Pipeline:
    pipe = real_wrap(*args, **kwargs)
    if int(os.environ.get("RANK", "0")) == RANK:
        pipe.on_step(send)
    return pipe


real_wrap, pipetrain.wrap = pipetrain.wrap, wrap_and_watch
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as python puts a script's folder first
runpy.run_path(script, run_name="__main__")
