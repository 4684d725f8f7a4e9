"""Train a residual LSTM classifier (mnist1d) or a character language model (text) in a pipeline.

    python examples/lstm.py --stages 2 --schedule async-1f1b --staleness spectrain
    python examples/lstm.py --model lstm-lm --epochs 2
    torchrun --standalone --nproc-per-node 2 examples/lstm.py --stages 2 --checkpoint-dir ckpt --resume auto
"""
from pipetrain.apps.training import example_main

if __name__ == "__main__":
    example_main(["lstm", "lstm-lm"], __doc__.splitlines()[0])
