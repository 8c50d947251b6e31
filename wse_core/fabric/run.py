"""A compiled fabric program: flat arrays for the engine, host memcpy, launch, and the run report."""
import numpy as np

from wse_core.fabric.program import (K_FIN, K_FOUT, K_IMM, K_MEM, K_NONE, MAX_TASKS, OPCODES, PORTS, FabricError)

_DIRS = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}     # N, E, S, W as (dx, dy)
_OPPOSITE = {0: 2, 1: 3, 2: 0, 3: 1}
_NAMES = {v: k for k, v in PORTS.items()}


class Compiled:
    """The program as arrays; owns the PEs' memory between host copies and runs."""

    def __init__(self, program):
        f = program.fabric
        self.fabric, self.program = f, program
        W, H = f.width, f.height
        colors = sorted({c for (_, _, c) in program.routes})
        self.colors = colors
        cmap = {c: i for i, c in enumerate(colors)}
        C = max(1, len(colors))
        self.C = C
        P = W * H
        self.rx = np.zeros(P * C, np.uint8)
        self.tx = np.zeros(P * C, np.uint8)
        for (x, y, c), (rxm, txm) in program.routes.items():
            self.rx[(y * W + x) * C + cmap[c]] = rxm
            self.tx[(y * W + x) * C + cmap[c]] = txm
        # Routes must lead somewhere that accepts them.
        for (x, y, c), (rxm, txm) in program.routes.items():
            for port in range(4):
                if not txm & (1 << port):
                    continue
                dx, dy = _DIRS[port]
                nx, ny = x + dx, y + dy
                if not (0 <= nx < W and 0 <= ny < H):
                    raise FabricError(f"PE ({x}, {y}) color {c}: routes {_NAMES[port]} off the edge of the fabric")
                nrx = program.routes.get((nx, ny, c), (0, 0))[0]
                if not nrx & (1 << _OPPOSITE[port]):
                    raise FabricError(f"PE ({x}, {y}) color {c}: routes {_NAMES[port]} to PE ({nx}, {ny}), whose route "
                                      f"for color {c} does not accept {_NAMES[_OPPOSITE[port]]}")
        # Code: one table per code region.
        self.pe_code = np.full(P, -1, np.int32)
        self.mem_off = np.zeros(P, np.int64)
        codes = program.codes
        self.task_color = np.full(len(codes) * MAX_TASKS, -1, np.int32)
        self.task_start = np.zeros(len(codes) * MAX_TASKS, np.int32)
        self.task_len = np.zeros(len(codes) * MAX_TASKS, np.int32)
        self.ntasks = np.zeros(len(codes), np.int32)
        self.task_index = []
        rows = []
        for k, code in enumerate(codes):
            names = list(code.tasks)
            self.task_index.append({n: i for i, n in enumerate(names)})
            self.ntasks[k] = len(names)
            pes = [p for p, cd in program.code_of.items() if cd is code]
            for t, name in enumerate(names):
                color, body = code.tasks[name]
                if color is not None:
                    self._need_route(pes, color, tx=True, what=f"task {name!r} is bound to color {color}")
                    self.task_color[k * MAX_TASKS + t] = cmap[color]
                self.task_start[k * MAX_TASKS + t] = len(rows)
                self.task_len[k * MAX_TASKS + t] = len(body)
                for ins in body:
                    rows.append(self._encode(ins, code, names, pes, cmap))
        n = len(rows)
        self.op = np.array([r[0] for r in rows], np.int32)
        self.length = np.array([r[1] for r in rows], np.int64)
        self.kind = np.array([r[2] for r in rows], np.int32).reshape(n, 3)
        self.arg = np.array([r[3] for r in rows], np.int64).reshape(n, 3)
        self.stride = np.array([r[4] for r in rows], np.int64).reshape(n, 3)
        self.immv = np.array([r[5] for r in rows], np.float32).reshape(n, 3)
        self.target = np.array([r[6] for r in rows], np.int32)
        off = 0
        for y in range(H):
            for x in range(W):
                code = program.code_of.get((x, y))
                if code is not None:
                    p = y * W + x
                    self.pe_code[p] = codes.index(code)
                    self.mem_off[p] = off
                    off += code.words
        self._code_index = {id(c): i for i, c in enumerate(codes)}
        self.mem = np.zeros(max(off, 1), np.float32)
        self.active = np.zeros(P, np.uint32)
        self.blocked = np.zeros(P, np.uint32)
        self.cycles = 0

    def _need_route(self, pes, color, *, tx=False, rx=False, what):
        for (x, y) in pes:
            rxm, txm = self.program.routes.get((x, y, color), (0, 0))
            if tx and not txm & (1 << PORTS["RAMP"]):
                raise FabricError(f"PE ({x}, {y}): {what}, but its route for color {color} does not deliver to RAMP")
            if rx and not rxm & (1 << PORTS["RAMP"]):
                raise FabricError(f"PE ({x}, {y}): {what}, but its route for color {color} does not accept RAMP")

    def _encode(self, ins, code, names, pes, cmap):
        opc = OPCODES[ins.op]
        kinds, args, strides, imms = [K_NONE] * 3, [0] * 3, [1] * 3, [0.0] * 3
        target = -1
        if ins.op in ("ACTIVATE", "BLOCK", "UNBLOCK"):
            if ins.task not in names:
                raise FabricError(f"{ins.op}({ins.task!r}): no such task on {len(pes)} PE(s) from {pes[0]}")
            return opc, 1, kinds, args, strides, imms, names.index(ins.task)
        operands = [ins.dst, ins.a, ins.b]
        n = ins.dst.length if ins.dst is not None else 0
        for i, od in enumerate(operands):
            if od is None:
                continue
            kinds[i] = od.kind
            if od.kind == K_MEM:
                if od.arg.name not in code.symbols:
                    raise FabricError(f"{ins.op}: symbol {od.arg.name!r} is not allocated on PE {pes[0]}")
                base, size = code.symbols[od.arg.name]
                last = od.offset + (od.length - 1) * od.stride
                if od.offset < 0 or od.length < 1 or last >= size or last < 0:
                    raise FabricError(f"{ins.op}: {od.arg.name}[{od.offset}:+{od.length}:{od.stride}] is outside "
                                      f"its {size} words on PE {pes[0]}")
                args[i], strides[i] = base + od.offset, od.stride
            elif od.kind in (K_FIN, K_FOUT):
                if od.arg not in cmap:
                    raise FabricError(f"{ins.op}: color {od.arg} has no route on PE {pes[0]}")
                if (od.kind == K_FOUT) != (i == 0):
                    raise FabricError(f"{ins.op}: fout is a destination and fin a source")
                self._need_route(pes, od.arg, tx=od.kind == K_FIN, rx=od.kind == K_FOUT,
                                 what=f"{ins.op} {'reads' if od.kind == K_FIN else 'writes'} color {od.arg}")
                args[i] = cmap[od.arg]
            elif od.kind == K_IMM:
                imms[i] = od.arg
            if od.kind != K_IMM and od.length != n:
                raise FabricError(f"{ins.op}: operand lengths differ ({od.length} and {n}) on PE {pes[0]}")
        if n < 1:
            raise FabricError(f"{ins.op}: a destination of length >= 1 is required")
        return opc, n, kinds, args, strides, imms, target

    # -- host side -------------------------------------------------------------------------------

    def _pes(self, region, symbol):
        prog, out = self.program, []
        for (x, y) in region.pes():
            code = prog.code_of.get((x, y))
            if code is None or symbol.name not in code.symbols:
                raise FabricError(f"memcpy: symbol {symbol.name!r} is not allocated on PE ({x}, {y})")
            base, size = code.symbols[symbol.name]
            out.append((self.mem_off[y * self.fabric.width + x] + base, size))
        return out

    def memcpy_h2d(self, symbol, region, data):
        """Copy ``data`` [h, w, n] (or broadcastable) into ``symbol`` on the PEs of ``region``."""
        data = np.broadcast_to(np.asarray(data, np.float32), (region.h, region.w, symbol.length))
        for (addr, size), v in zip(self._pes(region, symbol), data.reshape(-1, symbol.length)):
            self.mem[addr:addr + size] = v

    def memcpy_d2h(self, symbol, region):
        """``symbol`` on the PEs of ``region`` as an array [h, w, n]."""
        out = np.empty((region.h * region.w, symbol.length), np.float32)
        for i, (addr, size) in enumerate(self._pes(region, symbol)):
            out[i] = self.mem[addr:addr + size]
        return out.reshape(region.h, region.w, symbol.length)

    def launch(self, task, region=None):
        """Activate ``task`` on every PE of ``region`` (default: every PE whose code has it)."""
        W = self.fabric.width
        pes = region.pes() if region is not None else list(self.program.code_of)
        found = False
        for (x, y) in pes:
            k = self.pe_code[y * W + x]
            if k >= 0 and task in self.task_index[k]:
                self.active[y * W + x] |= np.uint32(1 << self.task_index[k][task])
                found = True
        if not found:
            raise FabricError(f"launch: no PE has a task {task!r}")

    def run(self, max_cycles=10**9):
        """Run until every core is idle and every queue empty; returns a ``Result``."""
        from wse_core.fabric import _engine

        f = self.fabric
        P = f.width * f.height
        busy, stall, link = np.zeros(P, np.int64), np.zeros(P, np.int64), np.zeros(P * 5, np.int64)
        status, cycles, state = _engine.run(
            f.width, f.height, self.C, f.queue_depth, f.hop_latency, int(max_cycles), self.rx, self.tx,
            self.pe_code, self.mem_off, self.mem, self.task_color, self.task_start, self.task_len, self.ntasks,
            self.op, self.length, self.kind, self.arg, self.stride, self.immv, self.target,
            self.active, self.blocked, busy, stall, link)
        if status != 0:
            raise FabricError(self._explain(status, cycles, state))
        return Result(cycles, busy.reshape(f.height, f.width), stall.reshape(f.height, f.width),
                      link.reshape(f.height, f.width, 5))

    def _explain(self, status, cycles, state):
        W, C = self.fabric.width, self.C
        if status == 2:
            return f"no end after {cycles} cycles (max_cycles): a task that never finishes?"
        if status == 3:
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
    """Cycles of a run and per-PE activity: busy (an element processed), stall (waiting on the fabric), link traffic."""

    def __init__(self, cycles, busy, stall, link):
        self.cycles, self.busy, self.stall, self.link = cycles, busy, stall, link

    @property
    def idle(self):
        return self.cycles - self.busy - self.stall

    def report(self):
        return {"cycles": int(self.cycles), "pes": int(self.busy.size), "busy_cycles": int(self.busy.sum()),
                "stall_cycles": int(self.stall.sum()), "wavelet_hops": int(self.link[..., :4].sum()),
                "ramp_deliveries": int(self.link[..., 4].sum()),
                "max_pe_busy": int(self.busy.max()), "mean_pe_utilisation": float(self.busy.mean() / max(self.cycles, 1))}
