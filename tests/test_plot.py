"""Pictures of training (pyapi.plot): a run's loss curve, the loss.png `wse fit` leaves, `wse plot` of
several runs, what `wse compile --plot` draws for each execution mode, and the scaling benchmark's picture."""
import io
import json
import math

import numpy as np
import pytest
import yaml
from matplotlib.patches import Rectangle
from matplotlib.text import Text

from bench.scaling import COUNTS, figure as scaling_figure
from mpi_launch.resolved import describe, resolve
from pyapi import plot
from pyapi.cli import main
from pyapi.params import validate

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(path, losses, evals=(), sim=1000.0):
    """A run directory with only a metrics.jsonl, as the coordinator writes it: a line per step (this
    machine's samples/s far from the simulated ones), a line per evaluation after its step's."""
    path.mkdir(parents=True)
    rows = [{"step": s, "loss": v, "samples_per_s": 5.0, "sim_samples_per_s": sim + s} for s, v in enumerate(losses, 1)]
    rows += [{"step": s, "eval_loss": v, "eval_perplexity": math.exp(v)} for s, v in evals]
    rows.sort(key=lambda r: (r["step"], "eval_loss" in r))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def texts(fig):
    """Every text of ``fig`` once drawn: titles, labels, tick labels, legends."""
    fig.savefig(io.BytesIO(), format="png")
    return [t.get_text() for t in fig.findobj(Text)]


def test_the_loss_figure_draws_every_step_and_evaluation_and_the_simulated_clock(tmp_path):
    """Loss against the step with the evaluations as points; below, the simulated samples/s (not this
    machine's), said so on its axis."""
    losses = [5.3, 4.1, 3.6, 3.2, 3.3, 2.9]
    run = write_run(tmp_path / "gpt2_small", losses, evals=[(3, 3.8), (6, 3.1)])
    fig = plot.loss_figure([run])
    loss, speed = fig.axes
    training, evaluation = loss.get_lines()
    assert list(training.get_xdata()) == [1, 2, 3, 4, 5, 6] and list(training.get_ydata()) == losses
    assert list(evaluation.get_xdata()) == [3, 6] and list(evaluation.get_ydata()) == [3.8, 3.1]
    assert evaluation.get_linestyle() == "None" and evaluation.get_marker() == "o"
    (clock,) = speed.get_lines()
    assert list(clock.get_ydata()) == [1001.0, 1002.0, 1003.0, 1004.0, 1005.0, 1006.0]
    assert "simulated" in speed.get_ylabel() and "not this machine's" in speed.get_title()
    assert fig.get_suptitle() == f"{run}: 6 steps"


def test_wse_plot_draws_runs_on_the_same_axes_labelled_by_their_directories(tmp_path, capsys):
    """`wse plot A B --output F`: one PNG, a line per run on each panel, each named by its directory."""
    a = write_run(tmp_path / "lr_high", [5.0, 4.0, 3.5], evals=[(3, 3.7)])
    b = write_run(tmp_path / "lr_low", [5.0, 4.5, 4.2, 4.0], sim=500.0)
    out = tmp_path / "both.png"
    assert main(["plot", str(a), str(b), "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and capsys.readouterr().out == f"wrote {out}\n"
    loss, speed = plot.loss_figure([a, b]).axes
    assert [line.get_label() for line in loss.get_lines()] == ["lr_high: training", "lr_high: eval_input",
                                                               "lr_low: training"]
    assert [len(line.get_xdata()) for line in speed.get_lines()] == [3, 4]
    assert [line.get_label() for line in speed.get_lines()] == ["lr_high", "lr_low"]


def test_wse_plot_writes_a_runs_own_loss_png_and_several_runs_here(tmp_path, monkeypatch):
    """Without --output: one run's picture is its loss.png (as `wse fit` leaves it), several runs' is
    loss.png in the current directory; two runs of one name are told apart by their paths."""
    a = write_run(tmp_path / "x" / "model", [3.0, 2.0])
    write_run(tmp_path / "y" / "model", [3.0, 2.5])
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(a)]) == 0
    assert (a / "loss.png").read_bytes()[:8] == PNG and not (tmp_path / "loss.png").exists()
    assert main(["plot", "x/model", "y/model"]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG
    labels = [line.get_label() for line in plot.loss_figure(["x/model", "y/model"]).axes[1].get_lines()]
    assert labels == ["x/model", "y/model"]


@pytest.mark.parametrize("what, error", [
    ("nothing", "{run}: not a run directory (no metrics.jsonl in it)"),
    ("evaluations only", "{run}/metrics.jsonl: no training step in it yet"),
])
def test_wse_plot_of_what_is_not_a_run_is_a_one_line_error_and_writes_nothing(tmp_path, capsys, what, error):
    """A RUN without a metrics.jsonl, or with no step in it, is named in one line (exit 1), before any
    picture is written, even beside a good run."""
    good = write_run(tmp_path / "good", [3.0, 2.0])
    run = tmp_path / "bad"
    if what == "evaluations only":
        write_run(run, [], evals=[(1, 3.0)])
    out = tmp_path / "out.png"
    assert main(["plot", str(good), str(run), "--output", str(out)]) == 1
    assert capsys.readouterr().err == f"wse plot: error: {error.format(run=run)}\n"
    assert not out.exists()


def test_a_picture_whose_place_or_format_is_wrong_is_named_in_one_line(tmp_path):
    """The missing directory, or a suffix matplotlib cannot write, names the path; nothing is left behind."""
    fig = plot.loss_figure([write_run(tmp_path / "run", [3.0, 2.0])])
    with pytest.raises(ValueError, match=r"^.*/nowhere/loss\.png: no directory .*/nowhere to write it in$"):
        plot.save(fig, tmp_path / "nowhere" / "loss.png")
    with pytest.raises(ValueError, match=r"^.*/loss\.txt: Format 'txt' is not supported"):
        plot.save(fig, tmp_path / "loss.txt")
    assert plot.save(fig, tmp_path / "loss.svg").read_text().lstrip().startswith("<?xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.svg", "run"]


def test_fit_leaves_its_loss_curve_and_a_picture_that_fails_does_not_fail_the_run(tmp_path, jobs):
    """`wse fit` ends with loss.png in model_dir and a line saying where; a loss.png it cannot write (here
    a directory in its place) is said in one line and the run still succeeds; a resume (pipelined, from
    the streamed run's checkpoint) redraws it from every step."""
    from data_tools.preprocess import preprocess_arrays
    from mpi_launch.rundir import RunDir

    x = np.random.default_rng(0).standard_normal((256, 12)).astype(np.float32)
    np.savez(tmp_path / "xy.npz", features=x, labels=(x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0))
    preprocess_arrays(tmp_path / "xy.npz", tmp_path / "arr")
    model_dir = tmp_path / "model"
    p = {"train_input": {"data_dir": str(tmp_path / "arr"), "batch_size": 16, "micro_batch_size": 8},
         "model": {"name": "fc_mlp", "input_size": 12, "hidden_sizes": [32, 16], "num_classes": 4},
         "optimizer": {"optimizer_type": "SGD", "learning_rate": 0.1},
         "runconfig": {"max_steps": 2, "num_csx": 1, "model_dir": str(model_dir)}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(p))
    run = RunDir(model_dir)
    run.loss_png.mkdir(parents=True)
    proc = jobs.run("fit", tmp_path / "p.yaml")
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stdout.splitlines() if line.startswith("loss curve:")]
    assert len(said) == 1 and said[0].startswith("loss curve: not drawn: IsADirectoryError: "), proc.stdout
    assert "done: trained steps 1..2 (2 steps)" in proc.stdout
    run.loss_png.rmdir()
    proc = jobs.run("fit", tmp_path / "p.yaml", "--set", "runconfig.max_steps=4", "--execution_strategy", "pipeline")
    assert proc.returncode == 0, proc.stderr
    assert f"loss curve: {run.loss_png}\n" in proc.stdout and "done: trained steps 3..4" in proc.stdout
    assert run.loss_png.read_bytes()[:8] == PNG
    assert [r["step"] for r in plot.read_run(model_dir)[0]] == [1, 2, 3, 4]
    assert not [f for f in model_dir.iterdir() if f.name.endswith(".partial")]


def compile_report(**runconfig):
    """`wse compile`'s report of a small GPT-2, whose embedding gets a stripe of two columns when pipelined."""
    return describe(resolve(validate({
        "train_input": {"data_dir": "unused", "batch_size": 16, "micro_batch_size": 4},
        "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 128, "num_hidden_layers": 4, "num_heads": 4,
                  "max_position_embeddings": 64},
        "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3},
        "runconfig": {"max_steps": 1, **runconfig}})))


def test_compile_draws_a_weight_streamed_run_as_weight_streaming():
    """A streamed run: its cluster (every MemoryX, SwarmX and CS-2 rank), its units by MemoryX, its
    simulated step and a wafer's memory; no placement on the wafer, which it does not have."""
    d = compile_report(num_csx=4, num_wgt_servers=2, swarmx_fanout=2)
    assert d["execution_strategy"] == "weight_streaming"
    fig = plot.compile_figure(d)
    assert fig.get_suptitle().startswith("weight streaming: gpt2, ") and "on 4 CS-2s, 2 MemoryX, 3 SwarmX" in \
        fig.get_suptitle()
    said = texts(fig)
    assert not any("PE column" in t for t in said)
    plan = d["plan"]
    for rank in plan["memoryx"] + plan["swarmx"] + plan["csx"]:  # each rank drawn, named by its number
        assert str(rank) in said
    for k, rank in enumerate(plan["memoryx"]):
        n = plan["unit_owner"].count(k)
        assert any(t.startswith(f"MemoryX rank {rank}: {n} units") for t in said), said
    assert any(t.startswith(f"(c) a step, simulated: {d['simulated']['step_s'] * 1e3:.3g} ms") for t in said)


def test_compile_draws_a_pipelined_run_as_its_placement_with_every_region_named():
    """A pipelined run: a stripe per layer covering the program rectangle in order, each named along the
    top, the two-column embedding too (a label inside it had no room, and it went unnamed)."""
    d = compile_report(num_csx=1, execution_strategy="pipeline")
    regions = d["pipeline"]["regions"]
    assert d["execution_strategy"] == "pipeline" and regions[0]["name"] == "embedding"
    assert regions[0]["columns"][1] - regions[0]["columns"][0] <= 2
    fig = plot.compile_figure(d)
    assert fig.get_suptitle().startswith("pipelined on one CS-2: gpt2, ")
    wafer = fig.axes[0]
    stripes = [(p.get_x(), p.get_x() + p.get_width()) for p in wafer.patches if isinstance(p, Rectangle)]
    assert stripes == [tuple(r["columns"]) for r in regions]
    said = texts(fig)
    for r in regions:
        assert r["name"] in said
    assert not any(t.startswith("MemoryX rank") for t in said)


def test_wse_compile_plot_writes_the_picture_of_the_mode_the_run_takes(tmp_path, capsys):
    """`wse compile --plot`: a streamed run's picture and a pipelined run's differ; --inference refuses it."""
    p = {"train_input": {"data_dir": str(tmp_path / "data"), "batch_size": 16, "micro_batch_size": 8},
         "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2,
                   "max_position_embeddings": 64},
         "optimizer": {"learning_rate": 1e-3}, "runconfig": {"max_steps": 1, "num_csx": 1}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(p))
    pictures = {}
    for mode in ("weight_streaming", "pipeline"):
        out = tmp_path / f"{mode}.png"
        assert main(["compile", str(tmp_path / "p.yaml"), "--execution_strategy", mode, "--plot", str(out)]) == 0
        assert capsys.readouterr().out.endswith(f"wrote {out}\n")
        pictures[mode] = out.read_bytes()
        assert pictures[mode][:8] == PNG
    assert pictures["weight_streaming"] != pictures["pipeline"]
    assert main(["compile", str(tmp_path / "p.yaml"), "--inference", "--plot", str(tmp_path / "i.png")]) == 1
    assert capsys.readouterr().err == "wse compile: error: --plot: draws the training's layout, not with --inference\n"


def scaling_result(spread):
    """A `wse bench scaling` result of four models: (a) linear, the fourth ``spread`` slower at every
    count above one; (b) falling off."""
    models = {}
    for k, name in enumerate(("A", "B", "C", "D")):
        slow = 1 + spread if k == 3 else 1.0
        fixed = {str(n): {"samples_per_s": 10.0 * n / (slow if n > 1 else 1.0)} for n in COUNTS}
        strong = {str(n): {"samples_per_s": 10.0 * min(n, 8 + k)} for n in COUNTS}
        models[name] = {"parameters": 1e9, "per_csx_fixed": fixed, "global_fixed": strong}
    return {"seq": 2048, "batch_per_csx": 64, "global_batch": 512, "models": models,
            "hardware": {"system": "cs2", "precision": "fp16", "io_gbps": 1200.0}}


def test_the_scaling_picture_keeps_coinciding_models_visible_and_says_they_coincide():
    """docs/scaling.png's panel (a): four models on one line each keep a marker and a line style of their
    own, and the panel says in words that they coincide; it says nothing of the kind when they differ."""
    fig = scaling_figure(scaling_result(0.0))
    a = fig.axes[0]
    series = [line for line in a.get_lines() if line.get_label() != "linear"]
    assert len(series) == 4
    assert len({line.get_marker() for line in series}) == 4 and len({line.get_linestyle() for line in series}) == 4
    assert len({line.get_markersize() for line in series}) == 4  # one inside the other
    assert [t.get_text() for t in a.texts] == ["the 4 models coincide: 192.00-192.00x\nat 192 CS-2s (linear: 192x)"]
    assert not scaling_figure(scaling_result(0.05)).axes[0].texts


def test_wse_plot_has_help():
    with pytest.raises(SystemExit) as stop:
        main(["plot", "--help"])
    assert stop.value.code == 0
