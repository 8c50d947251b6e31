"""Simulated inference latency (wse_core.perf.inference): decode's GEMV formula is the simulator's,
the latency model's invariants (batching, placements, physical bounds), the KV cache's memory and
its one-line refusal, and `wse compile --inference`."""
import math
import re
from pathlib import Path

import pytest
import yaml

from pyapi.cli import main
from wse_core.fabric.programs.broadcast import broadcast
from wse_core.fabric.programs.gemv import gemv
from wse_core.models import build_model
from wse_core.perf import Hardware
from wse_core.perf.calibration import GEMV_CHECK
from wse_core.perf.inference import _broadcast, _gemv, kv_bytes_per_sequence, serve

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama3_8b.yaml"
LLAMA_8B = yaml.safe_load(EXAMPLE.read_text())["model"]
LLAMA_70B = dict(LLAMA_8B, hidden_size=8192, num_hidden_layers=80, num_heads=64, filter_size=28672)


@pytest.fixture(scope="module")
def llama8b():
    return build_model(LLAMA_8B)


@pytest.mark.parametrize("size", GEMV_CHECK)
def test_decode_multiplies_as_the_simulator_does_on_held_out_sizes(size):
    """One fp32 vector on one lane is the program itself: the formula decode uses gives the simulator's
    cycles for the sizes the fit did not see (within the 10% bar; it is exact)."""
    W, H, b, c = size
    fp32 = Hardware(precision="fp32")
    assert _gemv(1, b, c, W, H, fp32) == pytest.approx(gemv(W, H, b, c)[2].cycles, rel=0.10)
    assert _broadcast(b * c, W, fp32) == pytest.approx(broadcast(W, H, b * c)[2].cycles, rel=0.10)


def test_the_kv_cache_is_two_values_per_layer_kv_head_dimension_and_position(llama8b):
    hw = Hardware(precision="fp16")
    assert kv_bytes_per_sequence(llama8b, 1000, hw) == 2 * 32 * 8 * 128 * 1000 * 2
    gpt = build_model({"name": "gpt2", "vocab_size": 50257, "hidden_size": 768, "num_hidden_layers": 12,
                       "num_heads": 12, "max_position_embeddings": 1024})
    assert kv_bytes_per_sequence(gpt, 10, Hardware(precision="fp32")) == 2 * 12 * 12 * 64 * 10 * 4


def test_resident_decode_time_grows_with_the_batch_sublinearly(llama8b):
    """Up to a micro-batch per stage the batch rides in the pipeline's idle stages; beyond, each
    stage shares its fixed costs: a token's time never falls as the batch grows, and grows less
    than the batch; tokens/s of the batch grow."""
    runs = [serve(llama8b, batch=b, prompt_tokens=128, new_tokens=128) for b in (1, 2, 8, 34, 64, 128, 256)]
    assert {r.placement for r in runs} == {"resident"}
    for a, b in zip(runs, runs[1:]):  # regions resize a little with the caches' bytes: 0.1% for that
        assert a.tpot_s <= b.tpot_s * 1.001 and b.tpot_s < b.batch / a.batch * a.tpot_s
        assert b.tokens_per_s_batch > a.tokens_per_s_batch
    assert runs[0].tpot_s == pytest.approx(runs[2].tpot_s, rel=1e-3)  # 8 sequences in 34 stages: free
    assert runs[-1].tpot_s > runs[0].tpot_s
    for r in runs:
        assert r.tokens_per_s_user == pytest.approx(1 / r.tpot_s)
        assert r.tokens_per_s_batch == pytest.approx(r.batch / r.tpot_s)


def test_streaming_the_weights_is_slower_than_keeping_them_and_bound_by_the_stream(llama8b):
    hw = Hardware.for_model(llama8b)
    kw = dict(batch=4, prompt_tokens=128, new_tokens=128)
    resident, streamed = serve(llama8b, **kw), serve(llama8b, placement="streamed", **kw)
    assert (resident.placement, streamed.placement) == ("resident", "streamed")
    assert streamed.tpot_s > 10 * resident.tpot_s and streamed.ttft_s > resident.ttft_s
    rate = min(hw.memoryx_gbps, hw.swarmx_port_gbps * hw.swarmx_ports_per_child, hw.io_gbps) * 1e9 / 8
    assert streamed.tpot_s >= streamed.weight_bytes / rate * (1 - 1e-12)  # the stream's period, to rounding
    assert streamed.weight_bytes == resident.weight_bytes == 2 * llama8b.num_params()


def test_no_token_beats_its_multiply_adds_at_the_wafers_peak(llama8b):
    hw = Hardware.for_model(llama8b)
    for batch, num_csx in ((1, 1), (64, 1), (256, 1), (8, 3)):
        r = serve(llama8b, batch=batch, prompt_tokens=512, new_tokens=64, num_csx=num_csx)
        assert r.tpot_s >= 2 * batch * llama8b.num_params() / (num_csx * hw.peak_flops)
        assert r.ttft_s >= 2 * 512 * (llama8b.num_params() - 128256 * 4096) / (num_csx * hw.peak_flops)


def test_a_model_larger_than_the_wafer_streams_unless_enough_wafers_hold_it():
    model = build_model(LLAMA_70B)
    one = serve(model, batch=1, prompt_tokens=128, new_tokens=128)
    assert one.placement == "streamed" and one.max_batch["resident"] == 0
    six = serve(model, batch=1, prompt_tokens=128, new_tokens=128, num_csx=6)
    assert six.placement == "resident" and six.tpot_s < one.tpot_s / 100
    with pytest.raises(ValueError, match=r"^placement resident: the weights alone need 141 GB, more than the 27\.5 GB "
                                         r"of usable SRAM of 1 CS-2: "):
        serve(model, batch=1, prompt_tokens=128, new_tokens=128, placement="resident")


def test_a_batch_whose_kv_caches_do_not_fit_is_refused_in_one_line_saying_how_many_fit(llama8b):
    kw = dict(prompt_tokens=4096, new_tokens=4096)
    fits = serve(llama8b, batch=1, **kw).max_batch
    assert 0 < fits["resident"] < fits["streamed"]
    kv = kv_bytes_per_sequence(llama8b, 8192, Hardware.for_model(llama8b))
    assert fits["streamed"] == math.floor((27.482112e9 - 2 * 128256 * 4096 * 2) / kv)
    assert serve(llama8b, batch=fits["resident"], **kw).placement == "resident"
    assert serve(llama8b, batch=fits["resident"] + 1, **kw).placement == "streamed"
    assert serve(llama8b, batch=fits["streamed"], **kw).placement == "streamed"
    for batch, placement, most in ((fits["streamed"] + 1, None, fits["streamed"]),
                                   (fits["resident"] + 1, "resident", fits["resident"])):
        with pytest.raises(ValueError) as e:
            serve(llama8b, batch=batch, placement=placement, **kw)
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"batch {batch}: {batch} sequences of 8192 positions need ")
        assert re.search(rf"; {most} fit beside the ", line), line


def test_refusals_name_what_is_wrong(llama8b):
    with pytest.raises(ValueError, match=r"positions exceed the model's 8192 \(model.max_position_embeddings\)"):
        serve(llama8b, batch=1, prompt_tokens=8000, new_tokens=500)
    with pytest.raises(ValueError, match="batch: expected a whole number >= 1, got 0"):
        serve(llama8b, batch=0, prompt_tokens=1, new_tokens=1)
    mlp = build_model({"name": "fc_mlp", "input_size": 4, "hidden_sizes": [8], "num_classes": 2})
    with pytest.raises(ValueError, match="fc_mlp is not a language model"):
        serve(mlp, batch=1, prompt_tokens=1, new_tokens=1)


def test_wse_compile_inference_prints_the_models_figures(llama8b, capsys):
    assert main(["compile", str(EXAMPLE), "--inference", "--batch", "8", "--prompt_tokens", "256",
                 "--new_tokens", "64"]) == 0
    out = capsys.readouterr().out
    r = serve(llama8b, batch=8, prompt_tokens=256, new_tokens=64)
    assert out.startswith("inference (a model of the hardware, wse_core.perf; fp16): weights resident on 1 CS-2, "
                          "pipelined across layers (they and the KV caches take ")
    assert (f"batch 8, prompt 256 tokens, 64 new: time to first token {r.ttft_s * 1e3:.3f} ms, time per output "
            f"token {r.tpot_s * 1e3:.3f} ms") in out
    assert f"{r.tokens_per_s_user:.1f} tokens/s per user, {r.tokens_per_s_batch:.1f} tokens/s for the batch" in out
    assert f"up to {r.max_batch['resident']} sequences with the weights resident" in out
    assert "streamed from MemoryX instead: " in out

    assert main(["compile", str(EXAMPLE), "--inference", "--batch", "100000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("wse compile: error: batch 100000: ") and " fit beside " in err[0]
    assert main(["compile", str(EXAMPLE), "--new_tokens", "5"]) == 1
    assert capsys.readouterr().err.strip() == "wse compile: error: --new_tokens: only with --inference"


def test_the_serving_figures_the_docs_quote_are_what_wse_compile_prints(llama8b, capsys):
    """docs/simulator.md said 2,284 tokens/s for Llama 3.1 8B where `wse compile --inference` printed 2,343.5:
    the docs quote what the command prints, at its default prompt and continuation (128 and 128) and at
    design.md's 1,000 and 1,000."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    assert main(["compile", str(EXAMPLE), "--inference"]) == 0
    short = serve(llama8b, batch=1, prompt_tokens=128, new_tokens=128).tokens_per_s_user
    assert f"  {short:.1f} tokens/s per user" in capsys.readouterr().out
    long = serve(llama8b, batch=1, prompt_tokens=1000, new_tokens=1000).tokens_per_s_user
    simulator = " ".join((docs / "simulator.md").read_text().split())
    assert f"at {short:,.1f} tokens/s per user for a prompt of 128 tokens and 128 new ones, {long:,.1f} for 1,000" \
        in simulator
    assert f"| 8B, 1 wafer | {long:,.0f} tokens/s per user" in (docs / "design.md").read_text()
