"""The ``mpiexec`` of the installed ``mpich`` wheel, and the command lines the project gives it.

The wheel puts ``mpiexec`` in the environment's scripts directory, next to the Python executable.
We take it from the wheel's own file list rather than from PATH, so a system MPI elsewhere on the
machine can never be mixed with the ``libmpi`` that mpi4py loads from the wheel.
"""
import importlib.metadata
import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

from wse_core.errors import JobError


class MPILaunchError(JobError):
    """mpiexec is missing, or an MPI job failed or timed out (the message is one line; a RuntimeError)."""


def find_mpiexec():
    """Path of the ``mpiexec`` installed by the ``mpich`` wheel of this Python environment."""
    try:
        dist = importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:
        raise MPILaunchError(
            "the mpich wheel is not installed in this Python environment "
            f"({sys.prefix}): run `pip install mpich`") from None
    candidates = [Path(dist.locate_file(f)) for f in (dist.files or [])
                  if f.name == "mpiexec" and f.parent.name == "bin"]
    # Fallbacks for installers that write no file list: the scripts directory, then beside python.
    candidates += [Path(sysconfig.get_path("scripts")) / "mpiexec",
                   Path(sys.executable).parent / "mpiexec"]
    for path in candidates:
        path = path.resolve()
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise MPILaunchError(
        f"mpich {dist.version} is installed but its mpiexec is missing or not executable "
        f"(looked in {candidates[-1].parent}): reinstall with `pip install --force-reinstall mpich`")


def mpi_env(threads_per_rank=1, extra=None):
    """Environment for MPI ranks: thread counts pinned so ranks x threads fits the cores."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads_per_rank)
    env.update(extra or {})
    return env


def hydra_env(topology_file):
    """What keeps a job's hydra from leaving a file in /tmp when the job is killed: ``topology_file``
    (in the run directory, never written) as HWLOC_XMLFILE, unless the user set one.

    Each hydra proxy shares the node's hwloc topology with its ranks through a file made with the
    template /tmp/hydra_hwloc_xmlfile_XXXXXX (compiled in: TMPDIR does not move it) and removes it
    only when it exits normally: a killed proxy always left one, a killed rank sometimes (20 after an
    afternoon of fault tests). With HWLOC_XMLFILE in its environment a proxy makes none, and hwloc
    (the proxy's and each rank's), finding no file there, reads the topology from /sys itself,
    silently, as without hydra's file (hello world of 8 ranks: 0.90 s against 0.87 s). It must be in
    mpiexec's environment: the proxies inherit it, and ``-genv`` reaches only the ranks, which then
    still read hydra's file.
    """
    return {} if os.environ.get("HWLOC_XMLFILE") else {"HWLOC_XMLFILE": str(topology_file)}


def run_mpi(nranks, argv, *, timeout, threads_per_rank=1, env=None):
    """Run ``mpiexec -n nranks argv...`` to completion and return its CompletedProcess (text output).

    The job runs in its own process group so that a timeout kills every rank, not just mpiexec.
    Raises MPILaunchError naming the command on timeout, or when mpiexec cannot start.
    """
    cmd = [str(find_mpiexec()), "-n", str(nranks), *map(str, argv)]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=mpi_env(threads_per_rank, env), start_new_session=True)
    except OSError as exc:
        raise MPILaunchError(f"cannot start {cmd[0]}: {exc.strerror}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise MPILaunchError(f"MPI job `{' '.join(cmd)}` did not finish within {timeout} s; killed") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def job_command(plan, run_dir, *, hostfile=None, cores=None):
    """The mpiexec command line that runs ``plan``'s ranks on the job in ``run_dir`` (its run.json):
    one MPMD segment per thread setting.

    CS-2 ranks do the arithmetic and share the cores; every other role mostly waits (sleeping),
    so it gets one thread.
    """
    cores = cores or os.cpu_count() or 1
    csx_threads = max(1, cores // plan.num_csx)
    # -P (Python 3.11+): the ranks run in the job's directory, which must not come first on their import path.
    entry = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "mpi_launch.run",
             str(Path(run_dir).resolve())]
    # Ranks before the CS-2s, the CS-2s, the input workers after them (the plan's order).
    segments = [(plan.csx[0], 1), (len(plan.csx), csx_threads), (plan.world_size - plan.csx[-1] - 1, 1)]
    # The watchdog ends the job when a rank fails (mpi_launch.watchdog), on one host or several,
    # so hydra must not kill the survivors first: their deaths would hide which rank died.
    cmd = [str(find_mpiexec()), "-disable-auto-cleanup"] + (["-f", str(hostfile)] if hostfile else [])
    parts = [["-n", str(n), "-env", "OMP_NUM_THREADS", str(threads), *entry] for n, threads in segments if n]
    for i, part in enumerate(parts):
        cmd += ([":"] if i else []) + part
    return cmd


#: More ranks than this per core on one machine is a mistake, not a plan: every rank is a Python
#: process with numpy, h5py and MPI loaded (about 100 MB), and they all share the cores.
MAX_RANKS_PER_CORE = 16


def check_capacity(plan, *, hostfile=None, cores=None):
    """Refuse a plan that cannot run on this machine (without a hostfile), in one line."""
    from wse_core.checks import plural

    cores = cores or os.cpu_count() or 1
    if hostfile is None and plan.world_size > MAX_RANKS_PER_CORE * cores:
        raise MPILaunchError(
            f"runconfig.num_csx: {plan.num_csx} CS-2s need {plan.world_size:,} MPI ranks, more than "
            f"{MAX_RANKS_PER_CORE} per core on this machine's {plural(cores, 'core')}; use fewer CS-2s or spread "
            "the ranks over several machines with --hostfile")
