"""The weight-streaming cluster under `wse fit`: exactness against the reference step, resume, failures.

One file over ~500 lines: every test here starts real MPI jobs from the same few params and
fixtures (a dataset, a reference run), so the cluster's promises are read in one place."""
import collections
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from conftest import read_events
from data_tools.checkpoint import Checkpoint
from data_tools.dataset import GlobalStream
from data_tools.preprocess import preprocess_text
from mpi_launch.plan import PlanError
from mpi_launch.resolved import describe, resolve
from mpi_launch.rundir import RunDir
from mpi_launch.protocol import RankEvent
from mpi_launch.supervisor import HOLD_ENV
from wse_core.models import build_model
from wse_core.nn import numpy_ops, reference_step
from wse_core.numerics import differences, environment
from pyapi.params import validate
from wse_core.optim import make_optimizer, make_schedule
from wse_core.optim.loss_scale import LossScaler

STEPS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    preprocess_text(["stdlib"], d / "lm", 32, samples_per_file=4000, progress=False)  # about 100 files
    return d / "lm"


def params_file(tmp_path, data, micro_batch_size=2, **runconfig):
    """A small GPT-2's params (a test of faults, not of micro-batching, takes micro-batches of 4: as
    many rounds of weights and gradients as it needs, and no more)."""
    p = {
        "train_input": {"data_dir": str(data), "batch_size": 8, "micro_batch_size": micro_batch_size, "shuffle": True,
                        "shuffle_seed": 4},
        "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
                  "max_position_embeddings": 32},
        "optimizer": {"optimizer_type": "AdamW", "weight_decay": 0.01, "max_gradient_norm": 1.0,
                      "learning_rate": [{"scheduler": "Linear", "initial_learning_rate": 1e-3,
                                         "end_learning_rate": 1e-4, "total_iters": 10}]},
        "runconfig": {"max_steps": STEPS, "num_wgt_servers": 2, "model_dir": str(tmp_path / "model"), **runconfig},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(p))
    return path, p


def one_line(proc):
    """The one line a failed `wse` command printed last."""
    return proc.stderr.strip().splitlines()[-1]


def reference(p, steps, results=None, num_csx=1, micro_batch_size=None):
    """Weights and optimizer state after `steps` single-process reference steps on the same data
    (each step's StepResult appended to ``results``), the batch laid out for ``num_csx`` CS-2s (which
    changes nothing when it divides evenly), in micro-batches of ``micro_batch_size`` (default: p's)."""
    model = build_model(p["model"])
    seed = p["runconfig"].get("seed", 0)
    params = model.init_params(seed)
    o = p["optimizer"]
    opt = make_optimizer("AdamW", lr=0.0, weight_decay=o["weight_decay"])
    state = {k: opt.init_state(v) for k, v in params.items()}
    schedule = make_schedule(o["learning_rate"])
    scaler = LossScaler.from_params(validate(p).optimizer, model.config.get("fp16_type"))
    t_in = p["train_input"]
    stream = GlobalStream(t_in.get("data_dir"), mixture=t_in.get("mixture"), shuffle=t_in["shuffle"],
                          seed=t_in["shuffle_seed"])
    losses = []
    for t in range(steps):
        ex = stream.read(t * t_in["batch_size"], t_in["batch_size"])
        batch = model.batch_of(ex)
        r = reference_step(model, params, state, opt, batch, micro_batch_size=micro_batch_size or t_in["micro_batch_size"],
                           step=t + 1, lr=schedule(t), max_gradient_norm=o["max_gradient_norm"], seed=seed,
                           scaler=scaler, lr_factors=model.lr_factors(o.get("adjust_learning_rate")),
                           num_csx=num_csx)
        losses.append(r.loss)
        if results is not None:
            results.append(r)
    stream.close()
    return params, state, losses


def fit_matches_reference(jobs, tmp_path, path, p, num_csx, steps=STEPS, results=None, env=None,
                          micro_batch_size=None):
    """`wse fit` of ``path`` on ``num_csx`` CS-2s ends with the reference's weights, optimizer state and
    losses (``p``: the flat params the file holds; the reference's micro-batches ``micro_batch_size``,
    default p's); returns the finished process and the metrics."""
    proc = jobs.run("fit", path, "--num_csx", num_csx, env=env)
    assert proc.returncode == 0, proc.stderr
    params, state, losses = reference(p, steps, results, num_csx, micro_batch_size)
    assert_bits(tmp_path / "model", params, state)
    metrics = RunDir(tmp_path / "model").read_metrics()
    assert [m["loss"] for m in metrics] == losses
    return proc, metrics


def assert_bits(ckpt_dir, params, state):
    got, got_state = Checkpoint(ckpt_dir).load()
    for k in params:
        assert got[k].tobytes() == params[k].tobytes(), k
        for s in state[k]:
            assert got_state[k][s].tobytes() == state[k][s].tobytes(), (k, s)


def test_auto_takes_the_micro_batch_that_fits_the_wafer_and_trains_with_the_references_bits(tmp_path, data, jobs):
    """micro_batch_size: auto, on a wafer too small for a CS-2's whole share (4 samples: 202 KB of the
    188 KB this wafer of 8 x 8 PEs holds), takes 2, and the run has the reference's bits at 2; the
    ranks' clocks are the walk's."""
    small = {"program_width": 8, "program_height": 8, "pe_memory_bytes": 3916}
    path, p = params_file(tmp_path, data, hardware=small)
    p["train_input"]["micro_batch_size"] = "auto"
    path.write_text(yaml.safe_dump(p))
    assert validate(p).train_input.micro_batch_size == 2
    with pytest.raises(PlanError, match="the largest that fits and deals the 4 samples each CS-2 gets evenly is 2"):
        resolve(validate(dict(p, train_input=dict(p["train_input"], micro_batch_size=4),
                              runconfig=dict(p["runconfig"], num_csx=2))))
    resolved = dict(p, train_input=dict(p["train_input"], micro_batch_size=2))
    _, metrics = fit_matches_reference(jobs, tmp_path, path, resolved, 2)
    assert_clock_agrees_with_the_walk(metrics, p, 2)


@pytest.mark.parametrize("batch_size", [10, 9])
def test_a_batch_that_does_not_divide_is_dealt_evenly_with_the_references_bits(tmp_path, data, jobs, batch_size):
    """Any batch runs, as on Cerebras' clusters from release 2.3: each of 2 CS-2s computes
    ceil(ceil(B / 2) / 3) = 2 micro-batches, the four the batch halved twice (10 as 2, 3, 2, 3; 9 as
    2, 2, 2, 3: the second CS-2 computes the micro-batches 1 and 3); the bits are the reference
    step's."""
    path, p = params_file(tmp_path, data)
    p["train_input"].update(batch_size=batch_size, micro_batch_size=3)
    path.write_text(yaml.safe_dump(p))
    _, metrics = fit_matches_reference(jobs, tmp_path, path, p, 2)
    assert [m["tokens"] for m in metrics] == [batch_size * 32] * STEPS


@pytest.mark.parametrize("num_csx,workers", [(1, 1), (2, 2), (4, 1)])
def test_bit_identical_to_the_reference(tmp_path, data, jobs, num_csx, workers):
    """With the default micro-batch size (auto: a CS-2's whole share, 8, 4 or 2 samples), weights and
    optimizer state after 3 steps equal the single-process reference's in micro-batches of one sample,
    bit for bit: the same bits for any num_csx. The run is resolved once: the launcher builds the model
    once, and each rank once (it obeys the plan in run.json), counted by the audit event ``build_model``
    raises."""
    path, p = params_file(tmp_path, data, micro_batch_size="auto", num_workers_per_csx=workers)
    hook, builds = tmp_path / "hook", tmp_path / "builds.txt"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, sys\n"
        "def count(event, args):\n"
        "    if event == 'wse.build_model':\n"
        f"        with open({str(builds)!r}, 'a') as f:\n"
        "            f.write(f'{os.getpid()} {sys.argv[0]}\\n')\n"
        "sys.addaudithook(count)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    _, metrics = fit_matches_reference(jobs, tmp_path, path, p, num_csx, env=env, micro_batch_size=1)
    assert (tmp_path / "model" / "plan.json").exists() and any((tmp_path / "model" / "logs").iterdir())
    assert_clock_agrees_with_the_walk(metrics, p, num_csx)
    per_process = collections.Counter(builds.read_text().splitlines())
    ranks = len(json.loads((tmp_path / "model" / "plan.json").read_text())["plan"]["roles"])
    assert sorted(per_process.values()) == [1] * (ranks + 1), per_process  # the launcher and every rank
    assert sum("pyapi" in line for line in per_process) == 1


def test_a_mixture_trains_as_the_reference_reads_it(tmp_path, data, jobs):
    """train_input.mixture through the cluster: every input worker reads its share of the mixed
    stream, and the weights equal the reference's on the same stream."""
    (tmp_path / "notes.txt").write_text("wafer-scale engines stream weights layer by layer. " * 400)
    preprocess_text([str(tmp_path / "notes.txt")], tmp_path / "notes", 32, progress=False)
    path, p = params_file(tmp_path, data, num_workers_per_csx=2)
    del p["train_input"]["data_dir"]
    p["train_input"]["mixture"] = [{"data_dir": str(data), "weight": 0.6},
                                   {"data_dir": str(tmp_path / "notes"), "weight": 0.4}]
    path.write_text(yaml.safe_dump(p))
    fit_matches_reference(jobs, tmp_path, path, p, 2)


def test_steps_longer_than_the_peer_timeout_train(tmp_path, jobs):
    """A model whose steps take about twice runconfig.peer_timeout here (2 s): its ranks wait out
    whole steps of their peers' compute and the job trains (with a fixed peer_timeout the MemoryX
    gave up waiting for the gradients of step 1, as GPT-2 124M did at the default 20 s)."""
    preprocess_text(["stdlib"], tmp_path / "lm", 128, samples_per_file=4000, progress=False)
    p = {"train_input": {"data_dir": str(tmp_path / "lm"), "batch_size": 32, "micro_batch_size": 8},
         "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 512, "num_hidden_layers": 4, "num_heads": 4,
                   "max_position_embeddings": 128},
         "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-4},
         "runconfig": {"max_steps": 3, "model_dir": str(tmp_path / "model"), "peer_timeout": 2}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    proc = jobs.run("fit", tmp_path / "params.yaml", timeout=600)
    assert proc.returncode == 0, proc.stderr
    metrics = RunDir(tmp_path / "model").read_metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3]
    if min(m["step_seconds"] for m in metrics) <= 2:
        pytest.skip(f"steps of {min(m['step_seconds'] for m in metrics):.1f} s here: too fast to test waits longer "
                    "than peer_timeout")


def assert_clock_agrees_with_the_walk(metrics, p, num_csx):
    """The ranks' simulated clocks give the step the analytical walk gives (what `wse compile`
    prints), within 5%; the parts that do not depend on the run are the walk's."""
    walk = describe(resolve(validate(dict(p, runconfig=dict(p["runconfig"], num_csx=num_csx)))))["simulated"]
    sim = metrics[-1]
    assert abs(sim["sim_step_s"] - walk["step_s"]) <= 0.05 * walk["step_s"], (sim, walk)
    assert sim["sim_samples_per_s"] == pytest.approx(p["train_input"]["batch_size"] / sim["sim_step_s"])
    assert sim["sim_compute_s"] == pytest.approx(walk["compute_s"])
    assert sim["sim_stream_s"] == pytest.approx(walk["stream_s"])
    return walk


def test_the_simulated_clock_agrees_with_the_walk_and_is_deterministic(tmp_path, data, jobs):
    """A second model size (the first is in the bit-identical test): N = 1, 2, 4 through `wse fit`,
    each rank's clock against the analytical walk; the same run again gives the same clock, and
    the clock never changes the bits (the weights equal the reference's)."""
    path, p = params_file(tmp_path, data, max_steps=3)
    p["model"].update(hidden_size=64, num_hidden_layers=3, num_heads=4)
    path.write_text(yaml.safe_dump(p))
    params, state, _ = reference(p, 3)
    steps = {}
    for n in (1, 2, 4, 2):
        model_dir = tmp_path / f"csx{n}"
        shutil.rmtree(model_dir, ignore_errors=True)
        proc = jobs.run("fit", path, "--num_csx", n, "--model_dir", model_dir)
        assert proc.returncode == 0, proc.stderr
        assert_bits(model_dir, params, state)
        metrics = RunDir(model_dir).read_metrics()
        assert_clock_agrees_with_the_walk(metrics, p, n)
        sim = [m["sim_step_s"] for m in metrics]
        assert steps.setdefault(n, sim) == sim   # N = 2 twice: the same simulated time, to the bit
    assert steps[4][-1] < steps[2][-1] < steps[1][-1]   # more CS-2s, same global batch: faster


def test_a_model_zoo_trainer_file_with_dropout_is_bit_identical_to_the_reference(tmp_path, data, jobs):
    """A trainer-layout file (Model Zoo 2.3 on) with Model Zoo's numerics: ``loss_scaling: batch_size``
    with ``loss_weight``, dropout keyed by (seed, step, sample, layer), truncated-normal
    initializers, no decay on biases and norms, muP's scales and per-group learning rates;
    num_csx 2 gives the reference's bits."""
    from pyapi.modelzoo import to_trainer

    path, p = params_file(tmp_path, data)
    p["model"].update(loss_scaling="batch_size", loss_weight=1 / 64, dropout_rate=0.1, attention_dropout_rate=0.2,
                      initializer={"name": "truncated_normal", "std": 0.03}, name="gpt3", embeddings_scale=4.0,
                      output_logits_scale=0.5, scale_qk_dot_by_d=True)  # and muP's scales
    p["optimizer"]["adjust_learning_rate"] = {"decoder_kernel": 0.5}
    p["runconfig"]["seed"] = 5
    trainer, dropped = to_trainer(p)
    assert not dropped
    path.write_text(yaml.safe_dump(trainer))
    fit_matches_reference(jobs, tmp_path, path, p, 2)


@pytest.mark.parametrize("fp16_type,num_csx", [("float16", 1), ("float16", 2), ("cbfloat16", 2)])
def test_mixed_precision_with_dynamic_loss_scaling_is_bit_identical_to_the_reference(tmp_path, data, jobs,
                                                                                    fp16_type, num_csx):
    """16-bit weights streamed (half the bytes), 16-bit activations and gradients, float32 master
    weights; a loss scale too big overflows the 16-bit gradients: those steps are skipped and the
    scale halves, then grows again after steps_per_increase finite steps. Weights, losses, scales
    and skips are the reference's, bit for bit, for num_csx 1 and 2."""
    steps = 6
    path, p = params_file(tmp_path, data, max_steps=steps)
    p["model"].update(mixed_precision=True, fp16_type=fp16_type)
    p["optimizer"].update(loss_scaling_factor="dynamic", initial_loss_scale=2.0 ** 24 if fp16_type == "cbfloat16"
                          else 2.0 ** 12, max_loss_scale=2.0 ** 30, steps_per_increase=2)
    path.write_text(yaml.safe_dump(p))
    results = []
    proc, metrics = fit_matches_reference(jobs, tmp_path, path, p, num_csx, steps, results)
    assert [(m["loss_scale"], m["skipped"]) for m in metrics] == [(r.loss_scale, r.skipped) for r in results]
    # The clocks time 16-bit values (2 bytes each, in chunks of 16-bit elements) as the walk does.
    assert assert_clock_agrees_with_the_walk(metrics, p, num_csx)["detail"]["precision"] == "fp16"
    if fp16_type == "float16":  # 2^12 overflows float16 gradients here: skipped, then recovered
        skips = [m["skipped"] for m in metrics]
        assert skips[0] and not all(skips)
        first_good = skips.index(False)
        assert metrics[first_good]["loss_scale"] == 2.0 ** 12 / 2 ** first_good
        # The overflows at the start are one line, and the step line says skipped rather than nan.
        run = "step 1" if first_good == 1 else f"steps 1-{first_good} ({first_good} in a row)"
        assert f"\n{run}: gradients overflowed, " in proc.stdout and "nan" not in proc.stdout, proc.stdout
        assert "step     1/6  loss " in proc.stdout and "skipped (overflow), loss scale halved to 2048" in proc.stdout
    # 16-bit on the wire: each MemoryX takes in 2 bytes per gradient value of its units (a tied weight
    # twice), for every micro-batch of a CS-2 (a round: one sum over the CS-2s).
    model, run_dir = build_model(p["model"]), RunDir(tmp_path / "model")
    uses = sum(int(np.prod(model.param_specs[n].shape)) for names in model.unit_params for n in names)
    memoryx = json.loads((tmp_path / "model" / "plan.json").read_text())["plan"]["memoryx"]
    per_step = [sum(json.loads(run_dir.timing_log(r).read_text().splitlines()[i])["bytes_in"] for r in memoryx)
                for i in range(steps)]
    rounds = p["train_input"]["batch_size"] // num_csx // p["train_input"]["micro_batch_size"]
    assert per_step == [2 * uses * rounds] * steps


def test_llama_with_gqa_bfloat16_and_dropout_is_bit_identical_to_the_reference(tmp_path, data, jobs):
    """llama (RMSNorm, rotary, grouped-query attention, SwiGLU, untied head) in bfloat16 with dropout:
    num_csx 2 gives the reference's bits."""
    path, p = params_file(tmp_path, data)
    p["model"] = {"name": "llama", "vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
                  "filter_size": 48, "max_position_embeddings": 32, "attention_module": "multiquery_attention",
                  "extra_attention_params": {"num_kv_groups": 2}, "share_embedding_weights": False,
                  "dropout_rate": 0.1, "mixed_precision": True, "fp16_type": "bfloat16"}
    path.write_text(yaml.safe_dump(p))
    fit_matches_reference(jobs, tmp_path, path, p, 2)


def test_evaluation_during_training_goes_to_metrics_and_tensorboard(tmp_path, data, jobs):
    """eval_frequency 2, eval_steps 2: the weights after steps 2 and 4 (the last) are evaluated on
    eval_input; the figures equal an evaluation of the reference's weights, and `wse validate` of
    the final checkpoint; TensorBoard gets train/ and eval/ event files with Model Zoo's tags."""
    from data_tools.dataset import Dataset
    from wse_core.nn.reference import evaluate

    path, p = params_file(tmp_path, data, max_steps=4, eval_frequency=2, eval_steps=2)
    p["eval_input"] = {"data_dir": str(data), "batch_size": 4, "micro_batch_size": 2}
    path.write_text(yaml.safe_dump(p))
    proc = jobs.run("fit", path, "--num_csx", 2)
    assert proc.returncode == 0, proc.stderr
    evals = [m for m in RunDir(tmp_path / "model").read_metrics() if "eval_loss" in m]
    assert [m["step"] for m in evals] == [2, 4] and all(m["eval_examples"] == 8 for m in evals)
    model = build_model(p["model"])
    for m in evals:
        params, _, _ = reference(p, m["step"])
        want = evaluate(model, params, Dataset(data), 2, 8)
        assert (m["eval_loss"], m["eval_accuracy"]) == (want["loss"], want["accuracy"])
        assert m["eval_perplexity"] == pytest.approx(math.exp(want["loss"])) and 0 < want["accuracy"] < 1
    val = jobs.run("validate", path, "--json")
    assert val.returncode == 0, val.stderr
    assert json.loads(val.stdout)["eval_loss"] == evals[-1]["eval_loss"]  # runconfig.eval_steps: 2 batches there too
    train, ev = read_events(tmp_path / "model" / "train"), read_events(tmp_path / "model" / "eval")
    assert [s for s, _ in train["loss"]] == [1, 2, 3, 4] and "lr" in train and "grad_norm" in train
    assert [s for s, _ in ev["loss"]] == [2, 4] and ev["accuracy"][0][1] == pytest.approx(evals[0]["eval_accuracy"])


def test_sparse_gpt2_trains_bit_identically_and_checkpoints_only_nonzeros(tmp_path, data, jobs):
    """model.sparsity 0.9: loss falls; num_csx 1 and 2 give the reference's bits; the checkpoint holds
    the nonzeros and the mask, and converts to dense [out, in] weights."""
    steps = 12
    path, p = params_file(tmp_path, data, max_steps=steps)
    p["model"]["sparsity"] = 0.9
    p["optimizer"]["learning_rate"] = 3e-3
    path.write_text(yaml.safe_dump(p))
    params, state, losses = reference(p, steps)
    model = build_model(p["model"])
    for n in (1, 2):
        model_dir = tmp_path / f"csx{n}"
        proc = jobs.run("fit", path, "--num_csx", n, "--model_dir", model_dir)
        assert proc.returncode == 0, proc.stderr
        assert_bits(model_dir, params, state)
        metrics = [json.loads(x) for x in (model_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["loss"] for m in metrics] == losses
    assert np.mean(losses[-3:]) < losses[0] - 0.5
    ckpt = Checkpoint(tmp_path / "csx2")
    name = "blocks.0.mlp.fc.weight"
    st = model.structures[name]
    assert ckpt.tensors[f"model/{name}"]["shape"] == [st.nnz] and st.nnz == 128 * 3  # 10% of 32 per row, 128 rows
    assert ckpt.tensors[f"optimizer/{name}/exp_avg"]["shape"] == [st.nnz]
    assert sorted(ckpt.sparse_names()) == sorted(model.structures)
    dense = ckpt.dense(ckpt.load([name])[0])[name]
    assert dense.shape == (128, 32) and np.count_nonzero(dense) <= st.nnz
    np.testing.assert_array_equal(dense[st.row_indices(), st.indices], params[name])
    plan_bytes = json.loads((tmp_path / "csx2" / "plan.json").read_text())["plan"]["unit_bytes"]
    dense_bytes = build_model({k: v for k, v in p["model"].items() if k != "sparsity"}).unit_bytes()
    assert plan_bytes[1] < 0.2 * dense_bytes[1]  # a block streams about a tenth of its dense bytes


@pytest.mark.parametrize("sparsity", [None, 0.9])
def test_a_pipelined_run_has_the_bits_of_weight_streaming_and_checkpoints_cross(tmp_path, data, jobs, sparsity):
    """runconfig.execution_strategy pipeline: one CS-2 keeps every weight and updates it; the weights
    equal the reference's (so weight streaming's). Checkpoints cross modes: 2 steps pipelined, then
    weight streaming on 2 CS-2s and 2 MemoryX to step 3, then pipelined again to 4: the bits of 4
    reference steps."""
    path, p = params_file(tmp_path, data, max_steps=4, execution_strategy="pipeline", num_wgt_servers=1)
    if sparsity:
        p["model"]["sparsity"] = sparsity
        path.write_text(yaml.safe_dump(p))
    proc = jobs.run("fit", path, "--set", "runconfig.max_steps=2")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((tmp_path / "model" / "plan.json").read_text())["plan"]
    assert plan["roles"] == ["coordinator", "pipeline", "worker"] and plan["pipeline"]
    params, state, losses = reference(p, 2)
    assert_bits(tmp_path / "model", params, state)
    proc = jobs.run("fit", path, "--set", "runconfig.max_steps=3", "--execution_strategy", "weight_streaming",
                    "--set", "runconfig.num_wgt_servers=2", "--num_csx", 2)
    assert proc.returncode == 0 and "resuming from checkpoint_2" in proc.stdout, proc.stderr
    proc = jobs.run("fit", path)
    assert proc.returncode == 0 and "resuming from checkpoint_3" in proc.stdout, proc.stderr
    params, state, losses = reference(p, 4)
    assert_bits(tmp_path / "model", params, state)
    metrics = RunDir(tmp_path / "model").read_metrics()
    assert [m["loss"] for m in metrics] == losses
    assert metrics[0]["sim_stream_s"] == 0.0 and metrics[2]["sim_stream_s"] > 0  # pipelined, streamed
    # The pipelined clock: a step of the pipeline model (plus the two control hops of 2 us); the first
    # step of a run (step 4 resumes) has no update before it: the last run's update was in its own clock.
    from pyapi.params import validate

    placement = resolve(validate(p)).placement
    assert metrics[1]["sim_step_s"] == pytest.approx(placement.step_s + 4e-6, rel=1e-9)
    assert metrics[3]["sim_step_s"] == pytest.approx(placement.step_s - placement.update_s + 4e-6, rel=1e-9)


@pytest.mark.parametrize("sparsity", [None, 0.5])
def test_pipelined_fc_mlp_and_auto(tmp_path, jobs, sparsity):
    """fc_mlp (dense and sparse) pipelined equals weight streaming bit for bit; auto says what it
    chose and why in one line; pipeline on 2 CS-2s is refused."""
    x = np.random.default_rng(0).standard_normal((256, 12)).astype(np.float32)
    np.savez(tmp_path / "xy.npz", features=x, labels=(x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0))
    from data_tools.preprocess import preprocess_arrays

    preprocess_arrays(tmp_path / "xy.npz", tmp_path / "arr")
    p = {"train_input": {"data_dir": str(tmp_path / "arr"), "batch_size": 16, "micro_batch_size": 4},
         "model": {"name": "fc_mlp", "input_size": 12, "hidden_sizes": [32, 16], "num_classes": 4},
         "optimizer": {"optimizer_type": "SGD", "learning_rate": 0.1, "momentum": 0.9},
         "runconfig": {"max_steps": 3, "execution_strategy": "auto"}}
    if sparsity:
        p["model"]["sparsity"] = sparsity
    got = {}
    for mode in ("auto", "weight_streaming"):
        p["runconfig"].update(execution_strategy=mode, model_dir=str(tmp_path / mode))
        (tmp_path / f"{mode}.yaml").write_text(yaml.safe_dump(p))
        proc = jobs.run("fit", tmp_path / f"{mode}.yaml")
        assert proc.returncode == 0, proc.stderr
        got[mode] = Checkpoint(tmp_path / mode).load()
        if mode == "auto":
            assert "execution strategy: pipelined: the model fits" in proc.stdout, proc.stdout
    for n, w in got["auto"][0].items():
        assert w.tobytes() == got["weight_streaming"][0][n].tobytes(), n
    p["runconfig"].update(execution_strategy="pipeline", num_csx=2)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(p))
    proc = jobs.run("fit", tmp_path / "bad.yaml")
    assert proc.returncode == 1 and "runconfig.execution_strategy: pipeline runs on one CS-2" in one_line(proc)


def test_resume_continues_bit_identically_and_keeps_its_books(tmp_path, data, jobs):
    """2 steps, a run killed at step 3 (metrics past the checkpoint), resume to 4: the same bits as
    4 steps in one go; the numerics environment recorded; metrics hold each step once; the output says
    where it resumed and what it trained; the params.yaml written into model_dir loads again (wse validate)."""
    path, p = params_file(tmp_path, data, max_steps=4)
    proc = jobs.run("fit", path, "--num_csx", 2, "--set", "runconfig.max_steps=2")
    assert proc.returncode == 0 and "done: trained steps 1..2 (2 steps)" in proc.stdout, proc.stderr
    assert Checkpoint(tmp_path / "model").step == 2
    run_dir = RunDir(tmp_path / "model")
    # The numerics environment the ranks computed in is in the checkpoint, and the launcher's in run.json.
    assert not differences(Checkpoint(tmp_path / "model").numerics, environment())
    assert not differences(run_dir.read_run()["numerics"], environment())
    with open(run_dir.metrics, "a") as f:  # what a run killed after logging step 3 leaves behind
        f.write(json.dumps({"step": 3, "loss": 0.0}) + "\n" + '{"step": 4, "lo')
    proc = jobs.run("fit", path, "--num_csx", 2)
    assert proc.returncode == 0, proc.stderr
    assert "resuming from checkpoint_2 (step 2)" in proc.stdout
    assert "done: trained steps 3..4 from checkpoint_2 (2 steps)" in proc.stdout
    params, state, losses = reference(p, 4)
    assert_bits(tmp_path / "model", params, state)
    assert [(m["step"], m["loss"]) for m in run_dir.read_metrics()] == list(enumerate(losses, 1))
    proc = jobs.run("fit", path, "--num_csx", 2)
    assert proc.returncode == 0 and "nothing to train: the checkpoint is at step 4, runconfig.max_steps is 4" \
        in proc.stdout and "done" not in proc.stdout, proc.stdout
    assert len(run_dir.read_metrics()) == 4

    # wse validate with the params.yaml the run wrote: the eval loss of that checkpoint, against the
    # unfused numpy layers.
    resolved = yaml.safe_load(run_dir.params_yaml.read_text())
    resolved["eval_input"] = {"data_dir": str(data), "batch_size": 8, "micro_batch_size": 4}
    run_dir.params_yaml.write_text(yaml.safe_dump(resolved))
    proc = jobs.run("validate", run_dir.params_yaml, "--eval_steps", 3, "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith(f"evaluating {tmp_path / 'model' / 'checkpoint_4'} (step 4) on 24 examples of "), \
        proc.stderr
    got = json.loads(proc.stdout)
    model = build_model(p["model"], ops=numpy_ops)
    ex = GlobalStream(str(data)).read(0, 24)
    batch = model.batch_of(ex)
    loss_sum, tokens, _ = model.loss(model.forward({k: v.astype(np.float64) for k, v in params.items()}, batch)[0],
                                     batch)
    assert got["step"] == 4 and got["examples"] == 24 and got["tokens"] == tokens
    assert abs(got["eval_loss"] - loss_sum / tokens) < 1e-5 * loss_sum / tokens
    proc = jobs.run("validate", run_dir.params_yaml, "--checkpoint_path", tmp_path / "nowhere")
    assert proc.returncode == 1 and proc.stderr.strip() == (f"wse validate: error: {tmp_path / 'nowhere'}: "
                                                            "no such checkpoint or model directory")

    # A damaged index is refused before anything runs (its step, changed, would resume elsewhere).
    with h5py.File(tmp_path / "model" / "checkpoint_4" / "index.h5", "r+") as f:
        f.attrs["step"] = 3
    proc = jobs.run("fit", path, "--num_csx", 2)
    assert proc.returncode == 1 and one_line(proc) == (
        f"wse fit: error: {tmp_path / 'model' / 'checkpoint_4' / 'index.h5'}: the index is damaged: its metadata "
        "(step, tensor table, SHA-256 entries, ...) does not match its metadata_sha256"), proc.stderr


def test_a_lost_latest_resumes_from_the_newest_complete_checkpoint_bit_identically(tmp_path, data, jobs):
    """`latest` removed after a run: `wse fit` initialised fresh weights and wrote over the checkpoints.
    It resumes from the newest complete one, says so in one line, leaves the checkpoints it did not
    make as they were, and ends with the bits of 4 uninterrupted steps."""
    path, p = params_file(tmp_path, data, max_steps=4, checkpoint_steps=1)
    proc = jobs.run("fit", path, "--num_csx", 2, "--set", "runconfig.max_steps=2")
    assert proc.returncode == 0, proc.stderr
    model_dir = tmp_path / "model"
    (model_dir / "latest").unlink()
    made = {d.name: (d / "index.h5").stat().st_mtime_ns for d in model_dir.glob("checkpoint_*")}
    proc = jobs.run("fit", path, "--num_csx", 2)
    assert proc.returncode == 0, proc.stderr
    assert "latest was missing: resuming from checkpoint_2 (step 2), the newest complete one\n" in proc.stdout
    assert "done: trained steps 3..4 from checkpoint_2 (2 steps)" in proc.stdout, proc.stdout
    assert made == {name: (model_dir / name / "index.h5").stat().st_mtime_ns for name in made}
    params, state, losses = reference(p, 4)
    assert_bits(model_dir, params, state)
    assert [(m["step"], m["loss"]) for m in RunDir(model_dir).read_metrics()] == list(enumerate(losses, 1))


def test_a_full_disk_names_rank_and_file_keeps_the_last_checkpoint_and_the_run_resumes(tmp_path, data, jobs,
                                                                                       small_disk):
    """model_dir on a disk with room for about three checkpoints, one saved per step: the job ends
    naming the rank and the file it could not write; the last checkpoint verifies; with room made,
    the run resumes from it and ends with the reference's bits, nothing of the failed save left."""
    steps = 8
    path, p = params_file(tmp_path, data, 4, max_steps=steps, checkpoint_steps=1)
    one = 3 * 4 * build_model(p["model"]).num_params()  # weights and two AdamW states, float32
    model_dir = small_disk(int(3.5 * one)) / "model"
    proc = jobs.run("fit", path, "--num_csx", 2, "--model_dir", model_dir)
    assert proc.returncode == 1, proc.stdout
    line = one_line(proc)
    m = re.fullmatch(r"wse fit: rank \d+ \((coordinator|memoryx) \d+\): CheckpointError: (.+): No space left on "
                     r"device while writing a checkpoint; it was not saved \((checkpoint_\d+) is intact\)", line)
    # (a log line can be what meets the full disk first: then that file is named, by the rank writing it)
    m = m or re.fullmatch(r"wse fit: rank \d+ \(\w+ \d+\): OSError: \[Errno 28\] No space left on device: '(.+)'", line)
    assert m and m.group(2 if m.lastindex > 1 else 1).startswith(str(model_dir)), proc.stderr
    ckpt = Checkpoint(model_dir)
    ckpt.verify()
    assert 1 <= ckpt.step < steps and (m.lastindex < 3 or m.group(3) == ckpt.dir.name)
    small_disk.resize(20 * one)
    proc = jobs.run("fit", path, "--num_csx", 2, "--model_dir", model_dir)
    assert proc.returncode == 0 and f"resuming from checkpoint_{ckpt.step} (step {ckpt.step})" in proc.stdout, \
        proc.stderr
    params, state, _ = reference(p, steps)
    assert_bits(model_dir, params, state)
    assert not [x.name for x in model_dir.iterdir() if x.name.startswith(".checkpoint_")]


def test_a_disk_that_fills_between_checkpoints_names_the_rank_and_its_file(tmp_path, data, jobs, small_disk):
    """model_dir's disk fills up while the job trains (the test fills it after step 1; no checkpoint
    before the last step): the job ends naming the rank and the file it could not write, not with a
    bare [Errno 28] from a log of the launcher's own that could not be written either."""
    disk = small_disk(16 * 2**20)
    path, _ = params_file(tmp_path, data, 4, max_steps=100000, log_steps=100000)
    job = jobs.start("fit", path, "--num_csx", 2, "--model_dir", disk / "model")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not RunDir(disk / "model").read_metrics():
        assert job.poll() is None, job.communicate()
        time.sleep(0.1)
    with open(disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError, match="No space left"):
        while True:
            f.write(b"\1" * 65536)
    code, line = ended(job)
    m = re.fullmatch(r"wse fit: rank \d+ \(\w+ \d+\): OSError: \[Errno 28\] No space left on device: '(.+)'", line)
    assert code == 1 and m and m.group(1).startswith(str(disk / "model")), line
    assert not jobs.leftovers()


def test_tensorboard_meeting_a_full_disk_is_the_coordinators_error_naming_it(small_disk):
    """tensorboardX's writer thread died on a full disk and the coordinator's next scalars waited on its
    full queue for ever: the coordinator flushes every step itself, and that flush fails naming where."""
    import errno
    import threading

    pytest.importorskip("tensorboardX")
    from mpi_launch.roles.coordinator import _BOARD_FLUSH_SECONDS, _flush, _summary_writer

    disk = small_disk(256 * 1024)
    writer = _summary_writer()(str(disk / "train"), flush_secs=_BOARD_FLUSH_SECONDS)
    with open(disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError, match="No space left"):
        while True:
            f.write(b"\1" * 4096)
    met = []

    def steps():  # a step's scalars, as the coordinator adds them
        try:
            for step in range(100000):
                for key in ("loss", "grad_norm", "lr", "samples_per_s", "sim_step_s", "sim_samples_per_s"):
                    writer.add_scalar(key, 1.0, step)
                _flush(writer)
        except OSError as exc:
            met.append(exc)

    coordinator = threading.Thread(target=steps, daemon=True)
    coordinator.start()
    coordinator.join(120)  # only a hang reaches this
    try:
        assert met and met[0].errno == errno.ENOSPC and met[0].filename == str(disk / "train"), met
    finally:  # room again, so the writer closes now (not at pytest's exit, in a traceback)
        (disk / "filler").unlink()
        writer.close()


def held_ranks(job, run_dir):
    """{rank: pid} of a job started with WSE_TEST_HOLD, once every rank has stopped itself there (as
    its supervisor reported)."""
    deadline = time.monotonic() + 120  # only a hang reaches this
    while not run_dir.plan_json.exists() and time.monotonic() < deadline:
        assert job.poll() is None, job.communicate()
        time.sleep(0.05)
    for rank in range(len(json.loads(run_dir.plan_json.read_text())["plan"]["roles"])):
        wait_for_event(run_dir, rank, "stopped", job)
    events = [json.loads(x) for x in run_dir.watchdog_log.read_text().splitlines()]
    return {e["rank"]: e["pid"] for e in events if e["event"] == "hello"}


def test_nohup_keeps_a_job_through_the_hangup_it_ignores(tmp_path, data, jobs):
    """`nohup wse fit ... &` and a logout: the SIGHUP nohup ignores stays ignored, and the job trains
    to its end (the launcher took SIGHUP over and ended the job). Sent while every rank is held at
    start-up (WSE_TEST_HOLD), so the launcher is surely running the job; then they go on."""
    path, _ = params_file(tmp_path, data, 4, peer_timeout=300)
    job = jobs.start("fit", path, "--num_csx", 2, env={**os.environ, HOLD_ENV: RankEvent.READY.value},
                     preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    pids = held_ranks(job, RunDir(tmp_path / "model"))
    job.send_signal(signal.SIGHUP)
    for pid in pids.values():
        os.kill(pid, signal.SIGCONT)
    out, err = job.communicate(timeout=240)
    assert job.returncode == 0 and f"done: trained steps 1..{STEPS}" in out, err


def test_a_launcher_killed_during_start_up_leaves_no_shared_memory(tmp_path, data, jobs):
    """SIGKILL of `wse fit` once MPICH has made its segment and before any rank reported it (every rank
    held there, WSE_TEST_HOLD=mpi_up): the supervisors, which outlive the launcher, remove it."""
    path, _ = params_file(tmp_path, data, 4, peer_timeout=300)
    job = jobs.start("fit", path, "--num_csx", 2, env={**os.environ, HOLD_ENV: RankEvent.MPI_UP.value})
    shm = set()
    for pid in held_ranks(job, RunDir(tmp_path / "model")).values():
        with open(f"/proc/{pid}/maps") as f:
            shm |= {line.split()[-1] for line in f if "/dev/shm/mpich_shm_" in line}
    assert shm
    job.kill()
    ended(job)
    deadline = time.monotonic() + 60  # seconds when it works; only a leak reaches this
    while jobs.leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not jobs.leftovers()
    assert not [path for path in shm if os.path.exists(path)]


def test_a_reader_that_leaves_does_not_end_the_training(tmp_path, data, jobs):
    """`wse fit | head -3`: the job trains to its last step and checkpoint, saying nothing more, nor
    anything on standard error (it ended at step ~20 with nothing in model_dir)."""
    path, _ = params_file(tmp_path, data, 4, max_steps=30, log_steps=1)
    job = jobs.start("fit", path, "--num_csx", 2)
    lines = [job.stdout.readline() for _ in range(3)]
    job.stdout.close()  # the lines after these meet a reader gone
    _, err = job.communicate(timeout=240)
    assert lines[-1].startswith("step     1/30") and job.returncode == 0 and err == "", (lines, err)
    assert Checkpoint(tmp_path / "model").step == 30


def fit_quietly(tmp_path, data, **popen):
    """`wse fit` of STEPS steps with ``popen``'s standard output; its CompletedProcess, stderr captured."""
    path, _ = params_file(tmp_path, data, 4)
    return subprocess.run([sys.executable, "-m", "pyapi.cli", "fit", str(path), "--num_csx", "2"],
                          stderr=subprocess.PIPE, text=True, timeout=240, start_new_session=True, **popen)


def test_a_full_standard_output_is_named_and_the_job_trains_on(tmp_path, data, jobs):
    """`wse fit > /dev/full`: one warning naming standard output (not a bare [Errno 28] that reads as
    model_dir's disk), and the job trains to its end."""
    with open("/dev/full", "w") as full:
        proc = fit_quietly(tmp_path, data, stdout=full)
    assert proc.returncode == 0 and proc.stderr == ("wse fit: warning: standard output: No space left on device: "
                                                    "nothing more is written there; the job goes on\n"), proc.stderr
    assert Checkpoint(tmp_path / "model").step == STEPS


def test_a_closed_standard_output_is_no_traceback(tmp_path, data, jobs):
    """`wse fit >&-`: nothing said (standard output was closed on purpose), and the job trains."""
    proc = fit_quietly(tmp_path, data, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert Checkpoint(tmp_path / "model").step == STEPS


def test_bad_params_fail_before_mpiexec(tmp_path, data, jobs):
    path, _ = params_file(tmp_path, data)
    proc = jobs.run("fit", path, "--set", "optimizer.learning_rate=fast")
    assert proc.returncode == 1 and proc.stderr.strip().endswith("optimizer.learning_rate: expected a number or a "
                                                                  "list of schedulers, got 'fast'")
    assert not (tmp_path / "model").exists()
    proc = jobs.run("fit", path, "--set", "model.max_position_embeddings=16")
    assert proc.returncode == 1 and "model.max_position_embeddings: 16 is shorter than the max_seq_length" in proc.stderr
    proc = jobs.run("fit", path, "--num_csx", 1000, "--set", "train_input.batch_size=2000")
    assert proc.returncode == 1 and re.fullmatch(
        r"wse fit: error: runconfig.num_csx: 1000 CS-2s need 3,\d\d\d MPI ranks, more than 16 per core on this "
        r"machine's \d+ cores; use fewer CS-2s or spread the ranks over several machines with --hostfile",
        proc.stderr.strip().splitlines()[-1]), proc.stderr  # after the warning that 1000 CS-2s sum in their own order
    assert not (tmp_path / "model").exists()


def test_an_exception_in_a_role_ends_the_job_with_one_line(tmp_path, data, jobs):
    """A damaged data file makes an input worker raise: the job ends, naming that rank and role, and
    leaves no MPICH shared-memory file in /dev/shm (its ranks and their supervisors were killed together)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in sorted(data.glob("*.h5"))[:2]:
        (bad / f.name).write_bytes(f.read_bytes())
    target = bad / "data-00002.h5"
    target.write_bytes(sorted(data.glob("*.h5"))[2].read_bytes())
    with h5py.File(target) as f:
        offset = f["data"].id.get_chunk_info_by_coord((5, 0, 0)).byte_offset
    raw = bytearray(target.read_bytes())
    raw[offset + 3] ^= 0xFF  # the chunk holding example 5 of the third file now fails its checksum
    target.write_bytes(bytes(raw))
    path, _ = params_file(tmp_path, bad, 4, max_steps=4000)
    proc = jobs.run("fit", path, "--num_csx", 2, "--set", "train_input.shuffle=false")
    assert proc.returncode == 1
    line = one_line(proc)
    assert line.startswith("wse fit: rank ") and "(worker " in line and "data-00002.h5" in line, proc.stderr
    shm = shared_memory_of(RunDir(tmp_path / "model"))
    assert shm and not [path for path in shm if os.path.exists(path)]


def shared_memory_of(run_dir):
    """The MPICH shared-memory files a job's ranks mapped, as their supervisors reported them."""
    events = [json.loads(x) for x in run_dir.watchdog_log.read_text().splitlines()]
    return {path for e in events if e.get("event") == "mpi_up" for path in e["shm"]}


def start_long_job(jobs, tmp_path, data, *extra, steps=100000):
    """A `wse fit` of 2 CS-2s that runs until stopped; returns (process, plan, run dir) once every
    rank is ready and step 1 is done."""
    path, _ = params_file(tmp_path, data, 4, max_steps=steps, log_steps=100000, peer_timeout=5)
    job = jobs.start("fit", path, "--num_csx", 2, *extra)
    run_dir = RunDir(tmp_path / "model")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not run_dir.read_metrics():
        assert job.poll() is None, job.communicate()
        time.sleep(0.1)
    return job, json.loads(run_dir.plan_json.read_text())["plan"], run_dir


def pid_of(run_dir, rank):
    return int(run_dir.pid_file(rank).read_text())


def ended(job, timeout=120):
    """(exit code, last line) of a job that must end; the timeout is one only a hang reaches."""
    out, err = job.communicate(timeout=timeout)
    return job.returncode, (err.strip().splitlines() or [""])[-1]


@pytest.mark.parametrize("role", ["coordinator", "memoryx", "swarmx", "csx", "worker"])
def test_a_killed_rank_is_named_with_its_signal(tmp_path, data, jobs, role):
    """SIGKILL of any role while training: that rank is named, with the signal, and nothing is left
    running, nor MPICH's shared-memory file in /dev/shm (which only MPI_Finalize removes)."""
    job, plan, run_dir = start_long_job(jobs, tmp_path, data)
    rank = {"coordinator": plan["coordinator"], "memoryx": plan["memoryx"][0], "swarmx": plan["swarmx"][0],
            "csx": plan["csx"][1], "worker": plan["workers"][0][0]}[role]
    with open(f"/proc/{pid_of(run_dir, rank)}/maps") as f:
        shm = {line.split()[-1] for line in f if "/dev/shm/mpich_shm_" in line}
    assert shm
    os.kill(pid_of(run_dir, rank), signal.SIGKILL)
    code, line = ended(job)
    assert code == 1
    assert line.startswith(f"wse fit: rank {rank} ({role} ") and "killed by signal 9 (SIGKILL)" in line, line
    assert not jobs.leftovers()
    assert not [path for path in shm if os.path.exists(path)]


def wait_for_event(run_dir, rank, event, job, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = run_dir.watchdog_log.read_text() if run_dir.watchdog_log.exists() else ""
        if any(json.loads(x).get("rank") == rank and json.loads(x).get("event") == event for x in log.splitlines()):
            return
        assert job.poll() is None, job.communicate()
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never reported {event}")


def test_an_input_worker_runs_a_bounded_number_of_steps_ahead_of_its_cs2(tmp_path, data):
    """A CS-2 that takes step 0 and then stays away 2 s: its worker has sent steps 1 and 2
    (AHEAD_STEPS) and waits for the CS-2 to take step 1, instead of sending every step of the run
    into the CS-2's queue of unexpected messages (over TCP that queue has no bound: step 0 took 36 s
    with 30,000 steps); every later micro-batch arrives whole and in order (tests/_worker_ahead.py)."""
    from mpi_launch.mpiexec import run_mpi
    _, p = params_file(tmp_path, data, 8, max_steps=40, num_csx=1, num_workers_per_csx=1)
    run = resolve(validate(p))
    RunDir(tmp_path / "model").prepare(run)
    program = Path(__file__).with_name("_worker_ahead.py")
    proc = run_mpi(run.plan.world_size, [sys.executable, program, tmp_path / "model"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"worker_done": 0}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_an_input_worker_that_has_sent_everything_is_named_when_it_dies_or_stops(tmp_path, data, jobs, sig):
    """Killed after its last send: named, with its signal. Stopped there: the training ends, the last
    checkpoint is written, and the worker is named at shutdown instead of the job hanging forever."""
    job, plan, run_dir = start_long_job(jobs, tmp_path, data, steps=40)
    rank = plan["workers"][1][0]
    wait_for_event(run_dir, rank, "done", job)
    os.kill(pid_of(run_dir, rank), sig)
    code, line = ended(job)
    assert code == 1 and line.startswith(f"wse fit: rank {rank} (worker 1): "), line
    if sig == signal.SIGKILL:
        assert "killed by signal 9 (SIGKILL)) after finishing its work" in line, line
    else:
        assert "finished its work but did not exit (its process is stopped, SIGSTOP)" in line, line
        assert Checkpoint(tmp_path / "model").step == 40
    assert not jobs.leftovers()


@pytest.mark.parametrize("role", ["csx", "memoryx"])
def test_a_stopped_rank_is_named(tmp_path, data, jobs, role):
    """SIGSTOP while training: named once it has been silent for runconfig.peer_timeout (5 s here)."""
    job, plan, run_dir = start_long_job(jobs, tmp_path, data)
    rank = plan["csx"][0] if role == "csx" else plan["memoryx"][1]
    os.kill(pid_of(run_dir, rank), signal.SIGSTOP)
    code, line = ended(job)
    assert code == 1 and line.startswith(f"wse fit: rank {rank} ({role} ") and "stopped answering" in line, line
    assert not jobs.leftovers()
    assert not [path for path in shared_memory_of(run_dir) if os.path.exists(path)]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["kill", "term", "int"])
def test_a_dead_launcher_takes_its_whole_job_with_it(tmp_path, data, jobs, sig):
    """SIGKILL, SIGTERM or SIGINT to `wse fit`: every rank, supervisor, proxy and mpiexec goes too."""
    job, plan, run_dir = start_long_job(jobs, tmp_path, data)
    assert len(jobs.leftovers()) > 2 * len(plan["roles"])  # ranks, supervisors, mpiexec, proxy, launcher
    job.send_signal(sig)
    code, line = ended(job)
    assert code == 128 + sig if sig != signal.SIGKILL else code == -signal.SIGKILL
    if sig != signal.SIGKILL:
        assert line.startswith(f"wse fit: interrupted by {signal.Signals(sig).name}: the job's ranks were stopped")
    deadline = time.monotonic() + 60  # seconds when it works; only a leak reaches this
    while jobs.leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not jobs.leftovers()


def test_a_killed_mpi_proxy_is_noticed(tmp_path, data, jobs):
    job, plan, run_dir = start_long_job(jobs, tmp_path, data)
    proxies = [p for p in jobs.leftovers() if b"hydra_pmi_proxy" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert proxies
    os.kill(proxies[0], signal.SIGKILL)
    code, line = ended(job)
    assert code == 1 and "its MPI process manager (hydra_pmi_proxy)" in line and "died" in line, line
    assert not jobs.leftovers()


def test_a_killed_job_leaves_no_hydra_topology_file_in_tmp(tmp_path, data, jobs):
    """hydra's proxy shares the node's topology through a /tmp/hydra_hwloc_xmlfile_* it removes only when
    it exits normally: a job whose proxy is killed (the case that always left one; a killed rank did
    sometimes) leaves none. Only this job's proxy is looked at (other jobs may make theirs meanwhile):
    the files it holds open."""
    job, plan, run_dir = start_long_job(jobs, tmp_path, data)
    proxies = [p for p in jobs.leftovers() if b"hydra_pmi_proxy" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert proxies
    held = [os.readlink(fd) for p in proxies for fd in Path(f"/proc/{p}/fd").iterdir()]
    os.kill(proxies[0], signal.SIGKILL)
    code, line = ended(job)
    assert code == 1 and "hydra_pmi_proxy" in line, line
    assert not jobs.leftovers()
    left = [f for f in held if f.startswith("/tmp/hydra_hwloc") and os.path.exists(f)]
    assert not left, left


def test_a_second_run_on_the_same_model_dir_is_refused_and_the_lock_never_sticks(tmp_path, data, jobs):
    """While a run trains, a second `wse fit` (or --dry-run) on its model_dir is refused at once, naming
    the first; once the first is killed with SIGKILL, a new run starts."""
    job, plan, run_dir = start_long_job(jobs, tmp_path, data)
    path = tmp_path / "params.yaml"
    for extra in ([], ["--dry-run"]):
        proc = jobs.run("fit", path, "--num_csx", 1, "--set", "runconfig.max_steps=2", *extra, timeout=60)
        assert proc.returncode == 1 and proc.stderr.strip() == (
            f"wse fit: error: {tmp_path / 'model'}: in use by wse fit (pid {job.pid} on {os.uname().nodename}, "
            f"started {json.loads((tmp_path / 'model' / '.wse.lock').read_text())['started']}); wait for it to end "
            "or use another --model_dir"), proc.stderr
    job.kill()
    ended(job)
    proc = jobs.run("fit", path, "--num_csx", 1, "--set", "runconfig.max_steps=2")
    assert proc.returncode == 0 and "done: trained steps 1..2" in proc.stdout, proc.stderr


def test_dry_run_prints_a_command_that_runs(tmp_path, data, jobs):
    """--dry-run prepares model_dir and prints the mpiexec command; run by hand it trains (no watchdog)."""
    path, p = params_file(tmp_path, data, max_steps=2)
    proc = jobs.run("fit", path, "--num_csx", 2, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    assert cmd[0].endswith("mpiexec") and "-auto-cleanup" not in cmd
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, start_new_session=True)
    assert out.returncode == 0, out.stderr
    params, state, _ = reference(p, 2)
    assert_bits(tmp_path / "model", params, state)
