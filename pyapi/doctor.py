"""`wse doctor`: what this installation is made of, and a real 2-rank MPI job through its mpiexec."""
import importlib.metadata
import json
import platform
import sys

from mpi_launch import MPILaunchError, find_mpiexec, run_mpi
# Each check imports what it examines, inside it: a broken piece (numpy, the kernels, h5py) is reported
# by its own check instead of ending `wse doctor` with a traceback.

HELLO_TIMEOUT_S = 60


class Problem(Exception):
    """A check found something broken; the message is one line saying what and how to fix it."""


def _python():
    return f"{platform.python_version()} ({sys.executable})"


def _numpy():
    from wse_core.numerics import describe, environment

    env = environment()
    variables = " ".join(f"{k}={v}" for k, v in env["variables"].items())
    return describe(env).removeprefix("numpy ") + (f" ({variables})" if variables else "")


def _openmp():
    try:
        from wse_core import openmp_info
    except ImportError as exc:
        raise Problem(f"the compiled kernels do not import ({exc}): reinstall with "
                      "`pip install -e '.[test]'`") from None
    info = openmp_info()
    if not info["openmp"]:
        return "NOT compiled in: every kernel runs on 1 thread (install a gcc with -fopenmp and reinstall)"
    return f"enabled, {info['max_threads']} threads per process"


def _bf16():
    from wse_core.nn import _kernels

    if _kernels.bf16_native():
        return "AVX512-BF16 (bfloat16 mixed precision multiplies at about twice float32's speed)"
    return "portable path (this CPU has no AVX512-BF16: bfloat16 products about 3x slower than float32's)"


def _h5py():
    try:
        import h5py
    except ImportError as exc:
        raise Problem(f"h5py does not import ({exc}): `pip install h5py`") from None
    return f"{h5py.__version__}, HDF5 {h5py.version.hdf5_version}"


def _mpi4py():
    try:
        return importlib.metadata.version("mpi4py")
    except importlib.metadata.PackageNotFoundError:
        raise Problem("mpi4py is not installed: `pip install mpi4py`") from None


def _mpiexec():
    try:
        path = find_mpiexec()
    except MPILaunchError as exc:
        raise Problem(str(exc)) from None
    return f"{path} (mpich {importlib.metadata.version('mpich')} wheel)"


def _hello(state):
    try:
        proc = run_mpi(2, [sys.executable, "-m", "mpi_launch.hello"], timeout=HELLO_TIMEOUT_S)
    except MPILaunchError as exc:
        raise Problem(str(exc)) from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Problem(f"2-rank MPI job failed (exit {proc.returncode}): {detail}")
    report = json.loads(lines[-1])
    if not report["ok"] or report["size"] != 2:
        raise Problem(f"2-rank MPI job ran but reported {report['size']} ranks or a wrong sum")
    state["library_version"] = report["library_version"]
    return "2 ranks ok"


def main():
    """Print each check; return 0 if nothing is broken, else 1 after one line naming the first problem."""
    state = {}
    checks = [("python", _python), ("numpy", _numpy), ("openmp", _openmp), ("bf16", _bf16), ("h5py", _h5py),
              ("mpi4py", _mpi4py), ("mpiexec", _mpiexec), ("mpi hello", lambda: _hello(state))]
    problems = []
    for label, check in checks:
        try:
            value = check()
        except Problem as exc:
            problems.append(f"{label}: {exc}")
            value = f"FAILED: {exc}"
        if label == "mpi hello" and "library_version" in state:
            print(f"{'MPI library':<11} {state['library_version']}")
        print(f"{label}: {value}" if label == "mpi hello" else f"{label:<11} {value}", flush=True)
    if problems:
        print(f"wse doctor: {len(problems)} problem(s); first: {problems[0]}", file=sys.stderr)
        return 1
    return 0
