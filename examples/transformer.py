"""Train a Transformer encoder classifier (mnist1d) or a small character language model (text) in a pipeline.

    python examples/transformer.py --stages 4 --schedule async-1f1b --staleness stash
    python examples/transformer.py --model transformer-lm --stages 2
    torchrun --standalone --nproc-per-node 2 examples/transformer.py --stages 2
"""
from pipetrain.apps.training import example_main

if __name__ == "__main__":
    example_main(["transformer", "transformer-lm"], __doc__.splitlines()[0])
