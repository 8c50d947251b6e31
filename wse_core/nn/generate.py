"""Generation: next tokens of a language model from prompts, with a KV cache (docs/design.md
section 2, "Inference").

``generate(model, params, prompts, max_new_tokens, sampling)`` yields ``(k, token)`` for prompt k
as each token is made: each prompt is prefilled alone (its positions through the units' ``infer``
in one step), then every unfinished sequence decodes one token per step, together. A sequence
ends at one of ``stop_ids`` (not yielded), after ``max_new_tokens``, or when it holds as many tokens
(the prompt's and the ones made) as the model has positions.

``Sampling``: greedy by default (temperature 0: the first of the largest logits, as torch.argmax);
otherwise Hugging Face's order of warpers (temperature, then top_k, then top_p) and a draw from
the softmax of what is left, with a generator keyed by (seed, position): the tokens depend on the
seed, the prompt and the weights, never on which other sequences share the step.
"""
from dataclasses import dataclass

import numpy as np

from wse_core.checks import Int, Number
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


def check_prompts(prompts, capacity):
    """The prompts as int32 arrays; ValueError naming the first that is empty or longer than the
    model's positions."""
    out = []
    for k, p in enumerate(prompts):
        a = np.asarray(p, dtype=np.int32).reshape(-1)
        if a.size == 0:
            raise ValueError(f"prompt {k}: empty (give it at least one token)")
        if a.size >= capacity:
            raise ValueError(f"prompt {k}: {a.size} tokens; the model holds {capacity} positions "
                             f"(model.max_position_embeddings), so at most {capacity - 1} leave room for one more")
        out.append(a)
    return out


def generate(model, params, prompts, max_new_tokens, sampling=GREEDY, stop_ids=()):
    """Yield (k, token) for prompt k as each token is made; see the module's docstring. ``params``:
    the float32 master weights (the model's precision is applied as the CS-2s apply it)."""
    Int(0)(max_new_tokens, "max_new_tokens")
    capacity = model.config["max_position_embeddings"]
    prompts = check_prompts(prompts, capacity)
    weights = model.compute_weights(params)
    kv = KVCache(capacity)
    seqs = [kv.add() for _ in prompts]
    last = {}  # sequence k -> the token it feeds next
    made = [0] * len(prompts)
    stops = set(int(s) for s in stop_ids)

    def take(k, logits):
        tok = sampling.pick(logits, kv.lengths[seqs[k]])
        made[k] += 1
        if tok in stops:
            return None
        last[k] = tok
        return tok

    if max_new_tokens == 0:
        return
    for k, p in enumerate(prompts):
        tok = take(k, model.infer(weights, p[None], kv, [seqs[k]])[0])
        if tok is not None:
            yield k, tok
    while True:
        # a sequence holds at most ``capacity`` tokens, the prompt's and the ones made
        live = [k for k in last if made[k] < max_new_tokens and len(prompts[k]) + made[k] < capacity]
        if not live:
            return
        logits = model.infer(weights, np.array([[last[k]] for k in live], np.int32), kv, [seqs[k] for k in live])
        for k in live:
            del last[k]
        for k, row in zip(live, logits):
            tok = take(k, row)
            if tok is not None:
                yield k, tok
