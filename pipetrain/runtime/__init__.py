"""One device running its action list: the executor loop and what it drives.

`executor` dispatches each action of a device's list; `stage` runs one stage's forward and
backward (`split_backward` for zero-bubble B/W); `staleness` chooses the weights an async
forward and backward see; `optimizer_step` is the STEP action; `precision` the autocast and
loss-scaling policy; `feed` and `batching` split mini-batches into micro-batches; `topology`
describes the links between stages; `metrics` holds the per-step result. Nothing here
crosses a device or process boundary by itself: pipetrain.comm does.
"""
