"""What crosses a device or process boundary, and the engine that builds it.

`engine` chooses between one process (`LocalEngine`) and one process per stage under
torchrun (`DistributedEngine`) and builds the pieces below for that layout: `world` (ranks and
process groups), `transport` (activations and gradients between stages), `tied` (tied
parameters kept equal), `overflow` (fp16 skip decisions), `reporting` (the per-step sum over
ranks), `replicas` (hybrid mode: batch shards and gradient averaging over replicas) and `peers`
(a wait on other ranks that ends, after `timeout`, in an error saying what it waited for).
"""
