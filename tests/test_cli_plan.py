"""`pipetrain plan` of Hugging Face language models named by a config: built on the meta device, the best
layout's per-stage memory printed, a cluster too small refused with the stage that does not fit."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
import transformers as hf

from partitioners.planners.layout import evaluate_layout
from pipetrain.cli import main
from schedules.cluster import Cluster

REPO = Path(__file__).resolve().parents[1]
# Tied embeddings: the head's weight is the embedding's, which a plan must count once.
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True)
UNITS = {"B": 1.0, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
SIZE = r"[\d.]+ [kMGT]?B"
# Figures are printed with 4 significant digits: each is within 5e-4 of its value, and so is their sum.
PRINTED = 5e-4
STAGE_ROW = re.compile(rf"^\s*(\d+)\s+\d+-\d+\s+({SIZE})\s+({SIZE})\s+({SIZE})\s+({SIZE})\s+(\d+)\s+({SIZE})\s+\S+$",
                       re.M)
RANK_ROW = re.compile(r"^\s*\d+\s+(\d+)\s+\d+\s+\d+\s+\d+\s+\d+\s+\S+\s+([\d.]+)\s+.*\s(yes|NO)$", re.M)


def _bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


def _stages(out: str) -> list[dict[str, float]]:
    """The best layout's per-stage memory table, in bytes."""
    table = out.split("predicted memory per device of each stage", 1)[1]
    keys = ("weights", "gradients", "optimizer", "activations")
    return [dict(zip(keys, map(_bytes, row[1:5])), in_flight=int(row[5]), total=_bytes(row[6]))
            for row in STAGE_ROW.findall(table)]


def _tiny_config(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-llama"
    hf.LlamaConfig(**TINY).save_pretrained(folder)
    return folder


def _cluster(tmp_path: Path, memory: float) -> str:
    """Four devices on one node with `memory` bytes each."""
    path = tmp_path / f"cluster-{memory:g}.json"
    path.write_text(Cluster(nodes=1, devices_per_node=4, intra_bandwidth=1e10, intra_latency=1e-5, inter_bandwidth=1e10,
                            inter_latency=1e-5, memory=memory, name="tiny4").to_json())
    return str(path)


def _plan_tiny(spec: str, cluster: str, *extra: str) -> list[str]:
    # 8 tokens, 8 samples: activations the same order as the 23 kB of weights, so memory decides the layout
    return ["plan", spec, "--cluster", cluster, "--batch-size", "8", "--seq-len", "8", *extra]


def _materialised_bytes(config: hf.PretrainedConfig) -> int:
    """Parameter bytes of the model built with data (parameters() yields a tied weight once)."""
    model = hf.AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie this reference counts once
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("as_file", [False, True], ids=["directory", "config.json"])
def test_tiny_config_plans_and_stage_weights_sum_to_the_model(tmp_path, capsys, as_file):
    folder = _tiny_config(tmp_path)
    spec = str(folder / "config.json" if as_file else folder)
    # 110 kB per device: the whole model's weights, gradients and Adam state (4 x 22.8 kB) plus one
    # micro-batch's activations do not fit one device, so the best layout is a pipeline.
    assert main(_plan_tiny(spec, _cluster(tmp_path, 110e3), "--top", "100")) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM on the meta device" in out and "8 tokens per sample" in out
    ranked = RANK_ROW.findall(out)
    fits = [row[2] == "yes" for row in ranked]
    assert fits[0] and not fits[-1], out  # some layouts fit and some do not
    assert fits == sorted(fits, reverse=True), "a layout over memory ranked above one that fits"
    assert all(row[2] == "NO" for row in ranked if row[0] == "1")  # one device cannot hold it all
    slowest_fitting = max(float(row[1]) for row in ranked if row[2] == "yes")
    assert any(float(row[1]) < slowest_fitting for row in ranked if row[2] == "NO"), \
        "no faster layout over memory: the order checked above would hold by speed alone"

    stages = _stages(out)
    assert len(stages) >= 2, out
    expected = _materialised_bytes(hf.LlamaConfig(**TINY))
    assert sum(s["weights"] for s in stages) == pytest.approx(expected, rel=PRINTED)
    for s in stages:
        # weights + gradients + two Adam moments, all fp32, plus the in-flight activations
        assert s["gradients"] == pytest.approx(s["weights"], rel=PRINTED)
        assert s["optimizer"] == pytest.approx(2 * s["weights"], rel=2 * PRINTED)
        parts = s["weights"] + s["gradients"] + s["optimizer"] + s["activations"]
        assert s["total"] == pytest.approx(parts, rel=2 * PRINTED)
        assert s["total"] <= 110e3 * (1 + PRINTED) and s["in_flight"] >= 1


@pytest.mark.slow
def test_llama_default_config_plans_on_meta_in_little_memory():
    # The default Llama config is the 6.7 B model: 27 GB in fp32, more than this machine has. Built on the
    # meta device, the whole plan stays within the memory of importing torch and transformers.
    # The peak of the new process's own memory (VmHWM): ru_maxrss would keep the peak of the process it was
    # forked from (a pytest worker), which Linux carries across exec.
    script = ("import re, sys; from pipetrain.cli import main; code = main(sys.argv[1:]); "
              "print('peak RSS kB', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]); "
              "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", script, "plan", "llama", "--cluster", "nvlink8-100g",
                           "--batch-size", "8", "--max-stages", "4", "--seq-len", "512", "--dtype", "bf16",
                           "--top", "3"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    peak_kb = int(re.search(r"peak RSS kB (\d+)", out).group(1))
    assert peak_kb < 2 * 1024 ** 2, f"peak RSS {peak_kb / 1024 ** 2:.1f} GiB: was the model materialised?"

    c = hf.AutoConfig.for_model("llama")
    h, inter, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
    count = c.num_hidden_layers * per_layer + 2 * c.vocab_size * h + h  # untied embedding and head, final norm
    assert 6.6e9 < count < 6.8e9
    printed = int(re.search(r"on the meta device, ([\d,]+) parameters", out).group(1).replace(",", ""))
    assert printed == count
    # fp32 weights under --dtype bf16 (autocast), as pipetrain keeps them
    assert sum(s["weights"] for s in _stages(out)) == pytest.approx(4 * count, rel=PRINTED)


def test_cluster_too_small_names_the_stage_and_its_peak(tmp_path, capsys):
    folder = str(_tiny_config(tmp_path))
    with pytest.raises(SystemExit) as refused:
        main(_plan_tiny(folder, _cluster(tmp_path, 20e3)))
    message = str(refused.value)
    got = re.search(rf"no layout fits cluster 'tiny4' \(20 kB per device\): the closest, (\d+) stages? x \d+ "
                    rf"replicas? .* puts a predicted peak of ({SIZE}) = [\d.e+]+ bytes on stage (\d+), ({SIZE}) over "
                    rf"\(weights ({SIZE}), gradients ({SIZE}), optimizer ({SIZE}), activations ({SIZE}) "
                    rf"\(\d+ micro-batch(?:es)? in flight\)\); fix: ", message)
    assert got, message
    stages, peak, stage, over = int(got[1]), _bytes(got[2]), int(got[3]), _bytes(got[4])
    assert stage < stages and peak > 20e3
    assert over == pytest.approx(peak - 20e3, rel=2 * PRINTED, abs=1.0)
    assert sum(map(_bytes, got.groups()[4:])) == pytest.approx(peak, rel=2 * PRINTED)
    # The closest layout's peak is the least any layout needs: with that much memory a plan exists.
    capsys.readouterr()
    assert main(_plan_tiny(folder, _cluster(tmp_path, peak * (1 + 2 * PRINTED)))) == 0
    assert max(s["total"] for s in _stages(capsys.readouterr().out)) <= peak * (1 + 3 * PRINTED)


def test_profile_is_refused_for_a_model_on_meta():
    with pytest.raises(SystemExit, match=r"--profile times every node on data, but 'llama' is built on the meta "
                                         r"device .*fix: drop --profile"):
        main(["plan", "llama", "--cluster", "nvlink8-100g", "--batch-size", "8", "--profile"])


def test_what_model_may_be_and_misuse(tmp_path, capsys):
    with pytest.raises(SystemExit) as shown:
        main(["plan", "--help"])
    assert shown.value.code == 0
    assert "config.json" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="holds no config.json"):
        main(["plan", str(tmp_path / "empty"), "--cluster", "nvlink8-100g", "--batch-size", "8"])
    with pytest.raises(SystemExit, match="--seq-len applies to Hugging Face language models"):
        main(["plan", "vgg", "--cluster", "nvlink8-100g", "--batch-size", "8", "--seq-len", "8"])
    with pytest.raises(SystemExit, match="unknown model 'no-such-model'"):
        main(["plan", "no-such-model", "--cluster", "nvlink8-100g", "--batch-size", "8"])


def test_stage_memory_adds_up_the_predicted_peak_by_hand():
    g = nx.DiGraph()
    g.add_node("a", fwd_time=1.0, bwd_time=2.0, param_bytes=10.0, act_bytes=5.0)
    g.add_node("b", fwd_time=3.0, bwd_time=4.0, param_bytes=20.0, act_bytes=7.0)
    g.add_edge("a", "b", bytes=5.0)
    cluster = Cluster(nodes=1, devices_per_node=2, intra_bandwidth=1e9, intra_latency=0.0, inter_bandwidth=1e9,
                      inter_latency=0.0)
    lay = evaluate_layout(g, cluster, [0, 1, 2], replicas=1, micro_batches=2, schedule="gpipe", batch_size=8,
                          profiled_batch=2, optimizer="sgd-momentum")
    # SGD with momentum: weights, gradients and one optimizer copy; gpipe holds both micro-batches, each of 2 x the
    # profiled size (stage 0 keeps its output, 5 bytes; stage 1 what it receives and its output, 5 + 7)
    first, second = lay.stage_memory
    assert (first.weights, first.gradients, first.optimizer, first.in_flight, first.activations) == (10, 10, 10, 2, 20)
    assert (second.weights, second.gradients, second.optimizer, second.in_flight, second.activations) == (
        20, 20, 20, 2, 48)
    assert [first.total, second.total] == lay.result.memory
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'; choose one of sgd, sgd-momentum"):
        evaluate_layout(g, cluster, [0, 2], replicas=1, micro_batches=1, schedule="gpipe", batch_size=2,
                        profiled_batch=2, optimizer="rmsprop")
