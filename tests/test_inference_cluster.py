"""Generation on the emulated cluster (issue 26): an inference job's CS-2 ranks make the tokens of the
single-process engine for any num_csx and either placement; KV caches that do not fit are refused
in one line; a rank that dies is named, leaves nothing running, and `wse serve --num_csx` answers
on with a fresh job."""
import json
import os
import signal
import tempfile
import time

import pytest
import yaml

from data_tools.checkpoint import save_checkpoint
from mpi_launch.inference import ClusterEngine, InferenceJobError
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
        with ClusterEngine(model, path, "checkpoint", max_streams=len(PROMPTS), **options) as engine:
            assert engine.spec["placement"] == options.get("placement", "resident")
            if options["num_csx"] == 2 and "placement" not in options:
                assert set(engine.spec["wafers"]) == {0, 1}  # pipelined across the wafers
            assert on(engine, model, PROMPTS, 12) == want, options
        assert not engine.dir.exists() and not job_processes(engine.dir)


def test_kv_caches_beyond_the_wafers_sram_are_refused_in_one_line_before_any_rank_starts(tmp_path):
    model, _, path = checkpoint(tmp_path, "gpt2")
    with pytest.raises(ValueError, match=r"^batch 100000000: 100000000 sequences of 24 positions need .* GB of KV "
                                         r"cache \(.* MB each\); \d+ fit beside the two units of weights streaming"):
        ClusterEngine(model, path, "checkpoint", num_csx=1, max_streams=100_000_000)
    with pytest.raises(ValueError, match=r"^placement resident: 5 CS-2s for the model's 4 units; each wafer holds "
                                         r"at least one: use at most 4 CS-2s, or stream the weights$"):
        ClusterEngine(model, path, "checkpoint", num_csx=5, placement="resident")


def csx_pid(job_dir, plan, c=0):
    """The pid of CS-2 c's rank of the job in ``job_dir`` (its pid file)."""
    f = job_dir / "logs" / f"pid_rank_{plan.csx[c]}"
    for _ in range(TIMEOUT * 10):
        if f.is_file():
            return int(f.read_text())
        time.sleep(0.1)
    raise AssertionError(f"no {f}")


def test_a_cs2_rank_that_dies_is_named_and_the_job_leaves_nothing_running(tmp_path, monkeypatch):
    model, _, path = checkpoint(tmp_path, "gpt2")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the failed job's directory, kept, is the test's
    engine = ClusterEngine(model, path, "checkpoint", num_csx=2, placement="streamed", max_streams=2)
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
                                                    rf"{engine.plan.csx[1]} \(csx 1\).*SIGKILL"):
            for _ in range(5):
                engine.add([4, 5], 5)
                engine.step()
    finally:
        engine.close()
    assert engine.dir.parent == tmp_path and engine.dir.exists()  # a failed job's logs are kept
    assert not job_processes(engine.dir)


def test_wse_serve_on_cs2s_answers_as_one_process_and_restarts_its_job_after_a_fault(tmp_path, monkeypatch):
    """`wse serve --num_csx 2`: the official client's completion equals Generator.generate's; a CS-2
    rank killed under the server fails the request under way with a 500, and the next request is
    answered by a new job."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    from mpi_launch.inference import plan_of
    from pyapi.generate import Generator
    from test_serve import start, stop, trained

    model_dir = trained(tmp_path / "m")
    want = Generator.load(model_dir).generate(["def f"], 8)[0]
    env_tmp = tmp_path / "jobs"
    env_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(env_tmp))  # the inference job's directory: where the test finds it
    proc, url = start(model_dir, "--num_csx", 2)
    api = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=TIMEOUT)
    try:
        got = api.completions.create(model="tiny", prompt="def f", max_tokens=8, temperature=0)
        assert got.choices[0].text == want.text
        (job,) = env_tmp.glob("wse-infer-*")
        plan = plan_of(json.loads((job / "run.json").read_text())["inference"])
        os.kill(csx_pid(job, plan, 1), signal.SIGKILL)
        with pytest.raises(openai.InternalServerError, match=r"the engine failed: InferenceJobError: .*rank "
                                                             rf"{plan.csx[1]} \(csx 1\)"):
            api.completions.create(model="tiny", prompt="def f", max_tokens=8, temperature=0)
        again = api.completions.create(model="tiny", prompt="def f", max_tokens=8, temperature=0)
        assert again.choices[0].text == want.text
        assert not job_processes(job)
    finally:
        code, out, err = stop(proc, signal.SIGINT)
    assert code == 0, err
    assert not job_processes(env_tmp)


def test_a_serve_job_holds_its_cs2s_is_listed_restarted_after_a_fault_and_cancelled(tmp_path, jobs, appliance,
                                                                                      monkeypatch):
    """`wse serve --submit --num_csx 2` on an appliance of 3 CS-2s: the job holds 2 of them while it
    serves (`wse jobs` lists it running), answers as one process does, is restarted when its server
    is killed (max_restarts 1) and serves again, and `wse cancel` stops it, leaving nothing running
    and its CS-2s free."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    from pyapi.generate import Generator
    from test_appliance import _children, until
    from test_serve import trained

    model_dir = trained(tmp_path / "m")
    want = Generator.load(model_dir).generate(["def f"], 8)[0].text
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the inference jobs' directories: the test's processes
    a = appliance(3)
    r = a.wse("serve", model_dir, "--num_csx", 2, "--port", 0, "--submit", "--max_restarts", 1)
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
    r = a.wse("cancel", job_id)
    assert r.returncode == 0, r.stderr
    rec = a.wait(job_id, TIMEOUT)
    assert rec["state"] == "cancelled", rec
    assert a.client.status()["free_csx"] == 3
    until(lambda: set(jobs.leftovers()) <= {service}, "nothing of the job left running", timeout=60)
