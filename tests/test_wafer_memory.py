"""A CS-2's wafer memory in weight streaming (docs/design/time-model.md "Wafer memory"): a limit that
admits what is known to have run on CS-2s and refuses what cannot, and ``micro_batch_size: auto |
explore | none | N``."""
import subprocess
import sys

import pytest
import yaml

from mpi_launch.plan import PlanError
from mpi_launch.resolved import describe, resolve
from pyapi.params import ParamsError, validate


def gpt3(hidden, layers, heads, *, vocab=50257, seq=2048):
    """A GPT-3 shape as Model Zoo's configs give it (filter 4 x hidden, cbfloat16 mixed precision)."""
    return {"name": "gpt3", "hidden_size": hidden, "num_hidden_layers": layers, "num_heads": heads,
            "filter_size": 4 * hidden, "vocab_size": vocab, "max_position_embeddings": seq,
            "mixed_precision": True, "fp16_type": "cbfloat16"}


def compiled(model, batch_size, micro_batch_size=None, num_csx=1, **runconfig):
    train = {"data_dir": "d", "batch_size": batch_size}
    if micro_batch_size is not None:
        train["micro_batch_size"] = micro_batch_size
    return describe(resolve(validate({"train_input": train, "model": model,
                              "optimizer": {"learning_rate": 1e-4, "loss_scaling_factor": "dynamic"},
                              "runconfig": {"max_steps": 1, "num_csx": num_csx,
                                            "execution_strategy": "weight_streaming", **runconfig}})))


# What ran on real CS-2s, with the micro-batch each CS-2 computed at once: Model Zoo's shipped configs
# (Release_2.0.2 to 2.10.0: GPT-3 XL 528 in micro-batches of 264, later 88; 2.7B 528/88; 6.7B
# 1040/104; 13B 1080/90; releases 1.6-1.8, before micro-batching: GPT-J 65, GPT-3 13B 60, 20B 50,
# whole batches on a CS-2 at most), and Cerebras' table of micro-batch sizes "that have
# demonstrated good performance" (1.3B 253, 2.7B 198, 6.7B 121, 13B 99; training docs, "Automatic
# microbatching"). GPT-J's shape is taken in the gpt3 family: rotary positions change no activation.
RAN_ON_CS2 = {
    "gpt3 xl 528/264": (gpt3(2048, 24, 16), 528, 264),
    "gpt3 xl 528/88": (gpt3(2048, 24, 16), 528, 88),
    "gpt3 2.7b 528/88": (gpt3(2560, 32, 32), 528, 88),
    "gpt3 6.7b 1040/104": (gpt3(4096, 32, 32), 1040, 104),
    "gpt3 13b 1080/90": (gpt3(5120, 40, 40), 1080, 90),
    "gptj 6b 65": (gpt3(4096, 28, 16, vocab=50400), 65, 65),
    "gpt3 13b 60": (gpt3(5120, 40, 40), 60, 60),
    "gpt3 20b 50": (gpt3(6144, 44, 64), 50, 50),
    "table 1.3b 253": (gpt3(2048, 24, 16), 253, 253),
    "table 2.7b 198": (gpt3(2560, 32, 32), 198, 198),
    "table 6.7b 121": (gpt3(4096, 32, 32), 121, 121),
    "table 13b 99": (gpt3(5120, 40, 40), 99, 99),
}


@pytest.mark.parametrize("name", RAN_ON_CS2)
def test_what_ran_on_a_cs2_fits_its_wafer(name):
    model, batch, micro = RAN_ON_CS2[name]
    d = compiled(model, batch, micro)
    wafer = d["wafer_bytes"]
    assert d["execution_strategy"] == "weight_streaming" and wafer["fits"] and wafer["micro_batch_size"] == micro
    assert 0 < wafer["need"] <= wafer["capacity"] == 750 * 994 * 36 * 1024


def test_a_13b_batch_on_one_wafer_is_refused_with_the_micro_batch_that_fits():
    model = gpt3(5120, 40, 40)
    with pytest.raises(PlanError) as e:
        compiled(model, 720, "none")
    line = str(e.value)
    assert "\n" not in line and line.startswith("train_input.micro_batch_size: 720 samples do not fit a CS-2's wafer")
    assert "of its 27.5 GB usable SRAM; the largest that fits and deals the 720 samples each CS-2 gets evenly is 90" in line
    # auto takes that size (Model Zoo's own for GPT-3 13B), on one CS-2 and split over four.
    assert compiled(model, 720)["wafer_bytes"]["micro_batch_size"] == 90
    assert compiled(model, 720, "auto", num_csx=4)["wafer_bytes"]["micro_batch_size"] == 90
    # A smaller micro-batch costs its stream: the weights cross the I/O once per micro-batch.
    few, many = compiled(model, 720, 90)["simulated"], compiled(model, 720, 2)["simulated"]
    assert few["detail"]["micro_batches"] == 8 and many["detail"]["micro_batches"] == 360
    assert many["stream_s"] == pytest.approx(45 * few["stream_s"]) and many["exposed_stream_s"] > 0
    assert many["samples_per_s"] < 0.5 * few["samples_per_s"]


def test_the_share_is_kept_when_it_fits_and_explore_is_compile_only(tmp_path):
    small = {"name": "gpt2", "vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
             "max_position_embeddings": 16}
    assert compiled(small, 8, num_csx=2)["wafer_bytes"]["micro_batch_size"] == 4   # no key: the share fits
    tiny = {"program_width": 8, "program_height": 8, "pe_memory_bytes": 3542}     # 170 KB usable
    d = compiled(small, 8, "auto", num_csx=2, hardware=tiny)
    assert d["wafer_bytes"]["micro_batch_size"] == 2 and d["wafer_bytes"]["fits"]
    with pytest.raises(PlanError, match="the largest that fits and deals the 4 samples each CS-2 gets evenly is 2"):
        compiled(small, 8, 4, num_csx=2, hardware=tiny)
    with pytest.raises(ParamsError, match="train_input.micro_batch_size: explore searches the sizes when the params "
                                          "are compiled"):
        compiled(small, 8, "explore")
    with pytest.raises(ParamsError, match="train_input.micro_batch_size: expected a number of samples, auto, "
                                          "explore or none, got 'some'"):
        compiled(small, 8, "some")
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump({
        "train_input": {"data_dir": "d", "batch_size": 8, "micro_batch_size": "explore"}, "model": small,
        "optimizer": {"learning_rate": 1e-3},
        "runconfig": {"max_steps": 1, "num_csx": 2, "execution_strategy": "weight_streaming", "hardware": tiny}}))
    proc = subprocess.run([sys.executable, "-m", "pyapi.cli", "compile", str(f)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout[proc.stdout.index("micro_batch_size: explore"):].splitlines()[2:5]
    assert [row.split()[0] for row in table] == ["1", "2", "4"]
    assert table[1].endswith("<- chosen") and "does not fit" in table[2]
