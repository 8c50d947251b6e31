"""The `wse` command line: version, help, doctor (a real 2-rank MPI job) and bench."""
import argparse
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pyapi.doctor
from bench.optim import HPARAMS, numpy_adamw
from mpi_launch import MPILaunchError, find_mpiexec
from pyapi.cli import main
from wse_core.optim import AdamW


def wse(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "pyapi.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_version():
    proc = wse("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("wse-cluster ")


@pytest.mark.parametrize("cmd", [[], ["doctor"], ["demo"], ["bench"], ["bench", "optim"], ["bench", "nn"],
                                 ["bench", "input"], ["data"], ["data", "preprocess"], ["data", "inspect"],
                                 ["data", "verify"], ["checkpoint"], ["checkpoint", "info"],
                                 ["checkpoint", "verify"], ["checkpoint", "convert"], ["serve"]])
def test_help_on_every_command(cmd):
    proc = wse(*cmd, "--help")
    assert proc.returncode == 0 and "usage: wse" in proc.stdout


def test_help_imports_nothing_heavy_and_the_bench_table_matches_the_modules():
    """`wse --help` and `wse bench --help` load no numerics (and no benchmark; of data_tools only its
    constants, of wse_core only the error root); each benchmark's one-line help in the table is its
    module's docstring."""
    import importlib

    from bench import BENCHMARKS

    code = ("import sys\nfrom pyapi.cli import main\n"
            "for argv in (['--help'], ['bench', '--help'], ['fit', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('numpy', 'h5py', 'mpi4py', 'wse_core', 'bench', 'data_tools', 'yaml') and m not in "
            "('bench', 'data_tools', 'wse_core', 'wse_core.errors')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr
    for name, (module, summary) in BENCHMARKS.items():
        assert importlib.import_module(module).__doc__.splitlines()[0] == summary, name


def test_importing_wse_core_leaves_the_process_alone():
    """No environment variable set and BLAS threads as they were, even after a product; configure_process()
    is what sets them (and matmul's bits do not depend on it)."""
    code = """
import os, numpy as np
from threadpoolctl import threadpool_info
blas = lambda: [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
before = blas()
import wse_core, wse_core.nn, wse_core.optim, wse_core.sparse
from wse_core.nn.gemm import matmul
a = np.random.default_rng(0).standard_normal((300, 64), dtype=np.float32)
b = np.random.default_rng(1).standard_normal((64, 96), dtype=np.float32)
free = matmul(a, b)
print("OMP_WAIT_POLICY" in os.environ, blas() == before)
wse_core.configure_process()
print(os.environ["OMP_WAIT_POLICY"], set(blas()), matmul(a, b).tobytes() == free.tobytes())
"""
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS",
                                                                          "OMP_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["False True", "PASSIVE {1} True"], proc.stdout + proc.stderr


def test_configure_process_keeps_freed_memory_for_the_next_allocation():
    """A pass's activations are allocated and freed again every pass: after configure_process() the
    second pass of 600 MB finds its pages mapped already (before it, glibc gives them back and every
    page faults in again; Linux's minor-fault count, glibc only)."""
    code = """
import resource, numpy as np, wse_core
def faults_of_a_pass():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.ones(150 << 18, np.float32) for _ in range(4)]  # 4 x 150 MB, written
    del arrays
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_pass()
print(faults_of_a_pass())
wse_core.configure_process()
faults_of_a_pass()
print(faults_of_a_pass())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    unconfigured, configured = map(int, proc.stdout.split())
    # 600 MB is 150,000 pages of 4 KiB, or 286 huge pages of 2 MiB where the kernel gives those
    assert unconfigured > 250 and configured < 50, proc.stdout


def test_unknown_command_is_one_clear_error():
    proc = wse("frobnicate")
    assert proc.returncode == 2 and "invalid choice: 'frobnicate'" in proc.stderr


@pytest.mark.parametrize("argv,said", [(["fitt"], "invalid choice: 'fitt' (did you mean fit?)"),
                                       (["data", "inspct", "x"], "invalid choice: 'inspct' (did you mean inspect?)")])
def test_a_mistyped_command_is_answered_with_the_closest_one(argv, said):
    proc = wse(*argv)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].endswith(said), proc.stderr


@functools.lru_cache(maxsize=None)
def every_parser():
    """(words, parser) of every command down to its actions (`wse checkpoint info`), each parser built as
    for its own command line (a benchmark's options and `wse fabric run` are added only for theirs)."""
    from pyapi.cli import build_parser

    out, todo = [], [()]
    while todo:
        words = todo.pop(0)
        parser = build_parser(list(words))
        for word in words:
            parser = subcommands(parser)[word]
        out.append((words, parser))
        todo += [words + (name,) for name in subcommands(parser)]
    return tuple(out)


def subcommands(parser):
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


#: What names the code rather than what it does: a module, a page of the design notes.
INTERNALS = re.compile(r"\b(wse_core|pyapi|mpi_launch|data_tools|bench)\.\w|docs/\w+\.md|JOB_BYTES")


def test_every_command_says_what_it_does_and_what_its_arguments_are():
    """Every command and action has a description, every positional argument (the command's name too) a
    help text, and none of them names the code behind it."""
    walked = every_parser()
    assert {"fit", "compile", "appliance start", "data preprocess", "checkpoint info", "fabric run",
            "bench peers"} <= {" ".join(words) for words, _ in walked}
    for words, parser in walked:
        assert parser.description and parser.description.strip(), f"wse {' '.join(words)}: no description"
        for action in parser._actions:
            if not action.option_strings:
                assert action.help, f"wse {' '.join(words)}: {action.metavar or action.dest} has no help"
        if words[:1] == ("bench",) and len(words) == 2:
            continue  # a benchmark's help is its module's docstring: the method behind its figures, code named
        said = "\n".join([parser.description, *(a.help or "" for a in parser._actions)])
        assert not INTERNALS.search(said), f"wse {' '.join(words)}: {INTERNALS.search(said)[0]}"


def test_every_option_of_several_words_takes_both_spellings():
    """--num_csx and --num-csx on every command, the commands plugged in too: the same option, the same
    value; help shows the underscore spelling only."""
    def value(action):
        """A value the action takes that is not its default."""
        return next(str(v) for v in (action.choices or ("11", "12")) if str(v) != str(action.default))

    def given(action, spelling):
        return [spelling] if action.nargs == 0 else [spelling, value(action)]

    checked = 0
    for words, parser in every_parser():
        if subcommands(parser):
            continue  # a group: its actions are commands of their own
        for action in parser._actions:
            for name in [s for s in action.option_strings if s.startswith("--") and re.search(r"\w[-_]\w", s)]:
                under, hyphen = "--" + name[2:].replace("-", "_"), "--" + name[2:].replace("_", "-")
                assert under in action.option_strings and hyphen not in action.option_strings, name
                rest = [value(a) for a in parser._actions if not a.option_strings]
                for other in parser._actions:
                    if other.required and other.option_strings and other is not action:
                        rest += given(other, other.option_strings[0])
                parsed = [vars(parser.parse_args(rest + given(action, spelling))) for spelling in (under, hyphen)]
                assert parsed[0] == parsed[1] and parsed[0][action.dest] != action.default, (words, name)
                checked += 1
    assert checked > 40


def test_bare_wse_prints_the_help():
    """`wse` alone answers as `wse --help` does: the help on standard output, exit 0."""
    bare, helped = wse(), wse("--help")
    assert bare.returncode == 0 and bare.stdout == helped.stdout and bare.stdout.startswith("usage: wse ")
    assert bare.stderr == ""


@pytest.mark.parametrize("argv,said", [
    (["fit", "p.yaml", "--bogus"], "wse fit: error: unrecognized arguments: --bogus"),
    (["fit", "p.yaml", "--num-csx", "two"], "wse fit: error: argument --num_csx: invalid int value: 'two'"),
    (["checkpoint", "info", "x", "--bogus"], "wse checkpoint info: error: unrecognized arguments: --bogus"),
    (["appliance", "start", "--num_csx"], "wse appliance start: error: argument --num_csx: expected one argument")])
def test_a_mistake_in_a_commands_arguments_is_answered_with_its_usage(argv, said, capsys):
    """The usage printed with the error is the command's (and its action's), not the top level's."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    command = said.split(":")[0]
    assert exit.value.code == 2 and err.startswith(f"usage: {command} [-h]") and err.splitlines()[-1] == said, err


@pytest.mark.parametrize("extra", [[], ["--set", "train_input.micro_batch_size=explore"], ["--inference"],
                                   ["--inference", "--batch", "4", "--prompt-tokens", "16", "--new_tokens", "8"]])
def test_job_compile_returns_the_report_wse_compile_prints(extra, monkeypatch):
    """`Job(...).compile()` is `wse compile`: the same lines, the same JSON, the figures readable as fields
    (a training's, with every micro-batch size when the params explore them, or serving's)."""
    from pyapi.job import CompileReport, InferenceReport, Job

    monkeypatch.chdir(EXAMPLES.parent)  # the examples' data directories are the repository root's
    argv = ["compile", "examples/gpt2_small.yaml", "--num_csx", "4", *extra]
    text, as_json = (subprocess.run([sys.executable, "-m", "pyapi.cli", *argv, *more], capture_output=True,
                                    text=True, timeout=120) for more in ([], ["--json"]))
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
    explore = "--set" in extra  # the file's micro_batch_size is auto, which explore searches from
    job = Job.from_yaml("examples/gpt2_small.yaml", num_csx=4)
    if "--inference" in extra:
        sizes = dict(batch=4, prompt_tokens=16, new_tokens=8) if "--batch" in extra else {}
        report = job.compile(inference=True, **sizes)
        assert isinstance(report, InferenceReport)
        assert f"time per output token {report.latency.tpot_s * 1e3:.3f} ms" in text.stdout
        assert f"{report.latency.tokens_per_s_user:.1f} tokens/s per user" in text.stdout
    else:
        report = job.compile(explore=explore)
        assert isinstance(report, CompileReport) and (report.micro_batches is not None) == explore
        assert f"{report.model['parameters']:,} parameters" in text.stdout
        assert f"{report.plan['world_size']} MPI ranks" in text.stdout
        assert f"{report.step_s * 1e3:.3f} ms, {report.samples_per_s:.1f} samples/s" in text.stdout
        assert report["plan"]["roles"] == report.plan["roles"]  # read as the dict compile() returned before
    assert text.stdout == f"{report}\n" and json.loads(as_json.stdout) == json.loads(json.dumps(report.to_dict()))


def test_a_benchmark_sets_the_process_up_before_its_kernels_load():
    """The benchmark's module loads the kernels when the command line reads its options: no warning
    that configure_process() came too late (as a user's shell, without the tests' OMP_WAIT_POLICY)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run([sys.executable, "-m", "pyapi.cli", "bench", "optim", "--size", "1000", "--repeats", "1"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr


def test_a_reader_that_leaves_ends_wse_quietly(tmp_path):
    """`wse ... | head`: once the reader has closed the pipe, wse ends with status 1 and says
    nothing (as other command-line tools do); an error of its own is still one line."""
    from data_tools.preprocess import preprocess_text

    preprocess_text(["stdlib"], tmp_path / "lm", 16, samples_per_file=500, progress=False)
    for args, err in [(["data", "inspect", str(tmp_path / "lm")], ""),
                      (["data", "inspect", str(tmp_path / "none")], "wse data: error: ")]:
        proc = subprocess.Popen([sys.executable, "-m", "pyapi.cli", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        proc.stdout.close()  # before wse has written anything: its first write meets a reader gone
        assert proc.wait(timeout=120) == 1
        said = proc.stderr.read()
        assert said.startswith(err) and len(said.splitlines()) == (1 if err else 0), said


def test_mpiexec_comes_from_the_mpich_wheel():
    """The mpiexec found is the wheel's, in this environment's scripts directory, not PATH's."""
    import importlib.metadata
    import sysconfig
    from pathlib import Path

    path = find_mpiexec()
    wheel_files = {Path(importlib.metadata.distribution("mpich").locate_file(f)).resolve()
                   for f in importlib.metadata.distribution("mpich").files}
    assert path in wheel_files
    assert path.parent == Path(sysconfig.get_path("scripts")).resolve()


def test_doctor_runs_a_real_two_rank_job():
    proc = wse("doctor")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "mpi hello: 2 ranks ok" in out
    for label in ("python", "numpy", "openmp", "h5py", "mpiexec", "MPI library"):
        assert label in out
    assert "HDF5" in out and "BLAS" in out and str(find_mpiexec()) in out


def test_doctor_reports_a_broken_mpi_in_one_line(monkeypatch, capsys):
    def missing():
        raise MPILaunchError("the mpich wheel is not installed in this Python environment")

    monkeypatch.setattr(pyapi.doctor, "find_mpiexec", missing)
    monkeypatch.setattr(pyapi.doctor, "run_mpi", lambda *a, **k: (_ for _ in ()).throw(
        MPILaunchError("cannot start mpiexec")))
    assert pyapi.doctor.main() == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("wse doctor: 2 problem(s); first: mpiexec: the mpich wheel is not installed")


def test_bench_optim_writes_json(tmp_path):
    """A small run has every reported key, with positive figures (no timing is asserted)."""
    out = tmp_path / "optim.json"
    proc = wse("bench", "optim", "--size", "200000", "--repeats", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["size"] == 200000 and result["machine"]["cores"] >= 1
    for key in ("speedup_vs_numpy", "fraction_of_copy_bandwidth"):
        assert result[key] > 0
    assert set(result["median_seconds"]) == {"fused_adamw", "numpy_adamw", "copy_numpy", "copy_openmp"}
    assert "speedup vs numpy" in proc.stdout


def test_bench_rejects_bad_size(capsys):
    assert main(["bench", "optim", "--size", "0"]) == 1
    assert "wse bench: error: --size and --repeats must be >= 1" in capsys.readouterr().err


def test_bench_numpy_baseline_is_the_same_update(rng):
    """The numpy baseline computes what the fused kernel computes, so the speedup compares like with like."""
    p = rng.standard_normal(5000)
    grads = [rng.standard_normal(5000) for _ in range(3)]
    p1, m1, v1 = p.copy(), np.zeros(5000), np.zeros(5000)
    p2 = p.copy()
    opt, state = AdamW(**HPARAMS), AdamW(**HPARAMS).init_state(p2)
    for t, g in enumerate(grads, start=1):
        numpy_adamw(p1, g, m1, v1, step=t, **HPARAMS)
        opt.update(p2, g, state, step=t)
    np.testing.assert_allclose(p1, p2, rtol=1e-13)


def test_bench_nn_writes_json(tmp_path):
    """One repetition, profiled, has every reported key and positive figures (no timing is asserted)."""
    out = tmp_path / "nn.json"
    proc = wse("bench", "nn", "--repeats", "1", "--profile", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["block"]["hidden"] == 256 and result["block"]["seq"] == 256
    assert result["block_speedup_vs_numpy"] > 0 and result["model_speedup_vs_numpy"] > 0
    assert result["median_seconds"]["block_fused_bf16"] > 0
    from wse_core.nn import _kernels
    if _kernels.bf16_native():  # the block's products in both ways
        assert result["median_seconds"]["products_bf16"] > 0 and result["median_seconds"]["products_blas"] > 0
    assert {"wse_core", "wse_core bfloat16"} <= set(result["profile"])
    if "torch" in result:  # the PyTorch block computes the same function as ours
        assert result["block_max_abs_diff_vs_torch"] < 1e-3
        assert result["block_bf16_speedup_vs_torch"] > 0
        assert {"torch", "torch autocast bfloat16"} <= set(result["profile"])
    for rows in result["profile"].values():
        assert rows[-1][0] == "everything else" and all(ms >= 0 for _, ms in rows)


def test_bench_input_on_a_given_dataset(tmp_path):
    """The loader benchmark on a small dataset reports every figure (no timing is asserted)."""
    from data_tools.lmdata import write_lm_file

    (tmp_path / "d").mkdir()
    for i in range(3):
        write_lm_file(tmp_path / "d" / f"data-{i}.h5", np.random.default_rng(i).integers(0, 9, (40, 3, 16)).astype(np.int32))
    out = tmp_path / "input.json"
    proc = wse("bench", "input", "--data", str(tmp_path / "d"), "--batch_size", "8", "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["n_examples"] == 120 and result["files"] == 3
    assert all(v > 0 for v in result["mb_per_s"].values()) and "preprocess" not in result


def test_bench_serve_answers_every_request_and_makes_transformers_token_counts(tmp_path):
    """`wse bench serve`, small: every request answered, as many tokens as transformers made from the
    same weights and prompts (one at a time and batched), and the emulated hardware's figure beside."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("transformers")
    out = tmp_path / "s.json"
    proc = wse("bench", "serve", "--requests", "3", "--clients", "2", "--new_tokens", "5", "--json", str(out),
               timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["serve_tokens"] == r["hf_alone_tokens"] == r["hf_batched_tokens"] == 15
    assert r["serve_tokens_per_s"] > 0 and 0 < r["simulated_s_per_token"] < r["wall_s_per_token"]
    assert "wse serve, 2 clients" in proc.stdout


def test_bench_scaling_from_the_model(tmp_path):
    """`wse bench scaling` (model only): every shape and CS-2 count, speed-ups against one CS-2."""
    out = tmp_path / "s.json"
    proc = wse("bench", "scaling", "--real", "", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert len(result["models"]) == 4 and result["counts"] == [1, 2, 4, 8, 16, 32, 64, 192]
    for m in result["models"].values():
        fixed = m["per_csx_fixed"]
        assert fixed["16"]["samples_per_s"] >= 0.9 * 16 * fixed["1"]["samples_per_s"]
    assert "(b) global batch 512" in proc.stdout and "GPT-NeoX 20B" in proc.stdout


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_each_shipped_example_compiles_without_a_warning_of_python(name, jobs):
    """Every params file in examples/ passes the params checks and plans a cluster (`wse compile` needs
    no data), from the repository's root as the README runs it."""
    proc = jobs.run("compile", f"examples/{name}", cwd=EXAMPLES.parent)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in said and "Warning" not in proc.stderr, said
    assert "simulated step" in proc.stdout, proc.stdout




@pytest.mark.parametrize("problem", ["vocabulary", "sequence length", "format", "no examples", "eval data", "absent"])
def test_compile_refuses_the_data_fit_refuses_and_plans_without_data(tmp_path, problem):
    """`wse compile` ran none of the data checks of `wse fit`, and planned runs that could not train: data
    that is there is checked as fit checks it, in the same line; data not there yet is left to the run."""
    from test_data import modelzoo_dir

    modelzoo_dir(tmp_path / "lm", vocab=50, seq=16)
    model = {"name": "gpt2", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "num_heads": 2,
             "max_position_embeddings": 16}
    p = {"train_input": {"data_dir": str(tmp_path / "lm"), "batch_size": 2}, "model": model,
         "optimizer": {"learning_rate": 1e-3}, "runconfig": {"max_steps": 1, "model_dir": str(tmp_path / "model")}}
    if problem == "vocabulary":
        model["vocab_size"] = 40
    elif problem == "sequence length":
        model["max_position_embeddings"] = 8
    elif problem == "format":
        p["model"] = {"name": "fc_mlp", "input_size": 16, "hidden_sizes": [8], "num_classes": 4}
    elif problem == "no examples":
        import h5py

        modelzoo_dir(tmp_path / "empty")
        with h5py.File(tmp_path / "empty" / "data-0.h5", "w") as f:
            f["data"] = np.zeros((0, 3, 16), np.int32)
        meta = json.loads((tmp_path / "empty" / "data_params.json").read_text())
        meta["post-process"]["n_examples"] = 0
        (tmp_path / "empty" / "data_params.json").write_text(json.dumps(meta))
        p["train_input"]["data_dir"] = str(tmp_path / "empty")
    elif problem == "eval data":
        modelzoo_dir(tmp_path / "eval", vocab=80, seq=16)
        p["eval_input"] = {"data_dir": str(tmp_path / "eval"), "batch_size": 2}
        p["runconfig"]["eval_frequency"] = 1
    else:
        p["train_input"]["data_dir"] = str(tmp_path / "not made yet")
    (tmp_path / "p.yaml").write_text(json.dumps(p))
    fit, compiled = wse("fit", str(tmp_path / "p.yaml")), wse("compile", str(tmp_path / "p.yaml"))
    assert fit.returncode == 1 and fit.stderr.startswith("wse fit: error: "), fit.stderr
    assert not (tmp_path / "model").exists()
    if problem == "absent":
        assert compiled.returncode == 0 and "simulated step" in compiled.stdout, compiled.stderr
    else:
        assert compiled.returncode == 1 and compiled.stderr.splitlines() == [
            fit.stderr.strip().replace("wse fit: ", "wse compile: ", 1)], (fit.stderr, compiled.stderr)
