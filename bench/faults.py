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
* SIGTERM and SIGKILL to the ``wse fit`` process itself: the processes of the job (ranks, their
  supervisors, mpiexec, hydra's proxy) still alive 5 s later are counted; the goal is none.

The baseline of the timings is the undisturbed run's own wall time.
"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import machine, table
from mpi_launch.launcher import job_processes
from mpi_launch.rundir import RunDir

ROLES = ("coordinator", "memoryx", "swarmx", "csx", "worker")
MODEL = {"name": "gpt2", "vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
         "max_position_embeddings": 32}


def add_arguments(parser):
    parser.add_argument("--kills", type=int, default=4, help="SIGKILLs per role type")
    parser.add_argument("--seed", type=int, default=0, help="seed of the moments and victims")
    for flag in ("--peer_timeout", "--peer-timeout"):
        parser.add_argument(flag, dest="peer_timeout", type=int, default=5, help="runconfig.peer_timeout of the jobs")
    parser.add_argument("--steps", type=int, default=60, help="training steps of each job")


def _rank_pid(marker, rank):
    """The pid of ``rank``'s process (the rank itself, not its supervisor), from any moment after mpiexec started it."""
    candidates = {}
    for pid in job_processes(marker):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in env and b"mpi_launch.run" in Path(f"/proc/{pid}/cmdline").read_bytes():
            candidates[pid] = ppid
    children = [p for p, ppid in candidates.items() if ppid in candidates]  # forked from its supervisor
    return children[0] if children else None


class Campaign:
    def __init__(self, args, work):
        from data_tools.preprocess import preprocess_text

        self.args, self.work, self.rng = args, Path(work), random.Random(args.seed)
        self.data = self.work / "data"
        preprocess_text(["stdlib"], self.data, 32, samples_per_file=4000, progress=False)
        self.n = 0

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

    def start(self, steps):
        self.n += 1
        model_dir = self.work / f"job{self.n}"
        path = self.params(model_dir, steps)
        proc = subprocess.Popen([sys.executable, "-m", "pyapi.cli", "fit", str(path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
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

    def calibrate(self):
        t0 = time.monotonic()
        proc, _ = self.start(self.args.steps)
        code, line = self.finish(proc)
        if code != 0:
            raise RuntimeError(f"the undisturbed job failed: {line}")
        return time.monotonic() - t0

    def victim(self, plan, role):
        ranks = {"coordinator": [plan["coordinator"]], "memoryx": plan["memoryx"], "swarmx": plan["swarmx"],
                 "csx": plan["csx"], "worker": [r for ws in plan["workers"] for r in ws]}[role]
        return self.rng.choice(ranks)

    def kill_trial(self, role, lifetime):
        while True:
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
            return {"role": role, "rank": rank, "moment_s": round(moment, 2), "phase": phase,
                    "seconds_to_end": round(seconds, 2), "named_right": right, "line": line,
                    "left_after_5s": self.leftovers(model_dir)}

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

    @staticmethod
    def leftovers(model_dir, seconds=5.0):
        """Processes of the job still alive ``seconds`` after ``wse fit`` returned (0 as soon as none are)."""
        deadline = time.monotonic() + seconds
        while job_processes(str(model_dir)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(job_processes(str(model_dir)))

    def stop_trial(self, role):
        proc, model_dir = self.start(100000)
        plan = self.plan(model_dir, proc)
        metrics = RunDir(model_dir).metrics
        while proc.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.05)
        time.sleep(self.rng.uniform(0.0, 2.0))
        rank = self.victim(plan, role)
        os.kill(int(RunDir(model_dir).pid_file(rank).read_text()), signal.SIGSTOP)
        t_stop = time.monotonic()
        code, line = self.finish(proc)
        seconds = time.monotonic() - t_stop
        right = code == 1 and line.startswith(f"wse fit: rank {rank} ({role} ") and "stopped answering" in line
        return {"role": role, "rank": rank, "seconds_to_end": round(seconds, 2), "named_right": right,
                "within_bound": seconds <= self.args.peer_timeout + 5, "line": line,
                "left_after_5s": self.leftovers(model_dir)}

    def launcher_trial(self, sig):
        proc, model_dir = self.start(100000)
        metrics = RunDir(model_dir).metrics
        while proc.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.05)
        before = len(job_processes(str(model_dir)))
        proc.send_signal(sig)
        t0 = time.monotonic()
        left = []
        while time.monotonic() - t0 < 5.0:
            left = job_processes(str(model_dir))
            if not left:
                break
            time.sleep(0.05)
        gone_after = time.monotonic() - t0 if not left else None
        proc.communicate()
        return {"signal": signal.Signals(sig).name, "processes_before": before, "left_after_5s": len(left),
                "all_gone_after_s": None if gone_after is None else round(gone_after, 2),
                "exit_code": proc.returncode}


def run(args):
    import statistics

    with tempfile.TemporaryDirectory(prefix="wse-faults-") as work:
        c = Campaign(args, work)
        lifetime = c.calibrate()
        kills = [c.kill_trial(role, lifetime) for role in ROLES for _ in range(args.kills)]
        stops = [c.stop_trial(role) for role in ROLES]
        launcher = [c.launcher_trial(sig) for sig in (signal.SIGTERM, signal.SIGKILL)]
    times = [k["seconds_to_end"] for k in kills]
    return {
        "machine": machine(), "peer_timeout": args.peer_timeout, "seed": args.seed,
        "undisturbed_job_seconds": round(lifetime, 2),
        "kills": kills, "stops": stops, "launcher": launcher,
        "summary": {
            "kills_named_right": sum(k["named_right"] for k in kills),
            "kills_ended_within_5s": sum(k["seconds_to_end"] <= 5 for k in kills),
            "kills": len(kills), "kill_seconds_median": statistics.median(times), "kill_seconds_max": max(times),
            "stops_named_right": sum(s["named_right"] for s in stops),
            "stops_within_bound": sum(s["within_bound"] for s in stops), "stops": len(stops),
            "hangs": sum(x["line"] == "hung" for x in kills + stops),
            "processes_left": sum(x["left_after_5s"] for x in kills + stops + launcher),
        },
    }


def report(r):
    s = r["summary"]
    rows = [[k["role"], k["rank"], k["phase"], k["moment_s"], k["seconds_to_end"], "yes" if k["named_right"] else "NO",
             k["left_after_5s"]] for k in r["kills"]]
    out = [f"undisturbed job: {r['undisturbed_job_seconds']} s; peer_timeout {r['peer_timeout']} s; seed {r['seed']}",
           "", "SIGKILL of a rank:",
           table(rows, ["role", "rank", "phase", "at s", "ended after s", "named right", "left after 5 s"]), "",
           "SIGSTOP of a rank:",
           table([[x["role"], x["rank"], x["seconds_to_end"], "yes" if x["named_right"] else "NO",
                   "yes" if x["within_bound"] else "NO", x["left_after_5s"]] for x in r["stops"]],
                 ["role", "rank", "ended after s", "named right", f"<= {r['peer_timeout'] + 5} s", "left after 5 s"]),
           "", "signal to `wse fit` itself:",
           table([[x["signal"], x["processes_before"], x["all_gone_after_s"], x["left_after_5s"], x["exit_code"]]
                  for x in r["launcher"]], ["signal", "processes", "all gone after s", "left after 5 s", "exit code"]),
           "",
           f"kills named right {s['kills_named_right']}/{s['kills']}, ended within 5 s {s['kills_ended_within_5s']}/"
           f"{s['kills']} (median {s['kill_seconds_median']:.2f} s, max {s['kill_seconds_max']:.2f} s); stops named "
           f"right {s['stops_named_right']}/{s['stops']}, within bound {s['stops_within_bound']}/{s['stops']}; "
           f"hangs {s['hangs']}; processes left {s['processes_left']}"]
    wrong = [x["line"] for x in r["kills"] + r["stops"] if not x["named_right"]]
    if wrong:
        out += ["", "lines that named the wrong thing:"] + [f"  {w}" for w in wrong]
    return "\n".join(out)
