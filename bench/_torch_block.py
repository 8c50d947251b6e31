"""The GPT-2 block of ``bench.nn`` in PyTorch eager, run in its own process with PyTorch's defaults.

``python -m bench._torch_block IN.npz OUT.npz REPEATS THREADS [profile]``: IN holds the block's
parameters (``blocks.0.*``), ``x`` and ``dy``; OUT gets ``seconds`` (median forward + backward),
``seconds_bf16`` (the same under ``torch.autocast`` in bfloat16, PyTorch's CPU mixed precision) and
``y``; with ``profile``, also ``ops`` and ``ms``: the operators' self CPU time per forward +
backward (``torch.profiler``), the largest twelve and the rest (``ops_bf16``, ``ms_bf16``: the same
under autocast).
It imports nothing of wse_core, so the OpenMP and malloc settings that wse_core makes for its
own kernels do not slow PyTorch down.
"""
import sys

import numpy as np
import torch

from bench.harness import median_seconds  # imports nothing of wse_core at module level


def main(src, dst, repeats, threads, profile=False):
    torch.set_num_threads(threads)
    data = np.load(src)
    f = torch.nn.functional
    p = "blocks.0."
    w = {k[len(p):]: torch.tensor(data[k], requires_grad=True) for k in data.files if k.startswith(p)}
    xt = torch.tensor(data["x"], requires_grad=True)
    dyt = torch.tensor(data["dy"])
    b, t, c = xt.shape
    nh = int(data["heads"])

    def step(autocast=False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = block()
        out.float().backward(dyt)
        return out

    def block():
        h = f.layer_norm(xt, (c,), w["ln_1.weight"], w["ln_1.bias"], 1e-5)
        q, k, v = f.linear(h, w["attn.qkv.weight"], w["attn.qkv.bias"]).split(c, dim=2)
        q, k, v = (z.view(b, t, nh, c // nh).transpose(1, 2) for z in (q, k, v))
        a = f.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        mid = xt + f.linear(a, w["attn.proj.weight"], w["attn.proj.bias"])
        h = f.layer_norm(mid, (c,), w["ln_2.weight"], w["ln_2.bias"], 1e-5)
        m = f.linear(f.gelu(f.linear(h, w["mlp.fc.weight"], w["mlp.fc.bias"]), approximate="tanh"),
                     w["mlp.proj.weight"], w["mlp.proj.bias"])
        return mid + m

    y = step().detach().numpy()
    out = {"seconds": median_seconds(step, repeats), "seconds_bf16": median_seconds(lambda: step(True), repeats),
           "y": y, "version": torch.__version__}
    if profile:
        for suffix, autocast in (("", False), ("_bf16", True)):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(repeats):
                    step(autocast)
            rows = sorted(((e.key, e.self_cpu_time_total / 1e3 / repeats) for e in prof.key_averages()),
                          key=lambda kv: -kv[1])
            rows = rows[:12] + [("everything else", sum(ms for _, ms in rows[12:]))]
            out.update({f"ops{suffix}": np.array([k for k, _ in rows]), f"ms{suffix}": np.array([ms for _, ms in rows])})
    np.savez(dst, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["profile"])
