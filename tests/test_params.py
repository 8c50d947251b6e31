"""The params schema: defaults, overrides, and errors that name the key path."""
import re
import warnings

import pytest
import yaml

from pyapi.params import ParamsError, apply_overrides, check, load, validate

BASE = {
    "train_input": {"data_dir": "data", "batch_size": 8},
    "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
              "max_position_embeddings": 16},
    "optimizer": {"learning_rate": 1e-3},
    "runconfig": {"max_steps": 5, "num_csx": 2},
}


@pytest.mark.parametrize("batch,num_csx,given,taken", [(673, 2, 168, 169), (8, 3, 2, 2), (10, 2, 4, 5), (8, 2, 3, 4)])
def test_a_micro_batch_size_is_taken_as_one_that_deals_the_batch_evenly(batch, num_csx, given, taken):
    """As Cerebras' compiler does (its example: 673 samples on 2 systems, 168 is taken as 169), and
    said when it changes."""
    raw = apply_overrides(BASE, [f"train_input.batch_size={batch}", f"runconfig.num_csx={num_csx}",
                                 f"train_input.micro_batch_size={given}"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert validate(raw).train_input.micro_batch_size == taken
    said = [str(w.message) for w in caught if f"micro_batch_size: {given} is taken as" in str(w.message)]
    assert len(said) == (given != taken)


def test_defaults_are_filled_in():
    p = validate(BASE)
    assert p.train_input.micro_batch_size == 4 and p.train_input.shuffle is True
    assert p.optimizer.optimizer_type == "AdamW" and p.runconfig.swarmx_fanout == 2
    assert p.eval_input is None and {k: p.model[k] for k in BASE["model"]} == BASE["model"]
    assert p.model["filter_size"] == 128 and p.model["nonlinearity"] == "gelu"  # the model's defaults, filled in
    with pytest.raises(AttributeError):
        p.runconfig.max_steps = 6  # read-only, all the way down
    with pytest.raises(TypeError):
        p.model["hidden_size"] = 64


@pytest.mark.parametrize("override,match", [
    ("optimizer.learning_rate='fast'", "optimizer.learning_rate: expected a number or a list of schedulers, got 'fast'"),
    ("runconfig.num_csx=0", "runconfig.num_csx: expected an integer >= 1, got 0"),
    ("runconfig.num_csx=9", "train_input.batch_size: 8 samples cannot feed runconfig.num_csx 9 CS-2s"),
    ("train_input.micro_batch_size=5", "train_input.micro_batch_size: 5 is more than the 4 samples each CS-2 gets"),
    ("runconfig.frobnicate=1", "runconfig.frobnicate: unknown key"),
    ("extras.x=1", "extras: unknown section"),
    ("model.num_heads=3", "model.num_heads: 3 does not divide model.hidden_size 32"),
    ("optimizer.optimizer_type=Lion", "optimizer.optimizer_type: Lion is one of Model Zoo's optimizers that "
                                      "wse-cluster does not implement"),
    ("optimizer.optimizer_type=Lamb", "optimizer.optimizer_type: Lamb is one of Model Zoo's optimizers"),
    ("optimizer.optimizer_type=Frob", "optimizer.optimizer_type: unknown optimizer 'Frob'"),
    ("optimizer.betas=[0.9, 1.5]", r"optimizer.betas: expected two numbers in \[0, 1\)"),
    ("optimizer.max_gradient_norm=-1", "optimizer.max_gradient_norm: expected a number > 0"),
    ("train_input.shuffle=maybe", "train_input.shuffle: expected true or false, got 'maybe'"),
    ("optimizer.learning_rate=[{scheduler: Linear, initial_learning_rate: 0}]",
     r"optimizer.learning_rate\[0\].end_learning_rate: missing"),
])
def test_errors_name_the_key(override, match):
    with pytest.raises(ParamsError, match=match):
        validate(apply_overrides(BASE, [override]))


@pytest.mark.parametrize("override,said", [
    ("model.hiden_size=64", "model.hiden_size: unknown key (did you mean hidden_size?)"),
    ("runconfig.max_step=3", "runconfig.max_step: unknown key (did you mean max_steps?)"),
    ("traininput.batch_size=8", "traininput: unknown section (did you mean train_input?)"),
    ("model.name=gtp2", "model.name: unknown model 'gtp2' (did you mean gpt2?)"),
])
def test_a_mistyped_key_is_answered_with_the_closest_one(override, said):
    """One line with the likely key, not the list of every key of the section."""
    with pytest.raises(ParamsError) as err:
        validate(apply_overrides(BASE, [override]))
    assert str(err.value) == said


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
    assert load(f, ["runconfig.max_steps=9"]).runconfig.max_steps == 9
    with pytest.raises(ParamsError, match="--set nodot=1: expected section.key=value"):
        load(f, ["nodot=1"])


def test_the_resolved_params_load_again():
    """What `wse fit` writes into model_dir (every default filled in, nulls included) validates to itself."""
    p = validate(dict(BASE, eval_input={"data_dir": "e", "batch_size": 4}))
    assert p.eval_input.micro_batch_size is None and p.optimizer.max_gradient_norm is None
    assert validate(yaml.safe_load(yaml.safe_dump(p.to_dict()))) == p


BAD_FILES = {  # file text -> the one line it must give (after "<file>: ")
    "bomb": ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
        for i in range(9)), r"line \d+: \w: expands to more than 100,000 values \(aliases of aliases\?\)"),
    "deep": ("runconfig: " + "[" * 5000 + "]" * 5000 + "\n", r"nested too deeply \(more than 32 levels\)"),
    "deep but parseable": ("runconfig: " + "[" * 40 + "]" * 40 + "\n",
                           r"line 1: runconfig(\[0\])+: nested too deeply \(more than 32 levels\)"),
    "recursive": ("a: &a [1, *a]\n", r"line 1: a\[1\]: contains itself \(a recursive alias\)"),
    "duplicate": (yaml.safe_dump(BASE, sort_keys=False) + "runconfig:\n  max_steps: 9\n",
                  r"line \d+: duplicate key runconfig \(first at line \d+\)"),
    "duplicate inside": ("runconfig:\n  max_steps: 5\n  num_csx: 2\n  max_steps: 50\n",
                         r"line 4: duplicate key runconfig.max_steps \(first at line 2\)"),
    "empty": ("", r"expected a mapping of sections \(train_input, model, optimizer, runconfig; or trainer\), got nothing"),
    "a list": ("- 1\n- 2\n", r"expected a mapping of sections .*, got list"),
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_hostile_or_malformed_yaml_is_one_line_naming_the_file(tmp_path, name):
    text, says = BAD_FILES[name]
    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(ParamsError) as err:
        load(f, ["runconfig.num_csx=2"])  # what --set and --num_csx add
    assert re.fullmatch(f"{re.escape(str(f))}: {says}", str(err.value)), str(err.value)


def test_a_params_file_that_is_not_utf8_is_named(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_bytes(yaml.safe_dump(BASE).encode() + b"# caf\xe9\n")
    with pytest.raises(ParamsError, match=re.escape(f"{f}: not UTF-8 text (byte 0xe9 at offset ")):
        load(f)


@pytest.mark.parametrize("override,match", [
    ("optimizer.weight_decay=.nan", "optimizer.weight_decay: expected a number >= 0, got nan"),
    ("optimizer.eps=.inf", "optimizer.eps: expected a number >= 0, got inf"),
    ("optimizer.max_gradient_norm=.inf", "optimizer.max_gradient_norm: expected a number > 0"),
    ("optimizer.momentum=.nan", "optimizer.momentum: expected a number >= 0, got nan"),
    ("runconfig.seed=-1", "runconfig.seed: expected an integer >= 0, got -1"),
    ("train_input.shuffle_seed=-7", "train_input.shuffle_seed: expected an integer >= 0, got -7"),
    ("model.layer_norm_epsilon=.nan", "model.layer_norm_epsilon: expected a number > 0"),
])
def test_non_finite_numbers_and_negative_seeds_are_refused(override, match):
    with pytest.raises(ParamsError, match=re.escape(match)):
        validate(apply_overrides(BASE, [override]))


def test_a_huge_value_is_shown_short():
    with pytest.raises(ParamsError) as err:
        validate(apply_overrides(BASE, ["optimizer.betas=[" + ", ".join(["0.5"] * 50_000) + "]"]))
    assert str(err.value).startswith("optimizer.betas: expected two numbers in [0, 1), got [0.5, 0.5,")
    assert len(str(err.value)) < 200


def test_set_fills_an_empty_section():
    raw = dict(BASE, eval_input=None)
    p = validate(apply_overrides(raw, ["eval_input.data_dir=e", "eval_input.batch_size=2"]))
    assert p.eval_input.batch_size == 2
    with pytest.raises(ParamsError, match=r"--set runconfig.max_steps={a: 1, a: 2}: line 1: duplicate key a \(first at line 1\)"):
        apply_overrides(BASE, ["runconfig.max_steps={a: 1, a: 2}"])


def test_hardware_constants_are_params():
    p = validate(apply_overrides(BASE, ["runconfig.hardware={io_gbps: 600}"]))
    assert p.runconfig.hardware == {"io_gbps": 600} and validate(BASE).runconfig.hardware == {}
    assert validate(apply_overrides(BASE, ["runconfig.hardware=cs3"])).runconfig.hardware == {"system": "cs3"}
    with pytest.raises(ParamsError, match="runconfig.hardware.system: expected cs2 or cs3, got 'cs9'"):
        validate(apply_overrides(BASE, ["runconfig.hardware=cs9"]))
    with pytest.raises(ParamsError, match="runconfig.hardware.io_gpbs: unknown constant"):
        validate(apply_overrides(BASE, ["runconfig.hardware.io_gpbs=1"]))
    with pytest.raises(ParamsError, match=r"runconfig.hardware.clock_hz: expected a number > 0, got inf"):
        validate(apply_overrides(BASE, ["runconfig.hardware.clock_hz=.inf"]))


def test_the_precision_is_the_models_not_a_hardware_constant():
    """runconfig.hardware.precision would be a second spelling of model.mixed_precision (and could
    time a float32 run at 2 bytes a value): refused in one line naming the key, alone or beside a
    constant, whatever its value."""
    for setting in ("runconfig.hardware={precision: fp32}", "runconfig.hardware={io_gbps: 600, precision: fp16}"):
        with pytest.raises(ParamsError) as e:
            validate(apply_overrides(BASE, [setting]))
        assert str(e.value) == ("runconfig.hardware.precision: the precision is the model's "
                                "(model.mixed_precision, model.fp16_type); remove this key"), setting


def test_a_mixture_instead_of_data_dir():
    """Model Zoo's train_input.mixture: a list of {data_dir, weight}; exactly one of it and data_dir."""
    mix = [{"data_dir": "web", "weight": 0.7}, {"data_dir": "code", "weight": 0.3}]
    p = validate({**BASE, "train_input": {"mixture": mix, "batch_size": 8}})
    assert p.train_input.data_dir is None and [dict(m) for m in p.train_input.mixture] == mix
    for train_input, match in [({"data_dir": "d", "mixture": mix}, "train_input: give one of data_dir or mixture "
                                                                   r"\(not both\)"),
                               ({}, r"train_input: give one of data_dir or mixture \(the data to read\)"),
                               ({"mixture": [{"data_dir": "d"}]}, "train_input.mixture: expected a list of"),
                               ({"mixture": [{"data_dir": "d", "weight": 0}]}, "some weight > 0"),
                               ({"mixture": [{"data_dir": "d", "weight": 1, "data_subset": "0-0.5"}]},
                                "data_subset is not built")]:
        with pytest.raises(ParamsError, match=match):
            validate({**BASE, "train_input": {**train_input, "batch_size": 8}})


def test_execution_strategy_in_both_layouts():
    from pyapi.modelzoo import flatten

    p = validate({**BASE, "runconfig": {"max_steps": 5, "execution_strategy": "auto"}})
    assert p.runconfig.execution_strategy == "auto"
    trainer = {"trainer": {"init": {"backend": {"backend_type": "CSX", "cluster_config": {"execution_strategy": "pipeline"}},
                                    "model": dict(BASE["model"]), "optimizer": {"AdamW": {}},
                                    "schedulers": [{"ConstantLR": {"learning_rate": 1e-3}}],
                                    "loop": {"max_steps": 5}},
                           "fit": {"train_dataloader": dict(BASE["train_input"])}}}
    assert validate(trainer).runconfig.execution_strategy == "pipeline"
    with pytest.raises(ParamsError, match="runconfig.execution_strategy: expected one of weight_streaming, pipeline, auto"):
        validate({**BASE, "runconfig": {"max_steps": 5, "execution_strategy": "layer_pipelined"}})


def test_every_spec_field_carries_a_constraint_and_its_help():
    """The one validator walks every section and family: each field says what it takes and what it is for,
    and no key is both a field and a Model Zoo fate of the same spec."""
    from dataclasses import fields as dc_fields

    from mpi_launch.spec import SECTIONS
    from wse_core.checks import Constraint
    from wse_core.nn.config import CONFIGS

    for cls in {*SECTIONS.values(), *CONFIGS.values()}:
        for f in dc_fields(cls):
            assert isinstance(f.metadata.get("check"), Constraint) and f.metadata.get("help"), (cls.__name__, f.name)
        assert not {f.name for f in dc_fields(cls)} & set(cls.ZOO), cls.__name__


def test_a_count_and_its_noun_agree():
    """One helper for every count a message prints ("1 HDF5 files", "1 micro-batches" and "4 CS-2" were seen)."""
    from wse_core.checks import plural

    assert [plural(n, "HDF5 file") for n in (1, 24)] == ["1 HDF5 file", "24 HDF5 files"]
    assert [plural(n, "micro-batch") for n in (1, 3)] == ["1 micro-batch", "3 micro-batches"]
    assert [plural(n, "CS-2") for n in (1, 4)] == ["1 CS-2", "4 CS-2s"]
    assert plural(1200, "step") == "1,200 steps" and plural(0, "key") == "0 keys"


def test_a_set_without_its_equals_sign_is_one_line_and_exit_1(tmp_path):
    """`--set k 5` gave the top-level usage and exit 2 (argparse blamed the 5); it is a params value's
    mistake, said in one line naming the --set and the form it takes, exit 1, as the README promises.
    What argparse itself cannot read keeps argparse's usage and exit 2."""
    import subprocess
    import sys

    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(BASE))
    for argv in (["--set", "runconfig.max_steps", "5"], ["--set", "runconfig.max_steps"]):
        proc = subprocess.run([sys.executable, "-m", "pyapi.cli", "compile", str(f), *argv], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 1 and proc.stderr.splitlines() == [
            "wse compile: error: --set runconfig.max_steps: expected key.path=value as one argument (no spaces "
            "around =)"], proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pyapi.cli", "compile", str(f), "--set", "runconfig.max_steps=5",
                           "extra"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == "wse compile: error: unrecognized arguments: extra"


def test_a_run_directory_stands_for_its_params_and_another_directory_is_named(tmp_path):
    """`wse validate runs/x` said "cannot read (Is a directory)": a run's directory holds its resolved
    params.yaml, which every command that takes a params file reads in its place."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "params.yaml").write_text(yaml.safe_dump(BASE))
    assert load(tmp_path / "run") == validate(BASE)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ParamsError, match=r"^\S+/empty: a directory, not a params file \(a run's model_dir holds "
                                          r"its params as params.yaml; this one has none\)$"):
        load(tmp_path / "empty")


@pytest.mark.parametrize("num_csx,fanout,differ", [(1, 2, False), (2, 2, False), (4, 2, False), (3, 2, True),
                                                   (3, 4, False)])
def test_a_num_csx_whose_sums_are_its_own_is_said(num_csx, fanout, differ):
    """`--num_csx 3` trained without a word that its bits differ from 1, 2 and 4 CS-2s (docs/design.md
    section 5, (a)): said in one warning when the params are validated, where num_csx and the
    micro-batch size are resolved; 1, 2, 4, and 3 under a SwarmX node of 4 children, are the reference's.
    `wse compile` prints it in its plan instead (and serving, `--inference`, does not train)."""
    raw = apply_overrides(BASE, ["train_input.batch_size=12", f"runconfig.num_csx={num_csx}",
                                 f"runconfig.swarmx_fanout={fanout}"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(raw)
        check(raw, compile_only=True)
    said = [str(w.message) for w in caught if "runconfig.num_csx" in str(w.message)]
    assert said == ([f"params: runconfig.num_csx: 3 CS-2s (1 micro-batch each, SwarmX fan-out {fanout}) sum the "
                     "gradients in another order than one process: the weights' bits differ from the "
                     "single-process reference's and from those of 1, 2 or 4 CS-2s (the same bits need a power of "
                     "two of micro-batches per CS-2, and num_csx at most swarmx_fanout or both powers of two; "
                     "docs/design.md section 5)"] if differ else [])


#: A size beyond wse-cluster's bounds -> what its one line says (each value a step past its bound).
BEYOND = {
    "model.num_hidden_layers=1025": "model.num_hidden_layers: 1025 is more than 1,024, wse-cluster's bound on layers",
    "model.hidden_size=1048578": "model.hidden_size: 1048578 is more than 1,048,576, wse-cluster's bound on a width",
    "model.num_heads=1048577": "model.num_heads: 1048577 is more than 1,048,576, wse-cluster's bound on a width",
    "model.filter_size=1048577": "model.filter_size: 1048577 is more than 1,048,576, wse-cluster's bound on a width",
    "model.vocab_size=4194305": "model.vocab_size: 4194305 is more than 4,194,304, wse-cluster's bound on a vocabulary",
    "model.max_position_embeddings=16777217": "model.max_position_embeddings: 16777217 is more than 16,777,216, "
                                              "wse-cluster's bound on positions",
    "train_input.batch_size=1048577": "train_input.batch_size: 1048577 is more than 1,048,576, wse-cluster's bound "
                                      "on a batch's samples",
    "runconfig.max_steps=1000000001": "runconfig.max_steps: 1000000001 is more than 1,000,000,000, wse-cluster's "
                                      "bound on steps",
    "runconfig.checkpoint_steps=1000000001": "runconfig.checkpoint_steps: 1000000001 is more than 1,000,000,000",
    "runconfig.num_csx=2049": "runconfig.num_csx: 2049 is more than 2,048, wse-cluster's bound on CS-2s",
    "runconfig.num_wgt_servers=2049": "runconfig.num_wgt_servers: 2049 is more than 2,048, wse-cluster's bound on "
                                      "MemoryX servers",
    "runconfig.num_workers_per_csx=65": "runconfig.num_workers_per_csx: 65 is more than 64, wse-cluster's bound on "
                                        "input workers per CS-2",
    "runconfig.peer_timeout=604801": "runconfig.peer_timeout: 604801 is more than 604,800, wse-cluster's bound on a "
                                     "wait",
    "train_input.micro_batch_size=1": "train_input.micro_batch_size: 1 deals each CS-2's 1,025 samples in 1,025 "
                                      "micro-batches a step, more than 1,024, wse-cluster's bound on micro-batches",
}


@pytest.mark.parametrize("override", BEYOND)
def test_every_size_has_a_bound_that_names_itself(override):
    """A size past its bound is one line naming the key, the bound and whose it is, before anything is
    laid out: sizes no real run reaches, which took minutes to fail or all memory."""
    raw = apply_overrides(BASE, ["train_input.batch_size=2050", override])
    with pytest.raises(ParamsError) as err:
        validate(raw)
    assert str(err.value).startswith(BEYOND[override]) and "\n" not in str(err.value), str(err.value)


def test_an_mlp_has_the_bound_on_layers_too():
    """fc_mlp's layers are its hidden sizes and the classes' layer: as many as a decoder's blocks may be."""
    mlp = {"name": "fc_mlp", "input_size": 4, "hidden_sizes": [2] * 1023, "num_classes": 2}
    validate({**BASE, "model": mlp})
    with pytest.raises(ParamsError, match=r"^model.hidden_sizes: 1,024 hidden layers and the last make more than "
                                          r"1,024, wse-cluster's bound on layers"):
        validate({**BASE, "model": {**mlp, "hidden_sizes": [2] * 1024}})


def wse_cli(*args, cwd=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pyapi.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=60, cwd=cwd)  # a bound only a hang reaches: each is refused within a second


@pytest.mark.parametrize("command,override,said", [
    ("compile", "model.num_hidden_layers=1000000", "model.num_hidden_layers: 1000000 is more than 1,024"),
    ("fit", "model.num_hidden_layers=1000000", "model.num_hidden_layers: 1000000 is more than 1,024"),
    ("compile", "runconfig.num_workers_per_csx=100000", "runconfig.num_workers_per_csx: 100000 is more than 64"),
    ("compile", "train_input.batch_size=1000000000", "train_input.batch_size: 1000000000 is more than 1,048,576"),
    ("fit", "train_input.batch_size=1000000000", "train_input.batch_size: 1000000000 is more than 1,048,576"),
    ("compile", "runconfig.max_steps=" + "1" + "0" * 30, "runconfig.max_steps: 1000000000000000000000000000000 is "
                                                         "more than 1,000,000,000"),
])
def test_issue_42s_sizes_are_refused_in_one_line(tmp_path, command, override, said):
    """The fault campaign's sizes spun for minutes (a million decoder blocks, 100,000 input workers) or
    were taken (a batch of 10^9 samples, whose ranks died of a MemoryError; 10^30 steps): one line each."""
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(BASE))
    proc = wse_cli(command, f, "--set", override, "--set", f"runconfig.model_dir={tmp_path / 'run'}")
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1].startswith(f"wse {command}: error: {said}"), \
        proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_params_reader_reads_regular_files_only_and_up_to_a_size(tmp_path):
    """`wse compile /dev/zero` read until memory ran out and a FIFO blocked forever: what is not a
    regular file is refused before a byte is read, and a file past MAX_BYTES is read no further."""
    import os

    from pyapi.params import MAX_BYTES

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # no writer: opening it to read would wait forever
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump(BASE) + "#" * MAX_BYTES)
    for path, said in ((fifo, "a FIFO, not a params file (a regular YAML file)"),
                       ("/dev/zero", "a character device, not a params file (a regular YAML file)"),
                       (big, "more than 1,048,576 bytes, wse-cluster's bound on a params file (a real one has a "
                             "few kilobytes)")):
        for command in ("compile", "fit"):
            proc = wse_cli(command, path)
            assert proc.returncode == 1 and proc.stderr.splitlines() == [f"wse {command}: error: {path}: {said}"], \
                proc.stderr
    big.write_text(yaml.safe_dump(BASE) + "#" * (MAX_BYTES - len(yaml.safe_dump(BASE))))  # at the bound: read
    assert load(big) == validate(BASE)
