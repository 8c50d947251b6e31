"""A compiled fabric program: flat arrays for the engine, host memcpy, launch, and the run report."""
import time

import numpy as np

from wse_core.fabric.engine import Engine, Outcome
from wse_core.fabric.isa import (K_FIN, K_FOUT, K_IDX, K_IMM, K_MEM, K_NONE, MAX_TASKS, OPCODES, PORTS,
                                 FabricError, Operand)

_DIRS = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}     # N, E, S, W as (dx, dy)
_OPPOSITE = {0: 2, 1: 3, 2: 0, 3: 1}
_NAMES = {v: k for k, v in PORTS.items()}


def _by_pe(table, colors, P):
    """A route table [color, y, x] as the engine's flat [y, x, used color] (zeros when no color is used)."""
    # [y, x, color] order: a PE's colors are adjacent in the engine's queues.
    return np.ascontiguousarray(table[colors].transpose(1, 2, 0)).reshape(-1) if colors else np.zeros(P, np.uint8)


def _check_routes(program, colors):
    """Routes must lead somewhere that accepts them: raise FabricError naming the first PE whose route
    sends a color off the fabric's edge, or to a neighbour whose route for it does not accept it."""
    for c in colors:
        txc, rxc = program.tx[c], program.rx[c]
        for port, (dx, dy) in _DIRS.items():
            sends = (txc & (1 << port)) != 0
            if not sends.any():
                continue
            off = np.zeros_like(sends)
            if dx == 1:
                off[:, -1] = True
            elif dx == -1:
                off[:, 0] = True
            elif dy == 1:
                off[-1, :] = True
            else:
                off[0, :] = True
            bad = sends & off
            if bad.any():
                y, x = np.argwhere(bad)[0]
                raise FabricError(f"PE ({x}, {y}) color {c}: routes {_NAMES[port]} off the edge of the fabric")
            accepts = (np.roll(rxc, (-dy, -dx), axis=(0, 1)) & (1 << _OPPOSITE[port])) != 0
            bad = sends & ~accepts
            if bad.any():
                y, x = np.argwhere(bad)[0]
                raise FabricError(f"PE ({x}, {y}) color {c}: routes {_NAMES[port]} to PE ({x + dx}, {y + dy}), "
                                  f"whose route for color {c} does not accept {_NAMES[_OPPOSITE[port]]}")


class Compiled:
    """The program as arrays; owns the PEs' memory between host copies and runs."""

    def __init__(self, program):
        f = program.fabric
        self.fabric, self.program = f, program
        P = f.width * f.height
        used = (program.rx != 0) | (program.tx != 0)
        colors = [c for c in range(used.shape[0]) if used[c].any()]
        self.colors = colors
        cmap = {c: i for i, c in enumerate(colors)}
        self.C = max(1, len(colors))
        self.rx = _by_pe(program.rx, colors, P)
        self.tx = _by_pe(program.tx, colors, P)
        _check_routes(program, colors)
        self._set_code(self._encode_tasks(cmap))
        self.pe_code = program.code_id.reshape(-1).copy()
        words = np.array([c.words for c in program.codes] + [0], np.int64)[self.pe_code]   # -1 -> 0 words
        self.mem_off = np.concatenate([[0], np.cumsum(words)[:-1]]).astype(np.int64)
        off = int(words.sum())
        self.mem = np.zeros(max(off, 1), np.float32)
        self.active = np.zeros(P, np.uint32)
        self.blocked = np.zeros(P, np.uint32)
        self.cycles = 0

    def _encode_tasks(self, cmap):
        """Fill the task tables (one per code region); return every task's instructions as encoded rows."""
        codes = self.program.codes
        self.task_color = np.full(len(codes) * MAX_TASKS, -1, np.int32)
        self.task_start = np.zeros(len(codes) * MAX_TASKS, np.int32)
        self.task_len = np.zeros(len(codes) * MAX_TASKS, np.int32)
        self.ntasks = np.zeros(len(codes), np.int32)
        self.task_index = []
        rows = []
        self.indexed = []   # (code, index address, length, stride, data words): checked before each run
        for k, code in enumerate(codes):
            names = list(code.tasks)
            self.task_index.append({n: i for i, n in enumerate(names)})
            self.ntasks[k] = len(names)
            y0, x0 = np.argwhere(self.program.code_id == k)[0]
            pes = [(int(x0), int(y0))]   # named in errors: the region's first PE
            for t, name in enumerate(names):
                color, body = code.tasks[name]
                if color is not None:
                    self._need_route(k, color, tx=True, what=f"task {name!r} is bound to color {color}")
                    self.task_color[k * MAX_TASKS + t] = cmap[color]
                self.task_start[k * MAX_TASKS + t] = len(rows)
                self.task_len[k * MAX_TASKS + t] = len(body)
                for ins in body:
                    rows.append(self._encode(ins, code, names, pes, cmap, k))
        return rows

    def _set_code(self, rows):
        """The encoded rows as the engine's instruction columns."""
        if not rows:  # the engine takes the address of row 0; a program without code gets one unused row
            rows.append((0, 1, [K_NONE] * 3, [0] * 3, [1] * 3, [0.0] * 3, -1, 0, [0] * 3, (0, 0, 0, 0)))
        n = len(rows)
        self.op = np.array([r[0] for r in rows], np.int32)
        self.length = np.array([r[1] for r in rows], np.int64)
        self.kind = np.array([r[2] for r in rows], np.int32).reshape(n, 3)
        self.arg = np.array([r[3] for r in rows], np.int64).reshape(n, 3)
        self.stride = np.array([r[4] for r in rows], np.int64).reshape(n, 3)
        self.immv = np.array([r[5] for r in rows], np.float32).reshape(n, 3)
        self.target = np.array([r[6] for r in rows], np.int32)
        self.asyn = np.array([r[7] for r in rows], np.uint8)
        self.iarg = np.array([r[8] for r in rows], np.int64).reshape(n, 3)
        self.ranges = np.array([r[9] for r in rows], np.int64).reshape(n, 4)

    def _need_route(self, k, color, *, tx=False, rx=False, what):
        """Every PE of code region k delivers ``color`` to its core (tx) or accepts it from the core (rx)."""
        ramp = 1 << PORTS["RAMP"]
        table, verb = (self.program.tx, "deliver to") if tx else (self.program.rx, "accept")
        bad = (self.program.code_id == k) & ((table[color] & ramp) == 0)
        if bad.any():
            y, x = np.argwhere(bad)[0]
            raise FabricError(f"PE ({x}, {y}): {what}, but its route for color {color} does not {verb} RAMP")

    def _encode(self, ins, code, names, pes, cmap, k):
        opc = OPCODES[ins.op]
        kinds, args, strides, imms, iargs = [K_NONE] * 3, [0] * 3, [1] * 3, [0.0] * 3, [0] * 3
        target = -1
        if ins.op in ("ACTIVATE", "BLOCK", "UNBLOCK"):
            if ins.task not in names:
                raise FabricError(f"{ins.op}({ins.task!r}): no such task on PE {pes[0]}")
            return opc, 1, kinds, args, strides, imms, names.index(ins.task), 0, iargs, (0, 0, 0, 0)
        operands = [ins.dst, ins.a, ins.b]
        n = ins.dst.length if ins.dst is not None else 0
        reads, writes = [], []   # word ranges, for the engine's batching of memory-only instructions
        for i, od in enumerate(operands):
            if od is None:
                continue
            kinds[i] = od.kind
            if od.kind == K_MEM:
                args[i], strides[i] = self._words(ins.op, od, code, pes, "float32")
                span = sorted((args[i], args[i] + (od.length - 1) * od.stride))
                (writes if i == 0 else reads).append((span[0], span[1] + 1))
            elif od.kind == K_IDX:
                base, _ = self._words(ins.op, Operand(K_MEM, od.arg, od.offset, 1, 1), code, pes, "float32")
                iargs[i], strides[i] = self._words(ins.op, od.index, code, pes, "int32")
                args[i] = base
                size = code.symbols[od.arg.name][1] - od.offset
                self.indexed.append((k, iargs[i], od.length, strides[i], size))
                (writes if i == 0 else reads).append((base, base + size))
                reads.append((iargs[i], iargs[i] + (od.length - 1) * strides[i] + 1))
            elif od.kind in (K_FIN, K_FOUT):
                if od.arg not in cmap:
                    raise FabricError(f"{ins.op}: color {od.arg} has no route on PE {pes[0]}")
                if (od.kind == K_FOUT) != (i == 0):
                    raise FabricError(f"{ins.op}: fout is a destination and fin a source")
                self._need_route(k, od.arg, tx=od.kind == K_FIN, rx=od.kind == K_FOUT,
                                 what=f"{ins.op} {'reads' if od.kind == K_FIN else 'writes'} color {od.arg}")
                args[i] = cmap[od.arg]
            elif od.kind == K_IMM:
                imms[i] = od.arg
            if od.kind != K_IMM and od.length != n:
                raise FabricError(f"{ins.op}: operand lengths differ ({od.length} and {n}) on PE {pes[0]}")
        if n < 1:
            raise FabricError(f"{ins.op}: a destination of length >= 1 is required")
        if ins.is_async and ins.task is not None:
            if ins.task not in names:
                raise FabricError(f"{ins.op}.asynchronous(then={ins.task!r}): no such task on PE {pes[0]}")
            target = names.index(ins.task)
        if ins.op == "FMAC":
            reads += writes   # d = d + a * b reads d
        hull = [(min(lo for lo, _ in rs), max(hi for _, hi in rs)) if rs else (0, 0) for rs in (reads, writes)]
        return opc, n, kinds, args, strides, imms, target, int(ins.is_async), iargs, (*hull[0], *hull[1])

    @staticmethod
    def _words(op, od, code, pes, dtype):
        """(first word, stride) of memory DSD ``od`` in ``code``, which must lie inside its symbol of ``dtype``."""
        name = od.arg.name
        if name not in code.symbols:
            raise FabricError(f"{op}: symbol {name!r} is not allocated on PE {pes[0]}")
        base, size, have = code.symbols[name]
        if have != dtype:
            use = "as the index= of a memory DSD" if have == "int32" else "only as data"
            raise FabricError(f"{op}: symbol {name!r} is {have}; use it {use} (PE {pes[0]})")
        last = od.offset + (od.length - 1) * od.stride
        if od.offset < 0 or od.length < 1 or last >= size or last < 0:
            raise FabricError(f"{op}: {name}[{od.offset}:+{od.length}:{od.stride}] is outside "
                              f"its {size} words on PE {pes[0]}")
        return base + od.offset, od.stride

    # -- host side -------------------------------------------------------------------------------

    def _addresses(self, region, symbol):
        """Memory address of ``symbol`` on every PE of ``region`` ([h', w'] array)."""
        prog = self.program
        ids = prog.code_id[region.index]
        base = np.full(len(prog.codes) + 1, -1, np.int64)
        for k, code in enumerate(prog.codes):
            if symbol.name in code.symbols:
                base[k] = code.symbols[symbol.name][0]
        b = base[ids]
        if (b < 0).any():
            dy, dx = np.argwhere(b < 0)[0]
            raise FabricError(f"memcpy: symbol {symbol.name!r} is not allocated on PE "
                              f"({region.x + dx * region.sx}, {region.y + dy * region.sy})")
        ys, xs = np.meshgrid(np.arange(region.y, region.y + region.h, region.sy),
                             np.arange(region.x, region.x + region.w, region.sx), indexing="ij")
        return self.mem_off[ys * self.fabric.width + xs] + b

    def memcpy_h2d(self, symbol, region, data):
        """Copy ``data`` [h, w, n] (or anything that broadcasts to it) into ``symbol`` on the PEs of ``region``."""
        addr = self._addresses(region, symbol)
        data = np.asarray(data)
        if symbol.dtype == "int32" and data.size and not np.issubdtype(data.dtype, np.integer):
            raise FabricError(f"memcpy_h2d: symbol {symbol.name!r} is int32, got {data.dtype} data")
        data = np.broadcast_to(data.astype(symbol.dtype, copy=False), (*addr.shape, symbol.length))
        self.mem.view(symbol.dtype)[addr[..., None] + np.arange(symbol.length)] = data

    def memcpy_d2h(self, symbol, region):
        """``symbol`` on the PEs of ``region`` as an array [h, w, n] (of the symbol's dtype)."""
        addr = self._addresses(region, symbol)
        return self.mem.view(symbol.dtype)[addr[..., None] + np.arange(symbol.length)]

    def launch(self, task, region=None):
        """Activate ``task`` on every PE of ``region`` (default: every PE whose code has it)."""
        W = self.fabric.width
        sel = np.zeros((self.fabric.height, W), bool)
        if region is None:
            sel[...] = True
        else:
            sel[region.index] = True
        sel = sel.reshape(-1)
        found = False
        for k, index in enumerate(self.task_index):
            if task in index:
                hit = sel & (self.pe_code == k)
                self.active[hit] |= np.uint32(1 << index[task])
                found |= bool(hit.any())
        if not found:
            raise FabricError(f"launch: no PE has a task {task!r}")

    def engine(self):
        """An ``Engine`` for a run from here, to step (``step(n)``) or run; ``run()`` uses one."""
        self._check_indices()
        return Engine(self)

    def run(self, max_cycles=10**9):
        """Run until every core is idle and every queue empty; returns a ``Result``."""
        f = self.fabric
        self._check_indices()
        t0 = time.perf_counter()
        engine = Engine(self)
        outcome = engine.run(int(max_cycles))
        seconds = time.perf_counter() - t0
        if outcome is not Outcome.DONE:
            raise FabricError(self._explain(outcome, engine.cycles, engine.state()))
        return Result(engine.cycles, engine.busy.reshape(f.height, f.width), engine.stall.reshape(f.height, f.width),
                      engine.link.reshape(f.height, f.width, 5), seconds=seconds)

    def _check_indices(self):
        """Every index an indexed DSD will read lies inside its data symbol, on every PE (the engine trusts them)."""
        ints = self.mem.view(np.int32)
        for k, iaddr, length, stride, size in self.indexed:
            pes = np.flatnonzero(self.pe_code == k)
            idx = ints[(self.mem_off[pes] + iaddr)[:, None] + stride * np.arange(length)]
            bad = (idx < 0) | (idx >= size)
            if bad.any():
                j, e = np.argwhere(bad)[0]
                p = int(pes[j])
                raise FabricError(f"PE ({p % self.fabric.width}, {p // self.fabric.width}): index {int(idx[j, e])} "
                                  f"(element {e}) is outside the {size} words it indexes")

    def _explain(self, outcome, cycles, state):
        W, C = self.fabric.width, self.C
        if outcome is Outcome.CYCLE_LIMIT:
            return f"no end after {cycles} cycles (max_cycles): a task that never finishes?"
        if outcome is Outcome.UNREAD_WAVELETS:
            qi = int(np.flatnonzero(state["cq_cnt"])[0])
            p, c = divmod(qi, C)
            return (f"PE ({p % W}, {p // W}): {state['cq_cnt'][qi]} wavelet(s) of color {self.colors[c]} reached the "
                    f"core and no task reads them (cycle {cycles})")
        stuck = np.flatnonzero(state["cur_task"] >= 0)
        if len(stuck):
            p = int(stuck[0])
            k = self.pe_code[p]
            name = [n for n, i in self.task_index[k].items() if i == state["cur_task"][p]][0]
            return (f"deadlock at cycle {cycles}: PE ({p % W}, {p // W}) task {name!r} waits forever "
                    f"({len(stuck)} PE(s) stalled)")
        p = int(np.flatnonzero(state["pending"])[0])
        return f"deadlock at cycle {cycles}: PE ({p % W}, {p // W}) holds wavelets its router can never forward"


class Result:
    """Cycles of a run and per-PE activity [H, W]: ``busy`` elements processed (by the task or a
    microthread: a PE can do several per cycle), ``stall`` element slots lost waiting on the fabric,
    ``link`` wavelets sent per port (N, E, S, W, and delivered to the core); ``seconds`` of wall
    time in the engine (host copies and compiling excluded)."""

    def __init__(self, cycles, busy, stall, link, extra=None, seconds=0.0):
        self.cycles, self.busy, self.stall, self.link = cycles, busy, stall, link
        self.extra = dict(extra or {})   # program-specific figures (iterations, padding, ...), in the report
        self.seconds = seconds

    @property
    def pe_cycles_per_second(self):
        """The simulator's speed: PEs x simulated cycles per wall second of the engine."""
        return self.busy.size * self.cycles / self.seconds if self.seconds > 0 else 0.0

    def report(self):
        return {"cycles": int(self.cycles), "pes": int(self.busy.size), "element_ops": int(self.busy.sum()),
                "stalls": int(self.stall.sum()), "wavelet_hops": int(self.link[..., :4].sum()),
                "ramp_deliveries": int(self.link[..., 4].sum()), "max_pe_ops": int(self.busy.max()),
                "ops_per_pe_cycle": float(self.busy.mean() / max(self.cycles, 1)), "engine_seconds": self.seconds,
                "pe_cycles_per_second": self.pe_cycles_per_second, **self.extra}

    def heatmap(self, path):
        """Write a PNG of per-PE busy, stall and link activity."""
        # A Figure of its own, not pyplot's: a caller's backend and open figures are left alone.
        from matplotlib.figure import Figure

        fig = Figure(figsize=(15, 4.5))
        axes = fig.subplots(1, 3)
        for ax, (title, data) in zip(axes, [("element ops", self.busy), ("stalls", self.stall),
                                            ("wavelets sent (N+E+S+W)", self.link[..., :4].sum(-1))]):
            im = ax.imshow(data, cmap="viridis", interpolation="nearest", aspect="auto")
            ax.set_title(f"{title}, of {self.cycles} cycles")
            ax.set_xlabel("x")
            ax.set_ylabel("y")
            fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path
