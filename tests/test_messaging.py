"""Messaging: chunked relay and reduce through a SwarmX tree, and waits that give up on a silent peer."""
import json
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpi_launch import messaging as msg
from mpi_launch.mpiexec import run_mpi
from mpi_launch.protocol import GRADS, ProtocolError, configure, tag


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
    buf = np.empty(4, np.float32)
    req = comm.Irecv(buf, source=0, tag=tag(GRADS, 3))
    t0 = time.monotonic()
    with pytest.raises(msg.PeerTimeout, match="no answer within 0.2 s while waiting for SwarmX rank 7"):
        msg.wait_all([req], "SwarmX rank 7", timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2
    req.Cancel()
    req.Wait()  # completes at once, as cancelled
    sent = comm.Isend(np.zeros(4, np.float32), dest=0, tag=tag(GRADS, 4))
    done = comm.Irecv(buf, source=0, tag=tag(GRADS, 4))
    msg.wait_all([sent, done], "self", timeout=1)
    msg.wait_all([done], "self again", timeout=1)  # already complete: returns, never waits out the timeout
    saved = dict(msg._timeout)
    try:  # the job's timeout (Role.step_done sets it) says why it is that long
        msg.set_timeout(0.3, "runconfig.peer_timeout 0 s + twice the longest step so far, 0.1 s")
        req = comm.Irecv(buf, source=0, tag=tag(GRADS, 5))
        with pytest.raises(msg.PeerTimeout, match=r"^no answer within 0.3 s \(runconfig.peer_timeout 0 s \+ twice the "
                                                  r"longest step so far, 0.1 s\) while waiting for SwarmX rank 7$"):
            msg.wait_all([req], "SwarmX rank 7")
        req.Cancel()
        req.Wait()
    finally:
        msg._timeout.update(saved)


def test_the_tag_layout_is_sized_for_the_job_and_refuses_what_it_cannot_name():
    """More than 256 units used to wrap into other units' tags; now the layout grows with the job,
    is checked against MPI's TAG_UB, and a tag outside it is an error, never a mix-up."""
    try:
        configure(units=300, micro_batches=4, arrays_per_unit=12, tag_ub=2**31 - 1)
        assert tag(GRADS, 299, 11) != tag(GRADS, 43, 11)   # 299 mod 256 = 43: distinct now
        with pytest.raises(ProtocolError, match=r"unit 300, index 0\) is outside the tag layout"):
            tag(GRADS, 300)
        with pytest.raises(ProtocolError, match="need MPI tags up to .*; this MPI allows 32,767"):
            configure(units=3000, micro_batches=4, arrays_per_unit=12, tag_ub=32767)
    finally:
        configure(units=256, micro_batches=1, arrays_per_unit=32, tag_ub=2**31 - 1)
