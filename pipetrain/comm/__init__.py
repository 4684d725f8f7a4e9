"""What crosses a pipeline position or process boundary, and the engine that builds it.

`engine` chooses between one process (`LocalEngine`) and one process per stage under
torchrun (`DistributedEngine`) and builds the pieces below for that layout (its `Connections`):

- `world`: ranks, pipeline positions and process groups;
- `transport`: activations and gradients between stages, with the message header's format in `wire`
  and the boundary shapes both ends agreed on in `agreed_shapes`;
- `tied`: tied parameters kept equal;
- `overflow_agreement`: the skip-or-step decision (non-finite values, fp16 overflow) every position takes alike;
- `reporting`: the per-step sum over ranks;
- `replicas` and `replica_start`: hybrid mode (batch shards, gradient averaging, replicas that start equal);
- `peers`: a wait on other ranks that ends, after `timeout`, in an error saying what it waited for;
- `failures`: `PeerFailure` and the board that names the rank that failed first;
- `consensus`: all-or-nothing decisions among the ranks over the store;
- `recording`: the point-to-point traffic posted, for the NCCL-order checker.
"""
