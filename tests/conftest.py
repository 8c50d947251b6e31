"""Shared fixtures: per-dtype tolerances, a seeded random generator, and test jobs that leak no processes."""
import numpy as np
import pytest

from mpi_launch.launcher import job_processes
from wse_core import configure_process

configure_process()  # the tests run the kernels as the ranks and the CLI do

# Tolerances of a float32 or float64 kernel against a float64 reference of the same formula.
RTOL = {np.float32: 2e-5, np.float64: 1e-12}


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _default_sigint():
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Jobs:
    """`wse` commands started as jobs of a test: each in a session of its own, and every process they
    leave behind killed at the end of the test (a failed or timed-out test leaks no ranks)."""

    def __init__(self, marker):
        self.marker = marker

    def start(self, *args, **kwargs):
        import subprocess
        import sys

        # SIGINT as a terminal's user gives it, whatever pytest inherited: a shell's background job
        # (`pytest &`) ignores it, and `wse fit` keeps an ignored signal ignored, as nohup's users expect.
        kwargs.setdefault("preexec_fn", _default_sigint)
        return subprocess.Popen([sys.executable, "-m", "pyapi.cli", *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)

    def run(self, *args, timeout=240, **kwargs):
        """Run to completion (a generous timeout that only a hang reaches); return a CompletedProcess.
        ``kwargs`` go to Popen (``cwd``, ``env``)."""
        import os
        import signal
        import subprocess

        proc = self.start(*args, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its command line may not name the marker (relative paths)
            self.kill_all()
            out, err = proc.communicate()
            raise AssertionError(f"`wse {' '.join(map(str, args))}` did not end within {timeout} s:\n{err}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def leftovers(self):
        """Processes of this test's jobs that are still alive."""
        return job_processes(self.marker)

    def kill_all(self):
        import os
        import signal

        for pid in job_processes(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def jobs(tmp_path):
    j = Jobs(tmp_path)
    yield j
    j.kill_all()


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(bytes)``: a directory on a tmpfs of that size (a disk that fills up), or a skip
    where this process may not mount one. ``small_disk.resize(bytes)`` makes room again."""
    import subprocess

    where = tmp_path / "small_disk"
    where.mkdir()

    class Disk:
        mounted = False

        def __call__(self, size):
            proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
            self.mounted = True
            return where

        def resize(self, size):
            subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)

    disk = Disk()
    yield disk
    if disk.mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def read_events(directory):
    """{tag: [(step, value)]} of the scalars in the TensorBoard event files of ``directory``."""
    import struct

    from tensorboardX.proto import event_pb2

    out = {}
    for f in sorted(directory.glob("events.out.tfevents.*")):
        data, pos = f.read_bytes(), 0
        while pos < len(data):  # TFRecord framing: u64 length, u32 crc, payload, u32 crc
            (n,) = struct.unpack_from("<Q", data, pos)
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 16 + n
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out
