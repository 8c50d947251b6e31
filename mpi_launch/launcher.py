"""Find the ``mpiexec`` of the installed ``mpich`` wheel and run jobs through it.

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
import time
from pathlib import Path


class MPILaunchError(RuntimeError):
    """mpiexec is missing, or an MPI job failed or timed out (the message is one line)."""


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


def prepare_run(params, *, checkpoint=None):
    """Write ``run.json``, ``params.yaml`` and ``plan.json`` into model_dir; return the run dict.

    Resumes from ``checkpoint`` if given, else from ``model_dir/latest`` if there is one.
    """
    import json

    import yaml

    from data_tools.checkpoint import LATEST, Checkpoint
    from mpi_launch.plan import describe

    model_dir = Path(params["runconfig"]["model_dir"])
    (model_dir / "logs").mkdir(parents=True, exist_ok=True)
    for pattern in ("error_rank_*.txt", "pid_rank_*", "done_rank_*"):
        for stale in (model_dir / "logs").glob(pattern):
            stale.unlink()
    if checkpoint is None and (model_dir / LATEST).is_file():
        checkpoint = model_dir
    start, ckpt_dir = 0, None
    if checkpoint is not None:
        ckpt = Checkpoint(checkpoint)
        start, ckpt_dir = ckpt.step, str(ckpt.dir.resolve())
        from wse_core.nn import build_model

        model = build_model(params["model"])
        missing = set(model.param_names) - set(ckpt.param_names)
        if missing:
            raise MPILaunchError(f"{ckpt.dir}: does not hold parameter {sorted(missing)[0]!r} of this model")
        for name, spec in model.param_specs.items():  # e.g. a different model.sparsity
            if ckpt.tensors[f"model/{name}"]["shape"] != list(spec.shape):
                raise MPILaunchError(f"{ckpt.dir}: parameter {name!r} has shape {ckpt.tensors[f'model/{name}']['shape']}, "
                                     f"this model's is {list(spec.shape)}")
    run = {"params": params, "start_step": start, "checkpoint": ckpt_dir}
    (model_dir / "run.json").write_text(json.dumps(run, indent=1))
    (model_dir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (model_dir / "plan.json").write_text(json.dumps(describe(params), indent=1))
    return run


def fit_command(params, *, hostfile=None, cores=None):
    """The mpiexec command line of a training job: one MPMD segment per thread setting.

    CS-2 ranks do the arithmetic and share the cores; every other role mostly waits (sleeping),
    so it gets one thread.
    """
    from mpi_launch.plan import plan_for

    r = params["runconfig"]
    plan, _ = plan_for(params)
    cores = cores or os.cpu_count() or 1
    csx_threads = max(1, cores // r["num_csx"])
    entry = [sys.executable, "-m", "mpi_launch.run", str(Path(r["model_dir"]).resolve())]
    # Ranks before the CS-2s, the CS-2s, the input workers after them (the plan's order).
    segments = [(plan.csx[0], 1), (len(plan.csx), csx_threads), (plan.world_size - plan.csx[-1] - 1, 1)]
    # On one machine the launcher watches the ranks itself (see launch), so hydra must not kill the
    # survivors first: that would hide which rank died. Across machines hydra cleans up, and the
    # survivors' timeouts name the rank they lost.
    cleanup = ["-auto-cleanup"] if hostfile else ["-disable-auto-cleanup"]
    cmd = [str(find_mpiexec()), *cleanup] + (["-f", str(hostfile)] if hostfile else [])
    parts = [["-n", str(n), "-env", "OMP_NUM_THREADS", str(threads), *entry] for n, threads in segments if n]
    for i, part in enumerate(parts):
        cmd += ([":"] if i else []) + part
    return cmd, plan


def explain_failure(model_dir, stderr, plan, dead=None, stopped=()):
    """One line saying which rank failed, its role, and what happened.

    In order: an error a rank raised itself (its ``MPI_Abort`` takes the others down); a rank the
    watchdog found stopped (SIGSTOP, a debugger) when a peer gave up on it (the abort then kills it
    too); a rank the watchdog saw vanish (when several vanished together, the one killed by a
    signal, not those that exited after losing a peer); a rank's failed exchange with or timeout
    on a peer (an echo).
    """
    import json
    import re

    errors = []
    for path in sorted(Path(model_dir, "logs").glob("error_rank_*.txt"), key=lambda p: p.stat().st_mtime):
        try:
            errors.append(json.loads(path.read_text()))
        except ValueError:
            errors.append({"line": path.read_text().strip(), "kind": "cause"})
    causes = [e["line"] for e in errors if e["kind"] == "cause"]
    if causes:
        return causes[0]
    if stopped:
        role, index = plan.role_of(stopped[0])
        waited = f"; {errors[0]['line']}" if errors else ""
        return f"rank {stopped[0]} ({role} {index}): stopped answering (its process is stopped){waited}"
    dead = dead or {}  # rank -> the signal that killed it, when known
    echoes = {int(r) for r in re.findall(r"\(rank (\d+) in comm 0\): Fatal error", stderr)}
    signalled = [r for r, sig in dead.items() if sig]
    culprits = signalled or [r for r in dead if r not in echoes] or list(dead)
    if culprits:
        role, index = plan.role_of(culprits[0])
        sig = dead[culprits[0]]
        how = f"killed by signal {sig} ({signal.Signals(sig).name})" if sig in signal.valid_signals() else \
            "killed by a signal or crashed"
        return f"rank {culprits[0]} ({role} {index}): the process died ({how}) without reporting an error"
    if errors:
        return errors[0]["line"]
    tail = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return tail[-1] if tail else "the MPI job failed without a message"


def _proc_state(pid):
    """(state letter from /proc: R, S, T, Z, ...; exit status of a zombie or None), or (None, None) once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None, None
    status = int(fields[49]) if fields[0] in ("Z", "X") and len(fields) > 49 else None
    return fields[0], status


def _dead_ranks(logs, only=None):
    """{rank: signal number or None} of ranks (all, or those in ``only``) whose process is gone (or a
    zombie not yet reaped) without having finished or reported an error. The signal is known while
    the process is a zombie: a rank killed by a signal is a cause, one that exited after losing a
    peer an echo."""
    dead = {}
    for pid_file in sorted(logs.glob("pid_rank_*"), key=lambda p: int(p.stem.rsplit("_", 1)[1])):
        rank = int(pid_file.stem.rsplit("_", 1)[1])
        if only is not None and rank not in only:
            continue
        try:
            pid = int(pid_file.read_text())
        except (ValueError, OSError):
            continue  # unreadable just now: judge it at the next look
        state, status = _proc_state(pid)
        if state not in (None, "Z", "X"):
            continue  # alive
        # Gone. Checked after the pid, so a rank that finished just now is not taken for dead.
        if not (logs / f"done_rank_{rank}").exists() and not (logs / f"error_rank_{rank}.txt").exists():
            dead[rank] = (status & 0x7F) or None if status is not None else None
    return dead


def _stopped_ranks(logs):
    """Ranks whose process is stopped (state T or t in /proc): alive, but never answering."""
    stopped = []
    for pid_file in logs.glob("pid_rank_*"):
        try:
            state, _ = _proc_state(int(pid_file.read_text()))
        except (ValueError, OSError):
            continue
        if state in ("T", "t"):
            stopped.append(int(pid_file.stem.rsplit("_", 1)[1]))
    return sorted(stopped)


def launch(cmd, plan, model_dir, *, stream=sys.stdout, watch=True):
    """Run the job, streaming the coordinator's progress lines; return (exit code, failure line or None).

    With ``watch`` (one machine), a thread waits on a pidfd of each rank (or, where there are none,
    looks every 5 ms): a rank that vanishes without finishing or reporting an error ends the job
    at once, named. Waking on the first exit matters: ranks that lose a peer go down ~20 ms after
    it, and the first to go is the one to name. When a rank reports that a peer timed out, the
    thread also looks for stopped processes to name.
    """
    import tempfile
    import threading

    logs = Path(model_dir, "logs")
    dead, stopped = {}, []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                                env=mpi_env(1, {"OMP_WAIT_POLICY": "PASSIVE"}))

        def watchdog():
            import select

            poller = select.poll() if hasattr(os, "pidfd_open") else None
            fd_rank = {}
            while proc.poll() is None:
                only = None
                if poller is not None:
                    for pid_file in logs.glob("pid_rank_*"):
                        rank = int(pid_file.stem.rsplit("_", 1)[1])
                        if rank in fd_rank.values():
                            continue
                        try:
                            fd = os.pidfd_open(int(pid_file.read_text()))
                        except (ValueError, OSError):
                            continue
                        fd_rank[fd] = rank
                        poller.register(fd, select.POLLIN)
                    events = poller.poll(5)
                    only = {fd_rank[fd] for fd, _ in events}
                    for fd, _ in events:  # exited: never report it again
                        poller.unregister(fd)
                else:
                    time.sleep(0.005)
                ranks = _dead_ranks(logs, only) if only is None or only else {}
                if ranks:
                    dead.update(ranks)
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                if not stopped and any(logs.glob("error_rank_*.txt")):
                    stopped.extend(_stopped_ranks(logs))  # before MPI_Abort takes every process down
            for fd in fd_rank:
                os.close(fd)

        if watch:
            threading.Thread(target=watchdog, daemon=True).start()
        banner = []  # hydra's failure banner comes on stdout; it goes to logs/mpiexec.log
        try:
            for line in proc.stdout:
                if line.startswith("=") or banner:
                    banner.append(line)
                elif line.strip():
                    stream.write(line)
                    stream.flush()
            code = proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        err.seek(0)
        stderr = "".join(banner) + err.read()
    logs.joinpath("mpiexec.log").write_text(stderr)  # hydra's own messages, kept for the user
    if code == 0 and not dead:
        return 0, None
    return code or 1, explain_failure(model_dir, stderr, plan, dead, stopped)
