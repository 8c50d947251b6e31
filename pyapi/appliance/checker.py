"""Checking a submission's params in a child forked for it, as the caller, under rlimits.

``pyapi.params.check`` as for a file, then the plan and ``check_capacity``, in a child running as
the submitting user with ``RLIMIT_CPU`` ``CHECK_SECONDS`` and ``RLIMIT_AS`` ``CHECK_MEMORY`` beyond
what the service had mapped: no params, however built (sparsity masks of a huge layer, a billion
input workers), take the service's time or memory, and the service answers others meanwhile. The
child closes every descriptor it inherited but its answer pipe, dies with the service, and is
reaped without blocking. docs/design/appliance.md "Requests".
"""
import json
import os
import resource
import signal
import time
import warnings
from pathlib import Path

from mpi_launch.inference import plan_of, spec
from mpi_launch.mpiexec import check_capacity
from mpi_launch.supervisor import die_with_parent
from pyapi.appliance.requests import ServeSpec
from pyapi.client import MAX_LINE
from pyapi.errors import RequestError
from pyapi.appliance.scheduler import cores_for
from pyapi.generate import Generator
from pyapi.params import check
# mpi_launch.resolved and pyapi.serve are imported where used: they load the kernels (and aiohttp).

#: The child that checks a submitted job's params: CPU seconds and bytes of address space it may use.
CHECK_SECONDS = 60
CHECK_MEMORY = 4 << 30
#: Params checks running at once: per user, and in all (each may use CHECK_MEMORY).
MAX_CHECKS_PER_USER = 2
MAX_CHECKS = max(2, os.cpu_count() or 1)
#: The most a check's answer may be (the params as checked, a few KiB) before it is cut off.
MAX_ANSWER = 4 * MAX_LINE


def _mapped_bytes():
    """This process's address space now (VmSize): what a child's RLIMIT_AS must allow beyond."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def umask_of(pid):
    """The umask of process ``pid`` (the submitting client): its job's files get the modes its own would."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o077


def check_params(kind, raw, pool_csx, cores):
    """In the checker child: a submitted job of ``kind`` (``requests.JOB_KINDS``) as the store keeps it
    ({"kind", "params", "num_csx", "max_steps", "model_dir"}), or {"error": line}."""
    from mpi_launch.resolved import resolve

    if kind == "serve":
        return check_serve(raw, pool_csx, cores)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the submitter's own check showed them
        spec, report = check(raw)
    r = spec.runconfig
    if r.num_csx > pool_csx:
        return {"error": f"runconfig.num_csx: {r.num_csx} CS-2s asked, the appliance has {pool_csx}"}
    check_capacity(resolve(spec, report.model).plan, cores=cores_for(r.num_csx, pool_csx, cores))
    return {"kind": spec.kind, "params": spec.to_dict(), "num_csx": r.num_csx, "max_steps": r.max_steps,
            "model_dir": str(r.model_dir)}


def check_serve(raw, pool_csx, cores):
    """In the checker child: a serve job (a ``ServeSpec``), its model loaded and its inference job
    planned as the submitter; its "model_dir" is the model's directory (one job of a user serves it at
    a time), its "max_steps" 0 (it has no steps: it serves until cancelled)."""
    from pyapi.serve import Limits

    try:
        serve = ServeSpec.from_fields(raw)
    except RequestError as exc:
        return {"error": f"serve: {exc}"}
    if not 1 <= serve.num_csx <= pool_csx:
        return {"error": f"--num_csx: {serve.num_csx} CS-2s asked, the appliance has {pool_csx}"}
    gen = Generator.load(serve.model, serve.checkpoint_path)
    if getattr(gen.model, "family", None) == "torch":
        return {"error": "a compiled PyTorch model generates in its own process only (its graph has no KV cache "
                         "to place on the wafers): serve it with `wse serve` without --submit"}
    if gen.tokenizer is None:
        return {"error": f"{gen.why_no_tokenizer}: the server answers in text, so it needs the model's tokenizer"}
    params = serve.to_dict()
    limits = Limits.given(params).resolved(gen.capacity)
    job, _ = spec(gen.model, gen.source, gen.source_format, num_csx=serve.num_csx, max_streams=limits.max_streams,
                  **{k: params[k] for k in ("placement", "peer_timeout") if k in params})
    check_capacity(plan_of(job), cores=cores_for(serve.num_csx, pool_csx, cores))
    return {"kind": serve.kind, "params": params, "num_csx": serve.num_csx, "max_steps": 0, "model_dir": serve.model}


class Check:
    """A child process checking a submitted job's params as its user, within CPU and memory limits."""

    def __init__(self, pid, fd, request, account, umask):
        self.pid, self.fd, self.request, self.account, self.umask = pid, fd, request, account, umask
        self.buf, self.started = b"", time.monotonic()

    def timed_out(self, now, slack):
        """Not ended ``slack`` seconds after its CPU limit would have ended it."""
        return now - self.started > CHECK_SECONDS + slack

    def read(self):
        """Read what the child wrote: None while more may come, else its answer ({"error": line} or
        what ``check_params`` returned)."""
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return None
        if chunk:
            self.buf += chunk
            if len(self.buf) <= MAX_ANSWER:
                return None
        try:
            return json.loads(self.buf)
        except ValueError:
            return {"error": "the params check ended without an answer (its CPU or memory limit?)"}


class Checker:
    """The checks running, and the children killed and not yet reaped."""

    def __init__(self, *, owner, pool_csx, cores):
        self.owner, self.pool_csx, self.cores = owner, pool_csx, cores
        self.running = []   # Check
        self.zombies = []   # pids of children killed and not yet reaped

    def start(self, request, account, client_pid):
        """Fork a child that validates ``request.params`` and plans the job as ``account``, limited in CPU
        and memory; return its ``Check`` (its answer pipe is non-blocking, for the caller's select)."""
        if (sum(c.account.pw_uid == account.pw_uid for c in self.running) >= MAX_CHECKS_PER_USER
                or len(self.running) >= MAX_CHECKS):
            raise RequestError("too many submissions being checked at once; submit again in a moment")
        r, w = os.pipe()
        service = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            raise
        if pid == 0:  # the child: everything under the finally, which never returns
            out = {"error": "the params check failed"}
            try:
                signal.set_wakeup_fd(-1)  # the service's wakeup pipe, sockets and files are not the child's
                for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
                    signal.signal(sig, signal.SIG_DFL)
                os.closerange(3, w)
                os.closerange(w + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
                die_with_parent(signal.SIGKILL)  # a service killed takes its checks along
                if os.getppid() != service:
                    raise RuntimeError("the appliance ended")
                if self.owner == 0 and account.pw_uid != 0:
                    os.setgroups(os.getgrouplist(account.pw_name, account.pw_gid))
                    os.setgid(account.pw_gid)
                    os.setuid(account.pw_uid)
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                resource.setrlimit(resource.RLIMIT_CPU, (CHECK_SECONDS, CHECK_SECONDS))
                limit = _mapped_bytes() + CHECK_MEMORY  # beyond what the service had mapped already
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                out = check_params(request.kind, request.params, self.pool_csx, self.cores)
            except MemoryError:
                out = {"error": f"the params check needed more than its {CHECK_MEMORY >> 30} GiB of memory"}
            except BaseException as exc:
                out = {"error": (str(exc).splitlines() or [type(exc).__name__])[0] or type(exc).__name__}
            finally:
                try:
                    data = json.dumps(out).encode()
                    while data:
                        data = data[os.write(w, data):]
                finally:
                    os._exit(0)
        os.close(w)
        os.set_blocking(r, False)
        check = Check(pid, r, request, account, umask_of(client_pid))
        self.running.append(check)
        return check

    def end(self, check):
        """Close its pipe and kill the child (it has answered, or its connection is gone)."""
        self.running.remove(check)
        os.close(check.fd)
        try:
            os.kill(check.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.zombies.append(check.pid)  # reaped without waiting (a child in D state must not stop the loop)
        self.reap()

    def reap(self):
        for pid in list(self.zombies):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            except ChildProcessError:
                pass
            self.zombies.remove(pid)
