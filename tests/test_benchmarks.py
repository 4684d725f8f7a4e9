"""The benchmark scripts behind README's measured results still run and still say what README says."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import schedules
from schedules.cluster import PRESETS, Cluster
from schedules.cluster.reductions import Group, allreduce_time

from dist_harness import free_port
from helpers import run_script_here

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "examples" / "benchmarks"


def run_script(name: str, *args: str, timeout: float = 300) -> str:
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_jia_reproduction_matches_the_readme(capsys, monkeypatch):
    # Pure cost model on ResNet-50's real gradient tensors: deterministic, so README's numbers must
    # come out exactly (per-tensor flat ring baseline and the best fused + hierarchical + overlap).
    out = run_script_here(BENCHMARKS / "reproduce_jia.py", capsys=capsys, monkeypatch=monkeypatch)
    efficiency = {line[:46].strip(): line.split()[-1] for line in out.splitlines() if line.endswith("%")}
    assert efficiency["per-tensor"] == "8.3%"
    assert efficiency["fused 4MB + hierarchical + overlap"] == "99.1%"
    assert "the model predicts 8.3% -> 99.1%" in (ROOT / "docs" / "results.md").read_text()


@pytest.mark.slow
def test_calibration_runs_predicts_every_layout_and_saves_a_plannable_cluster(tmp_path, capsys):
    # One round of every micro-benchmark and validation run (W = 2 and 4 gloo processes). Timing
    # is noisy, so this checks that each validated layout gets a measured and a predicted step
    # time whose printed error is their ratio, and that the saved cluster is the fit printed, not
    # how close prediction and measurement are (README reports that, from full runs).
    saved = tmp_path / "this_machine.json"
    out = run_script("bench_calibration.py", "--rounds", "1", "--save-cluster", str(saved), timeout=600)
    rows = re.findall(r"^(W\d \d stages x \d)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([+-][\d.]+)%", out, re.M)
    assert [r[0] for r in rows] == ["W2 2 stages x 1", "W4 4 stages x 1", "W4 2 stages x 2"], out[-2000:]
    for label, cores, measured, predicted, error in rows:
        assert 0 < float(cores) <= (os.cpu_count() or 1), label
        # the error column is the predicted time against the measured one (both printed to 0.01 ms)
        measured, predicted = float(measured), float(predicted)
        assert float(error) == pytest.approx(100 * (predicted / measured - 1),
                                             abs=0.05 + 100 * 0.005 * (1 / measured + predicted / measured ** 2)), label
    cluster = Cluster.from_json(saved.read_text())
    assert (cluster.devices, cluster.backend, cluster.overheads.report_bytes) == (4, "gloo", 8 * (2 + 8 * 4))
    # the saved cluster is the one fitted for W4 4 stages x 1: its effective cores and message-CPU lines
    # are the ones printed
    assert cluster.cores == pytest.approx(float(rows[1][1]), abs=0.006), out[-2000:]
    fit = re.search(r"send ([\d.-]+) ms \+ ([\d.-]+) ns/B, receive ([\d.-]+) ms \+ ([\d.-]+) ns/B", out)
    assert fit is not None, out[-2000:]
    assert [float(v) for v in fit.groups()] == pytest.approx(
        [cluster.send_cpu * 1e3, cluster.send_cpu_byte * 1e9, cluster.recv_cpu * 1e3, cluster.recv_cpu_byte * 1e9],
        abs=6e-4), out[-2000:]
    per_size = re.findall(r"^\s+(\d+) B: send [\d.]+/([\d.-]+)\s+receive [\d.]+/([\d.-]+)$", out, re.M)
    assert per_size, out[-2000:]
    for n, send, receive in per_size:
        assert float(send) == pytest.approx((cluster.send_cpu + int(n) * cluster.send_cpu_byte) * 1e3, abs=6e-4), n
        assert float(receive) == pytest.approx((cluster.recv_cpu + int(n) * cluster.recv_cpu_byte) * 1e3, abs=6e-4), n
    # action is a fitted slope clamped at 0 (one round on a loaded machine can fit 0): its sign is timing
    assert cluster.overheads.action >= 0
    # the file is what `pipetrain plan --cluster` reads: it ranks layouts of a model on this machine (the command
    # run in this process, as its entry point runs it)
    from pipetrain.cli import main

    capsys.readouterr()
    assert main(["plan", "vgg", "--cluster", str(saved), "--batch-size", "64", "--top", "3"]) == 0
    plan = capsys.readouterr().out
    # the ranking's first row: rank, stages, replicas, T, devices, micro-batches, schedule
    assert re.search(r"^\s+1\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+\s+(1f1b|gpipe)", plan, re.M), plan


@pytest.mark.slow
def test_soak_counts_every_step_and_prints_rss_per_rank():
    # The short mode of README's 20,000-step soak: every rank receives every result in order and the
    # script prints an RSS sample per rank at each interval (growth is only meaningful in the full run).
    out = run_script("soak.py", "--steps", "60", "--warmup", "20", "--every", "20")
    samples = re.findall(r"^(\d+)((?:\s+[\d.]+){4})\s*$", out, re.M)
    assert [int(step) for step, _ in samples] == [20, 40, 60], out
    rss = {int(step): row.split() for step, row in samples}  # MiB per rank, as printed
    ranks = re.findall(r"^rank (\d): 60 of 60 results, in order and complete: True; parameters finite: True; "
                       r"RSS ([\d.]+) MiB at step 20 -> ([\d.]+) MiB at the end \(([+-][\d.]+)%\)$", out, re.M)
    assert [int(rank) for rank, _, _, _ in ranks] == [0, 1, 2, 3], out
    growths = []
    for rank, start, end, growth in ranks:
        # each rank's growth is from its step-20 sample to its last one in the table (all printed to 0.1 MiB)
        assert (start, end) == (rss[20][int(rank)], rss[60][int(rank)]), out
        start, end, growth = float(start), float(end), float(growth)
        assert growth == pytest.approx(100 * (end - start) / start, abs=0.005 + 100 * 0.05 * (1 / start + end / start ** 2))
        growths.append(growth)
    worst = re.search(r"^worst RSS growth after warm-up: ([+-]\d+\.\d\d)%", out, re.M)
    assert worst is not None and float(worst.group(1)) == max(growths) and "steps: none lost" in out, out


def test_memory_benchmark_predicts_every_stage_within_ten_percent():
    # --fast: tiny models, one round, no torch comparison. The prediction is deterministic; timing is not checked.
    out = run_script("bench_memory.py", "--fast")
    worst = [float(w) for w in re.findall(r"largest prediction error \(none, always\): ([\d.]+)%", out)]
    assert len(worst) == 2 and max(worst) <= 10.0, out
    assert len(re.findall(r"^\s+(1f1b|gpipe)\s+(none|except-last|always)\s", out, re.M)) == 12, out


@pytest.mark.slow
def test_big_model_benchmark_runs_both_paths_and_checks_the_bound(tmp_path, capsys, monkeypatch):
    # A tiny configuration of README's ~1 B run: 2 gloo ranks (README's run has 4) build on meta and read their stage from the
    # sharded checkpoint the script writes; the materialised path runs beside it (it fits at this size). The script's
    # own process runs here: it writes the checkpoint and launches each path's ranks by command line, each a process
    # of its own (their peaks are theirs).
    out = run_script_here(BENCHMARKS / "bench_big_model.py", "--layers", "2", "--compare-layers", "0", "--hidden",
                          "128", "--vocab", "256", "--ranks", "2", "--cache", str(tmp_path), capsys=capsys, monkeypatch=monkeypatch)
    rows = re.findall(r"^\S+ B\s+(meta|materialised)\s+(\d)\s+([\d.]+)", out, re.M)
    assert sorted((path, int(rank)) for path, rank, _ in rows) == sorted(
        [(p, r) for p in ("meta", "materialised") for r in range(2)]), out
    # The bound itself is README's claim for the 1 B model; a tiny one is all interpreter, whose size varies.
    # What is checked: each row's bound is 1.3 x its state + 1 GiB, each path's total is the sum of its
    # ranks, and the verdict is the meta rows' peaks against their bounds (all printed to 0.01 GiB).
    table = re.findall(r"^\S+ B +(meta|materialised) +(\d|all) +([\d.]+) +(?:([\d.]+) +)?([\d.]+)(?: +([\d.]+))?",
                       out, re.M)
    verdict = re.search(r"within 1.3 x its stage's training state \+ 1 GiB: (True|False)$", out, re.M)
    assert verdict is not None, out
    for path in ("meta", "materialised"):
        ranks = [(float(peak), float(state), float(bound)) for p, rank, peak, _, state, bound in table
                 if p == path and rank != "all"]
        (total,) = [(float(peak), float(state)) for p, rank, peak, _, state, _ in table if p == path and rank == "all"]
        assert all(bound == pytest.approx(1.3 * state + 1.0, abs=0.005 + 1.3 * 0.005) for _, state, bound in ranks), out
        assert total[0] == pytest.approx(sum(peak for peak, _, _ in ranks), abs=0.005 * (len(ranks) + 1)), out
        assert total[1] == pytest.approx(sum(state for _, state, _ in ranks), abs=0.005 * (len(ranks) + 1)), out
        if path == "meta":
            assert verdict.group(1) == str(all(peak <= bound for peak, _, bound in ranks)), out


@pytest.mark.slow
def test_runtime_benchmark_pairs_each_schedule_with_torchs_on_the_same_stages():
    # --tiny: both frameworks' first step on identical stage modules must report the same loss (the script
    # raises otherwise), then every pair prints its CPU per action; timing itself is not checked. Two rounds
    # of one step each: each rank's median is the mean of the two rounds, the ends of the printed range.
    out = run_script("bench_runtime.py", "--tiny", "--steps", "2", "--rounds", "2", "--warmup", "1",
                     "--schedules", "1f1b,interleaved-1f1b")
    assert "2 rounds x 1 steps" in out, out
    cell = r"\s+([\d.]+) \(([\d.]+)-([\d.]+)\)"
    rows = {name: [float(v) for v in values] for name, *values in re.findall(
        r"^(pipetrain [\w-]+(?:, receives at use)?|torch \w+)" + cell + cell + "$", out, re.M)}
    assert set(rows) == {"pipetrain 1f1b", "torch Schedule1F1B", "pipetrain 1f1b, receives at use",
                         "pipetrain interleaved-1f1b", "torch ScheduleInterleaved1F1B"}, out
    for name, values in rows.items():
        for median, low, high in (values[:3], values[3:]):
            assert low <= median <= high and median == pytest.approx((low + high) / 2, abs=1.5e-3), (name, out)


def test_runtime_benchmark_times_the_local_engine_against_the_unsplit_model():
    out = run_script("bench_runtime.py", "--local", "--policies", "vanilla", "--steps", "1", "--rounds", "1",
                     "--warmup", "0")
    rows = {name: (float(ms), float(ratio)) for name, ms, ratio in
            re.findall(r"^(sync 1f1b|async-1f1b vanilla|unsplit, [\w ,-]+?)\s+([\d.]+)\s+([\d.]+)$", out, re.M)}
    assert set(rows) == {"sync 1f1b", "async-1f1b vanilla", "unsplit, micro-batches one at a time",
                         "unsplit, all forwards first"}, out
    # each ratio is the row's CPU time over its base's: sync 1f1b for the pipelines, micro-batches one at
    # a time for the unsplit model (times printed to 0.1 ms, ratios to 0.01)
    for name, base in (("sync 1f1b", "sync 1f1b"), ("async-1f1b vanilla", "sync 1f1b"),
                       ("unsplit, micro-batches one at a time", "unsplit, micro-batches one at a time"),
                       ("unsplit, all forwards first", "unsplit, micro-batches one at a time")):
        (ms, ratio), (base_ms, _) = rows[name], rows[base]
        assert ratio == pytest.approx(ms / base_ms, abs=0.005 + 0.05 * (1 / base_ms + ms / base_ms ** 2)), (name, out)


@pytest.mark.slow
def test_runtime_benchmark_on_vgg_prices_async_against_the_bubble_of_its_stream_length():
    # The README's main table: VGG pairs with equal first-step losses, and the async ratio a stream of
    # n mini-batches of equal stages can reach, n (M + S - 1) / (n M + S - 1), here 2 * 5 / 9 (2 stages,
    # 4 micro-batches), beside the one the measured split allows.
    out = run_script("bench_runtime.py", "--schedules", "1f1b", "--policies", "vanilla", "--steps", "2", "--rounds",
                     "1", "--warmup", "0", "--width", "8", "--batch-size", "16", "--micro-batches", "4")
    rows = re.findall(r"^(pipetrain 1f1b|torch Schedule1F1B|pipetrain async-1f1b vanilla)\s+([\d.]+)\s+([\d.]+),", out, re.M)
    assert {name for name, _, _ in rows} == {"pipetrain 1f1b", "torch Schedule1F1B", "pipetrain async-1f1b vanilla"}, out
    reach = re.search(r"async streams of (\d+) mini-batches, one fill and drain each, can reach ([\d.]+)x", out)
    assert reach is not None and int(reach.group(1)) == 2, out
    assert float(reach.group(2)) == pytest.approx(2 * 5 / 9, abs=5e-4), out
    # The bound on this split: removing the busiest rank's wait w from the sync wall T, n T / (n (T - w) + w)
    # (w and T printed to 0.1 ms: the bound recomputed from them agrees to that rounding).
    split = re.search(r"waits ([\d.]+) of ([\d.]+) ms per mini-batch: removing that wait reaches ([\d.]+)x", out)
    assert split is not None, out
    w, wall, bound = map(float, split.groups())
    assert bound == pytest.approx(2 * wall / (2 * (wall - w) + w), abs=2e-3 + 0.1 / wall), out
    assert re.search(r"^  pipetrain async-1f1b vanilla / pipetrain 1f1b\s+[\d.]+x .*-?\d+% of the equal-stage gain, "
                     r"\s*-?\d+% of the busiest rank's wait$", out, re.M), out
    corun = re.search(r"costs ([\d.]+) ms of CPU with the other rank idle, ([\d.]+) ms while it runs the same \(([\d.]+)x", out)
    assert corun is not None, out
    alone, together, ratio = map(float, corun.groups())
    assert alone > 0 and ratio == pytest.approx(together / alone, abs=1e-3 + 0.01 / alone), out


@pytest.mark.slow
def test_zero_bubble_benchmark_prints_simulated_and_measured_bubbles_and_each_stages_memory():
    # Two gloo ranks, every schedule of the table on a small chain. The simulated column must be the schedule's
    # own bubble at F = B = W = 1, 1f1b's ratio to itself 1, each memory cell's error its printed predicted /
    # measured - 1; zb-h1's last stage holds more activations than 1f1b's (its B keeps them until W). With
    # --compile (docs/results.md's command; test_doc_commands counts it as run here) every split schedule also
    # runs compiled and gets its compiled / eager ratio.
    out = run_script("bench_zero_bubble.py", "--steps", "2", "--rounds", "1", "--warmup", "1", "--layers", "4",
                     "--width", "64", "--batch-size", "16", "--micro-batches", "4", "--compile")
    ratios = re.search(r"^compiled / eager step time, same schedule: (.*)$", out, re.M)
    assert ratios is not None, out
    assert [kind for kind, _ in re.findall(r"([\w-]+) ([\d.]+)(?:, |$)", ratios.group(1))] == [
        "zb-h1", "interleaved-zb", "zbv", "dualpipev"], out
    assert {kind for kind in re.findall(r"^([\w-]+) compiled\s+[\d.]+%\s+-?[\d.]+%\s+[\d.]+\s+[\d.]+$", out, re.M)} == {
        "zb-h1", "interleaved-zb", "zbv", "dualpipev"}, out
    rows = {kind: (float(sim), float(measured), float(ms), float(ratio)) for kind, sim, measured, ms, ratio in
            re.findall(r"^([\w-]+)\s+([\d.]+)%\s+(-?[\d.]+)%\s+([\d.]+)\s+([\d.]+)$", out, re.M)}
    assert set(rows) == {"1f1b", "zb-h1", "interleaved-zb", "zbv", "dualpipev"}, out
    for kind, (sim, measured, ms, ratio) in rows.items():
        built = schedules.build(kind, 2, 4, **({"chunks": 2} if kind == "interleaved-zb" else {}))
        expected = schedules.simulate(built, schedules.Costs(forward=1, backward=1, weight=1)).bubble_fraction
        assert sim == pytest.approx(100 * expected, abs=0.05), (kind, out)
        assert 0 <= measured < 100 and ms > 0, (kind, out)
    assert rows["1f1b"][3] == 1.0, out
    assert rows["zbv"][0] < rows["zb-h1"][0] < rows["1f1b"][0], out
    memory = {kind: [tuple(map(float, cell)) for cell in re.findall(r"(\d+)/(\d+)/(\d+) \(([+-][\d.]+)%\)", line)]
              for kind, line in re.findall(r"^([\w-]+) +(\d+/.*)$", out, re.M)}
    assert {kind: len(cells) for kind, cells in memory.items()} == {
        "1f1b": 2, "zb-h1": 2, "interleaved-zb": 4, "zbv": 4, "dualpipev": 4}, out
    for kind, cells in memory.items():
        for held, measured, predicted, error in cells:
            # kB printed to 1 kB, the error to 0.1%: recomputed from the rounded kB it agrees within their rounding
            assert error == pytest.approx(100 * (predicted / measured - 1), abs=0.05 + 100 * 1.0 / measured), (kind, out)
    assert memory["zb-h1"][1][0] > memory["1f1b"][1][0], out


def _two_agents(script: str, *args: str) -> str:
    """What rank 0 prints when `script` runs on two torchrun agents of 2 ranks each on 127.0.0.1 (two "nodes",
    static rendezvous), as docs/results.md launches it."""
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    agents = [subprocess.Popen([*torchrun, "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
                                port, str(BENCHMARKS / script), *args],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}) for node in (0, 1)]
    logs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(log[-3000:] for log in logs)
    return logs[0]


@pytest.mark.slow
def test_hierarchical_allreduce_benchmark_counts_each_variants_bytes_and_prices_it():
    # Tiny gradients, two rounds: timing is not checked, only that every variant is there with the bytes its
    # collectives send on 2 nodes x 2 ranks, the socket bytes that back them, and a ratio that is the printed
    # measured / predicted; the real clusters' rows are the cost model's own numbers.
    out = _two_agents("bench_hierarchical_allreduce.py", "--mib", "0.05", "--rounds", "2")
    width = int(re.search(r"gradients: 4 x Linear\((\d+), \1\)", out).group(1))
    numel = 4 * (width * width + width)
    assert f"in 1 bucket(s) of {4 * numel} B" in out, out  # below the first bucket's 1 MiB: one bucket
    n, padded = 4 * numel, 4 * (-(-numel // 2) * 2)  # fp32 bytes; hierarchical pads to a multiple of 2 ranks
    number = r"\s+([\d.]+)"
    rows = {name: [float(v) for v in values] for name, *values in re.findall(
        r"^(flat|hierarchical|flat \+ fp16|hierarchical \+ fp16)" + number * 7 + "$", out, re.M)}
    assert list(rows) == ["flat", "hierarchical", "flat + fp16", "hierarchical + fp16"], out
    # per rank: a ring all-reduce over 4 sends 2 x 3/4 n, to the next rank (across nodes for one rank per node);
    # hierarchical: all-to-all n/2 in the node, all-reduce of the n/2 shard across (2 x 1/2 x n/2), all-gather
    # n/2 in the node; across nodes only the shard's all-reduce, n/2 from each of the node's 2 ranks
    expected = {"flat": (1.5 * n, 1.5 * n), "hierarchical": (1.5 * padded, padded)}
    for name, (sent, across, socket, measured, predicted, ratio, error) in rows.items():
        base = name.removesuffix(" + fp16")
        assert (sent, across) == tuple(b / (2 if "fp16" in name else 1) for b in expected[base]), (name, out)
        assert sent <= socket <= sent + 8192, (name, out)  # the socket adds gloo's message headers
        assert predicted > 0 and 0 <= error <= 1, (name, out)
        # ms printed to 0.001, the ratio to 0.01: recomputed from the rounded times it agrees within their rounding
        rounding = 5e-4 * (1 / predicted + measured / predicted ** 2)
        assert ratio == pytest.approx(measured / predicted, abs=0.005 + rounding), (name, out)
    assert len(re.findall(r"^hierarchical( \+ fp16|) / flat\1: measured [\d.]+, predicted [\d.]+: on this loopback "
                          r"hierarchy (pays|does not pay)$", out, re.M)) == 2, out
    presets = re.findall(r"^([\w-]+) .* (\d+)x(\d+)" + number * 3 + "  (pays|does not pay)$", out, re.M)
    shown = {(name, int(nodes), int(per)) for name, nodes, per, *_ in presets}
    assert shown == {(c.name, *shape) for c in PRESETS.values() if c.backend == "nccl"
                     for shape in ((2, 2), (c.nodes, c.devices_per_node))}, out
    for name, nodes, per, flat, hier, ratio, verdict in presets:
        group = Group(int(nodes), int(per))
        assert float(flat) == pytest.approx(1e3 * allreduce_time(n, group, PRESETS[name], False), abs=6e-4), out
        assert float(hier) == pytest.approx(1e3 * allreduce_time(n, group, PRESETS[name], True), abs=6e-4), out
        flat, hier = float(flat), float(hier)
        assert float(ratio) == pytest.approx(hier / flat, abs=0.005 + 5e-4 * (1 / flat + hier / flat ** 2)), out
        assert (verdict == "pays") == (hier < flat), out


@pytest.mark.slow
def test_large_batch_study_prints_each_rows_best_rate_and_its_gap_to_the_baseline(tmp_path):
    # cnn1d only, 2 seeds, 1 epoch on 4,096 samples (the fewest that give a batch of 2,048 an update after its warm-up),
    # validated on 512, two runs at a time in worker processes (--jobs 2, the way the study runs): the study's pipeline
    # end to end (3 rows, 13 rates, 26 runs), not its result. Each row's best
    # rate is one of its grid's, chosen by the seeds' mean final accuracy as results.json records them; the printed
    # mean and gap follow from those numbers.
    import json
    import statistics

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from large_batch_study import FAMILIES
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = run_script("large_batch_study.py", "--families", "cnn1d", "--seeds", "2", "--epochs", "1",
                     "--train-samples", "4096", "--val-samples", "512", "--precision", "fp32", "--jobs", "2",
                     "--logdir", str(tmp_path / "study"), timeout=900)
    record = json.loads((tmp_path / "study" / "results.json").read_text())["cnn1d"]
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| cnn1d |")]
    assert [r["row"] for r in record] == [row.label for row in FAMILIES["cnn1d"].rows] == [r[1] for r in rows]
    baseline = statistics.fmean(record[0]["final_val_accuracy"])
    for entry, row, printed in zip(record, FAMILIES["cnn1d"].rows, rows):
        assert entry["best_lr"] in row.grid and len(entry["final_val_accuracy"]) == 2
        mean = statistics.fmean(entry["final_val_accuracy"])
        assert printed[2].startswith(f"{entry['best_lr']:g}")
        assert printed[3].startswith(f"{100 * mean:.2f} ± ")
        assert printed[4].rstrip(" |") == f"{100 * (mean - baseline):+.2f}"
    assert rows[0][4].rstrip(" |") == "+0.00" and (tmp_path / "study" / "large_batch.png").stat().st_size > 0
