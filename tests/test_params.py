"""The params schema: defaults, overrides, and errors that name the key path."""
import pytest
import yaml

from pyapi.params import ParamsError, apply_overrides, load, validate

BASE = {
    "train_input": {"data_dir": "data", "batch_size": 8},
    "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
              "max_position_embeddings": 16},
    "optimizer": {"learning_rate": 1e-3},
    "runconfig": {"max_steps": 5, "num_csx": 2},
}


def test_defaults_are_filled_in():
    p = validate(BASE)
    assert p["train_input"]["micro_batch_size"] == 4 and p["train_input"]["shuffle"] is True
    assert p["optimizer"]["optimizer_type"] == "AdamW" and p["runconfig"]["swarmx_fanout"] == 2
    assert "eval_input" not in p and p["model"] == BASE["model"]


@pytest.mark.parametrize("override,match", [
    ("optimizer.learning_rate='fast'", "optimizer.learning_rate: expected a number or a list of schedulers, got 'fast'"),
    ("runconfig.num_csx=0", "runconfig.num_csx: expected an integer >= 1, got 0"),
    ("runconfig.num_csx=3", "train_input.batch_size: 8 does not split evenly across runconfig.num_csx 3"),
    ("train_input.micro_batch_size=3", "train_input.micro_batch_size: 3 does not divide the 4 samples"),
    ("runconfig.frobnicate=1", "runconfig.frobnicate: unknown key"),
    ("extras.x=1", "extras: unknown section"),
    ("model.num_heads=3", "model.num_heads: 3 does not divide model.hidden_size 32"),
    ("optimizer.optimizer_type=Lion", "optimizer.optimizer_type: unknown optimizer 'Lion'"),
    ("optimizer.betas=[0.9, 1.5]", r"optimizer.betas: expected two numbers in \[0, 1\)"),
    ("optimizer.max_gradient_norm=-1", "optimizer.max_gradient_norm: expected a number > 0"),
    ("train_input.shuffle=maybe", "train_input.shuffle: expected true or false, got 'maybe'"),
    ("optimizer.learning_rate=[{scheduler: Linear, initial_learning_rate: 0}]",
     r"optimizer.learning_rate\[0\].end_learning_rate: missing"),
])
def test_errors_name_the_key(override, match):
    with pytest.raises(ParamsError, match=match):
        validate(apply_overrides(BASE, [override]))


def test_missing_sections_and_keys():
    with pytest.raises(ParamsError, match="runconfig: missing section"):
        validate({k: v for k, v in BASE.items() if k != "runconfig"})
    with pytest.raises(ParamsError, match=r"train_input.batch_size: missing \(global batch size"):
        validate(dict(BASE, train_input={"data_dir": "x"}))


def test_load_reports_bad_yaml_with_its_line(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(BASE) + "oops: [\n")
    with pytest.raises(ParamsError, match=r"p.yaml: not valid YAML at line \d+"):
        load(f)
    with pytest.raises(ParamsError, match="cannot read"):
        load(tmp_path / "missing.yaml")
    f.write_text(yaml.safe_dump(BASE))
    assert load(f, ["runconfig.max_steps=9"])["runconfig"]["max_steps"] == 9
    with pytest.raises(ParamsError, match="--set nodot=1: expected section.key=value"):
        load(f, ["nodot=1"])
