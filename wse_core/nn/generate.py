"""Generation: next tokens of a language model from prompts, with a KV cache (docs/design/inference.md
"Generation").

``Engine`` batches continuously: sequences join at any step; each is prefilled alone (its
prompt's positions through the units' ``infer`` in one step), then every unfinished sequence
decodes one token per step, together. Its forward passes run on a runner: ``Local`` in this
process, or the emulated cluster's CS-2s (``mpi_launch.inference``), with the same bits. ``generate(model, params, prompts, max_new_tokens,
sampling)`` runs one over a list of prompts and yields ``(k, token)`` for prompt k as each token is
made. A sequence ends at one of ``stop_ids`` (not yielded), after ``max_new_tokens``, or when it holds as many tokens
(the prompt's and the ones made) as the model has positions.

``Sampling``: greedy by default (temperature 0: the first of the largest logits, as torch.argmax);
otherwise Hugging Face's order of warpers (temperature, then top_k, then top_p) and a draw from
the softmax of what is left, with a generator keyed by (seed, position): the tokens depend on the
seed, the prompt and the weights, never on which other sequences share the step.
"""
from dataclasses import dataclass

import numpy as np

from wse_core.checks import Int, Number
from wse_core.errors import ConfigError
from wse_core.nn.kv import KVCache


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep all."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        Number(0)(self.temperature, "temperature")
        Int(0)(self.top_k, "top_k")
        Number(0, 1, open="low")(self.top_p, "top_p")
        Int(0)(self.seed, "seed")

    def pick(self, logits, position):
        """The token after ``logits`` [vocab] (float32), the one at ``position`` of its sequence."""
        if self.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        if 0 < self.top_k < len(z):
            z[z < np.partition(z, -self.top_k)[-self.top_k]] = -np.inf   # ties with the k-th stay
        if self.top_p < 1:
            order = np.argsort(z, kind="stable")                             # ascending, as HF's warper
            p = np.exp(z[order] - z[order[-1]])
            cum = np.cumsum(p / p.sum())
            drop = cum <= 1 - self.top_p
            drop[-1] = False                                                 # the likeliest token stays
            z[order[drop]] = -np.inf
        p = np.exp(z - z.max())
        cdf = np.cumsum(p / p.sum())
        u = np.random.default_rng([self.seed, position]).random()
        return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))


GREEDY = Sampling()


def check_prompts(prompts, capacity, vocab_size):
    """The prompts as int32 arrays; ValueError naming the first that is empty, longer than the
    model's positions, or holds an id outside the vocabulary."""
    out = []
    for k, p in enumerate(prompts):
        a = np.asarray(p, dtype=np.int64).reshape(-1)
        if a.size == 0:
            raise ConfigError(f"prompt {k}: empty (give it at least one token)")
        bad = a[(a < 0) | (a >= vocab_size)]
        if bad.size:
            raise ConfigError(f"prompt {k}: token id {int(bad[0])} outside the model's vocabulary [0, {vocab_size}) "
                              "(model.vocab_size)")
        if a.size >= capacity:
            raise ConfigError(f"prompt {k}: {a.size} tokens; the model holds {capacity} positions "
                              f"(model.max_position_embeddings), so at most {capacity - 1} leave room for one more")
        out.append(a.astype(np.int32))
    return out


class Local:
    """Where an Engine's forward passes run in this process: the model's units over one KV cache.
    Any object with the same ``capacity``/``vocab_size``/``add``/``remove``/``forward`` runs them
    elsewhere (the emulated cluster's CS-2s: ``mpi_launch.inference``; a compiled PyTorch model's
    graph: ``wse_core.compiler.generate``)."""

    def __init__(self, model, params):
        self.model, self.weights = model, model.compute_weights(params)
        self.capacity, self.vocab_size = model.config["max_position_embeddings"], model.config["vocab_size"]
        self.kv = KVCache(self.capacity)

    def add(self):
        """A new sequence's id."""
        return self.kv.add()

    def remove(self, i):
        self.kv.remove(i)

    def forward(self, ids, active):
        """Logits [b, vocab] after the new tokens ``ids`` [b, t] of the sequences ``active``."""
        return self.model.infer(self.weights, ids, self.kv, active)


class Engine:
    """Continuous batching: sequences join (``add``) at any step and leave when they end; ``step()``
    prefills the sequences added since the last step, one by one, then decodes one token for every
    other unfinished sequence, together, and returns [(sequence, token or None)]: None when the
    sequence has ended (at a stop id, which is not returned, after its ``max_new_tokens``, or at
    the model's positions). The forward passes run on ``runner`` (default: ``Local(model, params)``,
    ``params`` the float32 master weights, in the model's precision as the CS-2s apply it)."""

    def __init__(self, model, params=None, *, runner=None):
        self.model = model
        self.runner = runner if runner is not None else Local(model, params)
        self.capacity, self.vocab_size = self.runner.capacity, self.runner.vocab_size
        self.waiting, self.live = [], {}  # sequences to prefill: (id, prompt); decoding: id -> state

    def add(self, prompt, max_new_tokens, sampling=GREEDY, stop_ids=()):
        """A sequence to generate from ``prompt`` (token ids); returns its id."""
        Int(0)(max_new_tokens, "max_new_tokens")
        (prompt,) = check_prompts([prompt], self.capacity, self.vocab_size)
        i = self.runner.add()
        self.waiting.append((i, prompt))
        self.live[i] = {"prompt": len(prompt), "made": 0, "last": None, "max": max_new_tokens,
                        "sampling": sampling, "stops": set(int(s) for s in stop_ids)}
        return i

    def cancel(self, i):
        """End sequence ``i`` now (a client that left)."""
        self.waiting = [(j, p) for j, p in self.waiting if j != i]
        if i in self.live:
            del self.live[i]
            self.runner.remove(i)

    @property
    def busy(self):
        return bool(self.live)

    def close(self):
        """Nothing to release in this process (an engine on the cluster ends its job)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _take(self, i, logits):
        s = self.live[i]
        tok = s["sampling"].pick(logits, s["prompt"] + s["made"])
        s["made"] += 1
        if tok in s["stops"]:
            tok = None
        s["last"] = tok
        return tok

    def _ended(self, i):
        s = self.live[i]
        return s["last"] is None or s["made"] >= s["max"] or s["prompt"] + s["made"] >= self.capacity

    def step(self):
        out = []
        waiting, self.waiting = self.waiting, []
        prefilled = set()
        for i, prompt in waiting:
            if self.live[i]["max"] == 0:
                out.append((i, None))
            else:
                out.append((i, self._take(i, self.runner.forward(prompt[None], [i])[0])))
                prefilled.add(i)
        decode = [i for i in self.live if i not in prefilled and self.live[i]["made"] and not self._ended(i)]
        if decode:
            ids = np.array([[self.live[i]["last"]] for i in decode], np.int32)
            for i, row in zip(decode, self.runner.forward(ids, decode)):
                out.append((i, self._take(i, row)))
        full = [i for i, tok in out if tok is not None and self._ended(i)]  # its last token just made
        for i in [i for i, tok in out if tok is None] + full:
            del self.live[i]
            self.runner.remove(i)
        return out + [(i, None) for i in full]


def generate(model, params, prompts, max_new_tokens, sampling=GREEDY, stop_ids=(), *, engine=None):
    """Yield (k, token) for prompt k as each token is made; see the module's docstring. ``engine``:
    an idle Engine (or one of the same interface) to run them on, instead of a new one in this process."""
    Int(0)(max_new_tokens, "max_new_tokens")
    engine = engine if engine is not None else Engine(model, params)
    prompts = check_prompts(prompts, engine.capacity, engine.vocab_size)
    index = {engine.add(p, max_new_tokens, sampling, stop_ids): k for k, p in enumerate(prompts)}
    while engine.busy:
        for i, tok in engine.step():
            if tok is not None:
                yield index[i], tok
