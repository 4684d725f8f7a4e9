"""A hierarchical reduction inside a pipeline across two "machines": two torchrun agents on
127.0.0.1 (--nnodes 2, c10d rendezvous), 2 stages x 2 replicas (one per machine) and 2 stages x 4
replicas (two per machine: both levels of the hierarchy), equal to one process; the latter also with
ZeRO-2 (reduce-scatter within the node then across, all-gather back)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import free_port
from test_hybrid import batches, reference_global

TESTS = Path(__file__).resolve().parent


# One launch per (allreduce, replicas) trains every ZeRO level of it in turn on the same processes: a
# launch of two agents and their ranks costs more than the training it checks.
LAUNCHES = {("hybrid", 2): [0], ("hierarchical", 4): [0, 2]}


def _two_agents(out: Path, allreduce: str, replicas: int, zeros: list[int]) -> None:
    port = free_port()
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nnodes", "2", "--nproc-per-node", str(replicas), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two-nodes-{allreduce}-{replicas}",
               str(TESTS / "two_node_worker.py"), str(out), allreduce, str(replicas), ",".join(map(str, zeros))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
              for _ in range(2)]
    logs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(log[-3000:] for log in logs)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The output folder of the launch for (allreduce, replicas), launched when a test first asks for it."""
    outs = {}

    def out(allreduce: str, replicas: int) -> Path:
        if (allreduce, replicas) not in outs:
            outs[allreduce, replicas] = tmp_path_factory.mktemp(f"{allreduce}{replicas}")
            _two_agents(outs[allreduce, replicas], allreduce, replicas, LAUNCHES[allreduce, replicas])
        return outs[allreduce, replicas]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("allreduce, replicas, zero", [(allreduce, replicas, zero) for (allreduce, replicas), zeros
                                                       in LAUNCHES.items() for zero in zeros])
def test_two_agents_two_stages_equal_one_process(launched, allreduce, replicas, zero):
    out = launched(allreduce, replicas) / f"zero{zero}"
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2 * replicas)]
    # torchrun's LOCAL_WORLD_SIZE puts replicas / 2 pipelines on each agent, so every stage's
    # data-parallel group spans the two nodes with replicas / 2 ranks on each.
    assert all(r["hierarchy"] == (2, replicas // 2) for r in ranks)
    # Every bucket goes hierarchically (hybrid without a cluster model: the cost model's verdict when
    # links inside a node are at least as fast). With one rank per node that is the inter-node ring;
    # with two, a reduce-scatter inside each node, an all-reduce of the shards across, an all-gather.
    assert all(r["hierarchical_buckets"] and all(r["hierarchical_buckets"]) for r in ranks)
    ref = reference_global(batches("convbn"), replicas).state_dict()
    for replica in range(replicas):
        merged = {k: v for r in ranks if r["replica"] == replica for k, v in r["state"].items()}
        for name, value in ref.items():
            if "running" in name or "num_batches" in name:
                continue  # batch statistics are per replica, as in DDP
            torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=0, msg=f"replica {replica} {name}")
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("allreduce, replicas", list(LAUNCHES))
def test_process_groups_end_before_the_interpreter(launched, allreduce, replicas):
    """A gloo worker thread still alive when the interpreter's teardown begins may abort the process after a
    run that succeeded (it releases a tensor under a GIL that is gone). ``close()`` ends the groups its pipeline
    made; at exit pipetrain closes the pipelines still open and the default group it started."""
    out = launched(allreduce, replicas)
    for rank in range(2 * replicas):
        threads = json.loads((out / f"threads-rank{rank}.json").read_text())
        assert threads["last_open"] > threads["before_last_wrap"], threads  # the pipeline's groups run workers
        if len(LAUNCHES[allreduce, replicas]) > 1:  # before the first pipeline there is no default group yet
            assert threads["last_closed"] == threads["before_last_wrap"], threads
        assert threads["at_exit"] == 0, threads
