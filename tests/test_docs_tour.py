"""The docs tour: every command the README and each page of docs/ show, run as written, in the order
a reader meets them, from a fresh demo (its 600 steps cut to 20), in a copy of the repository's root.

A shell command is a line (continuations joined) of a ```bash block; a Python example is a ```python
block. Each runs with exit 0, no traceback and no Python warning, unless NOT_RUN names it with the
reason it cannot run here as written (another machine, the user's own files, a placeholder, the
install itself); ```console blocks are transcripts, read and not run. `wse serve` keeps serving
while the rest of its page runs (the page's client talks to it), then stops at Ctrl-C (SIGINT).
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The pages in the order a reader meets them: the README, then the pages it sends them to.
PAGES = ["README.md", "docs/user-guide.md", "docs/modelzoo.md", "docs/python-api.md", "docs/simulator.md",
         "docs/appliance.md", "docs/benchmarks.md", "docs/development.md", "docs/design.md"]

#: (page, pattern of the command or the example's text, why it is not run here as written).
NOT_RUN = [
    (None, r"^pip install", "the install itself: CI runs the README's on a fresh clone (.ci/run)"),
    ("README.md", r"^pytest", "the test suite itself"),
    (None, r"\b(PARAMS|JOB|MODEL|TEXT)\b|\[--", "a synopsis: its capitals and brackets are the user's to fill"),
    (None, r"--hostfile hosts|-f hosts|^salloc|HYDRA_LAUNCHER", "needs other hosts"),
    (None, r"notes\.txt corpus\.jsonl", "the user's own files"),
    (None, r"status \| stop", "a synopsis: one of the two"),
    (None, r"^tensorboard ", "the tensorboard extra's viewer, which serves until Ctrl-C"),
    ("README.md", r"^python examples/cstorch_fc\.py", "run as written by tests/test_cstorch.py, which checks its "
     "losses too"),
    (None, r"^python -m pyapi\.cstorch train\.py", "the user's own script (tests/test_cstorch*.py run real ones)"),
    (None, r"^wse appliance start|^wse submit|^wse jobs|^wse cancel|^wse appliance stop|--submit",
     "needs an appliance started by root, in /var/lib (tests/test_appliance.py runs these commands with its "
     "own --state_dir)"),
    (None, r"\.submit\(", "needs an appliance (tests/test_appliance.py submits from Python)"),
    (None, r"cstorch\.compile\(model, backend\)", "a shape: its model and input_fn are the user's "
     "(examples/cstorch_fc.py is the runnable one)"),
]


def blocks(page):
    """(language, line number, text) of each fenced block of ``page``."""
    out, lang, start, body = [], None, 0, []
    for number, line in enumerate((ROOT / page).read_text().splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip() or "text", number, []
            else:
                out.append((lang, start, "\n".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def steps(page):
    """(kind, line number, text) to run, in order: "sh" for each shell command, "python" per example."""
    out = []
    for lang, start, text in blocks(page):
        if lang == "python":
            out.append(("python", start, text))
        elif lang in ("bash", "sh"):
            pending = ""
            for k, line in enumerate(text.splitlines(), start + 1):
                pending += line
                if pending.endswith("\\"):
                    pending = pending[:-1]
                    continue
                command, pending = pending.split(" #", 1)[0].strip(), ""  # the comment is the reader's
                if command and not command.startswith("#"):
                    out.append(("sh", k, command))
    return out


def why_not(page, text):
    for where, pattern, reason in NOT_RUN:
        if where in (None, page) and re.search(pattern, text, re.M):
            return reason
    return None


def tour():
    return [(page, kind, line, text) for page in PAGES if (ROOT / page).exists() for kind, line, text in steps(page)]


def test_the_tour_sees_the_commands_it_must():
    """The parser finds the commands a reader sees: the README's set-up and tour, a docs page's examples."""
    seen = {(page, text) for page, _, _, text in tour()}
    assert ("README.md", "pip install -e '.[test]' && wse demo") in seen
    assert ("README.md", "wse compile examples/gpt2_small.yaml --num_csx 4") in seen
    assert any(page == "docs/python-api.md" and "reference_step" in text for page, text in seen)
    assert why_not("docs/user-guide.md", "wse fit examples/gpt2_small.yaml --hostfile hosts") == "needs other hosts"
    assert why_not("README.md", "wse validate wse_demo/params.yaml") is None


class Server:
    """A `wse serve` of the tour: started, waited for until it answers, stopped with SIGINT."""

    def __init__(self, command, cwd, env):
        port = re.search(r"--port (\d+)", command)
        self.url = f"http://127.0.0.1:{port.group(1) if port else 8000}/v1/models"
        self.command = command
        self.proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120  # a bound only a hang reaches
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                request = urllib.request.Request(self.url, headers={"Authorization": "Bearer sk-local"})
                urllib.request.urlopen(request, timeout=5).close()
                return
            except OSError:
                time.sleep(0.2)
        said = self.stop()
        pytest.fail(f"{command}: did not answer on {self.url}: {said}")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal's whole process group
        try:
            said, _ = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            said, _ = self.proc.communicate()
        assert self.proc.returncode == 0 and "Traceback" not in said, (self.command, said)
        return said


def run(where, kind, text, cwd, env):
    """Run one step; return what it said. `wse fit` says what it does before its first step."""
    argv = ["bash", "-c", text] if kind == "sh" else [sys.executable, "-c", text]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in said and "Warning" not in proc.stderr, \
        f"{where}: {text}\n{said[-3000:]}"
    if re.match(r"wse fit ", text):
        before = re.split(r"^step +\d+/", proc.stdout, maxsplit=1, flags=re.M)[0]
        assert "starting " in before and " ranks ready in " in before, f"{where}: {proc.stdout}"
    print(f"{time.monotonic() - t0:6.1f} s  {where}: {text.splitlines()[0][:80]}")
    return said


def test_every_command_of_the_readme_and_the_docs_runs_as_written_from_a_fresh_demo(tmp_path):
    """From a copy of the repository's root (its examples/), after `wse demo`: each command and
    example of each page in turn."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # a user's shell, not the tests'
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this wse, this python
    ran, done, server = [], set(), None
    try:
        for page, kind, line, text in tour():
            where = f"{page}:{line}"
            if server is not None and server.page != page:  # a server lives for the rest of its page
                server.stop()
                server = None
            if text == "pip install -e '.[test]' && wse demo":
                if done:
                    continue  # the README's second install (PyTorch's CPU build first) runs the same demo
                # The install is CI's (.ci/run), which runs `wse demo` as written right after it; here the
                # demo's own code runs 20 of its 600 steps (its minute would be the suite's slowest test).
                text = ("python -c \"from pyapi import demo; demo.PARAMS['runconfig'].update(max_steps=20, "
                        "checkpoint_steps=10); raise SystemExit(demo.main())\"")
            elif text.startswith("pip install -e '.[serve]' && "):
                text = text.split(" && ", 1)[1]  # the test extra brings the serve extra's packages
            if why_not(page, text) and "demo.main()" not in text or text in done:
                continue  # not runnable here as written (NOT_RUN), or run as written already
            if kind == "sh" and re.match(r"(\w+=\S+ )*wse serve ", text):
                if server is not None:
                    server.stop()
                server = Server(text, tmp_path, env)
                server.page = page
                ran.append(where)
                continue
            said = run(where, kind, text, tmp_path, env)
            ran.append(where)
            done.add(text)
            if "demo.main()" in text:  # then what the demo suggests, as a reader would
                for command in re.findall(r"`(wse [^`]+)`", said):
                    if command.startswith("wse fit"):
                        continue  # what the demo ran, not a suggestion
                    run(f"{where} (the demo's suggestion)", "sh", command, tmp_path, env)
                    ran.append(command)
                    done.add(command)
    finally:
        if server is not None:
            server.stop()
    assert len(ran) >= 30, ran
