"""Messaging: chunked relay and reduce through a SwarmX tree, and waits that give up on a silent peer."""
import json
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpi_launch import messaging as msg
from mpi_launch.mpiexec import run_mpi
from mpi_launch.protocol import GRADS, INFER, STEP, Layout, ProtocolError


def test_chunked_tree_reduce_is_the_pairwise_tree_sum():
    """4 CS-2 leaves, fan-out 2, buffers of 2.3 MiB (3 chunks, the last partial): the MemoryX gets
    exactly tree_sum of the leaves' buffers (checked bit for bit inside the program), as do MPI's."""
    sizes = [2.3, 0.001]
    proc = run_mpi(8, [sys.executable, "-m", "bench._swarmx_reduce", 4, 2, 1, *sizes], timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ranks"] == 8 and set(out["seconds"]) == {str(s) for s in sizes}
    assert msg.CHUNK_FLOATS * 4 < 2.3 * 2**20 < 3 * msg.CHUNK_FLOATS * 4


def test_chunks_cover_the_array_once():
    a = np.arange(2 * msg.CHUNK_FLOATS + 6, dtype=np.float32).reshape(-1, 2)
    pieces = msg.chunks(a)
    assert [p.size for p in pieces] == [msg.CHUNK_FLOATS, msg.CHUNK_FLOATS, 6]
    assert all(np.shares_memory(p, a) for p in pieces)
    assert np.array_equal(np.concatenate(pieces), a.reshape(-1))
    assert [p.size for p in msg.chunks(np.zeros((0, 3), np.float32))] == [0]


def test_a_wait_for_a_silent_peer_times_out_naming_it():
    comm = MPI.COMM_SELF
    link = msg.Link(comm, Layout())
    tag = link.tag
    buf = np.empty(4, np.float32)
    req = comm.Irecv(buf, source=0, tag=tag(GRADS, 3))
    t0 = time.monotonic()
    with pytest.raises(msg.PeerTimeout, match="no answer within 0.2 s while waiting for SwarmX rank 7"):
        link.wait_all([req], "SwarmX rank 7", timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 120  # only a hang breaks it (tests never assert timings)
    req.Cancel()
    req.Wait()  # completes at once, as cancelled
    sent = comm.Isend(np.zeros(4, np.float32), dest=0, tag=tag(GRADS, 4))
    done = comm.Irecv(buf, source=0, tag=tag(GRADS, 4))
    link.wait_all([sent, done], "self", timeout=1)
    link.wait_all([done], "self again", timeout=1)  # already complete: returns, never waits out the timeout
    # The job's timeout (Role.step_done sets it on the rank's link) says why it is that long.
    link.set_timeout(0.3, "runconfig.peer_timeout 0 s + twice the longest step so far, 0.1 s")
    req = comm.Irecv(buf, source=0, tag=tag(GRADS, 5))
    with pytest.raises(msg.PeerTimeout, match=r"^no answer within 0.3 s \(runconfig.peer_timeout 0 s \+ twice the "
                                              r"longest step so far, 0.1 s\) while waiting for SwarmX rank 7$"):
        link.wait_all([req], "SwarmX rank 7")
    req.Cancel()
    req.Wait()


def test_a_rung_sleep_starts_the_backoff_again():
    """A doorbell ends a sleep early and says so: the message that rang may still be landing, so
    the next sleep is the shortest again; a sleep that ran out grows fourfold, up to the ceiling."""
    pauses, rings = [], {2, 7}
    state = iter([msg.IDLE] * 9 + [msg.DONE])

    def sleep(seconds):
        pauses.append(seconds)
        return len(pauses) in rings

    msg.poll(lambda: next(state), 60, AssertionError, max_sleep=2e-3, sleep=sleep)
    assert pauses == pytest.approx([5e-5, 2e-4, 5e-5, 2e-4, 8e-4, 2e-3, 2e-3, 5e-5, 2e-4])


def test_lanes_move_side_by_side_and_a_timeout_names_what_each_waits_for():
    """Lanes (a rank's waits run side by side) take what has come in each, hand each its value,
    return a lane's result once it ends, and a wait that times out names what every lane waits for."""
    link = msg.Link(MPI.COMM_SELF, Layout())
    ready, got = set(), []

    def lane(name, n):
        for k in range(n):
            value = yield (lambda: (name, k) if name in ready else None), f"{name} {k}"
            got.append(value)
        return name.upper()

    a, b = lane("a", 2), lane("b", 1)
    lanes = msg.Lanes(link, a, b)
    assert lanes.advance() is True and got == []  # started: both wait
    assert lanes.advance() is False and lanes.waiting_for() == "a 0; b 0"
    ready.add("b")
    assert lanes.wait(b) == "B" and got == [("b", 0)]
    ready.add("a")
    assert lanes.wait(a) == "A" and got == [("b", 0), ("a", 0), ("a", 1)]
    c = lane("c", 1)
    with pytest.raises(msg.PeerTimeout, match=r"^no answer within 0.2 s while waiting for c 0; d 0$"):
        lanes = msg.Lanes(link, c, lane("d", 1))
        lanes.wait(c, timeout=0.2)


_BELLS = """
import os, sys, tempfile, numpy as np
def named(*args, **kwargs):  # a bell named in the file system outlives a rank killed while it is made
    raise PermissionError("no bell may be named in the file system")
os.mkfifo = os.mkdir = tempfile.mkdtemp = named
from mpi4py import MPI
from mpi_launch import messaging as msg
from mpi_launch.protocol import GRADS, Layout
comm = MPI.COMM_WORLD
bells = msg.Bells.open(comm)
assert bells is not None  # every rank on this machine
link = msg.Link(comm, Layout(), timeout=120, bells=bells)
if comm.rank == 0:
    assert bells.wait(0) is False  # nothing rang
comm.Barrier()
if comm.rank == 1:
    bells.ring(0)
    bells.ring(0)
if comm.rank == 0:
    assert bells.wait(120) is True  # rung (only a hang takes the 120 s)
    assert bells.wait(0) is False   # both rings were taken by that one wake-up
comm.Barrier()
# A link with bells: a header and a tensor from rank 2 reach rank 0, which rings rank 2 back.
if comm.rank == 2:
    h = link.send_header(0, GRADS, 3, (1.5, 2.5))
    sends = link.isend_arrays([np.arange(5, dtype=np.float32)], 0, GRADS, 3)
    link.wait_all([h, *sends], "rank 0")
if comm.rank == 0:
    assert link.recv_header(2, GRADS, 3, "rank 2") == {"first": 1.5, "last": 2.5}
    got = np.empty(5, np.float32)
    link.wait_all(link.irecv_into([got], 2, GRADS, 3), "rank 2")
    assert np.array_equal(got, np.arange(5, dtype=np.float32))
done = comm.gather(comm.rank)
if comm.rank == 0:
    print(done, flush=True)
"""


def test_doorbells_wake_their_rank_and_leave_no_files():
    """Every rank of a job on one machine gets a doorbell; a ring wakes the rank's wait, which says
    it was rung; a link with doorbells carries headers and tensors; and no bell is ever named in the
    file system (a directory of named pipes outlived a job killed while its ranks made them)."""
    proc = run_mpi(3, [sys.executable, "-c", _BELLS], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0, 1, 2]"


def test_the_tag_layout_is_sized_for_the_job_and_refuses_what_it_cannot_name():
    """More than 256 units used to wrap into other units' tags; now the layout grows with the job,
    is checked against MPI's TAG_UB, and a tag outside it is an error, never a mix-up."""
    tag = Layout.for_job(units=300, micro_batches=4, arrays_per_unit=12, tag_ub=2**31 - 1).tag
    assert tag(GRADS, 299, 11) != tag(GRADS, 43, 11)   # 299 mod 256 = 43: distinct now
    with pytest.raises(ProtocolError, match=r"unit 300, index 0\) is outside the tag layout"):
        tag(GRADS, 300)
    with pytest.raises(ProtocolError, match="need MPI tags up to .*; this MPI allows 32,767"):
        Layout.for_job(units=3000, micro_batches=4, arrays_per_unit=12, tag_ub=32767)


def test_the_step_table_is_what_the_roles_and_the_walk_cite():
    """Every STEP["..."] in the roles and in the analytical walk names a row of protocol.STEP; every
    row is cited by a role, every row that carries simulated time by the walk too."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def cited(paths):
        return {name for p in paths for name in re.findall(r'STEP\["([^"]+)"\]', p.read_text())}

    by_roles = cited(sorted((root / "mpi_launch" / "roles").glob("*.py")))
    by_walk = cited([root / "wse_core" / "perf" / "step.py"])
    assert (by_roles | by_walk) <= set(STEP)
    assert by_roles == set(STEP)
    assert {m.name for m in STEP.values() if not m.clock.startswith("none")} <= by_walk
    inference = root / "mpi_launch" / "roles" / "inference.py"
    assert set(re.findall(r'INFER\["([^"]+)"\]', inference.read_text())) == set(INFER)


def test_the_protocol_table_imports_nothing_of_mpi_launch():
    """messaging builds on protocol, never the reverse (they imported each other)."""
    import ast
    from pathlib import Path

    import mpi_launch.protocol as protocol

    tree = ast.parse(Path(protocol.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "mpi_launch"]
