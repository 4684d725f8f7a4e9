"""Compare the staleness methods on one model, data and seed: data parallelism, sync 1F1B and async 1F1B
with each staleness policy and its delay corrections (--methods; the same command line as `pipetrain compare`).

    python examples/compare_staleness.py --model vgg --stages 4 --epochs 10 --logdir runs/vgg
    torchrun --standalone --nproc-per-node 4 examples/compare_staleness.py --model lstm --stages 4
    tensorboard --logdir runs/vgg
"""
from pipetrain.apps.compare import main

if __name__ == "__main__":
    raise SystemExit(main())
