"""`wse serve` (issue 26): OpenAI's client against the server, completions equal to Generator.generate,
concurrent requests batched together, every refusal OpenAI's error JSON, and the server serving on."""
import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import yaml

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from data_tools.checkpoint import save_checkpoint  # noqa: E402
from data_tools.preprocess import preprocess_text  # noqa: E402
from pyapi.generate import Generator  # noqa: E402
from wse_core.models import build_model  # noqa: E402
from wse_core.nn.generate import Sampling  # noqa: E402

GPT2 = {"name": "gpt2", "vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
        "filter_size": 48, "max_position_embeddings": 64}
KEY = "sk-test-key"
#: Long enough that only a hang reaches it.
TIMEOUT = 120


def trained(where, params_extra=None):
    """A model_dir of a tiny gpt2 with random weights (far from the initialisation, so greedy paths are
    not flat) whose params name byte-tokenized data."""
    (where / "text").mkdir(parents=True)
    (where / "text" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    preprocess_text([where / "text"], where / "data", 16, progress=False)
    model = build_model(GPT2)
    rng = np.random.default_rng(3)
    w = {n: (v + rng.normal(0, 0.3, v.shape)).astype(np.float32) for n, v in model.init_params(3).items()}
    params = {"train_input": {"data_dir": str(where / "data")}, "model": GPT2}
    save_checkpoint(where / "tiny", 3, [(w, {})], params_yaml=yaml.safe_dump(params))
    return where / "tiny"


def start(*args):
    """`wse serve ARGS --port 0` and the URL its ready line names; the process is the caller's to stop."""
    proc = subprocess.Popen([sys.executable, "-m", "pyapi.cli", "serve", *map(str, args), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("serving "):
        proc.kill()
        raise AssertionError(f"no ready line within {TIMEOUT} s: {line!r} {proc.communicate()[1]}")
    return proc, line.split(" on ")[1].split(" ")[0]


def stop(proc, sig=signal.SIGTERM):
    """Stop a server as a user does; (returncode, stdout, stderr). Killed if it does not end."""
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(model_dir):
    """A server with an API key and small limits: (url, its process)."""
    proc, url = start(model_dir, "--api_key", KEY, "--max_streams", 8, "--max_prompt_tokens", 40,
                      "--max_tokens", 32)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            stop(proc)


def client(url, key=KEY):
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=TIMEOUT)


def streamed(chunks):
    """(text, finish_reason, usage) of a streamed completion's chunks."""
    text, why, usage = "", None, None
    for c in chunks:
        for choice in c.choices:
            text += choice.text
            why = choice.finish_reason or why
        usage = c.usage or usage
    return text, why, usage


def test_completions_equal_generate_streamed_and_not(server, model_dir):
    """Greedy (temperature 0): the text, finish_reason and token counts of Generator.generate, from a text
    prompt, several prompts and a prompt of token ids; streamed, the pieces join to the same text."""
    url, _ = server
    api = client(url)
    assert [m.id for m in api.models.list().data] == ["tiny"]
    gen = Generator.load(model_dir)
    want = gen.generate(["def f(", "return x", [256, 100, 101]], 20)
    got = api.completions.create(model="tiny", prompt="def f(", max_tokens=20, temperature=0)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want[0].text, want[0].finish_reason)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want[0].prompt_ids), len(want[0].tokens))
    both = api.completions.create(model="tiny", prompt=["return x", "def f("], max_tokens=20, temperature=0)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [want[1].text, want[0].text]
    ids = api.completions.create(model="tiny", prompt=[256, 100, 101], max_tokens=20, temperature=0)
    assert ids.choices[0].text == want[2].text
    text, why, usage = streamed(api.completions.create(model="tiny", prompt="def f(", max_tokens=20, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
    assert (text, why) == (want[0].text, want[0].finish_reason)
    assert usage.completion_tokens == len(want[0].tokens)
    # sampled: seeded as Generator's; another seed, another text
    sampled = gen.generate("def f(", 20, temperature=0.8, top_p=0.9, seed=5)[0].text
    assert api.completions.create(model="tiny", prompt="def f(", max_tokens=20, temperature=0.8, top_p=0.9,
                                  seed=5).choices[0].text == sampled
    assert api.completions.create(model="tiny", prompt="def f(", max_tokens=20, temperature=0.8, top_p=0.9,
                                  seed=6).choices[0].text != sampled


def test_a_stop_string_ends_the_text_before_it_streamed_and_not(server, model_dir):
    """OpenAI's ``stop``: the text ends just before the first stop string it would contain
    (finish_reason "stop"), the same streamed (the pieces never show a stop's start) and not; a stop
    that never appears changes nothing."""
    url, _ = server
    api = client(url)
    want = Generator.load(model_dir).generate("def f(", 24)[0]
    assert len(want.text) > 8, want.text
    stop_at = want.text[5:8]
    cut = want.text[:want.text.find(stop_at)]
    for stops in (stop_at, ["\u00a7never", stop_at]):
        got = api.completions.create(model="tiny", prompt="def f(", max_tokens=24, temperature=0, stop=stops)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (cut, "stop")
        text, why, _ = streamed(api.completions.create(model="tiny", prompt="def f(", max_tokens=24, temperature=0,
                                                       stop=stops, stream=True))
        assert (text, why) == (cut, "stop")
    never = api.completions.create(model="tiny", prompt="def f(", max_tokens=24, temperature=0, stop="\u00a7never")
    assert (never.choices[0].text, never.choices[0].finish_reason) == (want.text, want.finish_reason)


def test_eight_concurrent_clients_are_each_answered_with_their_own_completion(server, model_dir):
    """Eight threads at once (half of them streaming) decode in the same steps; each gets what
    Generator.generate makes for its prompt alone."""
    url, _ = server
    prompts = [f"def f{k}(x):" for k in range(8)]
    want = [c.text for c in Generator.load(model_dir).generate(prompts, 24)]

    def ask(k):
        api = client(url)
        if k % 2:
            return streamed(api.completions.create(model="tiny", prompt=prompts[k], max_tokens=24, temperature=0,
                                                   stream=True))[0]
        return api.completions.create(model="tiny", prompt=prompts[k], max_tokens=24, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(8))) == want
    assert len(set(want)) > 1


def post(url, body, key=KEY):
    """(status, JSON) of a raw POST (a body the OpenAI client would not send)."""
    request = urllib.request.Request(url, data=body, headers={"Authorization": f"Bearer {key}",
                                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_refusals_are_openai_error_json_and_the_server_serves_on(server):
    """A malformed body, an over-long prompt, a wrong key, fields not served and limits each get their
    status and OpenAI's error object with one line; a good request after them is answered."""
    url, proc = server
    status, body = post(f"{url}/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and body["error"]["message"].startswith("the body is not JSON: ")
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    api = client(url)
    with pytest.raises(openai.BadRequestError) as exc:
        api.completions.create(model="tiny", prompt="x" * 50, max_tokens=4)
    assert exc.value.status_code == 400 and exc.value.body["code"] == "context_length_exceeded"
    assert exc.value.body["message"] == "prompt: 51 tokens; this server takes prompts of at most 40"
    with pytest.raises(openai.AuthenticationError) as exc:
        client(url, key="sk-wrong").completions.create(model="tiny", prompt="x", max_tokens=4)
    assert exc.value.status_code == 401 and exc.value.body["code"] == "invalid_api_key"
    assert post(f"{url}/completions", b"{}", key="")[0] == 401
    for kwargs, param, said in [
            ({"max_tokens": 33}, "max_tokens", "max_tokens: 33; this server makes at most 32 tokens per prompt"),
            ({"n": 2}, "n", "n: one completion per prompt is served, got 2"),
            ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop: expected a non-empty string or a list of 1 to 4"),
            ({"stop": ""}, "stop", "stop: expected a non-empty string or a list of 1 to 4"),
            ({"temperature": 2.5}, "temperature", "temperature: expected a number in [0, 2], got 2.5"),
            ({"extra_body": {"temprature": 1}}, "temprature", "temprature: unknown field (did you mean temperature?)"),
            ({"prompt": [[1, 2, 999]]}, "prompt", "prompt: token id 999 is outside the vocabulary [0, 257)")]:
        with pytest.raises(openai.BadRequestError) as exc:
            api.completions.create(**{"model": "tiny", "prompt": "x", **kwargs})
        assert exc.value.body["param"] == param and exc.value.body["message"].startswith(said), kwargs
    with pytest.raises(openai.NotFoundError) as exc:
        api.completions.create(model="gpt-4", prompt="x")
    assert exc.value.body["message"] == "model 'gpt-4': this server serves tiny"
    assert post(f"{url}/nothing", b"{}")[1]["error"]["message"] == "Not Found: POST /v1/nothing"
    assert api.completions.create(model="tiny", prompt="def", max_tokens=3, temperature=0).usage.completion_tokens == 3
    assert proc.poll() is None


def test_chat_without_a_template_is_one_clear_error(server):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as exc:
        client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["message"] == "this model has no chat template: use /v1/completions"


def test_chat_renders_a_hugging_face_directorys_template_and_stops_cleanly(tmp_path):
    """A Hugging Face directory whose tokenizer_config.json carries a chat template: the conversation is
    rendered (special tokens as their ids) and answered as Generator.generate answers those ids,
    streamed and not. SIGINT stops the server: status 0, one line, no traceback."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from data_tools.hf import to_hf

    hf = to_hf(trained(tmp_path) / "checkpoint_3", tmp_path / "hf")
    config = json.loads((hf / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    gen = Generator.load(hf)
    ids = gen.tokenizer.encode("<|endoftext|><|user|>hi\n<|bot|>hello\n<|assistant|>")
    assert ids[0] == 256
    want = gen.generate([ids], 16)[0]
    proc, url = start(hf)
    try:
        api = client(url)
        messages = [{"role": "user", "content": "hi"}, {"role": "bot", "content": [{"type": "text", "text": "hello"}]}]
        got = api.chat.completions.create(model="hf", messages=messages, max_tokens=16, temperature=0)
        assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want.text, want.finish_reason)
        assert got.usage.prompt_tokens == len(ids)
        text = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
            model="hf", messages=messages, max_tokens=16, temperature=0, stream=True))
        assert text == want.text
    finally:
        code, out, err = stop(proc, signal.SIGINT)
    assert code == 0 and out.splitlines()[-1] == "wse serve: stopped serving hf" and "Traceback" not in err, err


def test_a_model_without_a_tokenizer_is_refused_in_one_line(tmp_path):
    model = build_model(GPT2)
    save_checkpoint(tmp_path / "bare", 1, [(model.init_params(0), {})], params_yaml=yaml.safe_dump({"model": GPT2}))
    proc = subprocess.run([sys.executable, "-m", "pyapi.cli", "serve", str(tmp_path / "bare"), "--port", "0"],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"wse serve: error: {tmp_path / 'bare' / 'checkpoint_1'}: no tokenizer: its params name no "
        "train_input.data_dir: the server answers in text, so it needs the model's tokenizer"]


def test_a_request_beyond_max_streams_gets_429_and_a_client_that_leaves_frees_its_streams(model_dir):
    """In-process, the engine's thread not yet started: a streaming request of two prompts holds both
    streams; another request is 429; once its client leaves, its streams are free and the engine
    never sees its sequences."""
    from aiohttp.test_utils import TestClient, TestServer

    from pyapi.serve import Limits, Server

    server = Server.load(model_dir, limits=Limits(max_streams=2))
    body = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 4, "temperature": 0, "stream": True}

    async def scenario():
        async with TestClient(TestServer(server.app())) as http:
            first = await http.post("/v1/completions", json=body)  # its headers come once it is taken
            assert first.status == 200 and server.in_flight == 2
            busy = await http.post("/v1/completions", json=dict(body, prompt="c", stream=False))
            assert busy.status == 429 and (await busy.json())["error"]["code"] == "rate_limit_exceeded"
            first.close()
            for _ in range(6000):  # the server's side of the loop sees the connection close
                if server.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert server.in_flight == 0
            server.batcher.start()
            after = await http.post("/v1/completions", json=dict(body, stream=False))
            assert after.status == 200 and len((await after.json())["choices"]) == 2
            assert not server.batcher._engine.busy

    try:
        asyncio.run(scenario())
    finally:
        server.batcher.close()


def test_an_engine_that_fails_fails_its_requests_in_one_line_and_a_fresh_one_serves_on(model_dir, capsys):
    """A step that raises: its requests get a 500 (streamed: an error event), the traceback goes to the
    server's stderr, and the next request is answered by a fresh engine."""
    from aiohttp.test_utils import TestClient, TestServer

    from pyapi.serve import Server

    server = Server.load(model_dir)
    body = {"model": "tiny", "prompt": "def", "max_tokens": 4, "temperature": 0}

    def broken():
        raise FloatingPointError("overflow in the unit's infer")

    async def scenario():
        async with TestClient(TestServer(server.app())) as http:
            first = server.batcher._engine
            first.step = broken
            failed = await http.post("/v1/completions", json=body)
            assert failed.status == 500 and (await failed.json())["error"] == {
                "message": "the engine failed: FloatingPointError: overflow in the unit's infer",
                "type": "server_error", "param": None, "code": None}
            for _ in range(6000):  # its client is told before the fresh engine is made: wait for that one
                if server.batcher._engine not in (None, first):
                    break
                await asyncio.sleep(0.01)
            server.batcher._engine.step = broken
            events = await (await http.post("/v1/completions", json=dict(body, stream=True))).text()
            assert '"type": "server_error"' in events and events.endswith("data: [DONE]\n\n")
            served = await http.post("/v1/completions", json=body)
            assert served.status == 200 and (await served.json())["usage"]["completion_tokens"] == 4

    server.batcher.start()
    try:
        asyncio.run(scenario())
    finally:
        server.batcher.close()
    assert capsys.readouterr().err.count("FloatingPointError: overflow") == 2


def test_the_batcher_ends_a_cancelled_sequence_and_serves_the_others():
    """Two sequences decode in the same steps; one cancelled after two tokens gets no more (and never
    its end); the other runs to its own end with the tokens it makes alone."""
    from pyapi.serve import Batcher
    from wse_core.nn.generate import Engine, generate

    model = build_model(GPT2)
    weights = model.init_params(0)
    alone = [t for _, t in generate(model, weights, [[5, 6, 7]], 10)]
    engine, steps = Engine(model, weights), []
    step = engine.step
    engine.step = lambda: steps.append(1) or step()
    batcher = Batcher(lambda: engine)
    got, done = {"a": [], "b": []}, threading.Event()

    def deliver_a(token):
        got["a"].append(token)
        if len(got["a"]) == 2:
            batcher.cancel(a)

    def deliver_b(token):
        got["b"].append(token)
        if token is None:
            done.set()

    a = batcher.submit([1, 2, 3], 10, deliver=deliver_a, sampling=Sampling())
    batcher.submit([5, 6, 7], 10, deliver=deliver_b, sampling=Sampling())
    batcher.start()
    try:
        assert done.wait(TIMEOUT)
    finally:
        batcher.close()
    assert len(got["a"]) == 2 and None not in got["a"] and got["b"] == alone + [None]
    assert len(steps) == 10  # b's ten tokens, a's two among them: the two decoded in the same steps
    assert not engine.busy



def test_a_sequence_that_meets_a_dead_inference_job_before_its_first_token_goes_to_the_next_job_once():
    """An inference job that died while the server idled fails the next call (an addition): that
    sequence goes to a new job (issue 42: it failed) and, if that one dies too, gets its error; one
    that had its first token when its job died gets the error at once (what was delivered cannot be
    taken back); and the next job answers with the tokens a sequence makes alone."""
    from mpi_launch.inference import InferenceJobError
    from pyapi.serve import Batcher
    from wse_core.nn.generate import Engine, generate

    model = build_model(GPT2)
    weights = model.init_params(0)
    alone = [t for _, t in generate(model, weights, [[1, 2, 3]], 4)]
    made = []

    def dead(n):
        def call(*args):
            raise InferenceJobError(f"the inference job on 2 CS-2s failed: rank 3 (csx 0): killed by SIGKILL (job {n})")
        return call

    def make():
        engine = Engine(model, weights)
        if len(made) < 2:  # the first two jobs are dead when first called
            engine.add = dead(len(made))
        elif len(made) == 2:  # the third dies after its first step
            step = engine.step

            def first_step():
                engine.step = dead(2)
                return step()

            engine.step = first_step
        made.append(engine)
        return engine

    batcher = Batcher(make)
    got = {"a": [], "b": [], "c": []}
    done = {k: threading.Event() for k in got}

    def deliver(k):
        def take(item):
            got[k].append(item)
            if item is None or isinstance(item, Exception):
                done[k].set()
        return take

    batcher.start()
    try:
        batcher.submit([1, 2, 3], 4, Sampling(), deliver("a"))
        assert done["a"].wait(TIMEOUT)
        batcher.submit([1, 2, 3], 4, Sampling(), deliver("b"))
        assert done["b"].wait(TIMEOUT)
        batcher.submit([1, 2, 3], 4, Sampling(), deliver("c"))
        assert done["c"].wait(TIMEOUT)
    finally:
        batcher.close()
    assert len(got["a"]) == 1 and "(job 1)" in str(got["a"][0])  # handed from job 0 to job 1, and no further
    assert got["b"][:1] == alone[:1] and len(got["b"]) == 2 and "(job 2)" in str(got["b"][1])
    assert got["c"] == alone + [None] and len(made) == 4
