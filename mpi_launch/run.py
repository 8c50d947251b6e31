"""Entry point of every rank of a job: ``mpiexec -n N python -m mpi_launch.run RUN_DIR`` (a training
job's model_dir, or an inference job's directory: ``mpi_launch.inference``).

Under ``wse fit`` each rank first forks its supervisor (mpi_launch.supervisor), which reports to
the launcher's watchdog how the rank is doing and how it ended. The rank then reads
``MODEL_DIR/run.json`` (the validated params, the run the launcher resolved from them,
``mpi_launch.resolved.ResolvedRun.from_json``, the start step and the checkpoint to resume from),
finds its role in that run's rank plan and runs it. An exception on any rank becomes one line, sent to
the watchdog (which ends the job and names it) and written to the rank's log with its traceback.
Run by hand, without a watchdog, a failing rank aborts the whole job itself (``MPI_Abort``).
"""
import sys

from mpi_launch import supervisor
from mpi_launch.protocol import RankEvent
from wse_core.errors import JobError

#: Seconds a failed, supervised rank waits for the watchdog to end the job before aborting it itself.
_ABORT_AFTER = 60.0


def main(argv=None):
    supervisor.supervise()  # first: nothing heavy is imported in the supervisor's copy of Python
    argv = sys.argv[1:] if argv is None else argv
    import os
    import time
    import traceback

    from data_tools.files import write_text
    from mpi_launch.rundir import RunDir
    from wse_core import configure_process

    configure_process()
    run_dir = RunDir(argv[0])
    from mpi4py import MPI

    supervisor.report(RankEvent.MPI_UP)

    comm = MPI.COMM_WORLD
    role, index = ("unknown", 0)
    try:
        pid_file = run_dir.pid_file(comm.rank)
        write_text(pid_file, str(os.getpid()))  # a reader never sees half a pid
        run = run_dir.read_run()
        if "kind" not in run:  # a command line printed (wse fit --dry-run) before an upgrade
            raise JobError(f"{run_dir.run_json}: written by an older wse-cluster: prepare the run again "
                           "(wse fit, or wse fit --dry-run for a new command)")
        if run["kind"] == "infer":  # an inference job (mpi_launch.inference); else "train"
            from mpi_launch.inference import plan_of
            from mpi_launch.roles.inference import ROLES
            from wse_core.models import build_model

            model = build_model(run["inference"]["model"])
            plan = plan_of(run["inference"], model)
            make = lambda role, index: ROLES[role](comm, plan, run["inference"], run_dir, index, model)  # noqa: E731
        else:
            from mpi_launch.resolved import ResolvedRun
            from mpi_launch.roles import ROLES
            from mpi_launch.spec import RunSpec

            # The launcher's plan, strategy and micro-batches, obeyed as written; the model built here once.
            resolved = ResolvedRun.from_json(run["resolved"], RunSpec.from_dict(run["params"]))
            plan = resolved.plan
            make = lambda role, index: ROLES[role](comm, resolved, run, index, bells)  # noqa: E731
        if comm.size != plan.world_size:
            raise JobError(f"started with {comm.size} ranks, the plan needs {plan.world_size}")
        role, index = plan.role_of(comm.rank)
        from mpi_launch.messaging import Bells

        # Collective: every rank, before any role's own work. An inference job's roles poll without.
        bells = None if run["kind"] == "infer" else Bells.open(comm)
        job = make(role, index)
        supervisor.report(RankEvent.READY)
        job.run()
        supervisor.report(RankEvent.DONE)
    except BaseException as exc:  # any failure ends the whole job, named in one line
        from mpi_launch.messaging import PeerLost, PeerTimeout

        first = (str(exc).splitlines() or [""])[0]
        line = f"rank {comm.rank} ({role} {index}): {type(exc).__name__}: {first}"
        # A failed exchange with a peer is usually the echo of that peer's death, not the cause.
        kind = "peer" if isinstance(exc, (PeerLost, PeerTimeout)) else "cause"
        if supervisor.supervised():
            supervisor.report(RankEvent.ERROR, line=line, kind=kind)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        try:  # the traceback too, unless the disk is full: the line above is what matters
            with open(run_dir.rank_log(comm.rank), "a") as f:
                traceback.print_exc(file=f)
        except OSError:
            pass
        if supervisor.supervised():
            time.sleep(_ABORT_AFTER)  # the watchdog ends the job (and this rank) long before this
        comm.Abort(1)
    MPI.Finalize()


if __name__ == "__main__":
    main()
