"""Train a CIFAR-style ResNet (or torchvision's resnet18/resnet50) in a pipeline (default: ResNet-20 on digits).

    python examples/resnet.py --stages 4 --schedule 1f1b --micro-batches 4
    torchrun --standalone --nproc-per-node 4 examples/resnet.py --stages 2 --data-parallel 2
    python examples/resnet.py --model resnet18 --dataset cifar10 --data-dir data
"""
from pipetrain.apps.training import example_main

if __name__ == "__main__":
    example_main(["resnet", "resnet18", "resnet50"], __doc__.splitlines()[0])
