"""Starting a job's runner: as the user who submitted it, with their numerics variables, writing its log.

A service started by root runs each job as its submitter: their uid, primary and supplementary
groups, home and umask, an environment of locale and MPI settings only (none of root's tokens or
paths), in "/"; the runner enters the submitter's directory itself, as them, and Python's ``-P``
keeps that directory off its import path. Every runner, root's service or a user's, gets the
numerics variables of the shell that submitted the job (``wse_core.numerics``: BLAS kernel, thread
counts) in place of the service's own, so a job through the appliance has the bits of ``wse fit``
in that shell. docs/design/appliance.md "Who is asking".
"""
import errno
import json
import os
import pwd
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pyapi.client import SOCKET_ENV
from wse_core.checks import plural
from wse_core.numerics import is_numerics_variable

#: Python's -P (3.11+): the runner's import path does not start with a directory anyone chose.
SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()
#: Errors of the machine, not of a job: a start that meets one is tried again later (``manager.Manager``).
TRANSIENT = (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM, errno.ENOSPC)
#: What of the service's environment a job of another user gets: locale, and how MPI is set up on
#: this machine; never the rest (root's tokens, PATH, TMPDIR). Its numerics variables (BLAS kernel,
#: thread counts) are the submitter's, sent with the job (``requests.check_numerics``), for every job.
_ENV_KEEP = ("LANG", "LANGUAGE", "TZ")
_ENV_PREFIXES = ("LC_", "HYDRA_", "MPIR_", "MPICH_", "UCX_", "FI_")


def runner_env(job, owner):
    """The runner's environment, and the Popen arguments that make it ``job``'s user (none if it runs as
    the service's own user)."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    as_user = {}
    if owner == 0 and job["uid"] != 0:
        account = pwd.getpwuid(job["uid"])
        env.update({k: v for k, v in os.environ.items() if k in _ENV_KEEP or k.startswith(_ENV_PREFIXES)})
        env.update(HOME=account.pw_dir, USER=account.pw_name, LOGNAME=account.pw_name,
                   SHELL=account.pw_shell)
        as_user = {"user": job["uid"], "group": job["gid"],
                   "extra_groups": os.getgrouplist(account.pw_name, job["gid"])}
    else:  # the service's own user: their environment, as they started the service
        env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    if job["numerics"] is not None:  # the submitting shell's numerics, not the service's: `wse fit`'s bits
        env = {k: v for k, v in env.items() if not is_numerics_variable(k)}
        env.update(job["numerics"])
    return env, as_user


def start_runner(job, *, attempt, cores, owner, log_path, progress_fd):
    """Start attempt ``attempt`` of ``job`` (``python -m pyapi.appliance.runner``) on ``cores`` cores, its
    output appended to ``log_path``, its progress written to ``progress_fd``; return its Popen.

    Raises what Popen raises (OSError, ValueError, SubprocessError) and KeyError for an account gone;
    an OSError whose errno is in ``TRANSIENT`` is the machine's, the others the job's."""
    orders = {"kind": job["kind"], "params": job["params"], "cores": cores, "cwd": job["cwd"], "appliance_pid": os.getpid(),
              "progress_fd": progress_fd}
    env, as_user = runner_env(job, owner)
    with open(log_path, "ab") as log, tempfile.TemporaryFile() as stdin:
        log.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} job {job['id']} attempt {attempt}: "
                  f"{plural(job['num_csx'], 'CS-2')}, {plural(cores, 'core')}, user {job['user']}, in {job['cwd']}\n"
                  .encode())
        log.flush()
        stdin.write(json.dumps(orders).encode())  # a file: writing it never waits on the runner
        stdin.seek(0)
        # cwd "/": the runner enters the job's directory itself, as the user, after Python has
        # set its import path (-P: nor is that directory put on it).
        return subprocess.Popen([sys.executable, *SAFE_PATH, "-u", "-m", "pyapi.appliance.runner"],
                                stdin=stdin, stdout=log, stderr=subprocess.STDOUT, cwd="/", env=env,
                                umask=job["umask"], start_new_session=True, pass_fds=(progress_fd,),
                                **as_user)


def exit_name(code):
    """A runner's exit status in words: "SIGKILL", "exit code 1"."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
