"""The appliance: a real service on a real unix socket, running real jobs for several users, through faults.

One file over ~500 lines: the tests share one dataset per module and one way of starting a
service and acting as its users (the fixtures below), so each test says only what it asks."""
import json
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from data_tools.checkpoint import Checkpoint
from data_tools.preprocess import preprocess_text
from pyapi.client import ApplianceError, Client
from pyapi.appliance.scheduler import MAX_OVERTAKES, pick
from mpi_launch.launcher import job_processes
from mpi_launch.rundir import RunDir
from pyapi.job import Job


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    preprocess_text(["stdlib"], d / "lm", 32, samples_per_file=4000, progress=False)
    return d / "lm"


def params_file(path, data, model_dir, **runconfig):
    p = {"train_input": {"data_dir": str(data), "batch_size": 8, "micro_batch_size": 4, "shuffle": True,
                         "shuffle_seed": 4},
         "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
                   "max_position_embeddings": 32},
         "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3, "max_gradient_norm": 1.0},
         "runconfig": {"max_steps": 3, "num_csx": 2, "checkpoint_steps": 2, "model_dir": str(model_dir),
                       **runconfig}}
    path.write_text(yaml.safe_dump(p))
    return path


class Appliance:
    """A service of the test, started and stopped with `wse appliance`, and its client."""

    def __init__(self, jobs, where, num_csx):
        self.jobs, self.socket, self.state_dir, self.num_csx = jobs, where / "appliance.sock", where / "state", num_csx
        self.client = Client(self.socket)

    def start(self):
        r = self.wse("appliance", "start", "--num_csx", self.num_csx, "--state_dir", self.state_dir)
        assert r.returncode == 0, r.stderr
        return self

    def wse(self, *args, timeout=240):
        return self.jobs.run(*args, "--socket", self.socket, timeout=timeout)

    def submit(self, params, *extra):
        r = self.wse("submit", params, *extra)
        assert r.returncode == 0, r.stderr
        return int(r.stdout.split(":")[0].split()[1])

    def wait(self, job_id, timeout=300):
        return self.client.wait(job_id, timeout)


@pytest.fixture
def appliance(tmp_path, jobs):
    """``appliance(num_csx)``: a started service; stopped (and everything of the test killed) at the end."""
    started = []

    def start(num_csx=4, where=tmp_path):
        a = Appliance(jobs, where, num_csx).start()
        started.append(a)
        return a

    yield start
    for a in started:
        try:
            a.client.stop()
        except ApplianceError:
            pass
        for pid in job_processes(a.state_dir):  # a service that did not stop, and all it started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def until(predicate, what, timeout=180):
    """Poll ``predicate`` until true; the timeout is one only a hang reaches."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def weights(model_dir):
    w, state = Checkpoint(model_dir).load()
    return {n: a.tobytes() for n, a in w.items()}, {n: {k: a.tobytes() for k, a in s.items()} for n, s in state.items()}


def direct_fit(jobs, tmp_path, data, **runconfig):
    """Weights and optimizer state of the same job run by `wse fit`, without the appliance."""
    p = params_file(tmp_path / "direct.yaml", data, tmp_path / "direct", **runconfig)
    r = jobs.run("fit", p)
    assert r.returncode == 0, r.stderr
    return weights(tmp_path / "direct")


def test_pick_first_come_within_priority_and_bounded_overtaking():
    """Priority order is the queue's; a small job may pass a big one only MAX_OVERTAKES times."""
    big = {"id": 1, "num_csx": 4, "overtaken": 0}
    small = [{"id": i, "num_csx": 1, "overtaken": 0} for i in range(2, 6)]
    starts, passed = pick([big, *small], free=2)
    assert [j["id"] for j in starts] == [2, 3] and passed == [1, 1]
    big["overtaken"] = MAX_OVERTAKES
    starts, passed = pick([big, *small], free=2)
    assert starts == [] and passed == []           # the big job holds the pool now
    starts, _ = pick([big, *small], free=4)
    assert [j["id"] for j in starts] == [1]
    assert [j["id"] for j in pick([small[0], small[1]], free=1)[0]] == [2]  # first come


def test_a_submission_carrying_other_variables_or_bad_values_is_refused_in_one_line():
    """Only numerics variables travel with a job (LD_PRELOAD or PYTHONPATH would reach what the runner
    loads), with printable values of bounded length, at most MAX_NUMERICS of them."""
    from pyapi.appliance.requests import MAX_NUMERICS, RequestError, check_numerics

    fine = {"OPENBLAS_CORETYPE": "Haswell", "OMP_NUM_THREADS": "1", "GOTO_NUM_THREADS": "1", "NPY_x": ""}
    assert check_numerics(fine) == fine
    cases = [({"LD_PRELOAD": "/tmp/x.so"}, r"^numerics: 'LD_PRELOAD' is not a numerics variable \(OPENBLAS_\*, "),
             ({"PYTHONPATH": "/tmp"}, r"^numerics: 'PYTHONPATH' is not a numerics variable"),
             ({"OMP_NUM_THREADS=1 LD_PRELOAD": "x"}, r"^numerics: 'OMP_NUM_THREADS=1 LD_PRELOAD' is not a numerics"),
             ({"OMP_NUM_THREADS": "1\nLD_PRELOAD=x"}, r"^numerics\.OMP_NUM_THREADS: expected printable text of at "
                                                     r"most 1024 characters, got '1\\nLD_PRELOAD=x'$"),
             ({"OMP_NUM_THREADS": 1}, r"^numerics\.OMP_NUM_THREADS: expected printable text .*, got 1$"),
             ({"OPENBLAS_CORETYPE": "x" * 1025}, r"^numerics\.OPENBLAS_CORETYPE: expected printable text"),
             ({f"OMP_{i}": "1" for i in range(MAX_NUMERICS + 1)}, rf"^numerics: at most {MAX_NUMERICS} variables, "
                                                                 rf"got {MAX_NUMERICS + 1}$")]
    for variables, line in cases:
        with pytest.raises(RequestError, match=line) as refused:
            check_numerics(variables)
        assert "\n" not in str(refused.value)


def test_a_job_table_of_the_first_version_is_read_and_extended(tmp_path):
    """A state directory written before the umask column: its jobs read back (umask 0o077), a serve job
    of then (params {"serve": fields}) with its kind and its fields, new ones add."""
    import sqlite3

    from pyapi.appliance.store import Store

    db = sqlite3.connect(tmp_path / "jobs.sqlite")
    db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, uid INTEGER NOT NULL, gid INTEGER NOT NULL, "
               "user TEXT NOT NULL, name TEXT NOT NULL, params TEXT NOT NULL, cwd TEXT NOT NULL, model_dir TEXT NOT "
               "NULL, num_csx INTEGER NOT NULL, max_steps INTEGER NOT NULL, priority INTEGER NOT NULL, max_restarts "
               "INTEGER NOT NULL, state TEXT NOT NULL, restarts INTEGER NOT NULL DEFAULT 0, overtaken INTEGER NOT "
               "NULL DEFAULT 0, submitted REAL NOT NULL, started REAL, ended REAL, pid INTEGER, reason TEXT, step "
               "INTEGER, loss REAL, sim_seconds REAL)")
    db.execute("INSERT INTO jobs (uid, gid, user, name, params, cwd, model_dir, num_csx, max_steps, priority, "
               "max_restarts, state, submitted) VALUES (0, 0, 'root', 'old', '{}', '/', '/m', 1, 3, 0, 0, 'queued', 0)")
    db.execute("INSERT INTO jobs (uid, gid, user, name, params, cwd, model_dir, num_csx, max_steps, priority, "
               "max_restarts, state, restarts, submitted, started) VALUES (0, 0, 'root', 'ran', '{}', '/', '/r', 1, 3, "
               "0, 1, 'queued', 1, 0, 0)")
    db.execute("INSERT INTO jobs (uid, gid, user, name, params, cwd, model_dir, num_csx, max_steps, priority, "
               "max_restarts, state, submitted) VALUES (0, 0, 'root', 'srv', '{\"serve\": {\"model\": \"/s\", "
               "\"port\": 0}}', '/', '/s', 1, 0, 0, 0, 'queued', 0)")
    db.commit()
    db.close()
    store = Store(tmp_path / "jobs.sqlite")
    assert store.get(1)["umask"] == 0o077 and store.queue()[0]["name"] == "old"
    assert store.get(1)["attempts"] == 0 and store.get(2)["attempts"] == 2  # its next runner is attempt 3
    assert store.get(1)["numerics"] is None  # not sent: its runner gets what that version gave it
    assert [(j["kind"], j["params"]) for j in store.jobs()] == [("train", {}), ("train", {}),
                                                                 ("serve", {"model": "/s", "port": 0})]
    new = store.add(uid=0, gid=0, user="root", name="new", kind="train", params={}, cwd="/", umask=0o022, model_dir="/n", num_csx=1,
                    max_steps=3, priority=0, max_restarts=0, numerics={"OMP_NUM_THREADS": "1"})
    assert store.get(new)["umask"] == 0o022 and store.get(new)["numerics"] == {"OMP_NUM_THREADS": "1"}


def test_a_state_directory_of_a_newer_version_or_of_another_program_is_refused_in_one_line(tmp_path, jobs):
    """A jobs table of a newer version, one with columns unlike ours, a file that is not SQLite: each
    refused in one line naming the file and what to do; `wse appliance start` says that line."""
    import sqlite3

    from pyapi.appliance.store import VERSION, Store

    newer, foreign, garbage = tmp_path / "newer.sqlite", tmp_path / "foreign.sqlite", tmp_path / "garbage.sqlite"
    Store(newer).close()
    db = sqlite3.connect(newer)
    db.execute(f"PRAGMA user_version = {VERSION + 1}")
    db.close()
    db = sqlite3.connect(foreign)
    db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, command TEXT)")
    db.close()
    garbage.write_bytes(b"not a database " * 100)
    cases = {newer: f"{newer}: a jobs table of version {VERSION + 1}, written by a newer wse-cluster (this one "
                    f"knows up to {VERSION}); start the appliance of that version, or start this one with another "
                    "--state_dir",
             foreign: f"{foreign}: its jobs table has column 'command', unlike any wse-cluster's; move it away or "
                      "start with another --state_dir",
             garbage: f"{garbage}: not a jobs table this appliance can read (file is not a database); move it away "
                      "or start with another --state_dir"}
    for path, line in cases.items():
        with pytest.raises(ApplianceError) as refused:
            Store(path)
        assert str(refused.value) == line
    state = tmp_path / "state"
    state.mkdir()
    shutil.copy(newer, state / "jobs.sqlite")
    r = jobs.run("appliance", "start", "--state_dir", state, "--socket", tmp_path / "a.sock", timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"wse appliance: error: {state / 'jobs.sqlite'}: a jobs table of version "
        f"{VERSION + 1}, written by a newer wse-cluster (this one knows up to {VERSION}); start the appliance of "
        "that version, or start this one with another --state_dir"], r.stderr


def test_a_state_directory_holding_another_users_files_is_refused_in_one_line(tmp_path, jobs):
    """State another user could have written (a jobs table names the uid each job runs as) is not
    adopted: `wse appliance start` says so in one line."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    state = tmp_path / "state"
    state.mkdir()
    (state / "jobs.sqlite").write_bytes(b"")
    os.chown(state / "jobs.sqlite", 54321, 54321)
    r = jobs.run("appliance", "start", "--state_dir", state, "--socket", tmp_path / "a.sock", timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"wse appliance: error: {state / 'jobs.sqlite'}: owned by 54321, not by root, who starts this appliance; "
        "an appliance adopts only state of its own: chown it, or start with another --state_dir"], r.stderr


def test_three_jobs_on_four_csx_two_at_once_the_third_waits_all_bit_identical_to_wse_fit(tmp_path, data, jobs,
                                                                                      appliance):
    """3 jobs of 2 CS-2s on a pool of 4: two run side by side, the third starts when one ends; every
    job's weights and optimizer state equal `wse fit`'s bit for bit. One goes through the Python API."""
    a = appliance(4)
    ids = [a.submit(params_file(tmp_path / f"p{i}.yaml", data, tmp_path / f"m{i}")) for i in range(2)]
    job = Job.from_yaml(params_file(tmp_path / "p2.yaml", data, tmp_path / "m2"))
    handle = job.submit(socket=a.socket)
    ids.append(handle.id)
    final = handle.wait(timeout=300)
    assert final["state"] == "done" and final["step"] == 3
    assert [m["step"] for m in handle.metrics()] == [1, 2, 3]
    recs = {i: a.wait(i) for i in ids}
    assert all(r["state"] == "done" for r in recs.values()), recs
    r1, r2, r3 = (recs[i] for i in ids)
    assert r1["started"] < r2["ended"] and r2["started"] < r1["ended"], "the first two ran at once"
    assert r3["started"] >= min(r1["ended"], r2["ended"]) - 0.5, "the third waited for two CS-2s"
    listed = a.wse("jobs")
    assert listed.returncode == 0 and all("  done  " in ln for ln in listed.stdout.splitlines()[1:]), listed.stdout
    log = a.wse("logs", ids[0])
    assert "step     3/3" in log.stdout and "done: trained steps 1..3" in log.stdout, log.stdout
    expected = direct_fit(jobs, tmp_path, data)
    for i in range(3):
        assert weights(tmp_path / f"m{i}") == expected, f"job {ids[i]}"


def test_a_job_runs_in_the_numerics_environment_of_its_submitter_and_equals_wse_fit_there(tmp_path, data, jobs,
                                                                                         appliance, monkeypatch):
    """A service started without them, a job submitted from a shell with OMP_NUM_THREADS,
    OPENBLAS_NUM_THREADS and OPENBLAS_CORETYPE set: its runner has them and none of the service's own
    numerics variables, and its weights equal `wse fit`'s in that shell, bit for bit. The kernel named
    is the one OpenBLAS picks here anyway (tests never change it)."""
    from threadpoolctl import threadpool_info

    from wse_core.numerics import is_numerics_variable

    kernel = next(lib for lib in threadpool_info() if lib["user_api"] == "blas")["architecture"]
    for name in [k for k in os.environ if is_numerics_variable(k)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OPENBLAS_VERBOSE", "0")  # the service's own (0: OpenBLAS's default)
    a = appliance(2)
    monkeypatch.delenv("OPENBLAS_VERBOSE")
    shell = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "OPENBLAS_CORETYPE": kernel}
    for name, value in shell.items():
        monkeypatch.setenv(name, value)
    job_id = a.submit(params_file(tmp_path / "p.yaml", data, tmp_path / "m"))
    rec = a.wait(job_id)
    assert rec["state"] == "done", rec
    seen = RunDir(tmp_path / "m").read_run()["numerics"]["variables"]  # the runner's, as it prepared the run
    assert {k: seen.get(k) for k in shell} == shell and "OPENBLAS_VERBOSE" not in seen, seen
    assert weights(tmp_path / "m") == direct_fit(jobs, tmp_path, data)


def test_cancel_of_a_queued_and_of_a_running_job(tmp_path, data, jobs, appliance):
    """A queued job is cancelled at once and never starts; a running one is stopped cleanly: no
    process of it is left, its model_dir is free, its last checkpoint intact."""
    a = appliance(2)
    run_id = a.submit(params_file(tmp_path / "long.yaml", data, tmp_path / "long", max_steps=100000))
    queued_id = a.submit(params_file(tmp_path / "q.yaml", data, tmp_path / "q"))
    assert a.client.job(queued_id)["state"] == "queued"
    r = a.wse("cancel", queued_id)
    assert r.returncode == 0 and f"job {queued_id}: cancelled" in r.stdout, r.stderr
    until(lambda: a.client.job(run_id)["step"] >= 2, "the long job trains")
    # Clients that wait or follow and go away (Ctrl-C on `job.wait()`, `wse logs -f`) hold nothing:
    # more of them than one user may hold connections at once, and the user is still served.
    for request in [{"op": "logs", "id": run_id, "follow": True}] * 5 + [{"op": "wait", "id": run_id}] * 40:
        _raw(a.socket, json.dumps(request).encode() + b"\n", read=False)
    assert a.client.job(run_id)["state"] == "running"
    r = a.wse("cancel", run_id)
    assert r.returncode == 0, r.stderr
    rec = a.wait(run_id, 120)
    assert rec["state"] == "cancelled", rec
    assert rec["reason"] == f"cancelled by {pwd.getpwuid(os.getuid()).pw_name} while running", rec
    q = a.client.job(queued_id)
    assert q["state"] == "cancelled" and q["started"] is None, q
    until(lambda: not jobs.leftovers() or set(jobs.leftovers()) == {a.client.status()["pid"]}, "nothing but the "
          "service left", timeout=60)
    RunDir(tmp_path / "long").lock().unlock()  # free
    Checkpoint(tmp_path / "long").verify()
    r = a.wse("cancel", run_id)
    assert r.returncode == 1 and f"job {run_id} has already ended (cancelled)" in r.stderr, r.stderr


def test_a_killed_csx_rank_is_restarted_from_the_checkpoint_and_ends_bit_identical(tmp_path, data, jobs, appliance):
    """kill -9 of a CS-2 rank mid-job with max_restarts 1: the job resumes from its latest checkpoint,
    logs the fault, and ends with the bits of an uninterrupted run."""
    a = appliance(2)
    model = tmp_path / "m"
    # 120 steps: the kill must land while the job runs, after the service has seen step 5 (it follows
    # the job's metrics from time to time: 40 quick steps were once over before it saw the fifth)
    job_id = a.submit(params_file(tmp_path / "p.yaml", data, model, max_steps=120), "--max_restarts", "1")
    until(lambda: a.client.job(job_id)["step"] >= 5, "step 5")
    run_dir = RunDir(model)
    plan = json.loads(run_dir.plan_json.read_text())["plan"]
    os.kill(int(run_dir.pid_file(plan["csx"][0]).read_text()), signal.SIGKILL)
    rec = a.wait(job_id)
    assert rec["state"] == "done" and rec["restarts"] == 1, rec
    assert "killed by signal 9 (SIGKILL)" in rec["reason"], rec
    log = a.wse("logs", job_id).stdout
    assert "== restart 1 of 1 from the latest checkpoint after: rank" in log and "resuming from checkpoint_" in log
    assert [m["step"] for m in RunDir(model).read_metrics()] == list(range(1, 121))
    assert weights(model) == direct_fit(jobs, tmp_path, data, max_steps=120)


def test_a_job_that_fails_again_after_its_restarts_is_failed_with_the_fault(tmp_path, data, jobs, appliance):
    """Without restarts a killed rank fails the job, naming the rank and the signal in one line."""
    a = appliance(2)
    model = tmp_path / "m"
    job_id = a.submit(params_file(tmp_path / "p.yaml", data, model, max_steps=100000))
    until(lambda: a.client.job(job_id)["step"] >= 1, "step 1")
    os.kill(int(RunDir(model).pid_file(0).read_text()), signal.SIGKILL)
    rec = a.wait(job_id)
    assert rec["state"] == "failed" and rec["restarts"] == 0, rec
    assert rec["reason"].startswith("rank 0 (coordinator 0): the process died (killed by signal 9"), rec


def test_the_service_killed_and_started_again_runs_its_jobs(tmp_path, data, jobs, appliance):
    """kill -9 of the service: its running job stops with it; started again, the service resumes that
    job from its checkpoint (same bits) and runs the queued one."""
    a = appliance(2)
    running = a.submit(params_file(tmp_path / "r.yaml", data, tmp_path / "r", max_steps=40))
    queued = a.submit(params_file(tmp_path / "q.yaml", data, tmp_path / "q"))
    until(lambda: a.client.job(running)["step"] >= 4, "step 4")
    pid = a.client.status()["pid"]
    os.kill(pid, signal.SIGKILL)
    until(lambda: not any(f"{tmp_path / 'r'} " in p for p in _cmdlines()), "the running job's ranks end with "
                                                                            "the service", timeout=60)
    r = a.wse("jobs")
    assert r.returncode == 1 and "cannot reach the appliance" in r.stderr, r.stderr
    a.start()
    recs = {i: a.wait(i) for i in (running, queued)}
    assert all(r["state"] == "done" for r in recs.values()), recs
    assert "resumed from its latest checkpoint" in recs[running]["reason"]
    assert weights(tmp_path / "r") == direct_fit(jobs, tmp_path, data, max_steps=40)


def test_stop_interrupts_running_jobs_and_the_next_start_resumes_them(tmp_path, data, jobs, appliance):
    """`wse appliance stop` ends a running job's ranks cleanly and keeps it queued; started again,
    the service resumes it from its checkpoint to the bits of an uninterrupted run, in its attempt 2
    (issue 42: its log said attempt 1 again)."""
    a = appliance(2)
    # Long enough that `stop` finds it running: this job takes about 30 ms a step here.
    job_id = a.submit(params_file(tmp_path / "p.yaml", data, tmp_path / "m", max_steps=120))
    until(lambda: a.client.job(job_id)["step"] >= 4, "step 4")
    r = a.wse("appliance", "stop")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("appliance stopped (pid ") and "1 running job(s) interrupted" in r.stdout, r.stdout
    a.start()  # at once: `stop` returned once the service had ended
    rec = a.wait(job_id)
    assert rec["state"] == "done" and rec["restarts"] == 0, rec
    log = a.wse("logs", job_id).stdout
    assert "resuming from checkpoint_" in log
    assert re.findall(rf"^== \S+ \S+ job {job_id} attempt (\d+):", log, re.M) == ["1", "2"], log
    assert weights(tmp_path / "m") == direct_fit(jobs, tmp_path, data, max_steps=120)


def _cmdlines():
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out.append((d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return out


def _children(pid):
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _raw(sock_path, payload, read=True):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock_path))
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except BrokenPipeError:
            pass  # refused before the end of it: the reply is already there
        return s.makefile().read() if read else None


def test_malformed_and_hostile_requests_get_one_line_and_leave_the_service_running(tmp_path, data, appliance):
    """Garbage, wrong types, unknown fields, bad params, huge and deeply nested requests: each refused in
    one line, nothing queued, and the service still answers."""
    a = appliance(2)
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(str(a.socket))  # says nothing: must not hold up anyone else
    good = yaml.safe_load(params_file(tmp_path / "p.yaml", data, tmp_path / "m").read_text())
    # 4 CS-2s, each with micro-batches of its 2 samples: params that are good but for the pool's size
    four = {"train_input": {**good["train_input"], "micro_batch_size": 2}, "runconfig": {**good["runconfig"], "num_csx": 4}}
    cases = {
        b"not json\n": "a request is one line of JSON",
        b"[1, 2]\n": "a request is a JSON object",
        b'{"op": "reboot"}\n': "unknown request 'reboot'",
        b'{"op": "__init__"}\n': "unknown request '__init__'",
        b'{"op": "job", "id": "1"}\n': "id: expected int, got str",
        b'{"op": "job", "id": true}\n': "id: expected int, got bool",
        b'{"op": "jobs", "all": true}\n': "unknown field 'all'",
        b'{"op": "cancel", "id": 999}\n': "no job 999 of yours",
        b"[" * 100000 + b"\n": "a request is one line of JSON",
        b"x" * (2 << 20): "request longer than",
        json.dumps({"op": "submit", "params": {**good, "model": {**good["model"], "hiden_size": 3}},
                    "cwd": str(tmp_path)}).encode() + b"\n": "hiden_size",
        json.dumps({"op": "submit", "params": {**good, **four},
                    "cwd": str(tmp_path)}).encode() + b"\n": "runconfig.num_csx: 4 CS-2s asked, the appliance has 2",
        json.dumps({"op": "submit", "params": good, "cwd": "relative"}).encode() + b"\n":
            "cwd: expected an absolute path",
        json.dumps({"op": "submit", "params": good, "cwd": str(tmp_path), "max_restarts": -1}).encode() + b"\n":
            "max_restarts: expected an integer in [0, 100]",
        json.dumps({"op": "submit", "params": good, "cwd": str(tmp_path),
                    "numerics": {"LD_PRELOAD": "/tmp/x.so"}}).encode() + b"\n":
            "numerics: 'LD_PRELOAD' is not a numerics variable",
        json.dumps({"op": "submit", "params": good, "cwd": str(tmp_path), "numerics": ["OMP_NUM_THREADS"]}).encode()
        + b"\n": "numerics: expected dict, got list",
        json.dumps({"op": "submit", "params": good, "cwd": "/tmp\0x"}).encode() + b"\n":
            "cwd: expected an absolute path of printable characters",
        json.dumps({"op": "submit", "params": {**good, "runconfig": {**good["runconfig"], "model_dir": "/tmp/m\0"}},
                    "cwd": str(tmp_path)}).encode() + b"\n":
            "runconfig.model_dir: expected an absolute path of printable characters",
        json.dumps({"op": "submit", "params": {**good, "runconfig": {**good["runconfig"],
                                                                     "num_workers_per_csx": 10**9}},
                    "cwd": str(tmp_path)}).encode() + b"\n":
            "runconfig.num_workers_per_csx: 1000000000 is more than 64, wse-cluster's bound",
    }
    for payload, expected in cases.items():
        reply = _raw(a.socket, payload)
        assert len(reply.splitlines()) == 1 and expected in json.loads(reply)["error"], (payload[:60], reply)
    # Params that take seconds to check (sparsity masks of a wide model) are checked in a child:
    # the service answers others meanwhile; they are refused after (4 CS-2s on a pool of 2).
    slow = {**good, "model": {**good["model"], "hidden_size": 2048, "num_heads": 16, "sparsity": 0.5}, **four}
    refusal = []
    worker = threading.Thread(target=lambda: refusal.append(_raw(a.socket, json.dumps(
        {"op": "submit", "params": slow, "cwd": str(tmp_path)}).encode() + b"\n")))
    second = threading.Thread(target=lambda: refusal.append(_raw(a.socket, json.dumps(
        {"op": "submit", "params": slow, "cwd": str(tmp_path)}).encode() + b"\n")))
    service = a.client.status()["pid"]
    worker.start()
    second.start()
    until(lambda: len(_children(service)) == 2, "the service forks the checks")
    assert a.client.status()["pid"] == service and worker.is_alive(), "answered while the checks run"
    third = json.loads(_raw(a.socket, json.dumps({"op": "submit", "params": slow, "cwd": str(tmp_path)}).encode()
                            + b"\n"))
    assert third["error"] == "too many submissions being checked at once; submit again in a moment", third
    worker.join()
    second.join()
    assert all("runconfig.num_csx: 4 CS-2s asked, the appliance has 2" in r for r in refusal), refusal

    assert a.client.jobs() == []
    again = a.wse("appliance", "start", "--state_dir", a.state_dir)
    assert again.returncode == 1 and "an appliance already answers there" in again.stderr, again.stderr
    st = a.client.status()
    assert st["free_csx"] == 2 and st["queued"] == st["running"] == 0
    idle.close()


# -- several users ---------------------------------------------------------------------------------

@pytest.fixture
def other_user():
    """A second local user, created for the test (root only); Python made runnable by it; removed after."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create a second user")
    name = f"wsetest{os.getpid() % 100000}"
    subprocess.run(["userdel", name], capture_output=True)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    # The other user must be able to run this Python: open the directories above it to traversal
    # (o+x) for the test's duration, as an installation for several users would have them.
    changed = []
    for target in (os.path.realpath(sys.executable), str(Path(__file__).resolve().parent)):
        for d in reversed(Path(target).parents):
            mode = d.stat().st_mode
            if not mode & stat.S_IXOTH:
                os.chmod(d, mode | stat.S_IXOTH)
                changed.append((d, mode))
    home = Path(f"/tmp/{name}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(mode=0o755)
    account = pwd.getpwnam(name)
    os.chown(home, account.pw_uid, account.pw_gid)
    yield account, home
    for d, mode in reversed(changed):
        os.chmod(d, stat.S_IMODE(mode))
    subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
    subprocess.run(["userdel", name], capture_output=True)
    shutil.rmtree(home, ignore_errors=True)


def as_user(account, cwd, fn):
    """Run ``fn()`` in a child process with ``account``'s credentials; return what it returned (JSON)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the user, call, report
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(account.pw_gid)
            os.setuid(account.pw_uid)
            os.chdir(cwd)
            out = {"ok": fn()}
        except BaseException as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = json.loads(f.read())
    os.waitpid(pid, 0)
    return out


def test_users_see_and_control_only_their_own_jobs_and_jobs_run_as_their_user(tmp_path, data, jobs, other_user,
                                                                              appliance):  # torn down first
    """Root's appliance: a second user sees none of root's jobs and cannot cancel, follow or stop them
    (one line each); their own job runs as them (files theirs), and where they may not write it fails
    with the reason; root sees every job."""
    account, home = other_user
    shared = home / "appliance"  # where every user reaches the socket (pytest's tmp_path is root's alone)
    shared.mkdir(mode=0o755)
    a = appliance(4, shared)
    roots = a.submit(params_file(tmp_path / "root.yaml", data, tmp_path / "root", max_steps=100000))
    shutil.copytree(data, home / "lm")
    for p in [home / "lm", *(home / "lm").iterdir()]:
        os.chown(p, account.pw_uid, account.pw_gid)
    theirs = params_file(home / "p.yaml", home / "lm", home / "model")
    forbidden = params_file(home / "f.yaml", home / "lm", tmp_path / "not-theirs")
    secret = tmp_path / "secret"  # root's run: its progress must not show in the other user's job
    secret.mkdir()
    (secret / "metrics.jsonl").write_text(json.dumps({"step": 7, "loss": 1.5, "sim_step_s": 0.1}) + "\n")
    peek = params_file(home / "peek.yaml", home / "lm", secret)
    for p in (theirs, forbidden, peek):
        os.chown(p, account.pw_uid, account.pw_gid)
    client = Client(a.socket)

    def attempts():
        out = {"jobs": client.jobs()}
        for op in ("cancel", "job"):
            try:
                getattr(client, op)(roots)
                out[op] = "allowed"
            except ApplianceError as exc:
                out[op] = str(exc)
        try:
            "".join(client.logs(roots))
            out["logs"] = "allowed"
        except ApplianceError as exc:
            out["logs"] = str(exc)
        try:
            client.stop()
            out["stop"] = "allowed"
        except ApplianceError as exc:
            out["stop"] = str(exc)
        try:
            Job.from_yaml(theirs).submit(socket=a.socket, priority=1)
            out["priority"] = "allowed"
        except ApplianceError as exc:
            out["priority"] = str(exc)
        out["submitted"] = Job.from_yaml(theirs).submit(socket=a.socket).id
        out["forbidden"] = Job.from_yaml(forbidden).submit(socket=a.socket).id
        out["peek"] = Job.from_yaml(peek).submit(socket=a.socket).id
        d = Job.from_yaml(theirs, model_dir=home / "elsewhere").params.to_dict()
        out["cwd"] = client.request("submit", params=d, cwd=str(tmp_path))["job"]["id"]  # a directory not theirs
        return out

    got = as_user(account, home, attempts)
    assert "ok" in got, got
    got = got["ok"]
    assert got["jobs"] == []
    for op in ("cancel", "job", "logs"):
        assert got[op] == f"no job {roots} of yours (user {account.pw_name})", got
    assert got["stop"] == "only root may stop this appliance"
    assert got["priority"] == "priority: above 0 only for root (you may lower a job's priority, not raise it)"
    mine = a.wait(got["submitted"])
    assert mine["state"] == "done" and mine["user"] == account.pw_name, mine
    owners = {p.stat().st_uid for p in (home / "model").rglob("*")}
    assert owners == {account.pw_uid}, owners
    bad = a.wait(got["forbidden"])
    assert bad["state"] == "failed" and "Permission denied" in bad["reason"], bad
    assert not (tmp_path / "not-theirs").exists()
    peeked = a.wait(got["peek"])
    assert peeked["state"] == "failed" and peeked["step"] == 0 and peeked["loss"] is None, peeked
    bad = a.wait(got["cwd"])
    assert bad["state"] == "failed" and bad["reason"] == f"error: cannot enter {tmp_path}: Permission denied", bad
    everyone = {j["id"]: j["user"] for j in a.client.jobs()}
    assert everyone[roots] == "root" and everyone[got["submitted"]] == account.pw_name
    assert a.client.job(roots)["state"] == "running"
    a.client.cancel(roots)
    assert a.wait(roots)["state"] == "cancelled"


def test_an_appliance_of_an_ordinary_user_serves_only_that_user(tmp_path, jobs, other_user):
    """Started by a user, the appliance refuses other users' jobs, root's included, in one line."""
    account, home = other_user
    sock = home / "a.sock"
    start = subprocess.run([sys.executable, "-m", "pyapi.cli", "appliance", "start", "--num_csx", "1", "--socket",
                            str(sock), "--state_dir", str(home / "state")], user=account.pw_uid,
                           group=account.pw_gid, extra_groups=[], cwd=home, capture_output=True, text=True,
                           env={**os.environ, "HOME": str(home)}, timeout=120)
    assert start.returncode == 0, start.stderr
    client = Client(sock)
    try:
        assert client.status()["user"] == account.pw_name
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        params = tmp_path / "p.yaml"
        params_file(params, tmp_path / "nodata", tmp_path / "m")
        from pyapi.params import load

        with pytest.raises(ApplianceError, match=f"this appliance serves only user {account.pw_name}"):
            client.submit(load(params))
        assert client.jobs() == []  # root sees all: there are none
    finally:
        client.stop()
