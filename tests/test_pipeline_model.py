"""The pipelined mode's model (wse_core.perf.pipeline): placement, the memory fit at the seeds'
boundary, the step time against weight streaming, and what `wse compile` shows of it (the
pipelined run itself: tests/test_cluster.py; its picture: tests/test_plot.py)."""
import math
import subprocess
import sys

import pytest
import yaml

from wse_core.models import build_model
from wse_core.perf import Hardware
from wse_core.perf.pipeline import bytes_per_param, choose, place


def gpt(hidden, layers, heads, seq=512):
    """A GPT-2 shape in mixed precision (the seeds' figures are for 16-bit training)."""
    return build_model({"name": "gpt2", "vocab_size": 50257, "hidden_size": hidden, "num_hidden_layers": layers,
                        "num_heads": heads, "max_position_embeddings": seq, "mixed_precision": True})


def test_the_placement_covers_the_wafer_and_every_region_holds_its_layer():
    hw = Hardware()
    p = place(gpt(768, 12, 12), micro_batch_size=1, micro_batches=64, seq_len=512)
    assert p.fits and len(p.regions) == 14
    assert [r.columns for r in p.regions][0][0] == 0 and p.regions[-1].columns[1] == hw.program_width
    assert all(a.columns[1] == b.columns[0] for a, b in zip(p.regions, p.regions[1:]))
    assert all(r.need_bytes <= r.capacity_bytes for r in p.regions)
    assert all(r.pes == (r.columns[1] - r.columns[0]) * hw.program_height for r in p.regions)
    assert p.slowest_stage_s == max(r.stage_s for r in p.regions) > 0
    assert p.step_s >= (64 + 14 - 1) * p.slowest_stage_s
    blocks = [r for r in p.regions if r.name.startswith("blocks.")]
    assert len({r.columns[1] - r.columns[0] for r in blocks}) == 1  # equal layers, equal regions
    # The activations in flight fall along the pipeline (stage i keeps S - i micro-batches).
    assert all(a.activation_bytes > b.activation_bytes for a, b in zip(blocks, blocks[1:]))


def test_the_seeds_boundary_about_a_billion_parameters_fit_a_wafer():
    """Seed 000: pipelined mode is for networks below about 1B parameters, which fit the on-chip
    memory. With WSE-2 defaults, AdamW (18 bytes per parameter with its state in mixed precision),
    sequences of 512 and micro-batches of 1 (64 per step): GPT-3 760M fits, 2.7B does not, and says
    by how much in one line."""
    assert bytes_per_param(2, Hardware()) == 18
    kw = dict(micro_batch_size=1, micro_batches=64, seq_len=512)
    model = gpt(1536, 24, 16)
    small = place(model, **kw)
    assert small.fits and 0.75e9 < model.num_params() < 0.77e9
    big = place(gpt(2560, 32, 32), **kw)
    assert not big.fits and math.isnan(big.step_s)
    assert "\n" not in big.why and big.why.startswith("does not fit one wafer: needs 73.6 GB")
    assert "of its 27.5 GB usable SRAM, +46.1 GB" in big.why and big.why.endswith("use weight streaming")


def test_pipeline_refuses_a_model_that_does_not_fit_in_one_line():
    from mpi_launch.plan import PlanError
    from mpi_launch.resolved import resolve
    from pyapi.params import validate

    p = validate({"train_input": {"data_dir": "d", "batch_size": 64, "micro_batch_size": 1},
                  "model": {"name": "gpt2", "vocab_size": 50257, "hidden_size": 2560, "num_hidden_layers": 32,
                            "num_heads": 32, "max_position_embeddings": 512, "mixed_precision": True},
                  "optimizer": {"learning_rate": 1e-4},
                  "runconfig": {"max_steps": 1, "execution_strategy": "pipeline"}})
    with pytest.raises(PlanError, match=r"^runconfig.execution_strategy: pipeline: the model does not fit one wafer: "
                                        r"needs 73.6 GB .* use weight streaming$"):
        resolve(p)


def test_pipelined_is_faster_for_a_small_gpt2_and_not_from_some_size_on():
    """On one CS-2, a 124M GPT-2 steps faster pipelined (no weights to stream, each layer on a region
    its size keeps busy); a 350M one at a small batch in one micro-batch does not (the pipeline's fill
    and drain), and a model that does not fit streams its weights."""
    mode, why, p, ws = choose(gpt(768, 12, 12), batch_size=64, micro_batch_size=1, seq_len=512)
    assert mode == "pipeline" and p.step_s < ws.step_s and why.startswith("pipelined: the model fits")
    mode, why, p, ws = choose(gpt(1024, 24, 16), batch_size=8, micro_batch_size=8, seq_len=512)
    assert mode == "weight_streaming" and p.fits and p.step_s > ws.step_s and "slower than streaming" in why
    mode, why, _, _ = choose(gpt(2560, 32, 32), batch_size=64, micro_batch_size=1, seq_len=512)
    assert mode == "weight_streaming" and "does not fit one wafer" in why


def test_compile_shows_the_placement_and_the_choice(tmp_path):
    params = {"train_input": {"data_dir": str(tmp_path / "data"), "batch_size": 16, "micro_batch_size": 2},
              "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2,
                        "max_position_embeddings": 64},
              "optimizer": {"learning_rate": 1e-3}, "runconfig": {"max_steps": 1}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
    out = subprocess.run([sys.executable, "-m", "pyapi.cli", "compile", str(tmp_path / "p.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pipelined on one CS-2: fits one wafer" in out.stdout and "blocks.1" in out.stdout
    assert "execution strategy: weight_streaming (runconfig.execution_strategy)" in out.stdout
    out = subprocess.run([sys.executable, "-m", "pyapi.cli", "compile", str(tmp_path / "p.yaml"),
                          "--execution_strategy", "auto"], capture_output=True, text=True, timeout=120)
    assert "execution strategy: pipelined: the model fits" in out.stdout and "rank   1  pipeline" in out.stdout
