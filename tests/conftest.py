"""Fixtures shared by the test modules (helpers the spawned ranks use too are in helpers.py)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Every test runs on one intra-op thread, as every spawned rank does: the same kernels give the same
    bits, and on a shared 2-core machine spinning thread pools slow small models many-fold (a 4-stage
    EfficientNet case took 62 s with 2 threads and 6 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Longest files first. `make test` runs `--dist loadfile`: each file goes whole to one of the 4 workers, in
# collection order as they free up (4 on 2 cores: the launching tests leave a core idle while processes start, and a
# fresh clone's suite ran 909 s with 4 workers against 1,031 s with 2 in the same hour). xdist would order the files
# by their number of tests, which put the few-test files that launch torchrun or benchmark scripts (a minute or two
# each) last, where the run's end waited on them with the other workers out of work. The cost of a test is its
# duration in the last run that ran it (pytest's cache), else a guess from its marker; the order only affects how
# well the workers stay balanced.
SECONDS_KEY = "pipetrain/test_seconds"
# The modules whose tests claim equality with an independent reference (the unsplit model, a hand computation): they
# get the `exact` marker, and `make test-kernels` runs them under every CPU kernel path torch and MKL can be held to,
# because a tolerance that holds on one machine's kernels only is tuned, not derived.
EXACT_MODULES = {
    "test_allreduce", "test_batch_forms", "test_checkpoint", "test_clipping_and_schedules", "test_delay_corrections",
    "test_fine_tuning", "test_graph_split_backward", "test_hf_trainer", "test_hybrid", "test_inputs",
    "test_language_models", "test_large_batch_compositions", "test_live_casts", "test_mixture_of_experts", "test_optim_lamb", "test_optim_lars", "test_optim_muon",
    "test_partitioners_stage", "test_precision", "test_recompute", "test_runtime_distributed",
    "test_runtime_staleness", "test_runtime_sync", "test_runtime_zero_bubble_v", "test_sequence_lengths",
    "test_sequence_parallel", "test_split_backward", "test_stage_delays", "test_staleness_reference",
    "test_tensor_parallel", "test_third_party_models", "test_two_nodes", "test_zero", "test_zero3",
}
GUESS = {True: 10.0, False: 0.2}  # seconds: a test marked slow (spawns ranks or processes), any other
measured: dict[str, float] = {}  # this run's seconds per test (setup, call and teardown)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Files in decreasing cost; each file's tests stay together and in their order. The EXACT_MODULES' tests are
    marked `exact`."""
    for item in items:
        if item.module.__name__ in EXACT_MODULES:
            item.add_marker(pytest.mark.exact)
    cache = getattr(config, "cache", None)
    known = cache.get(SECONDS_KEY, {}) if cache is not None else {}
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def cost(path: str) -> float:
        return sum(known.get(i.nodeid, GUESS[i.get_closest_marker("slow") is not None]) for i in files[path])

    items[:] = [item for path in sorted(files, key=cost, reverse=True) for item in files[path]]


def pytest_runtest_logreport(report):
    measured[report.nodeid] = measured.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    """Keep this run's seconds per test for the next run's order (tests it did not run keep theirs)."""
    cache = getattr(session.config, "cache", None)
    if cache is not None and measured and not hasattr(session.config, "workerinput"):  # the controller writes
        cache.set(SECONDS_KEY, {**cache.get(SECONDS_KEY, {}), **measured})
