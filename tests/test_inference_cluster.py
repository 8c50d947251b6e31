"""Generation on the emulated cluster (issue 26): an inference job's CS-2 ranks make the tokens of the
single-process engine for any num_csx and either placement; KV caches that do not fit are refused
in one line; a rank that dies or stops is named, leaves nothing running and its logs kept (issue
42), and `wse serve --num_csx` answers on with a fresh job."""
import asyncio
import json
import os
import re
import signal
import tempfile
import time

import pytest
import yaml

from data_tools.checkpoint import save_checkpoint
from mpi_launch.inference import KEPT, SOCKET, ClusterEngine, InferenceJobError
from mpi_launch.launcher import job_processes
from test_appliance import appliance  # noqa: F401 - the fixture
from test_generate import FAMILIES, PROMPTS, made, weights_of
from wse_core.nn.generate import Sampling, generate

#: Long enough that only a hang reaches it.
TIMEOUT = 120
SAMPLING = Sampling(temperature=0.9, top_k=20, seed=11)


def checkpoint(tmp_path, family):
    cfg = FAMILIES[family]
    model, w = weights_of(cfg)
    return model, w, save_checkpoint(tmp_path / family, 1, [(w, {})], params_yaml=yaml.safe_dump({"model": cfg}))


def on(engine, model, prompts, n):
    out = [[] for _ in prompts]
    for k, tok in generate(model, None, prompts, n, SAMPLING, engine=engine):
        out[k].append(tok)
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_cs2_ranks_make_the_tokens_of_one_process_for_any_num_csx_and_placement(tmp_path, family):
    """Seeded sampling of three prompts of different lengths, prefilled and decoded together: the same
    tokens in this process, resident on 1 and 2 CS-2s (units split over the wafers), and streamed from
    two MemoryX servers to 2 and 3 CS-2s (sequences spread over them)."""
    model, w, path = checkpoint(tmp_path, family)
    want = made(model, w, PROMPTS, 12, SAMPLING)
    for options in ({"num_csx": 1}, {"num_csx": 2}, {"num_csx": 2, "placement": "streamed", "num_wgt_servers": 2},
                    {"num_csx": 3, "placement": "streamed"}):
        with ClusterEngine(model, path, "checkpoint", max_streams=len(PROMPTS), log_dir=tmp_path / "logs",
                           **options) as engine:
            assert engine.spec["placement"] == options.get("placement", "resident")
            if options["num_csx"] == 2 and "placement" not in options:
                assert set(engine.spec["wafers"]) == {0, 1}  # pipelined across the wafers
            assert on(engine, model, PROMPTS, 12) == want, options
        assert not engine.dir.exists() and not job_processes(engine.dir)
    assert not (tmp_path / "logs").exists()  # nothing kept of jobs that ended cleanly


def test_kv_caches_beyond_the_wafers_sram_are_refused_in_one_line_before_any_rank_starts(tmp_path):
    model, _, path = checkpoint(tmp_path, "gpt2")
    with pytest.raises(ValueError, match=r"^batch 100000000: 100000000 sequences of 24 positions need .* GB of KV "
                                         r"cache \(.* MB each\); \d+ fit beside the two units of weights streaming"):
        ClusterEngine(model, path, "checkpoint", num_csx=1, max_streams=100_000_000, log_dir=tmp_path)
    with pytest.raises(ValueError, match=r"^placement resident: 5 CS-2s for the model's 4 units; each wafer holds "
                                         r"at least one: use at most 4 CS-2s, or stream the weights$"):
        ClusterEngine(model, path, "checkpoint", num_csx=5, placement="resident", log_dir=tmp_path)
    with pytest.raises(ValueError, match=r"^peer_timeout: expected an integer >= 1, got 0$"):
        ClusterEngine(model, path, "checkpoint", num_csx=1, peer_timeout=0, log_dir=tmp_path)


def csx_pid(job_dir, plan, c=0):
    """The pid of CS-2 c's rank of the job in ``job_dir`` (its pid file)."""
    f = job_dir / "logs" / f"pid_rank_{plan.csx[c]}"
    for _ in range(TIMEOUT * 10):
        if f.is_file():
            return int(f.read_text())
        time.sleep(0.1)
    raise AssertionError(f"no {f}")


def test_a_cs2_rank_that_dies_is_named_the_job_leaves_nothing_running_and_its_logs_are_kept(tmp_path, monkeypatch):
    """A CS-2 rank killed: the next call raises the watchdog's line, which names the logs, moved from the
    temporary directory to log_dir; log_dir keeps the last KEPT jobs' (and whatever else it holds)."""
    model, _, path = checkpoint(tmp_path, "gpt2")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the job's directory is the test's
    (tmp_path / "tmp").mkdir()
    log_dir = tmp_path / "logs"
    older = [f"202601{d:02d}-120000-wse-infer-old{d}" for d in range(1, KEPT + 1)]
    for name in older:
        (log_dir / name).mkdir(parents=True)
    (log_dir / "notes.txt").write_text("the user's own")
    engine = ClusterEngine(model, path, "checkpoint", num_csx=2, placement="streamed", max_streams=2,
                           log_dir=log_dir)
    try:
        with pytest.raises(ValueError, match=r"^max_streams: 2 sequences are generating, as many as this inference "
                                             r"job was placed for"):
            for _ in range(3):
                engine.add([7], 3)
        assert engine.step() and engine.busy
        while engine.busy:
            engine.step()
        zero = engine.add([7], 0)
        assert engine.step() == [(zero, None)]  # ended before any pass: no CS-2 ever holds its cache
        first = engine.add([1, 2, 3], 5)
        assert [i for i, _ in engine.step()] == [first]
        os.kill(csx_pid(engine.dir, engine.plan, 1), signal.SIGKILL)
        with pytest.raises(InferenceJobError, match=rf"^the inference job on 2 CS-2s failed: rank "
                                                    rf"{engine.plan.csx[1]} \(csx 1\).*SIGKILL") as failed:
            for _ in range(5):
                engine.add([4, 5], 5)
                engine.step()
    finally:
        engine.close()
    assert not job_processes(engine.dir)
    assert not engine.dir.exists() and not list((tmp_path / "tmp").iterdir())  # nothing left in the temporary dir
    kept = sorted(p.name for p in log_dir.iterdir())
    assert kept[:-2] == older[1:] and kept[-1] == "notes.txt", kept  # the newest KEPT, and the user's file
    logs = log_dir / kept[-2] / "logs"
    assert str(failed.value).endswith(f"(its logs: {logs})") and kept[-2].endswith(engine.dir.name)
    assert '"signal": 9' in (logs / "watchdog.log").read_text() and not (logs.parent / SOCKET).exists()


def live_job(env_tmp):
    """(directory, plan) of the one inference job running with its directory in ``env_tmp``."""
    from mpi_launch.inference import plan_of

    (job,) = env_tmp.glob("wse-infer-*")
    return job, plan_of(json.loads((job / "run.json").read_text())["inference"])


def serving(tmp_path, monkeypatch, *args):
    """`wse serve` of a tiny model with ``args``, its inference jobs' directories in tmp_path/jobs:
    (process, OpenAI client, the text Generator.generate makes of "def f", model_dir, jobs' directory)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    from pyapi.generate import Generator
    from test_serve import start, trained

    model_dir = trained(tmp_path / "m")
    want = Generator.load(model_dir).generate(["def f"], 8)[0].text
    env_tmp = tmp_path / "jobs"
    env_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(env_tmp))  # the inference job's directory: where the test finds it
    proc, url = start(model_dir, *args)
    return proc, openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=TIMEOUT), want, model_dir, env_tmp


def complete(api):
    return api.completions.create(model="tiny", prompt="def f", max_tokens=8, temperature=0).choices[0].text


def test_wse_serve_on_cs2s_answers_as_one_process_and_a_request_after_a_fault_goes_to_a_new_job(tmp_path,
                                                                                                  monkeypatch):
    """`wse serve --num_csx 2`: the official client's completion equals Generator.generate's; after a
    CS-2 rank is killed while the server idles, the next request, which meets the dead job, is
    answered by a new job with the same text (issue 42: it got a 500), and the dead job's logs are
    kept beside the model (inference_logs)."""
    from test_serve import stop

    proc, api, want, model_dir, env_tmp = serving(tmp_path, monkeypatch, "--num_csx", 2)
    try:
        assert complete(api) == want
        job, plan = live_job(env_tmp)
        os.kill(csx_pid(job, plan, 1), signal.SIGKILL)
        assert complete(api) == want
        assert not job_processes(job)
        (kept,) = (model_dir / "inference_logs").iterdir()
        assert kept.name.endswith(job.name) and (kept / "logs" / "watchdog.log").is_file()
        assert live_job(env_tmp)[0] != job
    finally:
        code, out, err = stop(proc, signal.SIGINT)
    assert code == 0, err
    assert f"rank {plan.csx[1]} (csx 1): the process died (killed by signal 9 (SIGKILL))" in err
    assert not job_processes(env_tmp) and not list(env_tmp.glob("wse-infer-*"))  # the last job ended cleanly


def test_a_stopped_cs2_under_wse_serve_is_given_up_after_peer_timeout_and_its_request_goes_to_a_new_job(
        tmp_path, monkeypatch):
    """`wse serve --num_csx 2 --peer_timeout 2`, a CS-2 rank stopped (SIGSTOP) while the server idles: the
    next request waits until the job is given up (the stopped rank is given --peer_timeout, which was
    a fixed 300 s: issue 42) and is answered by a new job with the same text, within a bound only a
    hang reaches; the stopped job's logs go to --log_dir."""
    from test_serve import stop

    proc, api, want, _, env_tmp = serving(tmp_path, monkeypatch, "--num_csx", 2, "--peer_timeout", 2,
                                          "--log_dir", tmp_path / "logs")
    try:
        assert complete(api) == want
        job, plan = live_job(env_tmp)
        os.kill(csx_pid(job, plan, 0), signal.SIGSTOP)
        assert complete(api) == want
        assert not job_processes(job)
        (kept,) = (tmp_path / "logs").iterdir()
        assert kept.name.endswith(job.name)
    finally:
        code, out, err = stop(proc, signal.SIGINT)
    assert code == 0, err
    assert f"rank {plan.csx[0]} (csx 0): stopped answering: its process has been stopped (SIGSTOP)" in err


def test_a_client_mid_stream_when_a_cs2_stops_gets_the_fault_and_the_next_request_a_new_job(tmp_path, monkeypatch):
    """A streamed completion that has its first token when a CS-2 rank stops (SIGSTOP, sent between two
    steps by a hook on the engine): its tokens cannot be taken back, so its client gets the
    watchdog's line as an error event once the job is given up (peer_timeout 2 s), and the next
    request is answered by a new job with the text of one process."""
    pytest.importorskip("aiohttp")
    from aiohttp.test_utils import TestClient, TestServer

    from pyapi.generate import Generator
    from pyapi.serve import Server
    from test_serve import trained

    model_dir = trained(tmp_path / "m")
    want = Generator.load(model_dir).generate(["def f"], 8)[0].text
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the inference jobs' directories
    server = Server.load(model_dir, cluster={"num_csx": 2, "peer_timeout": 2, "log_dir": tmp_path / "logs"})
    body = {"model": "tiny", "prompt": "def f", "max_tokens": 8, "temperature": 0}
    stopped = {}

    async def scenario():
        async with TestClient(TestServer(server.app())) as http:
            engine = server.batcher._engine
            step = engine.step

            def step_then_stop():  # the first step gives the sequence its first token
                made = step()
                engine.step = step
                stopped["job"], stopped["rank"] = engine.dir, engine.plan.csx[1]
                os.kill(csx_pid(engine.dir, engine.plan, 1), signal.SIGSTOP)
                return made

            engine.step = step_then_stop
            streamed = await http.post("/v1/completions", json=dict(body, stream=True))
            events = await asyncio.wait_for(streamed.text(), TIMEOUT)
            served = await asyncio.wait_for(http.post("/v1/completions", json=body), TIMEOUT)
            return events, served.status, await served.json()

    server.batcher.start()
    try:
        events, status, served = asyncio.run(scenario())
    finally:
        server.batcher.close()
    errors = [json.loads(line[6:])["error"] for line in events.splitlines()
              if line.startswith("data: {") and '"error"' in line]
    assert len(errors) == 1 and errors[0]["type"] == "server_error", events
    assert (f"rank {stopped['rank']} (csx 1): stopped answering: its process has been stopped (SIGSTOP)"
            in errors[0]["message"]) and events.endswith("data: [DONE]\n\n"), errors
    assert status == 200 and served["choices"][0]["text"] == want
    assert not job_processes(stopped["job"]) and not list(tmp_path.glob("wse-infer-*"))


def test_the_directory_of_a_killed_server_s_job_goes_to_its_log_dir_at_the_next_start(tmp_path, monkeypatch):
    """SIGKILL of `wse serve --num_csx 1` leaves its inference job's directory, with its socket, in the
    temporary directory (issue 42: nothing runs at a SIGKILL); the user's next inference job moves it
    to its log_dir, without the socket, and leaves alone a job's directory whose process is alive
    (it holds the directory's flock)."""
    import fcntl

    from mpi_launch.inference import PREFIX
    from pyapi.generate import Generator
    from test_appliance import until

    proc, _, _, model_dir, env_tmp = serving(tmp_path, monkeypatch, "--num_csx", 1, "--log_dir", tmp_path / "logs")
    job, _ = live_job(env_tmp)
    proc.kill()
    proc.communicate()
    until(lambda: not job_processes(job), "the killed server's ranks end (their supervisors' connections close)")
    assert (job / SOCKET).exists() and not (tmp_path / "logs").exists()
    alive = env_tmp / f"{PREFIX}alive"
    alive.mkdir()
    (alive / "run.json").write_text(json.dumps({"inference": {"log_dir": str(tmp_path / "logs")}}))
    held = os.open(alive, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    monkeypatch.setattr(tempfile, "tempdir", str(env_tmp))
    try:
        with Generator.load(model_dir).engine(num_csx=1) as engine:
            (kept,) = (tmp_path / "logs").iterdir()
            assert kept.name.endswith(job.name) and (kept / "logs" / "watchdog.log").is_file()
            assert not (kept / SOCKET).exists()
            assert sorted(env_tmp.glob(f"{PREFIX}*")) == sorted([alive, engine.dir])
    finally:
        os.close(held)
    assert not (model_dir / "inference_logs").exists()  # the job that ended cleanly kept nothing


def test_peer_timeout_of_wse_generate_and_wse_serve_reaches_the_job_and_is_checked_in_one_line(tmp_path, jobs):
    """`--peer_timeout` of `wse generate --num_csx` and `wse serve --num_csx` is the inference job's: out of
    range, its one line, before any rank starts."""
    pytest.importorskip("aiohttp")
    from test_serve import trained

    model_dir = trained(tmp_path / "m")
    for command in (("generate", model_dir, "--prompt", "def"), ("serve", model_dir, "--port", 0)):
        r = jobs.run(*command, "--num_csx", 1, "--peer_timeout", 0)
        assert r.returncode == 1 and r.stderr.splitlines() == [
            f"wse {command[0]}: error: peer_timeout: expected an integer >= 1, got 0"], r.stderr


def test_a_serve_job_holds_its_cs2s_is_listed_restarted_after_a_fault_and_cancelled(tmp_path, jobs, appliance,
                                                                                      monkeypatch):
    """`wse serve --submit --num_csx 2` on an appliance of 3 CS-2s: the job holds 2 of them while it
    serves (`wse jobs` lists it running), answers as one process does, is restarted when its server
    is killed (max_restarts 1) and serves again, its log numbering the attempts, and `wse cancel`
    stops it, leaving nothing running and its CS-2s free; the killed server's inference job leaves its
    logs in --log_dir."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    from pyapi.generate import Generator
    from test_appliance import _children, until
    from test_serve import trained

    model_dir = trained(tmp_path / "m")
    want = Generator.load(model_dir).generate(["def f"], 8)[0].text
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the inference jobs' directories: the test's processes
    a = appliance(3)
    r = a.wse("serve", model_dir, "--num_csx", 2, "--port", 0, "--submit", "--max_restarts", 1, "--peer_timeout", 5,
              "--log_dir", tmp_path / "logs")
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout.split(":")[0].split()[1])

    def served(n):
        """The URL of the server's n-th ready line in the job's log (None before it)."""
        lines = [ln for ln in a.wse("logs", job_id).stdout.splitlines() if ln.startswith("serving tiny on ")]
        return lines[n - 1].split(" on ")[1].split(" ")[0] if len(lines) >= n else None

    def complete(url):
        api = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=TIMEOUT)
        return api.completions.create(model="tiny", prompt="def f", max_tokens=8, temperature=0).choices[0].text

    assert complete(until(lambda: served(1), "the server's ready line")) == want
    assert a.client.status()["free_csx"] == 1
    listed = [ln for ln in a.wse("jobs").stdout.splitlines() if ln.split()[:1] == [str(job_id)]]
    assert len(listed) == 1 and "running" in listed[0], listed
    service = a.client.status()["pid"]
    (runner,) = [p for p in _children(service) if b"pyapi.appliance.runner" in open(f"/proc/{p}/cmdline", "rb").read()]
    os.kill(runner, signal.SIGKILL)
    assert complete(until(lambda: served(2), "the restarted server's ready line")) == want
    assert a.client.job(job_id)["restarts"] == 1
    log = a.wse("logs", job_id).stdout
    assert re.findall(rf"^== \S+ \S+ job {job_id} attempt (\d+):", log, re.M) == ["1", "2"], log
    assert "kept the logs of an inference job whose process was killed: " in log
    assert len(list((tmp_path / "logs").iterdir())) == 1
    r = a.wse("cancel", job_id)
    assert r.returncode == 0, r.stderr
    rec = a.wait(job_id, TIMEOUT)
    assert rec["state"] == "cancelled", rec
    assert a.client.status()["free_csx"] == 3
    until(lambda: set(jobs.leftovers()) <= {service}, "nothing of the job left running", timeout=60)
