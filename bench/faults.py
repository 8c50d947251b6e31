"""Fault campaign: kill and stop every role at random moments, kill the launcher; count what is named right.

    wse bench faults [--json PATH] [--kills 4] [--seed 0] [--peer_timeout 5]

A small GPT-2 trains through ``wse fit`` on 2 CS-2s (8 ranks: coordinator, 2 MemoryX, 1 SwarmX,
2 CS-2s, 2 input workers). A first, undisturbed run measures how long a job lives. Then:

* ``--kills`` SIGKILLs per role type (coordinator, memoryx, swarmx, csx, worker), each at a moment
  drawn uniformly over that lifetime from the launch (start-up, training and shutdown alike; a
  rank not yet through ``MPI_Init`` is found by its ``PMI_RANK``), of a random rank of that role.
  A trial counts as right when ``wse fit`` exits 1 with a line naming that rank, its role and
  ``SIGKILL``; the time is from the kill to the exit of ``wse fit``. A kill that lands after the
  job ended is drawn again.
* one SIGSTOP per role type, during training: right when the rank is named as stopped; the time
  must stay within ``peer_timeout`` + 5 s.
* SIGTERM, SIGINT and SIGKILL to the ``wse fit`` process itself: the processes of the job (ranks,
  their supervisors, mpiexec, hydra's proxy) still alive 5 s later are counted; the goal is none.
  SIGHUP to a ``wse fit`` that ignores it (``nohup``): right when the job trains to its end.
* serve: a SIGKILL of a CS-2 rank of ``wse serve --num_csx 2`` while it idles, and a SIGSTOP of one
  mid-request: right when a request after it gets the undisturbed run's tokens (a request caught
  by the stop may fail, in bounded time, never hang).
* front-end: a SIGKILL of a CS-2 rank under ``python -m pyapi.cstorch examples/cstorch_fc.py``: right
  when the script ends in one line naming the rank (no traceback); each checkpoint it wrote before
  has the undisturbed run's tensors.
* appliance: a job submitted with one restart, a CS-2 rank of it SIGKILLed: right when its log
  names the rank and the job ends done with the undisturbed run's weights.
* disk: the model_dir on a tmpfs that fills between checkpoints (root only): right when the line
  names the file and the full disk; after room is made, the resumed run has the undisturbed weights.
* bad params: files a user could write by mistake, given to ``wse compile`` and ``wse fit``: right
  when each is one line naming what is wrong, exit 1, within 30 s.

For every trial: hangs (no end within its bound), orphans (processes of the trial alive 5 s after
it ended), leftovers (MPICH's shared memory, doorbell and inference directories it made and left)
and bits lost (a resume, a restart or a surviving checkpoint whose weights are not those of the
undisturbed run). The baseline of the timings is the undisturbed run's own wall time.
"""
import glob
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.bad_params import BAD_PARAMS
from bench.harness import machine, table
from mpi_launch.launcher import job_processes
from mpi_launch.rundir import RunDir
from wse_core.errors import JobError

ROLES = ("coordinator", "memoryx", "swarmx", "csx", "worker")
MODEL = {"name": "gpt2", "vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
         "max_position_embeddings": 32}
#: What a trial may leave behind, made by MPICH (its shared memory), the messaging layer (doorbells) and
#: inference jobs (their directories): counted when one appears in a trial and outlives it by 5 s.
LITTER = ("/dev/shm/mpich_shm_*", "/dev/shm/wse-bells-*", "/tmp/wse-bells-*", "/tmp/wse-infer-*")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cstorch_fc.py"
def add_arguments(parser):
    parser.add_argument("--kills", type=int, default=4, help="SIGKILLs per role type")
    parser.add_argument("--seed", type=int, default=0, help="seed of the moments and victims")
    parser.add_argument("--peer_timeout", type=int, default=5, help="runconfig.peer_timeout of the jobs")
    parser.add_argument("--steps", type=int, default=60, help="training steps of each job")


def _rank_pid(marker, rank):
    """The pid of ``rank``'s process (the rank itself, not its supervisor), from any moment after mpiexec started it."""
    candidates = {}
    for pid in job_processes(marker):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in env and (b"mpi_launch.run" in cmd or b"mpi_launch.inference" in cmd):
            candidates[pid] = ppid
    children = [p for p, ppid in candidates.items() if ppid in candidates]  # forked from its supervisor
    return children[0] if children else None


def litter():
    return {path for pattern in LITTER for path in glob.glob(pattern)}


def _settled(before, marker, seconds=5.0):
    """(orphans, leftovers) of a trial that has ended: its processes, and the litter it made, still there
    ``seconds`` later (0 as soon as none are)."""
    deadline = time.monotonic() + seconds
    while (job_processes(marker) or litter() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(job_processes(marker)), sorted(litter() - before)


def weights(path):
    """The trained weights of a model_dir's latest checkpoint (or of a checkpoint), by name."""
    from data_tools.checkpoint import Checkpoint

    return Checkpoint(path).load()[0]


def same_bits(a, b):
    import numpy as np

    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


class Campaign:
    def __init__(self, args, work):
        from data_tools.preprocess import preprocess_text

        self.args, self.work, self.rng = args, Path(work), random.Random(args.seed)
        self.data = self.work / "data"
        preprocess_text(["stdlib"], self.data, 32, samples_per_file=4000, progress=False)
        self.n = 0
        self.reference = None  # the undisturbed run's model_dir (its final weights are every bit's reference)

    def params(self, model_dir, steps):
        import yaml

        p = {"train_input": {"data_dir": str(self.data), "batch_size": 8, "micro_batch_size": 2},
             "model": dict(MODEL), "optimizer": {"learning_rate": 1e-3},
             "runconfig": {"max_steps": steps, "num_csx": 2, "num_wgt_servers": 2, "log_steps": 100000,
                           "checkpoint_steps": 20, "peer_timeout": self.args.peer_timeout,
                           "model_dir": str(model_dir)}}
        path = model_dir.parent / f"{model_dir.name}.yaml"
        path.write_text(yaml.safe_dump(p))
        return path

    def start(self, steps, model_dir=None, **popen):
        if model_dir is None:
            self.n += 1
            model_dir = self.work / f"job{self.n}"
        path = self.params(model_dir, steps)
        proc = subprocess.Popen([sys.executable, "-m", "pyapi.cli", "fit", str(path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True, **popen)
        return proc, model_dir

    def plan(self, model_dir, proc, timeout=120):
        path = RunDir(model_dir).plan_json
        deadline = time.monotonic() + timeout
        while not path.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        return json.loads(path.read_text())["plan"]

    def finish(self, proc, timeout=300):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in job_processes(str(self.work)):
                os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate()
            return None, "hung"
        return proc.returncode, (err.strip().splitlines() or [""])[-1]

    def lost_bits(self, model_dir):
        """Train ``model_dir`` to its end again (a resume from its latest checkpoint) and compare its final
        weights with the undisturbed run's: True when they differ or the resume fails."""
        proc, _ = self.start(self.args.steps, model_dir)
        code, line = self.finish(proc)
        return code != 0 or not same_bits(weights(model_dir), weights(self.reference))

    def calibrate(self):
        t0 = time.monotonic()
        proc, self.reference = self.start(self.args.steps)
        code, line = self.finish(proc)
        if code != 0:
            raise JobError(f"the undisturbed job failed: {line}")
        return time.monotonic() - t0

    def victim(self, plan, role):
        ranks = {"coordinator": [plan["coordinator"]], "memoryx": plan["memoryx"], "swarmx": plan["swarmx"],
                 "csx": plan["csx"], "worker": [r for ws in plan["workers"] for r in ws]}[role]
        return self.rng.choice(ranks)

    def wait_for_steps(self, model_dir, proc):
        metrics = RunDir(model_dir).metrics
        while proc.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.05)

    def kill_trial(self, role, lifetime):
        while True:
            before = litter()
            moment = self.rng.uniform(0.0, lifetime)
            t_launch = time.monotonic()
            proc, model_dir = self.start(self.args.steps)
            plan = self.plan(model_dir, proc)
            rank = self.victim(plan, role)
            pid = None
            while proc.poll() is None and (time.monotonic() - t_launch < moment or pid is None):
                pid = pid or _rank_pid(str(model_dir), rank)
                time.sleep(0.005)
            if proc.poll() is not None or pid is None:
                self.finish(proc)
                continue  # the job ended before the moment: draw again
            phase = self.phase(model_dir, rank)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                self.finish(proc)
                continue
            t_kill = time.monotonic()
            code, line = self.finish(proc)
            seconds = time.monotonic() - t_kill
            if code == 0:
                continue  # the rank had already exited: nothing to name, draw again
            right = (code == 1 and line.startswith(f"wse fit: rank {rank} ({role} ")
                     and "killed by signal 9 (SIGKILL)" in line)
            orphans, leftovers = _settled(before, str(model_dir))
            return {"kind": "rank killed", "role": role, "rank": rank, "moment_s": round(moment, 2),
                    "phase": phase, "seconds_to_end": round(seconds, 2), "named_right": right, "line": line,
                    "hung": code is None, "orphans": orphans, "leftovers": leftovers,
                    "bits_lost": self.lost_bits(model_dir)}

    @staticmethod
    def phase(model_dir, rank):
        log = RunDir(model_dir).watchdog_log
        events = []
        if log.exists():
            for line in log.read_text().splitlines():
                try:
                    m = json.loads(line)
                except ValueError:
                    continue
                if m.get("rank") == rank:
                    events.append(m.get("event"))
        return "shutdown" if "done" in events else "training" if "ready" in events else "start-up"

    def stop_trial(self, role):
        before = litter()
        proc, model_dir = self.start(100000)
        plan = self.plan(model_dir, proc)
        self.wait_for_steps(model_dir, proc)
        time.sleep(self.rng.uniform(0.0, 2.0))
        rank = self.victim(plan, role)
        os.kill(int(RunDir(model_dir).pid_file(rank).read_text()), signal.SIGSTOP)
        t_stop = time.monotonic()
        code, line = self.finish(proc)
        seconds = time.monotonic() - t_stop
        right = code == 1 and line.startswith(f"wse fit: rank {rank} ({role} ") and "stopped answering" in line
        orphans, leftovers = _settled(before, str(model_dir))
        return {"kind": "rank stopped", "role": role, "rank": rank, "seconds_to_end": round(seconds, 2),
                "named_right": right, "within_bound": seconds <= self.args.peer_timeout + 5, "line": line,
                "hung": code is None, "orphans": orphans, "leftovers": leftovers, "bits_lost": False}

    def launcher_trial(self, sig):
        before = litter()
        proc, model_dir = self.start(100000)
        self.wait_for_steps(model_dir, proc)
        processes = len(job_processes(str(model_dir)))
        proc.send_signal(sig)
        t0 = time.monotonic()
        left = []
        while time.monotonic() - t0 < 5.0:
            left = job_processes(str(model_dir))
            if not left:
                break
            time.sleep(0.05)
        gone_after = time.monotonic() - t0 if not left else None
        _, err = proc.communicate()
        line = (err.strip().splitlines() or [""])[-1]
        orphans, leftovers = _settled(before, str(model_dir))
        right = (proc.returncode == 128 + sig or proc.returncode == -sig) and (
            sig == signal.SIGKILL or f"interrupted by {signal.Signals(sig).name}" in line)
        return {"kind": "signal to wse fit", "signal": signal.Signals(sig).name, "processes_before": processes,
                "left_after_5s": len(left), "all_gone_after_s": None if gone_after is None else round(gone_after, 2),
                "exit_code": proc.returncode, "named_right": right, "line": line, "hung": False,
                "orphans": orphans, "leftovers": leftovers, "bits_lost": self.lost_bits(model_dir)}

    def nohup_trial(self):
        """SIGHUP to a `wse fit` started with SIGHUP ignored (as nohup does): it must train to its end."""
        before = litter()
        proc, model_dir = self.start(self.args.steps, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
        self.wait_for_steps(model_dir, proc)
        proc.send_signal(signal.SIGHUP)
        code, line = self.finish(proc)
        orphans, leftovers = _settled(before, str(model_dir))
        return {"kind": "signal to wse fit", "signal": "SIGHUP under nohup", "named_right": code == 0,
                "line": line, "hung": code is None, "orphans": orphans, "leftovers": leftovers,
                "bits_lost": code == 0 and not same_bits(weights(model_dir), weights(self.reference))}

    # -- serving -------------------------------------------------------------------------------------
    def serve_trials(self):
        """SIGKILL of a CS-2 rank of `wse serve --num_csx 2` while it idles, then SIGSTOP of one mid-request."""
        import socket as socketlib

        with socketlib.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = json.dumps({"model": self.reference.name, "prompt": "def ", "max_tokens": 24,
                           "temperature": 0}).encode()

        def ask(timeout):
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout) as r:
                    return json.loads(r.read())["choices"][0]["text"]
            except OSError as exc:
                return exc  # an HTTP error, a refused or lost connection, a timeout

        before = litter()
        server = subprocess.Popen([sys.executable, "-m", "pyapi.cli", "serve", str(self.reference), "--num_csx", "2",
                                   "--port", str(port), "--peer_timeout", str(self.args.peer_timeout)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        trials = []
        try:
            deadline = time.monotonic() + 120
            expected = ask(10)
            while isinstance(expected, Exception) and time.monotonic() < deadline and server.poll() is None:
                time.sleep(0.5)
                expected = ask(10)
            if isinstance(expected, Exception):
                raise JobError(f"wse serve did not answer: {expected}")
            for sig in (signal.SIGKILL, signal.SIGSTOP):
                pid = self._serve_csx()
                if sig == signal.SIGSTOP:  # mid-request: the request is on its way when the rank stops
                    import threading

                    caught = {}
                    asking = threading.Thread(target=lambda: caught.update(answer=ask(4 * self.args.peer_timeout
                                                                                      + 60)))
                    asking.start()
                    time.sleep(0.05)
                    os.kill(pid, sig)
                    asking.join()
                    hung = isinstance(caught.get("answer"), TimeoutError)
                    said = "the request it caught: " + ("answered" if isinstance(caught.get("answer"), str) else
                                                        f"refused ({caught.get('answer')})") + "; "
                else:
                    os.kill(pid, sig)
                    time.sleep(1.0)  # idle: the server learns of the death before the next request
                    hung, said = False, ""
                after = ask(4 * self.args.peer_timeout + 60)
                said += "the next: " + ("the undisturbed tokens" if after == expected else repr(after)[:100])
                trials.append({"kind": "serve", "what": f"{signal.Signals(sig).name} of a CS-2 rank",
                               "named_right": after == expected, "line": said[:300], "hung": hung,
                               "orphans": 0, "leftovers": [], "bits_lost": not isinstance(after, Exception)
                               and after != expected})
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.communicate()
        orphans, leftovers = _settled(before, f"--port {port}")
        trials[-1].update(orphans=orphans, leftovers=leftovers)
        return trials

    @staticmethod
    def _serve_csx(timeout=60):
        """The pid of a CS-2 rank of the running inference job under `wse serve` (its directory in /tmp, the
        newest): the rank plan_of gives its first CS-2."""
        from mpi_launch.inference import plan_of

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for d in sorted(glob.glob("/tmp/wse-infer-*"), key=os.path.getmtime, reverse=True):
                try:
                    rank = plan_of(RunDir(d).read_run()["inference"]).csx[0]
                    return int(RunDir(d).pid_file(rank).read_text())
                except (OSError, ValueError, KeyError):
                    continue  # a job still starting (or gone): look again
            time.sleep(0.1)
        raise JobError("no CS-2 rank of the inference job found")

    # -- the front-end ----------------------------------------------------------------------------------
    def front_end_trial(self):
        """SIGKILL of a CS-2 rank under examples/cstorch_fc.py (200 steps, a checkpoint every 50)."""
        import torch

        import pyapi.cstorch as cstorch

        runs = []
        for name in ("undisturbed", "killed"):
            where = self.work / f"front_end_{name}"
            where.mkdir()
            before = litter()
            # Through `python -m pyapi.cstorch`, the runner that makes a failed job one line (a script run
            # as `python script.py` ends in Python's own traceback, whose last line is the same).
            proc = subprocess.Popen([sys.executable, "-m", "pyapi.cstorch", str(EXAMPLE), "CSX", "2", "200", "50"],
                                    cwd=where,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            if name == "killed":
                run_dir = RunDir(where / "cerebras_logs" / "run_0" / "model")
                while proc.poll() is None and not (where / "checkpoint_50.h5").exists():
                    time.sleep(0.05)
                rank = json.loads(run_dir.plan_json.read_text())["plan"]["csx"][1] if run_dir.plan_json.exists() \
                    else None
                if rank is not None and run_dir.pid_file(rank).exists():
                    os.kill(int(run_dir.pid_file(rank).read_text()), signal.SIGKILL)
            try:
                _, err = proc.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                _, err = proc.communicate()
            runs.append((where, proc.returncode, err, before))
        (ref, _, _, _), (where, code, err, before) = runs
        lines = err.strip().splitlines() or [""]
        right = code == 1 and "Traceback" not in err and f"rank {rank} (csx 1)" in lines[-1] and "SIGKILL" in lines[-1]
        lost = False
        for ckpt in sorted(where.glob("checkpoint_*.h5")):
            try:
                a, b = cstorch.load(str(ckpt))["model"], cstorch.load(str(ref / ckpt.name))["model"]
                lost |= any(not torch.equal(a[k], b[k]) for k in a)
            except Exception:  # noqa: BLE001 - a checkpoint that does not load is a checkpoint lost
                lost = True
        orphans, leftovers = _settled(before, str(where))
        return {"kind": "front-end", "what": "SIGKILL of a CS-2 rank", "named_right": right, "line": lines[-1],
                "hung": code is None, "orphans": orphans, "leftovers": leftovers, "bits_lost": lost}

    # -- the appliance ---------------------------------------------------------------------------------
    def appliance_trial(self):
        """A job with one restart on an appliance of 2 CS-2s; a CS-2 rank of it SIGKILLed while it trains."""
        from pyapi import Job

        state, sock = self.work / "appliance", self.work / "appliance.sock"
        before = litter()
        started = subprocess.run([sys.executable, "-m", "pyapi.cli", "appliance", "start", "--num_csx", "2",
                                  "--state_dir", str(state), "--socket", str(sock)], capture_output=True, text=True,
                                 timeout=120)
        if started.returncode != 0:
            raise JobError(f"the appliance did not start: {started.stderr.strip()}")
        try:
            self.n += 1
            model_dir = self.work / f"job{self.n}"
            handle = Job.from_yaml(self.params(model_dir, self.args.steps)).submit(max_restarts=1, socket=str(sock))
            metrics, deadline = RunDir(model_dir).metrics, time.monotonic() + 120
            while not (metrics.exists() and metrics.read_text().count("\n") >= 25) and time.monotonic() < deadline:
                time.sleep(0.05)
            plan = json.loads(RunDir(model_dir).plan_json.read_text())["plan"]
            rank = plan["csx"][0]
            os.kill(int(RunDir(model_dir).pid_file(rank).read_text()), signal.SIGKILL)
            try:
                handle.wait()
                done = True
            except Exception:  # noqa: BLE001 - a job that failed: not named right
                done = False
            log = handle.logs()
        finally:
            subprocess.run([sys.executable, "-m", "pyapi.cli", "appliance", "stop", "--socket", str(sock)],
                           capture_output=True, timeout=120)
        named = f"rank {rank} (csx 0): the process died (killed by signal 9 (SIGKILL))" in log
        orphans, leftovers = _settled(before, str(state))
        return {"kind": "appliance", "what": "SIGKILL of a CS-2 rank, one restart", "named_right": done and named,
                "line": [ln for ln in log.splitlines() if "restart" in ln][:1], "hung": False, "orphans": orphans,
                "leftovers": leftovers, "bits_lost": not done or not same_bits(weights(model_dir),
                                                                                weights(self.reference))}

    # -- a full disk -----------------------------------------------------------------------------------
    def disk_trial(self):
        """The model_dir on a 64 MB tmpfs, filled after the first checkpoint: the next checkpoint fails."""
        disk = self.work / "disk"
        disk.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True,
                                 text=True)
        if mounted.returncode != 0:
            return None  # not root: said in the report
        try:
            before = litter()
            proc, model_dir = self.start(self.args.steps, disk / "model")
            while proc.poll() is None and not (model_dir / "checkpoint_20").exists():
                time.sleep(0.05)
            filler = disk / "filler"
            with open(filler, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    pass
            code, line = self.finish(proc)
            right = code == 1 and "No space left on device" in line and str(model_dir) in line
            orphans, leftovers = _settled(before, str(model_dir))
            filler.unlink()
            return {"kind": "disk full", "what": "between checkpoints", "named_right": right, "line": line,
                    "hung": code is None, "orphans": orphans, "leftovers": leftovers,
                    "bits_lost": self.lost_bits(model_dir)}
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)

    # -- bad params ------------------------------------------------------------------------------------
    def bad_params_trials(self):
        trials = []
        import yaml

        base = yaml.safe_load(self.params(self.work / "bad", 5).read_text())  # a good file, one section spoiled
        for k, (what, text) in enumerate(BAD_PARAMS):
            path = self.work / f"bad{k}.yaml"
            if text == "dir":
                path.mkdir()
            elif text == "fifo":
                os.mkfifo(path)
            elif text == "/dev/zero":
                path = Path("/dev/zero")
            else:
                raw = text if isinstance(text, bytes) else text.encode()
                if text and what not in ("YAML that does not parse", "an alias bomb", "nesting 10,000 deep",
                                         "a duplicate key", "not UTF-8"):
                    merged = {**base, **{s: {**base.get(s, {}), **v} if isinstance(v, dict) else v
                                         for s, v in (yaml.safe_load(text) or {}).items()}}
                    merged["runconfig"] = {**merged.get("runconfig", {}), "model_dir": str(self.work / f"bad{k}")}
                    raw = yaml.safe_dump(merged).encode()
                path.write_bytes(raw)
            for command in ("fit",) if "data_dir" in what else ("compile", "fit"):
                before = litter()
                try:
                    proc = subprocess.run([sys.executable, "-m", "pyapi.cli", command, str(path)], capture_output=True,
                                          text=True, timeout=30, start_new_session=True)
                    lines, code, hung = proc.stderr.strip().splitlines(), proc.returncode, False
                except subprocess.TimeoutExpired:
                    lines, code, hung = ["hung"], None, True
                    for pid in job_processes(str(path)):
                        os.kill(pid, signal.SIGKILL)
                said = [ln for ln in lines if "Warning" not in ln]  # a warning before the error is not a second one
                right = code == 1 and len(said) == 1 and said[0].startswith(f"wse {command}: error: ")
                orphans, leftovers = _settled(before, str(self.work / f"bad{k}"))
                trials.append({"kind": "bad params", "what": f"{what} ({command})", "named_right": right,
                               "line": (said or [""])[-1][:200], "hung": hung, "orphans": orphans,
                               "leftovers": leftovers, "bits_lost": False})
        return trials


KINDS = ("rank killed", "rank stopped", "signal to wse fit", "serve", "front-end", "appliance", "disk full",
         "bad params")


def run(args):
    import statistics

    with tempfile.TemporaryDirectory(prefix="wse-faults-") as work:
        c = Campaign(args, work)
        lifetime = c.calibrate()
        kills = [c.kill_trial(role, lifetime) for role in ROLES for _ in range(args.kills)]
        stops = [c.stop_trial(role) for role in ROLES]
        launcher = [c.launcher_trial(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)]
        launcher.append(c.nohup_trial())
        others = c.serve_trials() + [c.front_end_trial(), c.appliance_trial()]
        disk = c.disk_trial()
        bad = c.bad_params_trials()
    trials = kills + stops + launcher + others + ([disk] if disk else []) + bad
    times = [k["seconds_to_end"] for k in kills]
    by_kind = {kind: [t for t in trials if t["kind"] == kind] for kind in KINDS}
    return {
        "machine": machine(), "peer_timeout": args.peer_timeout, "seed": args.seed,
        "undisturbed_job_seconds": round(lifetime, 2),
        "kills": kills, "stops": stops, "launcher": launcher, "others": others, "disk": disk, "bad_params": bad,
        "table": {kind: {"injected": len(ts), "named_right": sum(bool(t["named_right"]) for t in ts),
                         "hangs": sum(bool(t["hung"]) for t in ts), "orphans": sum(t["orphans"] for t in ts),
                         "leftovers": sum(len(t["leftovers"]) for t in ts),
                         "bits_lost": sum(bool(t["bits_lost"]) for t in ts)} for kind, ts in by_kind.items()},
        "summary": {
            "kills_ended_within_5s": sum(k["seconds_to_end"] <= 5 for k in kills), "kills": len(kills),
            "kill_seconds_median": statistics.median(times), "kill_seconds_max": max(times),
            "stops_within_bound": sum(s["within_bound"] for s in stops), "stops": len(stops),
        },
    }


def report(r):
    s = r["summary"]
    rows = [[k["role"], k["rank"], k["phase"], k["moment_s"], k["seconds_to_end"], "yes" if k["named_right"] else "NO",
             k["orphans"]] for k in r["kills"]]
    out = [f"undisturbed job: {r['undisturbed_job_seconds']} s; peer_timeout {r['peer_timeout']} s; seed {r['seed']}",
           "", "SIGKILL of a rank:",
           table(rows, ["role", "rank", "phase", "at s", "ended after s", "named right", "left after 5 s"]), "",
           "SIGSTOP of a rank:",
           table([[x["role"], x["rank"], x["seconds_to_end"], "yes" if x["named_right"] else "NO",
                   "yes" if x["within_bound"] else "NO", x["orphans"]] for x in r["stops"]],
                 ["role", "rank", "ended after s", "named right", f"<= {r['peer_timeout'] + 5} s", "left after 5 s"]),
           "", "signal to `wse fit` itself:",
           table([[x["signal"], x.get("processes_before", "-"), x.get("all_gone_after_s", "-"),
                   x.get("left_after_5s", "-"), x.get("exit_code", "-")] for x in r["launcher"]],
                 ["signal", "processes", "all gone after s", "left after 5 s", "exit code"]),
           "", f"kills ended within 5 s {s['kills_ended_within_5s']}/{s['kills']} (median "
           f"{s['kill_seconds_median']:.2f} s, max {s['kill_seconds_max']:.2f} s); stops within bound "
           f"{s['stops_within_bound']}/{s['stops']}"
           + ("" if r["disk"] else "; disk full: not tried (mounting a tmpfs needs root)"), "",
           table([[kind, *row.values()] for kind, row in r["table"].items()],
                 ["kind", "injected", "named right", "hangs", "orphans", "leftovers", "bits lost"])]
    wrong = [f"{x['kind']}: {x.get('what') or x.get('role') or x.get('signal')}: {x['line']}"
             for x in r["kills"] + r["stops"] + r["launcher"] + r["others"] + [r["disk"] or {}] + r["bad_params"]
             if x and not x["named_right"]]
    if wrong:
        out += ["", "not named right:"] + [f"  {w}" for w in wrong]
    left = sorted({p for x in r["kills"] + r["stops"] + r["launcher"] + r["others"] + r["bad_params"]
                   for p in x["leftovers"]})
    if left:
        out += ["", "left behind:"] + [f"  {p}" for p in left]
    return "\n".join(out)
