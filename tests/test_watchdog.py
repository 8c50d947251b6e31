"""The watchdog's judgement, fed by fake supervisors over real sockets: which fault is named, and when."""
import json
import socket
import subprocess
import sys
import time

import pytest

from mpi_launch.plan import make_plan
from mpi_launch.watchdog import Watchdog

PLAN = make_plan(num_csx=2, num_wgt_servers=1, num_workers_per_csx=1, swarmx_fanout=2, unit_bytes=[10, 10])
# ranks: 0 coordinator, 1 memoryx, 2 swarmx, 3-4 csx, 5-6 workers


class FakeSupervisor:
    """A supervisor's side of the connection: hello, then whatever the test says the rank did."""

    def __init__(self, watchdog, rank, token=None, **hello):
        self.rank = rank
        self.sock = socket.create_connection(("127.0.0.1", watchdog.port))
        self.send("hello", **{"token": token or watchdog.token, "pid": 1000 + rank, "supervisor": 2000 + rank,
                              "host": "h", **hello})

    def send(self, event, t=None, **fields):
        msg = {"event": event, "rank": self.rank, "time": time.time() if t is None else t, **fields}
        self.sock.sendall((json.dumps(msg) + "\n").encode())

    def closed_by_watchdog(self, timeout=10):
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, socket.timeout):
            return False


@pytest.fixture
def watchdog():
    dog = Watchdog(PLAN, peer_timeout=0.5, startup_timeout=3.0)
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)  # stands in for mpiexec
    dog.start(proc)
    yield dog
    dog.end()
    proc.wait()
    dog.stop()


def connect_all(dog, ready=True):
    sups = [FakeSupervisor(dog, r) for r in range(PLAN.world_size)]
    if ready:
        for s in sups:
            s.send("ready")
    return sups


def verdict(dog, timeout=20):
    deadline = time.monotonic() + timeout  # only a hang reaches this
    while dog.verdict is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return dog.verdict


def test_the_earliest_death_is_named_with_its_signal_whatever_the_arrival_order(watchdog):
    """A casualty reported first, an echo, then the real first death: the first death is named."""
    sups = connect_all(watchdog)
    t = time.time()
    sups[4].send("exit", t=t + 0.05, signal=9)
    sups[2].send("error", t=t + 0.02, line="rank 2 (swarmx 0): PeerLost: MPI error", kind="peer")
    sups[1].send("exit", t=t, signal=9)
    assert verdict(watchdog) == "rank 1 (memoryx 0): the process died (killed by signal 9 (SIGKILL))"
    assert all(s.closed_by_watchdog() for s in sups)  # every supervisor is told to kill its rank


def test_a_kill_from_outside_is_named_before_a_crash_it_caused_even_if_that_was_stamped_first(watchdog):
    """A peer's death can make a rank crash (a lost TCP connection inside the MPI library), and on a
    loaded machine that rank's supervisor may stamp its report first; nothing in a job sends SIGKILL."""
    sups = connect_all(watchdog)
    t = time.time()
    sups[2].send("exit", t=t, signal=11)
    sups[4].send("exit", t=t + 0.01, signal=9)
    assert verdict(watchdog) == "rank 4 (csx 1): the process died (killed by signal 9 (SIGKILL))"


def test_an_error_a_rank_raised_is_named_and_its_exit_code_is_not(watchdog):
    sups = connect_all(watchdog)
    sups[5].send("error", line="rank 5 (worker 0): DataError: data-00002.h5: damaged", kind="cause")
    sups[5].send("exit", code=1)
    assert verdict(watchdog) == "rank 5 (worker 0): DataError: data-00002.h5: damaged"


def test_an_echo_alone_is_named_after_a_grace_period(watchdog):
    """A peer timeout with no death or stop behind it (a hung rank): the timeout line is what there is."""
    sups = connect_all(watchdog)
    sups[0].send("error", line="rank 0 (coordinator 0): PeerTimeout: no answer within 20 s", kind="peer")
    assert verdict(watchdog) == "rank 0 (coordinator 0): PeerTimeout: no answer within 20 s"


def test_a_stopped_rank_is_named_after_peer_timeout(watchdog):
    sups = connect_all(watchdog)
    sups[3].send("stopped", signal=19)
    assert verdict(watchdog).startswith("rank 3 (csx 0): stopped answering: its process has been stopped (SIGSTOP)")


def test_a_rank_continued_in_time_is_not_a_fault(watchdog):
    sups = connect_all(watchdog)
    sups[3].send("stopped", signal=19)
    sups[3].send("continued")
    time.sleep(1.5)  # three peer_timeouts
    assert watchdog.verdict is None and not watchdog.incidents


def test_a_rank_stopped_after_its_work_is_judged_at_the_end_of_training(watchdog):
    """An input worker that sent everything and was stopped: named once the training ended and it did not exit."""
    sups = connect_all(watchdog)
    sups[6].send("done")
    sups[6].send("stopped", signal=19)
    time.sleep(1.0)
    assert watchdog.verdict is None  # nothing needs it until the end
    for r in range(PLAN.world_size):
        if r != 6:
            sups[r].send("done")
            sups[r].send("exit", code=0)
    assert verdict(watchdog) == ("rank 6 (worker 1): finished its work but did not exit (its process is stopped, "
                                 "SIGSTOP) within runconfig.peer_timeout (0.5 s) after the training ended")


def test_a_rank_that_never_starts_is_named_after_startup_timeout(watchdog):
    sups = [FakeSupervisor(watchdog, r) for r in range(PLAN.world_size) if r != 4]
    for s in sups:
        s.send("ready")
    assert verdict(watchdog) == "rank 4 (csx 1): was not started within runconfig.startup_timeout (3 s)"


def test_a_lost_supervisor_is_named(watchdog):
    sups = connect_all(watchdog)
    sups[2].sock.close()
    assert verdict(watchdog) == "rank 2 (swarmx 0): lost its supervisor process (killed, or its host is unreachable)"


def test_a_lost_mpi_proxy_is_named(watchdog):
    sups = connect_all(watchdog)
    sups[5].send("proxy_lost")
    sups[5].send("exit", signal=9)
    assert verdict(watchdog) == "rank 5 (worker 0): its MPI process manager (hydra_pmi_proxy) on h died"


def test_mpiexec_killed_is_named_not_the_supervisors_it_took_with_it(watchdog):
    """SIGKILL of mpiexec: its proxies kill the supervisors they started, whose lost connections are
    the echo; the verdict names mpiexec (it named a worker's lost supervisor)."""
    sups = connect_all(watchdog)
    watchdog.proc.kill()  # the fixture's stand-in for mpiexec
    watchdog.proc.wait()
    sups[5].sock.close()
    sups[2].sock.close()
    assert verdict(watchdog) == (f"mpiexec (pid {watchdog.proc.pid}) was killed by signal 9 (SIGKILL); its MPI "
                                 "proxies ended every rank")


def test_the_job_is_over_only_once_its_processes_on_this_host_have_exited(watchdog):
    """``wait_gone``, which ``launch`` calls once the job is over: it returns only when the processes
    the supervisors' hellos named on this host (rank, supervisor, MPI proxy) have exited. A process
    killed takes a moment to exit on a loaded machine: a test that looked right after launch returned
    found a SIGKILLed rank's supervisor still there."""
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])  # stands in for one
    sup = FakeSupervisor(watchdog, 0, host=socket.gethostname(), pid=exiting.pid, supervisor=exiting.pid,
                         proxy=exiting.pid)
    deadline = time.monotonic() + 20  # only a hang reaches these bounds
    while exiting.pid not in watchdog.ranks[0].processes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert exiting.pid in watchdog.ranks[0].processes
    watchdog.wait_gone(60)
    assert exiting.poll() is not None
    sup.sock.close()


def test_a_connection_without_the_job_token_is_ignored(watchdog):
    sups = connect_all(watchdog)
    intruder = FakeSupervisor(watchdog, 1, token="not-the-token")
    assert intruder.closed_by_watchdog()
    time.sleep(0.5)
    assert watchdog.verdict is None and watchdog.ranks[1].pid == 1001 and len(sups) == PLAN.world_size


def test_the_launcher_hears_once_when_every_rank_is_ready():
    """`on_ready` is called once, when the last rank says it is ready (the launcher's line that the
    ranks are up and what comes before the first step), not before and not again."""
    heard = []
    dog = Watchdog(PLAN, peer_timeout=0.5, startup_timeout=30.0, on_ready=heard.append)
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    dog.start(proc)
    try:
        sups = connect_all(dog, ready=False)
        for s in sups[:-1]:
            s.send("ready")
        time.sleep(0.3)  # time for those reports to arrive: none of them may call it
        assert heard == []
        sups[-1].send("ready")
        sups[0].send("ready")  # said twice: still one call
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert len(heard) == 1 and heard[0] >= 0
    finally:
        dog.end()
        proc.wait()
        dog.stop()
