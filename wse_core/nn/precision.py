"""16-bit number formats and the run's compute precision (Model Zoo's ``mixed_precision`` / ``fp16_type``).

A ``Format`` is a binary floating-point format of 16 bits: 1 sign bit, ``exp_bits`` exponent bits
with bias 2^(exp_bits-1) - 1, ``man_bits`` stored mantissa bits, subnormals, infinities and NaN
where IEEE 754 puts them, and round-to-nearest-even. float16 (5/10) and bfloat16 (8/7) are
exactly that. cbfloat16 (Cerebras' format: 6 exponent and 9 mantissa bits) is emulated by the same
rules; its bias, subnormals and rounding are **assumptions**: the public documents give only the
bit split (docs/design/numerics.md "Mixed precision").

Values are carried in float32 arrays holding numbers of the format (``Format.round``) and cross
the wire as their 16-bit patterns (``encode``/``decode``: exact for such numbers), so a 16-bit
run streams half the bytes of a float32 run.

``Precision`` is what a run computes in (docs/design/numerics.md "Mixed precision"): weights streamed in the 16-bit
format; every unit's output and input gradient rounded to it; every micro-batch weight gradient
and every partial sum of gradients (on a CS-2, in SwarmX, at MemoryX) rounded to it after each
float32 addition, the same additions in the same order whatever num_csx is. ``Precision(None)`` is
float32 throughout, and changes nothing.
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Format:
    """A 16-bit binary floating-point format (see the module's docstring)."""

    name: str
    exp_bits: int
    man_bits: int

    @property
    def bias(self):
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def emin(self):
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def max(self):
        """The largest finite number."""
        emax = (1 << self.exp_bits) - 2 - self.bias
        return (2.0 - 2.0 ** -self.man_bits) * 2.0 ** emax

    def round(self, x, out=None):
        """float32 array of the format's numbers nearest ``x`` (ties to even; beyond max: +-inf)."""
        from wse_core.nn import _kernels

        x = np.ascontiguousarray(x, np.float32)
        if out is None:
            out = np.empty_like(x)
        elif not (out.flags.c_contiguous and out.dtype == np.float32 and out.shape == x.shape):
            out[...] = self.round(x)
            return out
        # One pass in a kernel: |x| = f 2^e, quantum 2^(max(e, emin) - man_bits), round(x / quantum)
        # ties to even, times quantum (exact in float64); numpy's seven passes over float64 copies
        # took 11 ms of a GPT-2 block's 88 in mixed precision.
        _kernels.round_to_format(x.reshape(-1), out.reshape(-1), self.exp_bits, self.man_bits, self.max)
        return out

    def encode(self, x):
        """uint16 bit patterns of ``x``, whose values must be numbers of the format (``round``'s)."""
        x64 = np.asarray(x, np.float64)
        sign = np.signbit(x64).astype(np.uint32) << 15
        a = np.abs(x64)
        _, e = np.frexp(a)
        e = e - 1
        normal = (a > 0) & (e >= self.emin) & np.isfinite(a)
        biased = np.where(normal, e + self.bias, 0)
        quantum = np.ldexp(1.0, np.where(normal, e, self.emin) - self.man_bits)
        man = np.where(normal, a / quantum - (1 << self.man_bits), a / quantum)
        man = np.where(np.isfinite(a), man, 0)
        top = (1 << self.exp_bits) - 1
        biased = np.where(np.isfinite(a), biased, top)
        man = np.where(np.isnan(a), 1 << (self.man_bits - 1), man)   # a quiet NaN
        bits = sign | (biased.astype(np.uint32) << self.man_bits) | man.astype(np.uint32)
        return bits.astype(np.uint16)

    def decode(self, bits):
        """float32 values of uint16 bit patterns."""
        b = np.asarray(bits, np.uint16).astype(np.int64)
        sign = np.where(b >> 15, -1.0, 1.0)
        biased = (b >> self.man_bits) & ((1 << self.exp_bits) - 1)
        man = (b & ((1 << self.man_bits) - 1)).astype(np.float64)
        top = (1 << self.exp_bits) - 1
        normal = np.ldexp(1.0 + man / (1 << self.man_bits), biased - self.bias)
        sub = np.ldexp(man, self.emin - self.man_bits)
        value = np.where(biased == 0, sub, normal)
        value = np.where(biased == top, np.where(man == 0, np.inf, np.nan), value)
        return (sign * value).astype(np.float32)


FORMATS = {"float16": Format("float16", 5, 10), "bfloat16": Format("bfloat16", 8, 7),
           "cbfloat16": Format("cbfloat16", 6, 9)}


class Precision:
    """The run's compute precision: a 16-bit ``Format``, or None for float32 throughout."""

    def __init__(self, fmt=None):
        self.format = FORMATS[fmt] if isinstance(fmt, str) else fmt

    @property
    def name(self):
        return "float32" if self.format is None else self.format.name

    @property
    def products(self):
        """The format dense products' operands are rounded to (``gemm.products_in``): bfloat16 in a
        bfloat16 run; None (float32 operands) otherwise, float16 and cbfloat16 included."""
        return "bfloat16" if self.format is not None and self.format.name == "bfloat16" else None

    @property
    def wire_dtype(self):
        """What weights and gradients cross the fabric as."""
        return np.float32 if self.format is None else np.uint16

    @property
    def itemsize(self):
        return np.dtype(self.wire_dtype).itemsize

    def round_(self, a):
        """Round a float32 array to the format in place (nothing for float32); return it."""
        if self.format is not None:
            self.format.round(a, out=a)
        return a

    def add(self, a, b):
        """a + b in float32, rounded to the format: every gradient sum is one of these (inf - inf,
        from overflowed gradients, is NaN without a warning: the overflow check finds it)."""
        with np.errstate(invalid="ignore"):
            return self.round_(a + b)

    def to_wire(self, a):
        """``a`` as it crosses the fabric: rounded to the format, as 16-bit patterns (float32: itself)."""
        return a if self.format is None else self.format.encode(self.format.round(a))

    def from_wire(self, a):
        return a if self.format is None else self.format.decode(a)

    def wire_sum(self, pieces):
        """The tree sum (``wse_core.microbatch.tree_sum`` order) of wire arrays, as a wire array."""
        from wse_core.microbatch import tree_sum

        if self.format is None:
            return tree_sum(pieces)
        return self.to_wire(tree_sum([self.from_wire(p) for p in pieces], add=self.add))
