"""Build dataflow programs for the PE mesh in Python; compile them to the arrays the engine runs.

    from wse_core.fabric import Fabric, Program, mem, fin, fout, ops
    fab = Fabric(width=8, height=1)                      # 48 KiB per PE, queue depth 2, hop latency 1
    prog = Program(fab)
    everywhere = prog.region(0, 0, 8, 1)
    a = prog.alloc(everywhere, "a", 16)                  # 16 float32 words on every PE of the region
    prog.route(prog.region(0, 0, 1, 1), color=0, rx=["RAMP"], tx=["E"])
    prog.route(prog.region(1, 0, 6, 1), color=0, rx=["W"], tx=["E", "RAMP"])
    ...
    prog.task(prog.region(0, 0, 1, 1), "send", [ops.FMOV(fout(0, 16), mem(a))])
    run = prog.compile().run(launch=["send"])

A PE has a router with ports N, E, S, W and RAMP (to and from its core) and 24 colors; per color,
a route says which ports it accepts wavelets from (``rx``) and which it forwards them to (``tx``,
several for a multicast). A core runs tasks: a task bound to a color (``color=``) runs when a
wavelet of that color reaches its core; others run when launched by the host or activated by
another task. A task body is a list of DSD vector instructions, one element per cycle, whose
operands are memory DSDs (``mem``: symbol, offset, length, stride) or fabric DSDs (``fin``/``fout``:
color, length); a fabric operand stalls the instruction while its input queue is empty or its
output queue is full.

Sparse data use an indexed memory DSD, ``mem(x, index=mem(idx))``: element e is x[idx[e]], where
idx is an int32 symbol (``alloc(..., dtype="int32")``) written by the host. It stands for the
hardware's sparse addressing (data paired with indices) and costs one element per cycle like any
DSD; it is this model's choice, not an SDK construct.
"""
from dataclasses import dataclass, field

import numpy as np

from wse_core.fabric.isa import DTYPES, MAX_TASKS, NUM_COLORS, PORTS, FabricError, Symbol
from wse_core.fabric.run import Compiled


@dataclass(frozen=True)
class Fabric:
    width: int
    height: int
    mem_bytes: int = 48 * 1024
    queue_depth: int = 2
    hop_latency: int = 1

    def __post_init__(self):
        for name in ("width", "height", "mem_bytes", "queue_depth", "hop_latency"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise FabricError(f"Fabric.{name}: expected a positive integer, got {v!r}")


@dataclass(frozen=True)
class Region:
    """The PEs x, x + sx, ... below x + w and y, y + sy, ... below y + h (a rectangle when sx = sy = 1)."""
    x: int
    y: int
    w: int
    h: int
    sx: int = 1
    sy: int = 1

    @property
    def index(self):
        """numpy index of this region in a [height, width] array."""
        return slice(self.y, self.y + self.h, self.sy), slice(self.x, self.x + self.w, self.sx)

    def pes(self):
        return [(x, y) for y in range(self.y, self.y + self.h, self.sy) for x in range(self.x, self.x + self.w, self.sx)]

    @property
    def shape(self):
        return len(range(self.y, self.y + self.h, self.sy)), len(range(self.x, self.x + self.w, self.sx))

    def __str__(self):
        step = f" step ({self.sx}, {self.sy})" if (self.sx, self.sy) != (1, 1) else ""
        return f"PEs x {self.x}..{self.x + self.w - 1}, y {self.y}..{self.y + self.h - 1}{step}"



@dataclass
class _Code:
    """What one region's PEs run: symbols (name -> word offset), tasks (name -> (color, instrs))."""
    symbols: dict = field(default_factory=dict)
    words: int = 0
    tasks: dict = field(default_factory=dict)


class Program:
    """A program under construction: regions of code, routes, symbols for host I/O."""

    def __init__(self, fabric):
        self.fabric = fabric
        # Routes as arrays [color, y, x] of port masks (0: no route), so a whole wafer stays cheap.
        self.rx = np.zeros((NUM_COLORS, fabric.height, fabric.width), np.uint8)
        self.tx = np.zeros((NUM_COLORS, fabric.height, fabric.width), np.uint8)
        self.code_id = np.full((fabric.height, fabric.width), -1, np.int32)   # code region of each PE
        self.codes = []

    def region(self, x, y, w, h, step=(1, 1)):
        """A rectangle of PEs; ``step=(sx, sy)`` takes every sx-th column and sy-th row of it."""
        f = self.fabric
        if min(w, h) < 1 or x < 0 or y < 0 or x + w > f.width or y + h > f.height:
            raise FabricError(f"region ({x}, {y}, {w}, {h}): outside the {f.width} x {f.height} fabric")
        if min(step) < 1:
            raise FabricError(f"region step {step}: expected positive integers")
        return Region(x, y, w, h, *step)

    def _code(self, region):
        """The code object of a region; a region with code must be exactly another's or overlap none."""
        ids = self.code_id[region.index]
        first = int(ids.flat[0])
        if first < 0 and (ids < 0).all():
            self.codes.append(_Code())
            ids[...] = len(self.codes) - 1
            return self.codes[-1]
        if first >= 0 and (ids == first).all() and int((self.code_id == first).sum()) == ids.size:
            return self.codes[first]
        raise FabricError(f"{region}: overlaps another region's code only partly; give each PE one code region")

    def code_at(self, x, y):
        k = int(self.code_id[y, x])
        return self.codes[k] if k >= 0 else None

    def alloc(self, region, name, length, dtype="float32"):
        """``length`` 32-bit words named ``name`` on every PE of ``region``, float32 or int32 (indices
        for indexed DSDs, written by the host); returns the Symbol."""
        if dtype not in DTYPES:
            raise FabricError(f"symbol {name!r}: dtype must be one of {DTYPES}, got {dtype!r}")
        code = self._code(region)
        if name in code.symbols:
            raise FabricError(f"{region}: symbol {name!r} allocated twice")
        if length < 1:
            raise FabricError(f"symbol {name!r}: length must be >= 1, got {length}")
        code.symbols[name] = (code.words, length, dtype)
        code.words += length
        if code.words * 4 > self.fabric.mem_bytes:
            raise FabricError(f"{region}: symbol {name!r} needs {code.words * 4} bytes in all, more than the "
                              f"{self.fabric.mem_bytes} bytes of a PE's memory")
        return Symbol(name, length, dtype)

    def route(self, region, color, rx, tx):
        """On every PE of ``region``, wavelets of ``color`` are accepted from ports ``rx`` and forwarded to ``tx``."""
        if not 0 <= color < NUM_COLORS:
            raise FabricError(f"color {color}: expected 0..{NUM_COLORS - 1}")
        for ports in (rx, tx):
            for port in ports:
                if port not in PORTS:
                    raise FabricError(f"color {color}: unknown port {port!r} (N, E, S, W, RAMP)")
        rxm = sum(1 << PORTS[p] for p in set(rx))
        txm = sum(1 << PORTS[p] for p in set(tx))
        sl = (color, *region.index)
        clash = ((self.rx[sl] != 0) | (self.tx[sl] != 0)) & ((self.rx[sl] != rxm) | (self.tx[sl] != txm))
        if clash.any():
            dy, dx = np.argwhere(clash)[0]
            raise FabricError(f"PE ({region.x + dx * region.sx}, {region.y + dy * region.sy}) color {color}: "
                              "routed twice in conflicting ways")
        self.rx[sl], self.tx[sl] = rxm, txm

    def task(self, region, name, body, color=None):
        """A task on every PE of ``region``: bound to ``color`` (runs when its wavelets arrive) or local."""
        code = self._code(region)
        if name in code.tasks:
            raise FabricError(f"{region}: task {name!r} defined twice")
        if len(code.tasks) >= MAX_TASKS:
            raise FabricError(f"{region}: more than {MAX_TASKS} tasks")
        if color is not None and any(c == color for c, _ in code.tasks.values()):
            raise FabricError(f"{region}: two tasks bound to color {color}")
        code.tasks[name] = (color, list(body))

    def compile(self):
        """The program as the engine's arrays (``run.Compiled``): copy data in, launch, run."""
        return Compiled(self)
