"""`wse serve`: a trained model behind an OpenAI-compatible HTTP API (docs/user-guide.md, "Serving").

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` and, for a Hugging Face directory whose
tokenizer carries a chat template, ``POST /v1/chat/completions``; streamed answers are OpenAI's
server-sent events ending with ``data: [DONE]``. The HTTP side is aiohttp: one well-kept package
that gives the server, its limits (body size, connections) and streamed responses, so there is no
hand-written HTTP parser here and no ASGI stack (a framework, a server, a glue layer) to assemble.

Parts, by what they do:

    requests    pyapi.openai_api: one dataclass per endpoint, its fields checked on arrival; every
                refusal is an ``ApiError``, which the transport writes as OpenAI's error JSON
    Batcher     the one thread that owns the ``Engine`` (wse_core.nn.generate): it loops ``step()``
                while any sequence is live and sleeps on a condition when none is, so the
                requests of the moment decode together, one token each per step
    Server      the transport: aiohttp's handlers on the event loop, which hand prompts to the
                batcher and get tokens back through ``loop.call_soon_threadsafe`` into one
                asyncio.Queue per request; the API key, the limits, and a client that leaves (its
                handler is cancelled, and with it the request's sequences)
"""
import asyncio
import hmac
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from mpi_launch.inference import InferenceJobError
from pyapi.generate import Generator, TextPieces, finish_reason
from pyapi.openai_api import NO_CHAT, ApiError, ChatRequest, ChatTemplate, CompletionRequest, read, sampling_of
from wse_core.checks import Int, plural, show
from wse_core.errors import ConfigError, DataError


# -- the engine thread -----------------------------------------------------------------------------

class _Ticket:
    """A sequence handed to the batcher, and how its tokens go back: ``deliver(token)``, then
    ``deliver(None)`` at its end, or ``deliver(exception)`` if the engine failed."""

    def __init__(self, prompt, max_tokens, sampling, deliver):
        self.prompt, self.max_tokens, self.sampling, self.deliver = prompt, max_tokens, sampling, deliver
        self.cancelled = False
        self.started = False  # a token was delivered: what was delivered cannot be taken back
        self.retried = False  # handed to a new inference job after its first died


class Batcher:
    """The one thread that owns the engine (continuous batching): sequences handed over by ``submit``
    join at the next step; ``cancel`` ends one at the next step; with none live the thread sleeps on
    a condition until one comes. ``make_engine()`` gives the engine (this process's, or an inference
    job's on the emulated CS-2s): once at ``start``, and again after an engine fails (a new job,
    when a CS-2 rank died), so the server goes on. The sequences under way then fail, but those
    that had no token yet when an inference job died go to the new job (once)."""

    def __init__(self, make_engine, stop_ids=()):
        self._make, self.stop_ids = make_engine, tuple(stop_ids)
        self._engine = None
        self._cond = threading.Condition()
        self._arrivals, self._closed = [], False
        self._thread = threading.Thread(target=self._run, name="wse serve engine", daemon=True)

    def start(self):
        """Make the engine (an inference job starts here: its failure is raised here) and start the thread."""
        self._engine = self._make()
        self._thread.start()

    def submit(self, prompt, max_tokens, sampling, deliver):
        """Hand a sequence to the engine; ``deliver`` is called from the engine's thread. Returns its ticket."""
        ticket = _Ticket(prompt, max_tokens, sampling, deliver)
        with self._cond:
            self._arrivals.append(ticket)
            self._cond.notify()
        return ticket

    def cancel(self, ticket):
        """End ``ticket``'s sequence at the next step (nothing more is delivered to it)."""
        with self._cond:
            ticket.cancelled = True
            self._cond.notify()

    def close(self):
        """Stop the thread after its step, and the engine; sequences still live get nothing more."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def _renew(self):
        """A fresh engine in place of one that failed (None if it cannot be made: the next arrivals try again)."""
        try:
            self._engine.close()
        except Exception:  # noqa: BLE001 - a failed engine may fail to close too; a new one is what matters
            pass
        self._engine = _made(self._make)

    def _run(self):
        live = {}  # the engine's id -> ticket
        while True:
            with self._cond:
                while not (self._arrivals or self._closed or live):
                    self._cond.wait()
                if self._closed:
                    return
                arrivals, self._arrivals = self._arrivals, []
                cancelled = [i for i, t in live.items() if t.cancelled]
            if self._engine is None:  # it failed and could not be made again: try once more for these
                self._engine = _made(self._make)
                if self._engine is None:
                    for t in arrivals:
                        t.deliver(RuntimeError("the engine could not be restarted (the server's log says why)"))
                    continue
            taken = set()  # arrivals the engine took, or refused with their own error
            try:  # the engine of an inference job may fail in any call (a CS-2 rank died while idle)
                for i in cancelled:
                    self._engine.cancel(i)
                    del live[i]
                for t in arrivals:
                    if t.cancelled:
                        continue
                    try:
                        live[self._engine.add(t.prompt, t.max_tokens, t.sampling, self.stop_ids)] = t
                    except ValueError as exc:  # the handlers check first; this keeps the thread alive if one did not
                        t.deliver(exc)
                    taken.add(id(t))
                if not live:
                    continue
                made = self._engine.step()
            except Exception as exc:  # the server keeps serving: these requests fail, a fresh engine goes on
                traceback.print_exc(file=sys.stderr)
                held = list(live.values()) + [t for t in arrivals if not t.cancelled and id(t) not in taken]
                live = {}
                # A sequence that has had no token when its inference job died (a CS-2 rank that died
                # while the server idled fails the next call) is handed to the new job, once: its
                # client sees nothing of the death. Tokens delivered cannot be taken back: those fail.
                again = [t for t in held if isinstance(exc, InferenceJobError)
                         and not (t.started or t.retried or t.cancelled)]
                for t in held:
                    if t not in again:
                        t.deliver(exc)  # at once: the new job's start-up is not theirs to wait for
                for t in again:
                    t.retried = True
                with self._cond:
                    self._arrivals[:0] = again
                self._renew()
                continue
            for i, token in made:
                live[i].started = True
                live[i].deliver(token)
                if token is None:
                    del live[i]


def _made(make):
    """``make()``, or None, said on stderr, if it fails."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001
        print(f"wse serve: cannot restart the engine: {exc}", file=sys.stderr, flush=True)
        return None


def _to_loop(loop, queue, k):
    """A ``deliver`` for the engine's thread: (k, item) into ``queue`` on the event loop ``loop``."""
    def deliver(item):
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (k, item))
        except RuntimeError:  # the loop has closed: the server is stopping and nobody waits
            pass
    return deliver


# -- the HTTP side ---------------------------------------------------------------------------------

@dataclass
class Limits:
    """What the server takes at once; None: the most the model allows."""

    max_prompt_tokens: int | None = None  # tokens of one prompt; None: the model's positions minus one
    max_tokens: int | None = None         # tokens made for one prompt; None: the model's positions minus one
    max_streams: int = 16                 # sequences generating at once, over all requests; beyond: 429

    @classmethod
    def given(cls, options):
        """The limits of ``options`` (a mapping that may hold any of the three), the unset (None) left out."""
        return cls(**{k: options[k] for k in ("max_prompt_tokens", "max_tokens", "max_streams")
                      if options.get(k) is not None})

    def resolved(self, capacity):
        """These limits with the Nones filled in for a model of ``capacity`` positions; ValueError
        naming the option that is out of range."""
        most = capacity - 1
        Int(1, most)(most if self.max_prompt_tokens is None else self.max_prompt_tokens, "--max_prompt_tokens")
        Int(0, most)(most if self.max_tokens is None else self.max_tokens, "--max_tokens")
        Int(1)(self.max_streams, "--max_streams")
        return Limits(most if self.max_prompt_tokens is None else self.max_prompt_tokens,
                      most if self.max_tokens is None else self.max_tokens, self.max_streams)


class Server:
    """A Generator behind the OpenAI API: ``app()`` is the aiohttp application, ``run(host, port)``
    serves it until SIGINT or SIGTERM. ``cluster``: ``Generator.engine``'s options (num_csx, ...) to
    generate on emulated CS-2s (an inference job held while the server runs); None: in this process."""

    def __init__(self, generator, name, *, limits=None, api_key=None, chat=(None, NO_CHAT), cluster=None):
        if generator.tokenizer is None:
            raise DataError(f"{generator.why_no_tokenizer}: the server answers in text, so it needs the "
                            "model's tokenizer")
        self.gen, self.name, self.api_key = generator, name, api_key
        self.capacity = generator.capacity
        self.limits = (limits or Limits()).resolved(self.capacity)
        self.chat, self.why_no_chat = chat
        cluster = {} if cluster is None else dict(cluster, max_streams=self.limits.max_streams)
        self.where = f"on {plural(cluster['num_csx'], 'emulated CS-2')}" if cluster else "in this process"
        self.batcher = Batcher(lambda: generator.engine(**cluster), generator.stop_ids)
        self.in_flight = 0  # sequences of the requests being answered (read and written on the event loop only)
        self.created = int(time.time())

    @classmethod
    def load(cls, source, checkpoint_path=None, **kwargs):
        """A server for what ``Generator.load`` reads, named by its directory; a Hugging Face directory's
        chat template, if it has one, answers /v1/chat/completions."""
        gen = Generator.load(source, checkpoint_path)
        is_hf = checkpoint_path is None and (Path(source) / "config.json").is_file()  # as Generator.load decides
        chat = ChatTemplate.find(source) if is_hf else (None, NO_CHAT)
        return cls(gen, Path(source).resolve().name, chat=chat, **kwargs)

    def describe(self):
        lim = self.limits
        return (f"{self.where}, max_streams {lim.max_streams}, max_tokens {lim.max_tokens}, max_prompt_tokens "
                f"{lim.max_prompt_tokens}, {'API key required' if self.api_key else 'no API key'}, "
                f"chat {'on' if self.chat else 'off'}")

    def app(self):
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    def run(self, host, port, on_ready):
        """Serve on ``host``:``port`` (0: a free port) until SIGINT or SIGTERM; ``on_ready(url)`` once
        listening. ValueError naming the address when it cannot be bound."""
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            sock = socket.create_server((host, port), family=family)
        except socket.gaierror as exc:
            raise ConfigError(f"--host {host}: {exc.strerror}") from None
        except OSError as exc:  # create_server's own message repeats the address; the system's says it once
            raise ConfigError(f"--host {host} --port {port}: {os.strerror(exc.errno) if exc.errno else exc}") from None
        try:
            self.batcher.start()  # an inference job on CS-2s starts here; its failure is one line
            asyncio.run(self._serve(sock, on_ready))
        finally:
            self.batcher.close()
            sock.close()

    async def _serve(self, sock, on_ready):
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # handler_cancellation: a client that leaves cancels its handler, which cancels its sequences.
        # shutdown_timeout: requests under way at a stop get this long to finish.
        runner = web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=2.0, access_log=None)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
            host, port = sock.getsockname()[:2]
            on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}/v1")
            await stop.wait()
        finally:
            await runner.cleanup()

    # -- the transport's rules: the key, and every failure as OpenAI's error JSON

    @web.middleware
    async def _guard(self, request, handler):
        try:
            if self.api_key is not None:
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' "
                                        "with the key the server was started with", code="invalid_api_key")
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPException as exc:  # aiohttp's own: no such route (404), method (405), a body too large (413)
            return ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}").response()
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    async def _body(self, request, cls):
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            raise ApiError(400, f"the body is not JSON: {exc}") from None
        req = read(cls, body)
        if req.model != self.name:
            raise ApiError(404, f"model {show(req.model)}: this server serves {self.name}", param="model",
                           code="model_not_found")
        return req

    # -- endpoints

    def _card(self):
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "wse-cluster"}

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [self._card()]})

    async def _model(self, request):
        if request.match_info["model"] != self.name:
            raise ApiError(404, f"model {show(request.match_info['model'])}: this server serves {self.name}",
                           param="model", code="model_not_found")
        return web.json_response(self._card())

    async def _completions(self, request):
        req = await self._body(request, CompletionRequest)
        prompts = [self._check_prompt(self.gen.encode(p), "prompt", None if len(req.prompt) == 1 else k)
                   for k, p in enumerate(req.prompt)]
        # OpenAI's default of 16, within the server's own limit (a client that said nothing is not refused)
        n = min(16, self.limits.max_tokens) if req.max_tokens is None else req.max_tokens
        return await self._answer(request, req, prompts, n, chat=False)

    async def _chat(self, request):
        if self.chat is None:
            raise ApiError(400, self.why_no_chat)
        req = await self._body(request, ChatRequest)
        # The template writes the special tokens a conversation starts with (a bos_token), so nothing is added.
        prompt = self._check_prompt(self.gen.tokenizer.encode(self.chat.render(req.messages)), "messages", None)
        given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await self._answer(request, req, [prompt], self.limits.max_tokens if given is None else given, chat=True)

    def _check_prompt(self, ids, param, k):
        """The token ids of field ``param`` (its k-th prompt, if k is not None), checked."""
        where, vocab = param if k is None else f"{param}[{k}]", self.gen.vocab_size
        if not ids:
            raise ApiError(400, f"{where}: empty (give at least one token)", param=param)
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise ApiError(400, f"{where}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)
        if len(ids) > self.limits.max_prompt_tokens:
            raise ApiError(400, f"{where}: {len(ids)} tokens; this server takes prompts of at most "
                                f"{self.limits.max_prompt_tokens}", param=param, code="context_length_exceeded")
        return ids

    async def _answer(self, request, req, prompts, max_tokens, *, chat):
        if max_tokens > self.limits.max_tokens:
            param = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
            raise ApiError(400, f"{param}: {max_tokens}; this server makes at most {self.limits.max_tokens} tokens "
                                "per prompt", param=param)
        if len(prompts) > self.limits.max_streams:
            raise ApiError(400, f"prompt: {len(prompts)} prompts; this server generates at most "
                                f"{self.limits.max_streams} sequences at once", param="prompt")
        if self.in_flight + len(prompts) > self.limits.max_streams:
            raise ApiError(429, f"the server is busy: {self.in_flight} of its {self.limits.max_streams} streams are "
                                f"generating and this request needs {len(prompts)}; try again shortly",
                           code="rate_limit_exceeded")
        self.in_flight += len(prompts)
        try:
            head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
                    "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": self.name}
            if req.stream:
                return await self._stream(request, req, head, prompts, max_tokens, chat)
            done = await self._generate(prompts, max_tokens, sampling_of(req), req.stop or ())
            made = sum(len(tokens) for tokens, _, _ in done)
            choices = [{"index": k, **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
                        "logprobs": None, "finish_reason": why} for k, (_, text, why) in enumerate(done)]
            return web.json_response({**head, "choices": choices, "usage": _usage(prompts, made)})
        finally:
            self.in_flight -= len(prompts)

    async def _generate(self, prompts, max_tokens, sampling, stops=(), on_piece=None):
        """[(tokens, text, finish_reason)] of each prompt; ``on_piece(k, text, finish_reason or None)`` is
        awaited as prompt k's text grows and once at its end. A prompt whose text meets one of
        ``stops`` ends there ("stop"; its sequence is cancelled). Whatever ends this early (the client
        left, the server's stop) cancels the sequences still live."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        pieces = [TextPieces(self.gen.tokenizer, stops) for _ in prompts]
        ended = [None] * len(prompts)
        tickets = [self.batcher.submit(p, max_tokens, sampling, _to_loop(loop, queue, k))
                   for k, p in enumerate(prompts)]
        try:
            while None in ended:
                k, item = await queue.get()
                if isinstance(item, Exception):
                    raise ApiError(500, f"the engine failed: {type(item).__name__}: {item}")
                if ended[k] is not None:  # made before its stop string cancelled it
                    continue
                if item is None:
                    ended[k] = finish_reason(len(prompts[k]), len(pieces[k].tokens), max_tokens, self.capacity)
                    piece = pieces[k].rest() if on_piece else ""
                elif on_piece or stops:
                    piece = pieces[k].add(item)
                    if pieces[k].stopped:
                        ended[k] = "stop"
                        self.batcher.cancel(tickets[k])
                else:  # not streamed: the text is decoded once, at the end
                    pieces[k].tokens.append(item)
                    piece = ""
                if on_piece and (piece or ended[k]):
                    await on_piece(k, piece, ended[k])
        finally:
            for t, why in zip(tickets, ended):
                if why is None:
                    self.batcher.cancel(t)
        return [(p.tokens, p.text(), why) for p, why in zip(pieces, ended)]

    async def _stream(self, request, req, head, prompts, max_tokens, chat):
        """OpenAI's server-sent events: a chunk per piece of text, one with each prompt's finish_reason,
        the usage if ``stream_options.include_usage``, then ``data: [DONE]``."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        usage = bool(req.stream_options and req.stream_options.get("include_usage"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(data):
            await resp.write(b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n")

        async def chunk(k, text, why, role=None):
            said = {"text": text} if not chat else {"delta": {**({"role": role} if role else {}),
                                                              **({"content": text} if text or role else {})}}
            await send({**head, "choices": [{"index": k, **said, "logprobs": None, "finish_reason": why}],
                        **({"usage": None} if usage else {})})

        try:
            try:
                if chat:  # OpenAI's first chunk names the role; it also sends the headers at once
                    await chunk(0, "", None, role="assistant")
                else:  # a comment line: the headers go now, so the client knows at once that it was taken
                    await resp.write(b": accepted\n\n")
                done = await self._generate(prompts, max_tokens, sampling_of(req), req.stop or (), chunk)
                if usage:
                    await send({**head, "choices": [], "usage": _usage(prompts, sum(len(t) for t, _, _ in done))})
            except ApiError as exc:  # after the headers, an error is an event of the stream (OpenAI's clients raise it)
                await send(exc.body())
            await send(b"[DONE]")
            await resp.write_eof()
        except ConnectionResetError:  # the client left; _generate has cancelled its sequences
            pass
        return resp


def _usage(prompts, made):
    given = sum(len(p) for p in prompts)
    return {"prompt_tokens": given, "completion_tokens": made, "total_tokens": given + made}
