"""Model Zoo params files as they are: both layouts, one RunSpec, and a fate for every key.

The files here are written for these tests with the keys Model Zoo's own GPT-2/GPT-3/LLaMA configs
use (1.x to 2.2 flat layout; 2.3 on trainer layout) and values of our own. One file over ~500
lines: these files are the fixtures, written out as YAML, and every test reads several of them.
"""
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from mpi_launch.rundir import RunDir
from pyapi.modelzoo import ParamsWarning
from pyapi.params import ParamsError, check, load, validate

pytestmark = pytest.mark.filterwarnings("ignore::pyapi.modelzoo.ParamsWarning")  # asserted where they matter

# A GPT-3 style file in the flat layout (Model Zoo 1.9-2.2 keys), shrunk.
FLAT = """
train_input:
  data_processor: GptHDF5MapDataProcessor
  data_dir: ./train
  batch_size: 8
  shuffle: true
  shuffle_seed: 7
  num_workers: 2
  prefetch_factor: 4
  persistent_workers: true
eval_input:
  data_processor: GptHDF5MapDataProcessor
  data_dir: ./val
  batch_size: 4
  shuffle: false
  num_workers: 2
model:
  name: gpt3
  vocab_size: 300
  hidden_size: 48
  position_embedding_type: learned
  share_embedding_weights: true
  max_position_embeddings: 32
  num_hidden_layers: 2
  dropout_rate: 0.0
  layer_norm_epsilon: 1.0e-05
  num_heads: 4
  attention_type: scaled_dot_product
  attention_dropout_rate: 0.0
  use_projection_bias_in_attention: true
  use_ffn_bias_in_attention: true
  filter_size: 96
  nonlinearity: gelu
  use_ffn_bias: true
  embedding_initializer: {mean: 0.0, name: truncated_normal, std: 0.03, a: -0.06, b: 0.06}
  initializer: {mean: 0.0, name: truncated_normal, std: 0.03, a: -0.06, b: 0.06}
  output_layer_initializer: {mean: 0.0, name: truncated_normal, std: 0.01, a: -0.02, b: 0.02}
  loss_scaling: batch_size
  loss_weight: 0.03125
  use_bias_in_output: false
  mixed_precision: false
optimizer:
  optimizer_type: AdamW
  betas: [0.9, 0.95]
  eps: 1.0e-08
  weight_decay: 0.05
  correct_bias: true
  max_gradient_norm: 1.0
  log_summaries: true
  learning_rate:
    - {scheduler: Linear, initial_learning_rate: 0.0, end_learning_rate: 0.002, total_iters: 3}
    - {scheduler: CosineDecay, initial_learning_rate: 0.002, end_learning_rate: 0.0002, total_iters: 9}
runconfig:
  max_steps: 12
  log_steps: 1
  checkpoint_steps: 6
  save_initial_checkpoint: false
  seed: 3
  model_dir: ./model_dir
  precision_opt_level: 1
  num_wgt_servers: 2
"""

# The same run in the trainer layout (Model Zoo 2.3 on).
TRAINER = """
trainer:
  init:
    backend:
      backend_type: CSX
      cluster_config: {num_csx: 1, max_wgt_servers: 2}
    model_dir: ./model_dir
    seed: 3
    model:
      name: gpt3
      vocab_size: 300
      hidden_size: 48
      position_embedding_type: learned
      share_embedding_weights: true
      max_position_embeddings: 32
      num_hidden_layers: 2
      dropout_rate: 0.0
      layer_norm_epsilon: 1.0e-05
      num_heads: 4
      attention_type: scaled_dot_product
      attention_dropout_rate: 0.0
      use_projection_bias_in_attention: true
      use_ffn_bias_in_attention: true
      filter_size: 96
      nonlinearity: gelu
      use_ffn_bias: true
      embedding_initializer: {mean: 0.0, name: truncated_normal, std: 0.03, a: -0.06, b: 0.06}
      initializer: {mean: 0.0, name: truncated_normal, std: 0.03, a: -0.06, b: 0.06}
      output_layer_initializer: {mean: 0.0, name: truncated_normal, std: 0.01, a: -0.02, b: 0.02}
      loss_scaling: batch_size
      loss_weight: 0.03125
      use_bias_in_output: false
    optimizer:
      AdamW: {betas: [0.9, 0.95], eps: 1.0e-08, weight_decay: 0.05, correct_bias: true}
    schedulers:
      - SequentialLR:
          schedulers:
            - LinearLR: {initial_learning_rate: 0.0, end_learning_rate: 0.002, total_iters: 3}
            - CosineDecayLR: {initial_learning_rate: 0.002, end_learning_rate: 0.0002, total_iters: 9}
    precision: {enabled: false, precision_opt_level: 1, max_gradient_norm: 1.0, log_loss_scale: true}
    loop: {max_steps: 12}
    checkpoint: {steps: 6, save_initial_checkpoint: false}
    logging: {log_steps: 1}
    callbacks:
      - ComputeNorm: {}
  fit:
    train_dataloader:
      data_processor: GptHDF5MapDataProcessor
      data_dir: ./train
      batch_size: 8
      shuffle: true
      shuffle_seed: 7
      num_workers: 2
      prefetch_factor: 4
      persistent_workers: true
    val_dataloader: &val
      data_processor: GptHDF5MapDataProcessor
      data_dir: ./val
      batch_size: 4
      shuffle: false
      num_workers: 2
  validate:
    val_dataloader: *val
  validate_all:
    val_dataloaders: *val
"""


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ParamsWarning)
        return fn(*args, **kwargs)


def test_both_layouts_load_into_one_run_spec():
    flat, trainer = quiet(validate, yaml.safe_load(FLAT)), quiet(validate, yaml.safe_load(TRAINER))
    assert flat == trainer
    assert trainer.model["name"] == "gpt3" and trainer.optimizer.betas == (0.9, 0.95)
    assert trainer.runconfig.num_wgt_servers == 2 and trainer.eval_input.batch_size == 4
    assert trainer.optimizer.learning_rate[1]["scheduler"] == "CosineDecay"


def test_tuning_keys_are_one_warning_and_change_nothing():
    """Listed once, where the params are compiled (`wse compile`), in the file's own paths; not again by
    every command that runs them (a Model Zoo file has them in every run: it was noise)."""
    with pytest.warns(ParamsWarning) as record:
        spec, report = check(yaml.safe_load(FLAT), "f.yaml", compile_only=True)
    lines = [str(w.message) for w in record if "without effect" in str(w.message)]
    assert len(lines) == 1 and lines[0].startswith("f.yaml: 8 keys accepted without effect")
    assert "train_input.num_workers" in lines[0] and "runconfig.precision_opt_level" in lines[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(yaml.safe_load(FLAT), "f.yaml")
        _, trainer = check(yaml.safe_load(TRAINER), "t.yaml", compile_only=True)
    said = [str(w.message) for w in caught if "without effect" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("t.yaml: ")  # the compiled one alone
    assert "trainer.fit.train_dataloader.num_workers" in said[0] and "trainer.init.precision.precision_opt_level" \
        in said[0] and "runconfig." not in said[0]
    bare = yaml.safe_load(FLAT)
    for section, key in (("train_input", "data_processor"), ("train_input", "num_workers"),
                         ("optimizer", "log_summaries"), ("runconfig", "precision_opt_level")):
        del bare[section][key]
    assert quiet(validate, bare) == spec
    assert report.fates["model.use_ffn_bias"] == "honoured (same value)"
    assert report.fates["model.initializer"] == "honoured"


def test_every_refused_key_is_in_one_error():
    raw = yaml.safe_load(FLAT)
    raw["model"].update(use_ffn_bias=False, rotary_dim=16, attention_type="dot_product", frobnicate=1)
    raw["optimizer"].update(max_gradient_value=1.0, correct_bias=False)
    raw["model"]["attention_sliding_window_length"] = 16
    raw["sparsity"] = {"type": "static", "sparsity": 0.5}
    with pytest.raises(ParamsError) as err:
        quiet(validate, raw)
    text = str(err.value)
    assert text.startswith("8 keys cannot be used as given")
    for line in ("model.use_ffn_bias: False asks for feed-forward layers without biases, which is not built",
                 "model.rotary_dim: rotary position embeddings (built for llama, not gpt2) is not built",
                 "model.attention_type: 'dot_product' asks for unscaled (dot_product) attention",
                 "optimizer.correct_bias: False asks for Adam without bias correction",
                 "optimizer.max_gradient_value: 1.0 asks for clipping gradients by value",
                 "model.attention_sliding_window_length: sliding-window attention is not built",
                 "sparsity: Model Zoo's sparsity",
                 "model.frobnicate: unknown key"):
        assert "\n  " + line in text, line


def test_1x_aliases_are_honoured_not_dropped():
    """Deleting beta2 or weight_decay_rate would change the training; read as what they name."""
    raw = yaml.safe_load(FLAT)
    opt = raw["optimizer"]
    del opt["betas"], opt["eps"]
    opt.update(beta1=0.8, beta2=0.95, epsilon=1e-7, weight_decay_rate=0.05)
    opt.pop("weight_decay")
    spec = quiet(validate, raw)
    assert spec.optimizer.betas == (0.8, 0.95) and spec.optimizer.eps == 1e-7 and spec.optimizer.weight_decay == 0.05
    opt["weight_decay"] = 0.1
    with pytest.raises(ParamsError, match="optimizer.weight_decay_rate: given beside optimizer.weight_decay"):
        quiet(validate, raw)


def test_an_unnamed_model_is_inferred_and_said():
    raw = yaml.safe_load(FLAT)
    del raw["model"]["name"]
    with pytest.warns(ParamsWarning, match=r"model.name: absent; inferred gpt2 from its keys"):
        assert validate(raw).model["name"] == "gpt2"
    raw["model"].update(norm_type="rmsnorm", position_embedding_type="rotary")
    with pytest.warns(ParamsWarning, match=r"inferred llama from its keys \(RMSNorm, rotary positions or SwiGLU\)"):
        with pytest.raises(ParamsError, match=r"model.nonlinearity: llama is built with 'swiglu', got 'gelu'"):
            validate(raw)
    # 1.x files had no loss_scaling; their loss was sum / batch_size * loss_weight.
    raw = yaml.safe_load(FLAT)
    del raw["model"]["loss_scaling"]
    with pytest.warns(ParamsWarning, match="model.loss_scaling: absent beside loss_weight 0.03125; inferred batch_size"):
        assert validate(raw).model["loss_scaling"] == "batch_size"


def test_overrides_take_either_layouts_paths(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text(TRAINER)
    a = quiet(load, f, ["model.hidden_size=64", "trainer.init.loop.max_steps=5"])
    assert a.model["hidden_size"] == 64 and a.runconfig.max_steps == 5
    g = tmp_path / "f.yaml"
    g.write_text(FLAT)
    with pytest.raises(ParamsError, match=r"--set trainer.init.seed=1: this file has the flat layout"):
        quiet(load, g, ["trainer.init.seed=1"])


def test_trainer_layout_errors_name_the_trainer_path():
    raw = yaml.safe_load(TRAINER)
    raw["trainer"]["init"]["callbacks"].append({"EmaCallback": {}})
    raw["trainer"]["fit"]["ckpt_path"] = "x"
    with pytest.raises(ParamsError) as err:
        quiet(validate, raw)
    assert "trainer.init.callbacks[1].EmaCallback: unknown key of the trainer layout" in str(err.value)
    assert "trainer.fit.ckpt_path: unknown key of the trainer layout" in str(err.value)
    raw = yaml.safe_load(TRAINER)
    raw["trainer"]["init"]["optimizer"]["SGD"] = {}
    with pytest.raises(ParamsError, match=r"trainer.init.optimizer: expected one mapping \{OptimizerName"):
        quiet(validate, raw)


def wse(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pyapi.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_convert_writes_the_other_layout_and_back(tmp_path):
    (tmp_path / "flat.yaml").write_text(FLAT)
    out = wse("params", "convert", str(tmp_path / "flat.yaml"), "-o", str(tmp_path / "t.yaml"))
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # every key has a home in the trainer layout (input-pipeline keys in the dataloaders)
    converted = yaml.safe_load((tmp_path / "t.yaml").read_text())
    assert list(converted) == ["trainer"] and converted["trainer"]["init"]["optimizer"]["AdamW"]["betas"] == [0.9, 0.95]
    back = wse("params", "convert", str(tmp_path / "t.yaml"), "-o", str(tmp_path / "back.yaml"))
    assert back.returncode == 0, back.stderr
    original = quiet(validate, yaml.safe_load(FLAT))
    assert quiet(load, tmp_path / "t.yaml") == quiet(load, tmp_path / "back.yaml") == original


def test_params_keys_prints_every_fate(tmp_path):
    (tmp_path / "t.yaml").write_text(TRAINER)
    out = wse("params", "keys", str(tmp_path / "t.yaml"))
    assert out.returncode == 0, out.stderr
    *lines, counts = out.stdout.splitlines()
    fates = dict(line.split(None, 1) for line in lines if not line.startswith("note"))
    # each key as the file names it (a trainer-layout file's were listed by their flat names)
    assert fates["trainer.fit.train_dataloader.num_workers"] == "tuning"
    assert fates["trainer.init.model.use_ffn_bias"] == "honoured (same value)"
    assert fates["trainer.init.optimizer.AdamW.betas"] == fates["trainer.init.schedulers"] == "honoured"
    assert fates["trainer.init.loop.max_steps"] == fates["trainer.init.backend.cluster_config.max_wgt_servers"]
    assert all(path.startswith("trainer.") for path in fates) and counts.endswith(" tuning")
    bad = TRAINER.replace("use_ffn_bias: true", "use_ffn_bias: false")
    (tmp_path / "b.yaml").write_text(bad)
    out = wse("params", "keys", str(tmp_path / "b.yaml"))
    assert out.returncode == 1 and "trainer.init.model.use_ffn_bias" in out.stdout and "refused: False asks for" \
        in out.stdout
    (tmp_path / "f.yaml").write_text(FLAT)
    flat = wse("params", "keys", str(tmp_path / "f.yaml"), "--json")
    assert json.loads(flat.stdout)["fates"]["train_input.num_workers"] == "tuning"  # a flat file's own paths


def test_wse_compile_warns_in_one_line(tmp_path):
    (tmp_path / "t.yaml").write_text(TRAINER)
    out = wse("compile", str(tmp_path / "t.yaml"))
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if "warning" in line]
    assert warned[0].startswith("wse compile: warning: ") and any("without effect" in w for w in warned)
    assert out.stdout.startswith("model gpt3:")


# GPT-2 small as a Model Zoo 1.x file would write it (flat layout, 1.x key names, full size).
GPT2_SMALL_1X = """
train_input:
  data_processor: GptHDF5DataProcessor
  data_dir: DATA
  vocab_size: 50257
  max_sequence_length: 1024
  batch_size: 8
  shuffle: true
  shuffle_seed: 11
  num_workers: 4
  prefetch_factor: 4
  persistent_workers: true
eval_input:
  data_processor: GptHDF5DataProcessor
  data_dir: DATA
  vocab_size: 50257
  max_sequence_length: 1024
  batch_size: 8
  shuffle: false
  num_workers: 4
model:
  vocab_size: 50257
  hidden_size: 768
  use_position_embedding: true
  position_embedding_type: learned
  share_embedding_weights: true
  max_position_embeddings: 1024
  num_hidden_layers: 12
  dropout_rate: 0.1
  layer_norm_epsilon: 1.0e-5
  num_heads: 12
  attention_type: scaled_dot_product
  attention_dropout_rate: 0.1
  use_projection_bias_in_attention: true
  use_ffn_bias_in_attention: true
  filter_size: 3072
  nonlinearity: gelu
  use_ffn_bias: true
  use_bias_in_output: false
  loss_weight: 0.0009765625
  mixed_precision: true
  use_bfloat16: false
optimizer:
  optimizer_type: AdamW
  beta1: 0.9
  beta2: 0.98
  epsilon: 1.0e-7
  correct_bias: true
  disable_lr_steps_reset: false
  weight_decay_rate: 0.02
  max_gradient_norm: 1.0
  learning_rate:
    - {scheduler: Linear, initial_learning_rate: 0.0, end_learning_rate: 0.0003, steps: 2}
    - {scheduler: Linear, initial_learning_rate: 0.0003, end_learning_rate: 0.0, steps: 4, alpha: 0.1}
  loss_scaling_factor: dynamic
  log_summaries: true
runconfig:
  max_steps: 6
  log_steps: 1
  checkpoint_steps: 3
  save_initial_checkpoint: false
  seed: 2
  show_debug_metrics: false
  save_losses: true
  eval_steps: 1
  eval_frequency: 3
  enable_distributed: false
  use_appliance_data: true
  precision_opt_level: 0
"""

# A Cerebras-GPT style file in the trainer layout (Model Zoo 2.3 on), full size.
GPT3_TRAINER = """
trainer:
  init:
    backend: {backend_type: CSX}
    model:
      name: gpt3
      hidden_size: 768
      position_embedding_type: learned
      share_embedding_weights: true
      max_position_embeddings: 2048
      vocab_size: 50257
      num_hidden_layers: 10
      dropout_rate: 0.0
      layer_norm_epsilon: 1.0e-05
      num_heads: 12
      attention_type: scaled_dot_product
      attention_dropout_rate: 0.0
      use_projection_bias_in_attention: true
      use_ffn_bias_in_attention: true
      filter_size: 3072
      nonlinearity: gelu
      use_ffn_bias: true
      embedding_initializer: {mean: 0.0, name: truncated_normal, std: 0.02, a: -0.04, b: 0.04}
      initializer: {mean: 0.0, name: truncated_normal, std: 0.02, a: -0.04, b: 0.04}
      output_layer_initializer: {mean: 0.0, name: truncated_normal, std: 0.0045, a: -0.009, b: 0.009}
      loss_scaling: batch_size
      loss_weight: 0.00048828125
      use_bias_in_output: false
      fp16_type: cbfloat16
      mixed_precision: true
    optimizer:
      AdamW: {betas: [0.9, 0.95], eps: 1.0e-08, weight_decay: 0.1, correct_bias: true}
    schedulers:
      - SequentialLR:
          schedulers:
            - LinearLR: {initial_learning_rate: 0.0, end_learning_rate: 0.0006, total_iters: 2}
            - LinearLR: {initial_learning_rate: 0.0006, end_learning_rate: 6.0e-05, total_iters: 4}
    precision:
      enabled: true
      fp16_type: cbfloat16
      precision_opt_level: 1
      loss_scaling_factor: dynamic
      max_gradient_norm: 1.0
      log_loss_scale: true
    loop: {max_steps: 6, eval_frequency: 3, eval_steps: 1}
    checkpoint: {steps: 3, save_initial_checkpoint: false}
    logging: {log_steps: 1}
    callbacks:
      - ScopedTrainFlags: {csx.performance.micro_batch_size: 2}
      - ScopedValidateFlags: {csx.performance.micro_batch_size: 2}
      - ComputeNorm: {}
    seed: 2
  fit:
    train_dataloader:
      data_processor: GptHDF5DataProcessor
      data_dir: DATA
      shuffle: true
      shuffle_seed: 0
      batch_size: 8
      num_workers: 1
      prefetch_factor: 10
      persistent_workers: true
    val_dataloader: &val
      data_processor: GptHDF5DataProcessor
      data_dir: DATA
      batch_size: 8
      shuffle: false
      num_workers: 1
  validate:
    val_dataloader: *val
  validate_all:
    val_dataloaders: *val
"""

# A LLaMA-3 style file in the trainer layout (grouped-query attention, llama3 rope scaling, tied head).
LLAMA_TRAINER = """
trainer:
  init:
    backend: {backend_type: CSX}
    callbacks:
      - ScopedTrainFlags: {csx.performance.micro_batch_size: 2}
      - ScopedValidateFlags: {csx.performance.micro_batch_size: 2}
      - ComputeNorm: {}
      - LoadCheckpointStates: {load_checkpoint_states: model}
    checkpoint: {disable_strict_checkpoint_loading: true, save_initial_checkpoint: false, steps: 3}
    logging: {log_steps: 1}
    loop: {eval_frequency: 3, eval_steps: 1, max_steps: 6}
    model:
      attention_dropout_rate: 0.0
      attention_module: multiquery_attention
      attention_type: scaled_dot_product
      dropout_rate: 0.0
      embedding_dropout_rate: 0.0
      embedding_layer_norm: false
      extra_attention_params: {num_kv_groups: 4}
      filter_size: 5632
      hidden_size: 2048
      initializer_range: 0.02
      layer_norm_epsilon: 1.0e-05
      loss_scaling: num_tokens
      loss_weight: 1.0
      max_position_embeddings: 4096
      name: llama
      nonlinearity: swiglu
      norm_type: rmsnorm
      num_heads: 16
      num_hidden_layers: 4
      pos_scaling_extra_args: {high_freq_factor: 4.0, low_freq_factor: 1.0, original_max_position_embeddings: 1024}
      pos_scaling_factor: 4.0
      pos_scaling_type: llama3
      position_embedding_type: rotary
      rope_theta: 500000.0
      rotary_dim: 128
      share_embedding_weights: true
      use_bias_in_output: false
      use_ffn_bias: false
      use_ffn_bias_in_attention: false
      use_projection_bias_in_attention: false
      vocab_size: 50000
    optimizer:
      AdamW: {betas: [0.9, 0.95], correct_bias: true, weight_decay: 0.1}
    precision:
      enabled: true
      fp16_type: cbfloat16
      log_loss_scale: true
      loss_scaling_factor: dynamic
      max_gradient_norm: 1.0
      precision_opt_level: 1
    schedulers:
      - SequentialLR:
          schedulers:
            - CosineDecayLR: {end_learning_rate: 0.0003, initial_learning_rate: 0, total_iters: 2}
            - CosineDecayLR: {end_learning_rate: 3.0e-05, initial_learning_rate: 0.0003, total_iters: 4}
    seed: 1
  fit:
    train_dataloader:
      batch_size: 8
      data_dir: DATA
      data_processor: GptHDF5MapDataProcessor
      num_workers: 8
      persistent_workers: true
      prefetch_factor: 10
      shuffle: true
      shuffle_seed: 1337
    val_dataloader: &id001
      batch_size: 8
      data_dir: DATA
      data_processor: GptHDF5MapDataProcessor
      num_workers: 8
      shuffle: false
  validate:
    val_dataloader: *id001
  validate_all:
    val_dataloaders: *id001
"""

SHRINK = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_heads=4", "model.filter_size=64",
          "model.vocab_size=257", "model.max_position_embeddings=32"]


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    from data_tools.preprocess import preprocess_text

    d = tmp_path_factory.mktemp("lm") / "lm"
    preprocess_text(["stdlib"], d, 32, samples_per_file=4000, progress=False)
    return d


@pytest.mark.parametrize("text", [GPT2_SMALL_1X, GPT3_TRAINER, LLAMA_TRAINER],
                         ids=["gpt2-1.x-flat", "gpt3-2.x-trainer", "llama-2.x-trainer"])
def test_model_zoo_files_compile_dry_run_and_a_shrunk_one_trains(tmp_path, lm_data, jobs, text):
    """Nothing edited but data_dir: `wse compile` and `wse fit --dry-run` accept the full-size
    file; with --set sizes it trains (mixed precision, dynamic loss scaling, dropout,
    evaluation during training, all as the file says)."""
    f = tmp_path / "params.yaml"
    f.write_text(text.replace("DATA", str(lm_data)))
    model_dir = tmp_path / "model"
    out = jobs.run("compile", f, "--set", f"runconfig.model_dir={model_dir}")
    assert out.returncode == 0, out.stderr
    assert "error" not in out.stderr and "parameters" in out.stdout
    dry = jobs.run("fit", f, "--dry-run", "--model_dir", model_dir)
    assert dry.returncode == 0, dry.stderr
    assert "mpiexec" in dry.stdout and (model_dir / "run.json").is_file()
    shrink = SHRINK + (["model.rotary_dim=8", "model.extra_attention_params.num_kv_groups=2"] if "llama" in text else [])
    run = jobs.run("fit", f, "--model_dir", model_dir, "--num_csx", 2, *(x for s in shrink for x in ("--set", s)))
    assert run.returncode == 0, run.stderr
    metrics = RunDir(model_dir).read_metrics()
    steps = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 7)) and [m["step"] for m in evals] == [3, 6]
    assert all("loss_scale" in m for m in steps) and math.isfinite(evals[-1]["eval_loss"])


def test_the_trainer_layout_example_trains_its_documented_steps(tmp_path, jobs):
    """examples/gpt3_trainer.yaml's documented `--set trainer.init.loop.max_steps=10` skipped 9 of the 10
    steps: cbfloat16's first loss scale, 2^31, overflowed the gradients until halved 9 times. Its own
    initial_loss_scale trains every step, from where the README runs it (here on a few Python files at the
    demo's path)."""
    from data_tools.preprocess import preprocess_text

    root = Path(__file__).resolve().parents[1]
    for d in ("data", "eval_data"):
        preprocess_text(sorted(map(str, (root / "pyapi").glob("*.py"))), tmp_path / "wse_demo" / d, 64, progress=False)
    example = root / "examples" / "gpt3_trainer.yaml"
    run = jobs.run("fit", example, "--set", "trainer.init.loop.max_steps=10", "--model_dir", tmp_path / "m",
                   cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    steps = [m for m in RunDir(tmp_path / "m").read_metrics() if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 11)) and not any(m["skipped"] for m in steps), steps
