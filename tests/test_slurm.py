"""Jobs handed to a real single-node Slurm (munged, slurmctld, slurmd started here, as root)."""
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from pyapi.appliance import slurm as wse_slurm
from mpi_launch.rundir import RunDir
from test_appliance import _cmdlines, direct_fit, params_file, until, weights

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel")


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm():
    """A Slurm cluster of this one machine, with its own munged, ports and state; stopped at the end.

    The node claims 32 CPUs (``SlurmdParameters=config_overrides``): a job takes one task per rank,
    and the ranks of an emulated cluster mostly wait, so this machine's cores are shared, as they
    are under ``wse fit``.
    """
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if os.geteuid() != 0 or missing:
        pytest.skip("needs root and Slurm (Debian: apt-get install slurm-wlm munge; .ci/run installs them); "
                    + (f"missing {', '.join(missing)}" if missing else "not root"))
    d = Path(tempfile.mkdtemp(prefix="wse-slurm-"))
    os.chmod(d, 0o755)
    munge_dir = d / "munge"
    munge_dir.mkdir(mode=0o755)
    shutil.chown(munge_dir, "munge", "munge")
    msock = munge_dir / "munge.sock"
    subprocess.run(["runuser", "-u", "munge", "--", shutil.which("munged"), f"--socket={msock}",
                    f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={munge_dir / 'munged.log'}",
                    f"--seed-file={munge_dir / 'seed'}"], check=True, timeout=30)
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    conf = d / "slurm.conf"
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    conf.write_text(f"""\
ClusterName=wsetest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={msock}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd.log'}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs=32 State=UNKNOWN
PartitionName=wse Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)  # for the tests' own commands and every `wse` they start
    try:
        subprocess.run(["slurmctld", "-f", str(conf)], check=True, timeout=30)
        subprocess.run(["slurmd", "-f", str(conf)], check=True, timeout=30)
        until(lambda: "idle" in subprocess.run(["sinfo", "--noheader", "--format=%t"], capture_output=True,
                                               text=True).stdout, "the Slurm node is idle", timeout=60)
        yield d
    finally:
        for pid_file in (d / "slurmd.pid", d / "slurmctld.pid", munge_dir / "munged.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        time.sleep(1)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from data_tools.preprocess import preprocess_text

    out = tmp_path_factory.mktemp("data") / "lm"
    preprocess_text(["stdlib"], out, 32, samples_per_file=4000, progress=False)
    return out


def slurm_job(job_id, timeout=240):
    return until(lambda: next((j for j in wse_slurm.jobs() if j["id"] == job_id), None), f"Slurm job {job_id}",
                 timeout)


def ended(job_id, timeout=240):
    return until(lambda: (lambda j: j if j["state"] not in ("pending", "running", "configuring", "completing")
                          else None)(slurm_job(job_id)), f"Slurm job {job_id} ends", timeout)


def submit(jobs, params, *extra):
    r = jobs.run("submit", params, "--slurm", *extra)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[3])  # "submitted Slurm job N ..."


def test_a_job_on_slurm_has_one_task_per_rank_and_ends_bit_identical_to_wse_fit(tmp_path, data, jobs, slurm):
    """`wse submit --slurm`: sbatch with one task per rank; Slurm runs it; `wse jobs --slurm` reads it
    back (squeue) with its step and loss; the weights equal `wse fit`'s."""
    model = tmp_path / "m"
    job_id = submit(jobs, params_file(tmp_path / "p.yaml", data, model))
    script = (model / "slurm_job.sh").read_text()
    assert "#SBATCH --ntasks=7" in script  # coordinator, 2 MemoryX... as `wse compile` plans it
    rec = ended(job_id)
    assert rec["state"] == "completed" and rec["step"] == 3 and rec["num_csx"] == 2, rec
    listed = jobs.run("jobs", "--slurm")
    assert listed.returncode == 0 and f"{job_id}  completed" in listed.stdout, listed.stdout
    out = jobs.run("logs", "--slurm", job_id)
    assert "done: trained steps 1..3" in out.stdout, out.stdout
    assert weights(model) == direct_fit(jobs, tmp_path, data)


def test_on_slurm_a_killed_rank_restarts_from_the_checkpoint_and_a_cancel_ends_every_process(tmp_path, data, jobs,
                                                                                          slurm):
    """Inside its allocation a job restarts after kill -9 of a CS-2 rank (same final bits); `wse
    cancel --slurm` ends a running job and leaves none of its processes."""
    model = tmp_path / "m"
    job_id = submit(jobs, params_file(tmp_path / "p.yaml", data, model, max_steps=40), "--max_restarts", "1")
    until(lambda: slurm_job(job_id)["step"] >= 5, "step 5")
    run_dir = RunDir(model)
    csx = json.loads(run_dir.plan_json.read_text())["plan"]["csx"][0]
    os.kill(int(run_dir.pid_file(csx).read_text()), signal.SIGKILL)
    rec = ended(job_id)
    assert rec["state"] == "completed", rec
    log = jobs.run("logs", "--slurm", job_id).stdout
    assert f"== restart 1 of 1 from the latest checkpoint after: rank {csx} (csx 0)" in log, log
    assert weights(model) == direct_fit(jobs, tmp_path, data, max_steps=40)

    long = tmp_path / "long"
    job_id = submit(jobs, params_file(tmp_path / "long.yaml", data, long, max_steps=100000))
    until(lambda: slurm_job(job_id)["step"] >= 2, "the long job trains")
    r = jobs.run("cancel", "--slurm", job_id)
    assert r.returncode == 0, r.stderr
    assert ended(job_id)["state"] == "cancelled"
    until(lambda: not any(f"mpi_launch.run {long} " in c for c in _cmdlines()), "no rank of the cancelled job",
          timeout=90)



def test_the_sbatch_script_exports_the_numerics_variables_it_is_given(tmp_path):
    """Where a site has sbatch pass on no environment (SBATCH_EXPORT=NONE), the variables that decide a
    job's bits still reach it: the script exports them, quoted, before it runs the job."""
    from pyapi.job import Job

    job = Job.from_yaml(params_file(tmp_path / "p.yaml", tmp_path / "lm", tmp_path / "m"))
    text = wse_slurm.script(job, world_size=7, max_restarts=0, name="t",
                            numerics={"OPENBLAS_CORETYPE": "Haswell", "OMP_PROC_BIND": "spread, close"})
    exports = [ln for ln in text.splitlines() if ln.startswith("export ")]
    assert exports == ["export OPENBLAS_CORETYPE=Haswell", "export OMP_PROC_BIND='spread, close'"]
    assert text.index(exports[-1]) < text.index("\nexec ")
    shell = subprocess.run(["bash", "-c", "\n".join(exports) + '\nprintf %s "$OMP_PROC_BIND"'], capture_output=True,
                           text=True, env={}, timeout=30)
    assert shell.stdout == "spread, close"
