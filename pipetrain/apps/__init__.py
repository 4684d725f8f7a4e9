"""Applications built on the public API: the training loop, the staleness comparison, the demo,
the offline datasets and the example models (VGG, ResNet, Transformer, LSTM).

Nothing here reaches into pipetrain's internals: what these programs do, a user's can.
"""
