"""The emulated hardware's time: the streaming GEMM on the fabric, the calibration of the compute
model on sizes it was not fitted on, the constants, and physical bounds of the cost functions."""
import numpy as np
import pytest

from wse_core.fabric.programs.stream_gemm import stream_gemm
from wse_core.perf import Hardware, gemm_seconds, unit_seconds, unit_work
from wse_core.perf.calibration import ALLREDUCE_COEF, BROADCAST_COEF, GEMM_COEF, GEMV_COEF, calibrate


@pytest.mark.parametrize("size", [(1, 1, 1, 1, 4), (1, 3, 2, 2, 8), (3, 1, 4, 3, 5), (4, 5, 3, 4, 16)])
def test_stream_gemm_computes_x_times_w(size):
    y, ref, r = stream_gemm(*size)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert 0 < r.extra["fmac_utilisation"] <= 1


def test_the_compute_model_is_calibrated_on_the_simulator_and_holds_on_held_out_sizes():
    """The constants in calibration.py are what a fit gives today, and predict sizes the fit did not
    see within 10% of the simulator's cycles (the issue's bar; they do far better): training's
    streaming GEMM and allreduce, decode's GEMV and broadcast."""
    result = calibrate()
    for name, coef in (("gemm", GEMM_COEF), ("allreduce", ALLREDUCE_COEF), ("gemv", GEMV_COEF),
                       ("broadcast", BROADCAST_COEF)):
        np.testing.assert_allclose(result[name]["coef"], coef, rtol=2e-3, atol=1e-2)
        assert result[name]["max_check_error"] < 0.10, result[name]["check"]


def test_hardware_constants_override_and_refuse_nonsense():
    hw = Hardware.from_params({"io_gbps": 600}, precision="fp32")
    assert hw.io_gbps == 600 and hw.bytes_per_value == 4 and hw.fmac_lanes == 1
    assert Hardware().peak_flops == 2 * 750 * 994 * 4 * 850e6
    with pytest.raises(ValueError, match="runconfig.hardware.io_gpbs: unknown constant"):
        Hardware.from_params({"io_gpbs": 1})
    with pytest.raises(ValueError, match=r"runconfig.hardware.clock_hz: expected a number > 0, got -1"):
        Hardware(clock_hz=-1)


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 300, 5), (2048, 2048, 8192), (16384, 5120, 20480),
                                   (100_000, 12288, 49152)])
def test_a_gemm_is_never_faster_than_its_flops_at_peak(shape, precision):
    hw = Hardware(precision=precision)
    M, K, N = shape
    assert gemm_seconds(M, K, N, hw) >= 2 * M * K * N / hw.peak_flops
    assert gemm_seconds(2 * M, K, N, hw) >= gemm_seconds(M, K, N, hw)   # more work never takes less time
    assert gemm_seconds(M, K, 2 * N, hw) >= gemm_seconds(M, K, N, hw)


def test_unit_costs_of_a_gpt_block():
    from wse_core.models import build_model

    model = build_model({"name": "gpt2", "vocab_size": 50257, "hidden_size": 2048, "num_hidden_layers": 24,
                         "num_heads": 16, "max_position_embeddings": 2048})
    block = model.units[1]
    one, four = (unit_seconds(unit_work(block, s, 2048)) for s in (1, 4))
    assert one["backward"] > one["forward"] > 0
    assert four["forward"] > 2 * one["forward"]   # more tokens per PE: better use, but more work
    work = unit_work(block, 1, 2048)
    macs = sum(M * K * N for M, K, N in work.gemms) + work.other_macs
    assert one["forward"] >= 2 * macs / Hardware().peak_flops


SHAPES = {"GPT-3 XL": (2048, 24, 16, 50257), "GPT-J 6B": (4096, 28, 16, 50400), "GPT-3 13B": (5120, 40, 40, 50257),
          "GPT-NeoX 20B": (6144, 44, 64, 50432)}


def gpt(shape, seq=2048):
    """A published GPT shape, in mixed precision as Cerebras trains them (the walk times it at fp16)."""
    from wse_core.models import build_model

    h, layers, heads, vocab = shape
    return build_model({"name": "gpt2", "vocab_size": vocab, "hidden_size": h, "num_hidden_layers": layers,
                        "num_heads": heads, "max_position_embeddings": seq, "mixed_precision": True})


@pytest.mark.parametrize("fp16_type", ["float16", "bfloat16", "cbfloat16"])
def test_a_run_is_timed_at_its_models_precision(fp16_type):
    """The simulated clock's precision is the model's (model.mixed_precision), as `wse compile` and the
    ranks build their Hardware: the same model in float32 streams 4 bytes a value on the fp32 lanes,
    in any 16-bit format 2 bytes on the fp16 lanes, and their weight-streaming steps differ."""
    from mpi_launch.resolved import describe, resolve
    from pyapi.params import validate
    from wse_core.models import build_model

    def compiled(**precision):
        model = {"name": "gpt2", "vocab_size": 257, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2,
                 "max_position_embeddings": 64, **precision}
        optimizer = {"learning_rate": 1e-3, "loss_scaling_factor": "dynamic"}  # cbfloat16 needs it
        return describe(resolve(validate({"train_input": {"data_dir": "d", "batch_size": 16, "micro_batch_size": 2},
                                          "model": model, "optimizer": optimizer,
                                          "runconfig": {"max_steps": 1, "num_csx": 2}}))), build_model(model)

    (f32, model), (f16, _) = compiled(), compiled(mixed_precision=True, fp16_type=fp16_type)
    streamed = sum(int(np.prod(model.param_specs[n].shape)) for names in model.unit_params for n in names)
    w32, w16 = f32["simulated"], f16["simulated"]
    assert w32["detail"]["precision"] == "fp32" and w32["detail"]["weight_bytes"] == 4 * streamed
    assert w16["detail"]["precision"] == "fp16" and w16["detail"]["weight_bytes"] == 2 * streamed
    assert w32["stream_s"] == pytest.approx(2 * w16["stream_s"])
    assert w32["compute_s"] > w16["compute_s"] and w32["step_s"] > w16["step_s"]
    assert f32["wafer_bytes"]["weights"] == 2 * f16["wafer_bytes"]["weights"]
    assert f32["wafer_bytes"]["checkpoints"] == 2 * f16["wafer_bytes"]["checkpoints"]
    # The pipelined model too: AdamW's 32-bit weights, gradients and two states, or 16-bit weights with a
    # 32-bit master copy.
    assert (f32["pipeline"]["detail"]["bytes_per_param"], f16["pipeline"]["detail"]["bytes_per_param"]) == (16, 18)
    assert (f32["pipeline"]["detail"]["precision"], f16["pipeline"]["detail"]["precision"]) == ("fp32", "fp16")


@pytest.mark.parametrize("name", SHAPES)
def test_a_step_obeys_physical_bounds_and_scales_near_linearly_with_the_batch_per_csx_fixed(name):
    from wse_core.perf.step import lower_bounds, walk_step

    model = gpt(SHAPES[name])
    steps = {}
    for n in (1, 4, 16, 192):
        s = walk_step(model, num_csx=n, samples_per_csx=64, micro_batch_size=8, seq_len=2048)
        bounds = lower_bounds(model, samples_per_csx=64, micro_batch_size=8, seq_len=2048)
        assert s.step_s >= bounds["io_s"] and s.step_s >= bounds["flops_s"], (n, s, bounds)
        assert s.step_s >= s.compute_s and s.stream_s == pytest.approx(bounds["io_s"])
        steps[n] = s
    speedup16 = steps[16].samples_per_s / steps[1].samples_per_s
    assert 0.9 * 16 <= speedup16 <= 16 * 1.0001
    assert steps[192].reduce_tail_s > steps[1].reduce_tail_s   # a deeper tree: a longer tail
    again = walk_step(model, num_csx=16, samples_per_csx=64, micro_batch_size=8, seq_len=2048)
    assert again.step_s == steps[16].step_s                    # deterministic


def test_the_cs3_is_a_system_of_its_own_constants_and_overrides_apply_over_them():
    """runconfig.hardware: cs3 (or {system: cs3, ...}): the WSE-3's program rectangle, I/O and lanes
    (hardware.SYSTEMS), overrides over them; a GPT-J step computes faster and streams 1.3x faster."""
    from wse_core.perf.step import walk_step

    cs3 = Hardware.from_params("cs3")
    assert (cs3.system, cs3.program_width * cs3.program_height, cs3.io_gbps, cs3.fmac_lanes_fp16) == \
        ("cs3", 883_350, 1560.0, 8)
    mine = Hardware.from_params({"system": "cs3", "io_gbps": 1600})
    assert (mine.io_gbps, mine.fmac_lanes_fp16) == (1600, 8)
    assert Hardware.from_params({}).system == Hardware().system == "cs2"
    with pytest.raises(ValueError, match=r"^runconfig.hardware.system: expected cs2 or cs3, got 'cs4'$"):
        Hardware.from_params("cs4")
    model = gpt(SHAPES["GPT-J 6B"])
    step = {s: walk_step(model, num_csx=1, samples_per_csx=64, micro_batch_size=8, seq_len=2048,
                         hw=Hardware.for_model(model, s)) for s in ("cs2", "cs3")}
    assert step["cs3"].compute_s < step["cs2"].compute_s
    assert step["cs3"].stream_s == pytest.approx(step["cs2"].stream_s / 1.3)


def test_a_13b_model_at_1_2_tbps_streams_at_least_0_35_s_per_step():
    from wse_core.perf.step import walk_step

    s = walk_step(gpt(SHAPES["GPT-3 13B"]), num_csx=1, samples_per_csx=1, micro_batch_size=1, seq_len=2048)
    assert s.stream_s >= 0.35 and s.step_s >= s.stream_s


def test_with_the_global_batch_fixed_the_stream_takes_over():
    from wse_core.perf.step import walk_step

    model = gpt(SHAPES["GPT-J 6B"])
    one = walk_step(model, num_csx=1, samples_per_csx=512, micro_batch_size=8, seq_len=2048)
    many = walk_step(model, num_csx=192, samples_per_csx=2, micro_batch_size=2, seq_len=2048)
    assert many.samples_per_s / one.samples_per_s < 0.5 * 192
    assert many.exposed_stream_s > many.compute_s / 10   # waiting for weights is now a large part


def test_the_tree_depth_is_the_plans():
    """The walk's tree has the depth of the tree the ranks build."""
    from mpi_launch.plan import make_plan
    from wse_core.perf.step import tree_depth

    for n in (1, 2, 3, 4, 5, 16, 17, 192):
        for f in (2, 4):
            plan = make_plan(num_csx=n, num_wgt_servers=1, num_workers_per_csx=1, swarmx_fanout=f, unit_bytes=[1])
            depth, rank = 0, plan.csx[-1]
            while plan.parent.get(rank) is not None:
                rank, depth = plan.parent[rank], depth + 1
            assert tree_depth(n, f) == depth, (n, f)   # SwarmX nodes between a CS-2 and MemoryX


def test_the_model_holds_against_published_cs2_and_cs3_runs():
    """`wse bench fidelity`: the walk against logged runs of real CS-2s and CS-3s (bench/fidelity.py
    cites each), nothing fitted on them. The current-release runs of GPT-2, LLaMA and Llama-2 on
    CS-2s and of GPT-J and Llama-2 on a CS-3 are within 25%; GPT-J on CS-2s is the model's known
    gap (docs/benchmarks.md, "Held against the machine")."""
    from bench.fidelity import run

    result = run(None)
    ratios = {r["id"]: r["ratio"] for r in result["runs"]}
    assert result["within_25pct"] == ["A5", "A6", "A7", "A8", "E1"]
    assert all(0.75 <= ratios[i] <= 1.25 for i in result["within_25pct"])
    assert 1.25 < ratios["A3"] < ratios["A4"] < 1.4            # GPT-J on CS-2s: optimistic
    assert ratios["A1"] > ratios["A2"] > ratios["A4"]          # the same run, later releases faster
