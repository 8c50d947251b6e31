"""`wse fit --hostfile` across two hosts: two network namespaces joined by a veth pair, each with its
own address and host name, ranks started on the second host through Hydra's ssh launcher (an
``ssh`` stand-in that enters that host's namespace), MPI traffic over TCP between them."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mpi_launch.rundir import RunDir
from test_cluster import assert_bits, data, params_file, reference  # noqa: F401 (data: a fixture)

HOSTS = {"a": "10.213.0.1", "b": "10.213.0.2"}


def _sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """Namespaces wse<pid>a and wse<pid>b: 10.213.0.1 and 10.213.0.2 on a veth pair; yields their names."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if not (shutil.which("ip") and shutil.which("unshare")):
        pytest.skip("needs `ip` (iproute2) and `unshare` (util-linux) to make two hosts on one machine")
    tag = f"wse{os.getpid() % 100000}"
    ns = {h: f"{tag}{h}" for h in HOSTS}
    steps = [("ip", "netns", "add", ns["a"]), ("ip", "netns", "add", ns["b"]),
             ("ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")]
    for h in HOSTS:
        steps += [("ip", "link", "set", f"{tag}v{h}", "netns", ns[h]),
                  ("ip", "-n", ns[h], "addr", "add", f"{HOSTS[h]}/24", "dev", f"{tag}v{h}"),
                  ("ip", "-n", ns[h], "link", "set", f"{tag}v{h}", "up"),
                  ("ip", "-n", ns[h], "link", "set", "lo", "up")]
    try:
        for cmd in steps:
            r = _sh(*cmd)
            if r.returncode:
                pytest.skip(f"cannot make two network namespaces here (`{' '.join(cmd)}`: {r.stderr.strip()})")
        # Hydra starts the second host's proxy with `<launcher> HOST COMMAND`, as it would with ssh.
        d = tmp_path_factory.mktemp("hosts")
        fake_ssh = d / "ssh-into-namespace"
        cases = "\n".join(f"  {HOSTS[h]}) ns={ns[h]}; name=host-{h};;" for h in HOSTS)
        fake_ssh.write_text(f"""#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
{cases}
  *) echo "no such host: $host" >&2; exit 255;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $name; exec $*"
""")
        fake_ssh.chmod(0o755)
        hostfile = d / "hosts"
        hostfile.write_text(f"{HOSTS['a']}:4\n{HOSTS['b']}:4\n")
        yield {"ns": ns, "veth_b": f"{tag}vb", "ssh": fake_ssh, "hostfile": hostfile}
    finally:
        for name in ns.values():
            _sh("ip", "netns", "delete", name)


def rx_bytes(ns, dev):
    out = _sh("ip", "-n", ns, "-s", "-j", "link", "show", dev).stdout
    return json.loads(out)[0]["stats64"]["rx"]["bytes"]


def start_fit(hosts, tmp_path, data, max_steps):
    # peer_timeout at its default: a killed rank is named by the watchdog, not by a timeout. (Step 0
    # here once took 36 s, the input workers' run-ahead over TCP: test_cluster's steps-ahead test.)
    path, p = params_file(tmp_path, data, 4, max_steps=max_steps, num_csx=2, log_steps=100000)
    # The namespaces share this machine's memory, so force UCX onto TCP as separate machines would be.
    env = dict(os.environ, HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=str(hosts["ssh"]), UCX_TLS="tcp,self")
    cmd = f"hostname host-a; exec {sys.executable} -m pyapi.cli fit {path} --hostfile {hosts['hostfile']}"
    return subprocess.Popen(["ip", "netns", "exec", hosts["ns"]["a"], "unshare", "--uts", "sh", "-c", cmd],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True), p


def hosts_of(run_dir):
    hello = [json.loads(x) for x in run_dir.watchdog_log.read_text().splitlines() if '"hello"' in x]
    return {m["rank"]: m["host"] for m in hello}


def test_a_job_spread_over_two_hosts_trains_bit_identically(two_hosts, tmp_path, data, jobs):
    """8 ranks, 4 per host: the weights equal the single-process reference (and so the one-host run)
    bit for bit, and the weight stream crossed the link between the hosts."""
    before = rx_bytes(two_hosts["ns"]["b"], two_hosts["veth_b"])
    job, p = start_fit(two_hosts, tmp_path, data, max_steps=3)
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err
    run_dir = RunDir(tmp_path / "model")
    assert sorted(set(hosts_of(run_dir).values())) == ["host-a", "host-b"]
    params, state, _ = reference(p, 3)
    assert_bits(tmp_path / "model", params, state)
    streamed = 3 * 2 * sum(v.nbytes for v in params.values())  # weights reach host b twice per step
    assert rx_bytes(two_hosts["ns"]["b"], two_hosts["veth_b"]) - before > streamed


def test_a_rank_killed_on_the_second_host_is_named(two_hosts, tmp_path, data, jobs):
    job, _ = start_fit(two_hosts, tmp_path, data, max_steps=100000)
    run_dir = RunDir(tmp_path / "model")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not run_dir.read_metrics():
        assert job.poll() is None, job.communicate()
        time.sleep(0.1)
    on_b = [r for r, h in hosts_of(run_dir).items() if h == "host-b"]
    plan = json.loads(run_dir.plan_json.read_text())["plan"]
    rank = next(r for r in on_b if plan["roles"][r] == "csx")
    os.kill(int(run_dir.pid_file(rank).read_text()), signal.SIGKILL)
    out, err = job.communicate(timeout=120)
    line = err.strip().splitlines()[-1]
    assert job.returncode == 1
    assert line.startswith(f"wse fit: rank {rank} (csx ") and "on host-b: the process died (killed by signal 9 " \
        "(SIGKILL))" in line, err
    deadline = time.monotonic() + 30
    while jobs.leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not jobs.leftovers()
