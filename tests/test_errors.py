"""One error root (issue 43): every exception of the project is a ``WseError`` of a kind that is also the
builtin it replaces, and the command line turns that root into one line while a bug keeps its traceback."""
import importlib
import inspect
import pkgutil

import pytest

from pyapi.cli import main
from wse_core.errors import ConfigError, ConfigTypeError, DataError, JobError, PlanError, WseError

PACKAGES = ("wse_core", "data_tools", "mpi_launch", "pyapi", "bench")

#: The exceptions that are not a WseError, each for its reason. Warnings are left out by rule: they are
#: shown, not raised (DataWarning, ParamsWarning, OutputLost).
ALLOWED = {
    # A signal turned into an exception that unwinds the launcher: a BaseException so that no `except
    # Exception` on its way (a rank's, a cleanup's) swallows it; `wse fit` turns it into exit 130.
    "mpi_launch.launcher.JobInterrupted",
    # `wse doctor`'s control flow: a check's failure, caught by doctor.main and printed as that check's
    # row; it never leaves the module.
    "pyapi.doctor.Problem",
    # An HTTP answer (status, OpenAI's error fields) that the server writes as JSON to its client; it
    # never reaches the command line, and a 4xx and a 500 are no one kind.
    "pyapi.openai_api.ApiError",
}


def project_exceptions():
    """{qualified name: class} of every exception class defined in the project's modules (imported)."""
    found = {}
    for package in PACKAGES:
        names = [package] + [m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__,
                                                                   package + ".")]
        for name in names:
            if name.rsplit(".", 1)[-1] == "__main__":  # a script: importing it runs it
                continue
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as exc:  # an optional extra not installed: its module cannot be read
                if (exc.name or "").split(".")[0] in PACKAGES:
                    raise
                continue
            for cls in vars(module).values():
                if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == name:
                    found[f"{name}.{cls.__qualname__}"] = cls
    return found


def test_every_exception_of_the_project_is_a_wse_error_or_allowed_by_name():
    """Walking every module of the five packages: each exception class derives from WseError, is a
    warning, or is in ALLOWED (with its reason); and ALLOWED names only classes that exist."""
    found = project_exceptions()
    assert {"pyapi.params.ParamsError", "mpi_launch.inference.InferenceJobError",
            "data_tools.errors.CheckpointError"} <= set(found)  # the walk did reach the floors
    outside = sorted(name for name, cls in found.items()
                     if not issubclass(cls, (WseError, Warning)) and name not in ALLOWED)
    assert not outside, f"not a WseError (derive from a kind of wse_core.errors, or allow with a reason): {outside}"
    assert ALLOWED <= set(found), ALLOWED - set(found)


@pytest.mark.parametrize("kind,builtin", [(ConfigError, ValueError), (ConfigTypeError, TypeError),
                                          (DataError, ValueError), (PlanError, ValueError),
                                          (JobError, RuntimeError)])
def test_each_kind_is_the_builtin_it_replaces(kind, builtin):
    """A caller or test written against the builtin (``except ValueError``) still catches the kind."""
    assert issubclass(kind, WseError) and issubclass(kind, builtin)


def test_the_old_names_are_the_kinds_or_subclasses_of_them():
    """Each class keeps its import path, and sits under the kind that says what went wrong."""
    from data_tools.errors import CheckpointError
    from data_tools.errors import DataError as DataErrorOfDataTools
    from mpi_launch import MPILaunchError
    from mpi_launch.inference import InferenceJobError
    from mpi_launch.plan import PlanError as PlanErrorOfPlan
    from pyapi.errors import ApplianceError, RequestError
    from pyapi.job import JobError as JobErrorOfJob
    from pyapi.params import ParamsError
    from wse_core.compiler import CompileError
    from wse_core.fabric import FabricError

    assert DataErrorOfDataTools is DataError and PlanErrorOfPlan is PlanError
    assert issubclass(CheckpointError, DataError)
    assert all(issubclass(c, ConfigError) for c in (ParamsError, CompileError, FabricError, RequestError))
    assert all(issubclass(c, JobError) for c in (MPILaunchError, InferenceJobError, ApplianceError, JobErrorOfJob))
    assert not issubclass(InferenceJobError, JobErrorOfJob)  # `except pyapi.job.JobError` catches a training's only


@pytest.mark.parametrize("error", [ConfigError("--x: expected 1"), DataError("f.h5: damaged"),
                                   PlanError("runconfig.num_csx: too many"), JobError("rank 3: killed"),
                                   OSError(28, "No space left on device")])
def test_a_wse_error_or_an_os_error_is_one_line_and_exit_1(error, monkeypatch, capsys):
    """The root and the system's errors are what a user acts on: one line naming the command, exit 1."""
    import pyapi.cli.plot

    def fail(args):
        raise error

    monkeypatch.setattr(pyapi.cli.plot, "_cmd_plot", fail)
    assert main(["plot", "run"]) == 1
    assert capsys.readouterr().err.splitlines() == [f"wse plot: error: {error}"]


@pytest.mark.parametrize("bug", [TypeError("unsupported operand type(s) for +: 'int' and 'str'"),
                                 ValueError("too many values to unpack"), KeyError("step")])
def test_a_bug_is_not_swallowed_into_one_line(bug, monkeypatch, capsys):
    """A plain TypeError (or ValueError, KeyError) is a bug's: main() lets it through, so Python prints
    its traceback (the CLI used to catch TypeError and ValueError and print them as a user's mistake)."""
    import pyapi.cli.plot

    def fail(args):
        raise bug

    monkeypatch.setattr(pyapi.cli.plot, "_cmd_plot", fail)
    with pytest.raises(type(bug)):
        main(["plot", "run"])
    assert "error:" not in capsys.readouterr().err


def test_a_real_refusal_is_still_one_line(tmp_path, capsys):
    """Unpatched: `wse plot` on a directory that is no run says so in one line (a DataError)."""
    assert main(["plot", str(tmp_path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"wse plot: error: {tmp_path}: not a run directory (no metrics.jsonl in it)"]


def test_a_failed_inference_job_of_wse_generate_is_one_line(tmp_path, monkeypatch, capsys):
    """`wse generate --num_csx 2` whose inference job fails (its ClusterEngine raising what a dead rank
    makes it raise) prints the job's line and exits 1; it printed a traceback before the root."""
    import yaml

    import mpi_launch.inference
    from data_tools.checkpoint import save_checkpoint
    from mpi_launch.inference import InferenceJobError
    from wse_core.models import build_model

    cfg = {"name": "gpt2", "vocab_size": 61, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
           "filter_size": 48, "max_position_embeddings": 24}
    path = save_checkpoint(tmp_path / "run", 1, [(build_model(cfg).init_params(0), {})],
                           params_yaml=yaml.safe_dump({"model": cfg}))
    line = "the inference job on 2 CS-2s failed: rank 5 (csx 1): killed by SIGKILL (its logs: logs)"

    class Dead:
        def __init__(self, *args, **kwargs):
            raise InferenceJobError(line)

    monkeypatch.setattr(mpi_launch.inference, "ClusterEngine", Dead)
    assert main(["generate", str(path), "--prompt", "[1, 2, 3]", "--num_csx", "2"]) == 1
    assert capsys.readouterr().err.splitlines() == [f"wse generate: error: {line}"]
