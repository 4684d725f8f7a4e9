"""Train a CIFAR-style VGG with BatchNorm in a pipeline (default: VGG-11 on the offline digits set).

    python examples/vgg.py --stages 4 --schedule async-1f1b --staleness spectrain
    torchrun --standalone --nproc-per-node 4 examples/vgg.py --stages 4
    python examples/vgg.py --dataset cifar10 --data-dir data --width 64 --depth 16
"""
from pipetrain.apps.training import example_main

if __name__ == "__main__":
    example_main(["vgg"], __doc__.splitlines()[0])
