"""OpenAI's API as `wse serve` reads and answers it (pyapi.serve): the requests, the errors, chat templates.

    requests        one dataclass per endpoint, its fields checked on arrival by the constraints of
                    wse_core.checks (``read``); what the server does not serve is refused by name
    ApiError        every refusal, written as OpenAI's error JSON ({"error": {"message", "type",
                    "param", "code"}}) with its HTTP status
    ChatTemplate    a Hugging Face directory's chat template, rendered as transformers renders it
"""
import json
import secrets
import time
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from aiohttp import web

from wse_core.checks import Bool, Check, Constraint, Int, Number, Text, default_of, did_you_mean, key, show
from wse_core.errors import ConfigError, ConfigTypeError
from wse_core.nn.generate import GREEDY, Sampling
# jinja2 (optional: chat templates only) is imported where a template is rendered.


# -- errors ----------------------------------------------------------------------------------------

class ApiError(Exception):
    """A request refused: its HTTP status and OpenAI's error fields (``param``: the field at fault)."""

    TYPES = {429: "requests", 500: "server_error"}  # any other status: OpenAI's "invalid_request_error"

    def __init__(self, status, message, *, param=None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self):
        return {"error": {"message": str(self), "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self):
        return web.json_response(self.body(), status=self.status)


# -- requests --------------------------------------------------------------------------------------

class Unserved(Constraint):
    """A field of OpenAI's API whose other values ask for what this server does not do: ``accepted``
    (and null) pass; anything else is one line saying why."""

    def __init__(self, *accepted, why):
        super().__init__(none=True)
        self.accepted, self.why = accepted, why
        self.expected = " or ".join(show(a) for a in accepted)

    def check(self, value, path):
        if any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in self.accepted):
            return value
        raise ConfigError(f"{path}: {self.why}, got {show(value)}")


def _prompts(value, path):
    """OpenAI's ``prompt``: a text, texts, token ids, or lists of token ids; as a list of prompts."""
    def ids(v):
        return isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v)

    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and (all(isinstance(v, str) for v in value) or all(ids(v) for v in value)):
        return value
    if ids(value):
        return [value]
    raise ConfigTypeError(f"{path}: expected a string, a list of strings, a list of token ids or a list of such lists, "
                          f"got {show(value)}")


def _messages(value, path):
    """OpenAI's chat ``messages``: objects with a role and a text content (text parts are joined, as a
    model of text reads them); the other keys go to the template as given."""
    if not isinstance(value, list) or not value:
        raise ConfigTypeError(f"{path}: expected a non-empty list of messages, got {show(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ConfigTypeError(f"{path}[{i}]: expected an object with a role, got {show(m)}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ConfigError(f"{path}[{i}].content: only text parts are served, got {show(content)}")
            m = dict(m, content="".join(p["text"] for p in content))
        elif content is not None and not isinstance(content, str):
            raise ConfigTypeError(f"{path}[{i}].content: expected a string or a list of text parts, "
                                  f"got {show(content)}")
        out.append(m)
    return out


def _stream_options(value, path):
    if not isinstance(value, dict) or set(value) - {"include_usage"} or \
            not isinstance(value.get("include_usage", False), bool):
        raise ConfigError(f"{path}: expected {{\"include_usage\": true or false}}, got {show(value)}")
    return value


def _stops(value, path):
    """OpenAI's ``stop``: a string or a list of up to 4 non-empty strings."""
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or \
            not all(isinstance(s, str) and s for s in stops):
        raise ConfigTypeError(f"{path}: expected a non-empty string or a list of 1 to 4 of them, got {show(value)}")
    return stops


def _any_text(value, path):
    if not isinstance(value, str):
        raise ConfigTypeError(f"{path}: expected a string, got {show(value)}")
    return value


@dataclass(kw_only=True)
class _Sampled:
    """What both endpoints take: the model, how many tokens, how to pick them. A null is the default."""

    model: str = key(Text(), "the served model's name (GET /v1/models)")
    max_tokens: int = key(Int(0), "tokens to make per prompt", None)  # None: the endpoint's default
    temperature: float = key(Number(0, 2), "0: greedy; above: sampling", 1.0)  # OpenAI's default
    top_p: float = key(Number(0, 1), "sample among the likeliest tokens of this total probability", 1.0)
    top_k: int = key(Int(0), "sample among the k likeliest tokens (0: all; vLLM's, not OpenAI's)", 0)
    seed: int = key(Int(0), "the sampling seed", None)  # None: one drawn per request, as OpenAI's
    n: int = key(Unserved(1, why="one completion per prompt is served"), "completions per prompt", 1)
    stream: bool = key(Bool(), "send the tokens as they come (server-sent events)", False)
    stream_options: dict = key(Check(_stream_options, "{include_usage: bool}"), "", None)
    stop: list = key(Check(_stops, "a string or up to 4 strings"), "texts that end the completion (not included)",
                     None)
    user: str = key(Check(_any_text, "a string"), "the end user's id (taken, not used)", None)
    frequency_penalty: float = key(Unserved(0, why="penalties are not served"), "", 0)
    presence_penalty: float = key(Unserved(0, why="penalties are not served"), "", 0)
    logit_bias: dict = key(Unserved({}, why="logit biases are not served"), "", None)


@dataclass(kw_only=True)
class CompletionRequest(_Sampled):
    """POST /v1/completions."""

    prompt: list = key(Check(_prompts, "texts or token ids"), "the prompt(s): text or token ids")
    echo: bool = key(Unserved(False, why="echo is not served"), "", False)
    logprobs: int = key(Unserved(None, why="log-probabilities are not served"), "", None)
    best_of: int = key(Unserved(1, why="best_of is not served"), "", 1)
    suffix: str = key(Unserved(None, "", why="suffixes are not served"), "", None)


@dataclass(kw_only=True)
class ChatRequest(_Sampled):
    """POST /v1/chat/completions."""

    messages: list = key(Check(_messages, "a list of messages"), "the conversation so far")
    max_completion_tokens: int = key(Int(0), "max_tokens' newer name", None)
    logprobs: bool = key(Unserved(False, why="log-probabilities are not served"), "", False)
    top_logprobs: int = key(Unserved(None, why="log-probabilities are not served"), "", None)
    tools: list = key(Unserved([], why="tools are not served"), "", None)
    tool_choice: str = key(Unserved("none", why="tools are not served"), "", None)
    response_format: dict = key(Unserved({"type": "text"}, why="only text responses are served"), "", None)


def read(cls, body):
    """The request dataclass ``cls`` from a JSON body, each field checked by its constraint; an unknown,
    missing or wrong field is an ApiError naming it. (``wse_core.checks.check_fields``'s rules, but
    the error's ``param`` must name the field, and OpenAI's clients send null for "the default".)"""
    if not isinstance(body, dict):
        raise ApiError(400, f"the body: expected a JSON object, got {show(body)}")
    known = {f.name: f for f in fields(cls)}
    for name in body:
        if name not in known:
            shown = name if len(name) <= 60 and name.isprintable() else show(name)
            raise ApiError(400, f"{shown}: unknown field ({did_you_mean(name, sorted(known))})", param=name)
    out = {}
    for name, f in known.items():
        value = body.get(name)
        if value is None:
            if default_of(f) is MISSING:
                raise ApiError(400, f"{name}: missing ({f.metadata['help']})", param=name)
            out[name] = default_of(f)
            continue
        try:
            out[name] = f.metadata["check"](value, name)
        except (TypeError, ValueError) as exc:
            raise ApiError(400, str(exc), param=name) from None
    return cls(**out)


def sampling_of(req):
    """OpenAI's sampling fields as ours: temperature 0 (and top_p 0: only the likeliest token left) is
    greedy; a request without a seed gets a fresh one, so its samples differ from another's."""
    if req.temperature == 0 or req.top_p == 0:
        return GREEDY
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    return Sampling(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed)


# -- chat templates --------------------------------------------------------------------------------

NO_CHAT = "this model has no chat template: use /v1/completions"


class ChatTemplate:
    """A Hugging Face directory's chat template (tokenizer_config.json's ``chat_template``, or
    ``chat_template.jinja``), rendered as transformers' ``apply_chat_template`` renders it: a
    sandboxed jinja2 environment (trim_blocks, lstrip_blocks, loop controls), ``raise_exception``,
    ``strftime_now``, and the special tokens' text (``bos_token``, ``eos_token``, ...)."""

    def __init__(self, source, specials):
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                            extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: time.strftime(f))
        self.template, self.specials = env.from_string(source), specials
        self.errors = (jinja2.exceptions.TemplateError,)

    @classmethod
    def find(cls, directory):
        """(the template of ``directory``, or None and one line saying why there is none)."""
        directory = Path(directory)
        try:
            config = json.loads((directory / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            config = {}
        source = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if source is None and (directory / "chat_template.jinja").is_file():
            source = (directory / "chat_template.jinja").read_text()
        if not isinstance(source, str):
            return None, NO_CHAT
        try:
            import jinja2.sandbox  # noqa: F401  (the optional package the templates need)
        except ImportError:
            return None, "this model's chat template needs the jinja2 package, which is not installed on the server"
        specials = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()
                    if k.endswith("_token") and isinstance(v, (str, dict))}
        return cls(source, specials), ""

    def render(self, messages):
        """The prompt text of ``messages`` followed by the assistant's turn; ApiError for what the
        template refuses (its own ``raise_exception``)."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.specials)
        except self.errors as exc:
            raise ApiError(400, f"messages: the chat template refused them: {exc}", param="messages") from None
