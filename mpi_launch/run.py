"""Entry point of every rank of a training job: ``mpiexec -n N python -m mpi_launch.run MODEL_DIR``.

Each rank reads ``MODEL_DIR/run.json`` (the validated params, the start step and the checkpoint to
resume from, written by the launcher), finds its role in the rank plan and runs it. An exception
on any rank is written as one line to ``MODEL_DIR/logs/error_rank_<r>.txt`` and aborts the whole
job (``MPI_Abort``), so no rank is left waiting for it.
"""
import json
import os
import sys
import time
import traceback
from pathlib import Path


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    model_dir = Path(argv[0])
    run = json.loads((model_dir / "run.json").read_text())
    from mpi4py import MPI

    from mpi_launch.plan import plan_for
    from mpi_launch.roles import ROLES

    comm = MPI.COMM_WORLD
    pid_file = model_dir / "logs" / f"pid_rank_{comm.rank}"
    pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
    os.replace(pid_file.with_suffix(".tmp"), pid_file)  # the launcher's watchdog never reads half a pid
    params = run["params"]
    plan, _ = plan_for(params)
    role, index = ("unknown", 0)
    try:
        if comm.size != plan.world_size:
            raise RuntimeError(f"started with {comm.size} ranks, the plan needs {plan.world_size}")
        role, index = plan.role_of(comm.rank)
        ROLES[role](comm, plan, params, run, index).run()
        # A rank that finishes early (an input worker) is not a rank that died: say so.
        (model_dir / "logs" / f"done_rank_{comm.rank}").touch()
    except BaseException as exc:  # any failure ends the whole job, named in one line
        from mpi_launch.messaging import PeerLost, PeerTimeout

        first = (str(exc).splitlines() or [""])[0]
        line = f"rank {comm.rank} ({role} {index}): {type(exc).__name__}: {first}"
        # A failed exchange with a peer is usually the echo of that peer's death, not the cause.
        kind = "peer" if isinstance(exc, (PeerLost, PeerTimeout)) else "cause"
        logs = model_dir / "logs"
        (logs / f"error_rank_{comm.rank}.txt").write_text(json.dumps({"line": line, "kind": kind}) + "\n")
        with open(logs / f"rank_{comm.rank}.log", "a") as f:
            traceback.print_exc(file=f)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        if kind == "peer":
            time.sleep(1.0)  # let the launcher's watchdog see the rank that really died first
        comm.Abort(1)


if __name__ == "__main__":
    main()
