"""The cycle engine of the PE-mesh simulator: routers, queues and cores as flat arrays, no GIL.

Each cycle has two phases, each visiting PEs in index order (the deterministic tie-break); the
engine runs them in one sweep, each core a row behind the routers (see ``Engine.advance``), which
gives the same result and keeps a PE's state in cache between its router and its core:

* routers: for each PE with wavelets queued and each color (starting from ``cycle % colors`` so no
  color starves), the head wavelet moves when it has arrived (hop latency) and every destination
  of its route has room: the neighbour's queue of that color through a link used at most once per
  cycle per direction, and/or the core's input queue (RAMP). A multicast moves all copies at once.
* cores: first each busy microthread (an asynchronous instruction handed off by a task, as the
  SDK's async DSD operations are) processes one element; then a core without a running task picks
  its lowest-numbered task that is activated, or bound to a color with a wavelet waiting, and not
  blocked; a running instruction processes one element per cycle, stalling while a fabric input is
  empty or a fabric output queue is full. The ramp is a link like the others: a core sends at most
  one wavelet into its router per cycle (microthreads and task together) and receives at most one.
  A memory-only instruction that no busy microthread can observe runs all its elements at once
  and holds the task for as many cycles (``_batch``); a core whose task waits on an empty input
  with no microthread running sleeps until its router delivers a wavelet; a router does not retry
  a head waiting for room until its destination pops. Each gives the same bits, cycles and
  per-PE counts as checking everything every cycle, for less work.

``Engine`` holds one run's state and advances it cycle by cycle; ``Engine.advance`` returns a
status: -1 still running, 0 done (every core idle, every queue empty), 1 deadlock (nothing moved
and nothing is in flight), 2 the cycle limit, 3 wavelets left in a core queue that no task will
read (named in ``wse_core.fabric.engine.Outcome``, the Python side).

It is one file because it is one hot loop: ``advance`` calls ``_router`` and ``_core`` for every PE
every cycle in one ``nogil`` sweep, and they call the queue and operand helpers for every wavelet
and element. Each .pyx is an extension module of its own (setup.py), so here they are static C
functions of one translation unit, which the compiler inlines and optimizes together; split across
modules, every call between them would go through a function pointer imported at load time (only
``cdef inline`` bodies in a .pxd cross modules inlined), and the structs would need a .pxd besides.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t

cdef extern from *:
    int __builtin_ctz(unsigned int) nogil

cdef enum:
    K_NONE = 0
    K_MEM = 1
    K_FIN = 2
    K_FOUT = 3
    K_IMM = 4
    K_IDX = 5       # indexed memory DSD: word arg + idx[e], idx int32 words from iarg with the operand's stride
    OP_FMOV = 0
    OP_FADD = 1
    OP_FSUB = 2
    OP_FMUL = 3
    OP_FMAC = 4
    OP_FNEG = 5
    OP_FMAX = 6
    OP_FDIV = 7
    OP_ACTIVATE = 8
    OP_BLOCK = 9
    OP_UNBLOCK = 10
    MAXT = 32
    MT = 4          # microthreads per PE: async vector instructions run beside the task


cdef struct Ins:
    # One DSD instruction, as the engine reads it (array of structs: one or two cache lines each).
    int32_t op
    int32_t asyn
    int32_t target
    int32_t memonly     # memory and immediate operands only: it never stalls (see _batch)
    int64_t length
    int32_t kind[3]
    int64_t arg[3]
    int64_t stride[3]
    int64_t iarg[3]
    float immv[3]
    int64_t rlo, rhi, wlo, whi   # words (from the PE's base) it may read and write: [lo, hi)


cdef struct Eng:
    int W
    int C
    int Q
    int latency
    int64_t cycle
    const uint8_t* tx   # route of each [PE, color]: output ports (bits N, E, S, W, RAMP)
    const uint8_t* rx   # and the ports it accepts from
    int64_t* link       # wavelets sent per [PE, port]
    const Ins* ins
    const int64_t* mem_off
    float* mem
    const int32_t* imem   # the same memory read as int32 (index words)
    const int32_t* pe_code
    const int32_t* task_color
    const int32_t* task_start
    const int32_t* task_len
    const int32_t* ntasks
    uint32_t* active
    uint32_t* blocked
    int64_t* busy
    int64_t* stall
    int QS              # int32 words per queue: count, head, Q ready cycles, Q values (float bits)
    int32_t* rq         # router queues [PE, color]
    int32_t* cq         # core input queues [PE, color]
    uint32_t* rq_mask   # colors with wavelets queued in this PE's router
    uint32_t* rq_wait   # of those, colors whose head waits for room in a full destination queue
    int32_t* ramp_out   # the cycle this core last sent a wavelet into its router
    int32_t* pending
    int32_t* cur_task
    int64_t* cur_pc
    int64_t* cur_e
    int64_t* wake       # a batched instruction occupies the task until this cycle
    int64_t* sleep      # a task stalled on an empty input sleeps from this cycle (-1: awake); see _core
    int64_t* mt_pc      # instruction of each microthread (-1: free)
    int64_t* mt_e
    int32_t* mt_busy    # microthreads in use per PE


cdef inline int64_t _wrap(int64_t i, int Q) noexcept nogil:
    """i mod Q for 0 <= i < 2Q, without a division (the engine's hottest arithmetic)."""
    return i - Q if i >= Q else i


# A queue is one run of QS int32 words (a cache line or so: the engine's misses are its queues):
# q[0] wavelets queued, q[1] the head slot, q[2 + s] the cycle slot s may leave, then the values.
cdef inline bint _q_ready(const int32_t* q, int Q, int64_t cycle) noexcept nogil:
    return q[0] > 0 and q[2 + q[1]] <= cycle


cdef inline float _q_pop(int32_t* q, int Q) noexcept nogil:
    cdef float v = (<const float*>(q + 2 + Q))[q[1]]
    q[1] = <int32_t>_wrap(q[1] + 1, Q)
    q[0] -= 1
    return v


cdef inline void _q_push(int32_t* q, int Q, float v, int64_t ready) noexcept nogil:
    cdef int64_t s = _wrap(q[1] + q[0], Q)
    (<float*>(q + 2 + Q))[s] = v
    q[2 + s] = <int32_t>ready
    q[0] += 1


cdef inline bint _can_read(Eng* g, int64_t p, const Ins* I, int k) noexcept nogil:
    if I.kind[k] != K_FIN:
        return True
    return _q_ready(&g.cq[(p * g.C + I.arg[k]) * g.QS], g.Q, g.cycle)


cdef inline int64_t _addr(Eng* g, int64_t p, const Ins* I, int k, int64_t e) noexcept nogil:
    """Word address of element e of memory operand k (plain or indexed) on PE p."""
    cdef int64_t base = g.mem_off[p]
    if I.kind[k] == K_IDX:
        return base + I.arg[k] + g.imem[base + I.iarg[k] + e * I.stride[k]]
    return base + I.arg[k] + e * I.stride[k]


cdef inline float _source(Eng* g, int64_t p, const Ins* I, int k, int64_t e) noexcept nogil:
    """Element e of source operand k; pops the wavelet of a fabric input (the caller checked it is there)."""
    cdef int kd = I.kind[k]
    if kd == K_MEM or kd == K_IDX:
        return g.mem[_addr(g, p, I, k, e)]
    if kd == K_FIN:
        g.rq_wait[p] &= ~(1u << I.arg[k])   # room in the core's queue: the router may deliver again
        return _q_pop(&g.cq[(p * g.C + I.arg[k]) * g.QS], g.Q)
    if kd == K_IMM:
        return I.immv[k]
    return 0


cdef inline float _apply(int o, float d, float va, float vb) noexcept nogil:
    if o == OP_FMOV:
        return va
    if o == OP_FADD:
        return va + vb
    if o == OP_FSUB:
        return va - vb
    if o == OP_FMUL:
        return va * vb
    if o == OP_FMAC:
        return d + va * vb
    if o == OP_FNEG:
        return -va
    if o == OP_FDIV:
        return va / vb
    return va if va > vb else vb


cdef inline bint _stalled(Eng* g, int64_t p, const Ins* I) noexcept nogil:
    """Whether instruction I on PE p must stall this cycle (inline: most stalls are decided here cheaply)."""
    if I.kind[0] == K_FOUT and (g.ramp_out[p] == g.cycle or g.rq[(p * g.C + I.arg[0]) * g.QS] >= g.Q):
        return True    # the ramp link already carried a wavelet this cycle, or the output queue is full
    return not (_can_read(g, p, I, 1) and _can_read(g, p, I, 2))


cdef inline bint _element(Eng* g, int64_t p, const Ins* I, int64_t e) noexcept nogil:
    """Process element e of instruction I on PE p; False (and nothing done) if it must stall."""
    if _stalled(g, p, I):
        return False
    _compute(g, p, I, e)
    return True


cdef void _compute(Eng* g, int64_t p, const Ins* I, int64_t e) noexcept nogil:
    """Element e of instruction I on PE p, which is not stalled."""
    cdef int kd = I.kind[0]
    cdef int64_t addr
    cdef float va, vb
    va = _source(g, p, I, 1, e)
    vb = _source(g, p, I, 2, e)
    if kd == K_MEM or kd == K_IDX:
        addr = _addr(g, p, I, 0, e)
        g.mem[addr] = _apply(I.op, g.mem[addr], va, vb)
    elif kd == K_FOUT:
        _q_push(&g.rq[(p * g.C + I.arg[0]) * g.QS], g.Q, _apply(I.op, 0, va, vb), g.cycle + 1)
        g.rq_mask[p] |= 1u << I.arg[0]
        g.ramp_out[p] = <int32_t>g.cycle
        g.pending[p] += 1


cdef inline bint _input_empty(Eng* g, int64_t p, const Ins* I) noexcept nogil:
    """Whether a fabric input of I has no wavelet at all (not merely one still arriving)."""
    cdef int k
    for k in range(1, 3):
        if I.kind[k] == K_FIN and g.cq[(p * g.C + I.arg[k]) * g.QS] == 0:
            return True
    return False


cdef inline bint _overlap(int64_t alo, int64_t ahi, int64_t blo, int64_t bhi) noexcept nogil:
    return alo < bhi and blo < ahi


cdef bint _batch(Eng* g, int64_t p, const Ins* I) noexcept nogil:
    """Whether the task may run memory-only instruction I to its end at once: no busy microthread of
    the PE reads what I writes or writes what I reads or writes. Then nothing else can see I's words
    before its last element's cycle, so doing every element now (in order, the same arithmetic)
    gives the same bits and the same cycles as one element per cycle."""
    cdef int m
    cdef const Ins* J
    for m in range(MT):
        if g.mt_pc[p * MT + m] >= 0:
            J = &g.ins[g.mt_pc[p * MT + m]]
            if (_overlap(I.wlo, I.whi, J.rlo, J.rhi) or _overlap(I.wlo, I.whi, J.wlo, J.whi)
                    or _overlap(I.rlo, I.rhi, J.wlo, J.whi)):
                return False
    return True


cdef int _router(Eng* g, int64_t p, int64_t cycle, int rot) noexcept nogil:
    """One cycle of PE p's router: for each color with wavelets queued (starting at ``rot``, so that
    no color starves), the head wavelet moves when it has arrived and every destination has room:
    a neighbour's queue through a link not yet used this cycle, and/or the core's queue (RAMP). A
    multicast moves all its copies at once. Returns bit 1 if a wavelet moved, bit 2 if one waits
    for its arrival cycle."""
    # A head waiting for room is not tried again until its destination pops (``rq_wait``): the
    # same outcome as trying it every cycle, for a fraction of the work on a congested fabric.
    cdef uint32_t bits = g.rq_mask[p] & ~g.rq_wait[p]
    cdef int C = g.C, Q = g.Q, QS = g.QS, k, ci, port, flags = 0, moved_ports = 0
    cdef unsigned int ports
    cdef int64_t qi, qn
    cdef int64_t nbr[4]
    cdef int32_t* qp
    cdef uint8_t txm
    cdef bint ok
    cdef float va
    if bits == 0:
        return 0
    nbr[0] = p - g.W                                       # N (routes never point off the edge)
    nbr[1] = p + 1                                         # E
    nbr[2] = p + g.W                                       # S
    nbr[3] = p - 1                                         # W
    if rot:
        bits = ((bits >> rot) | (bits << (C - rot))) & ((1u << C) - 1)
    while bits:
        k = __builtin_ctz(bits)
        bits &= bits - 1
        ci = rot + k
        if ci >= C:
            ci -= C
        qi = p * C + ci
        txm = g.tx[qi]
        if txm & moved_ports:
            continue   # a link it needs carried a wavelet this cycle (so this cycle made progress)
        qp = &g.rq[qi * QS]
        if qp[2 + qp[1]] > cycle:
            flags |= 2
            continue
        ok = not ((txm & 16) and g.cq[qi * QS] >= Q)
        ports = txm & 15
        while ok and ports:
            port = __builtin_ctz(ports)
            ports &= ports - 1
            ok = g.rq[(nbr[port] * C + ci) * QS] < Q
        if not ok:
            g.rq_wait[p] |= 1u << ci
            continue
        va = _q_pop(qp, Q)
        if qp[0] == 0:
            g.rq_mask[p] &= ~(1u << ci)
        g.pending[p] -= 1
        ports = g.rx[qi] & 15          # the neighbours that feed this queue may send again
        while ports:
            port = __builtin_ctz(ports)
            ports &= ports - 1
            g.rq_wait[nbr[port]] &= ~(1u << ci)
        ports = txm & 15
        while ports:
            port = __builtin_ctz(ports)
            ports &= ports - 1
            qn = nbr[port] * C + ci
            _q_push(&g.rq[qn * QS], Q, va, cycle + g.latency)
            g.rq_mask[nbr[port]] |= 1u << ci
            g.pending[nbr[port]] += 1
            g.link[p * 5 + port] += 1
        if txm & 16:
            _q_push(&g.cq[qi * QS], Q, va, cycle + 1)
            g.link[p * 5 + 4] += 1
            if g.sleep[p] >= 0:   # wake the core: it stalled every cycle it slept, and tries again this cycle
                g.stall[p] += cycle - g.sleep[p]
                g.sleep[p] = -1
        moved_ports |= txm
        flags |= 1
    return flags


cdef int _core(Eng* g, int64_t p) noexcept nogil:
    """One cycle of PE p's core (it touches only p's own state, so PEs may run in parallel).
    Returns bit 1 if it did something, bit 2 if it waits for something already on its way."""
    cdef int code = g.pe_code[p], m, t, best, c, o, flags = 0
    cdef int64_t i, pc, e, qi, n, cycle = g.cycle
    cdef const Ins* I
    if code < 0 or g.sleep[p] >= 0:
        return 0
    # Microthreads first, in slot order: one element each per cycle.
    if g.mt_busy[p]:
        for m in range(MT):
            i = p * MT + m
            pc = g.mt_pc[i]
            if pc < 0:
                continue
            I = &g.ins[pc]
            if _element(g, p, I, g.mt_e[i]):
                g.mt_e[i] += 1
                g.busy[p] += 1
                flags |= 1
                if g.mt_e[i] >= I.length:
                    g.mt_pc[i] = -1
                    g.mt_busy[p] -= 1
                    if I.target >= 0:   # the task to activate when this stream is done
                        g.active[p] |= (1u << I.target)
            else:
                g.stall[p] += 1
    if g.wake[p] > cycle:
        return flags | 2
    if g.cur_task[p] < 0:
        best = -1
        for t in range(g.ntasks[code]):
            if g.blocked[p] & (1u << t):
                continue
            if g.active[p] & (1u << t):
                best = t
                break
            c = g.task_color[code * MAXT + t]
            if c >= 0 and g.cq[(p * g.C + c) * g.QS] > 0:
                if _q_ready(&g.cq[(p * g.C + c) * g.QS], g.Q, cycle):
                    best = t
                    break
                flags |= 2
        if best < 0:
            return flags
        g.active[p] &= ~(1u << best)
        g.cur_task[p] = best
        g.cur_pc[p] = g.task_start[code * MAXT + best]
        g.cur_e[p] = 0
        if g.task_len[code * MAXT + best] == 0:
            g.cur_task[p] = -1
            return flags | 1
    pc = g.cur_pc[p]
    e = g.cur_e[p]
    I = &g.ins[pc]
    o = I.op
    n = 1
    if o >= OP_ACTIVATE:
        t = I.target
        if o == OP_ACTIVATE:
            g.active[p] |= (1u << t)
        elif o == OP_BLOCK:
            g.blocked[p] |= (1u << t)
        else:
            g.blocked[p] &= ~(1u << t)
        e = I.length
    elif I.asyn:
        # Hand the instruction to a free microthread; the task goes on next cycle.
        if g.mt_busy[p] >= MT:
            g.stall[p] += 1
            return flags
        for m in range(MT):
            if g.mt_pc[p * MT + m] < 0:
                g.mt_pc[p * MT + m] = pc
                g.mt_e[p * MT + m] = 0
                g.mt_busy[p] += 1
                break
        e = I.length
    elif I.memonly and I.length - e > 1 and _batch(g, p, I):
        n = I.length - e
        while e < I.length:
            _compute(g, p, I, e)
            e += 1
        g.wake[p] = cycle + n
    elif _element(g, p, I, e):
        e += 1
    else:
        g.stall[p] += 1
        # Waiting for an input that is not there, with no microthread running: nothing can happen
        # on this core until its router delivers a wavelet, which wakes it (_router) and counts the
        # stalls it slept through. So it is not visited meanwhile.
        if g.mt_busy[p] == 0 and _input_empty(g, p, I):
            g.sleep[p] = cycle + 1
        return flags
    g.busy[p] += n
    flags |= 1
    if e >= I.length:
        e = 0
        pc += 1
        if pc >= g.task_start[code * MAXT + g.cur_task[p]] + g.task_len[code * MAXT + g.cur_task[p]]:
            g.cur_task[p] = -1
    g.cur_pc[p] = pc
    g.cur_e[p] = e
    return flags


cdef int64_t LAST_CYCLE = 2**31 - 2   # arrival cycles are int32: no run goes past this cycle


cdef class Engine:
    """One run of a compiled program: the queues, the cores' progress and the counters, advanced
    cycle by cycle. ``mem``, ``active`` and ``blocked`` (the program's) and ``busy``, ``stall``,
    ``link`` (the counters) are updated in place."""
    cdef Eng g
    cdef int64_t P, S
    cdef readonly int64_t cycle
    cdef readonly int status          # -1 while the program runs, else as ``advance`` returns
    cdef object keep                  # the buffers g points into
    cdef object rq_arr, cq_arr
    cdef int32_t[::1] cur_task, pending, mt_busy

    def __init__(self, *, int W, int H, int C, int Q, int latency,
                 const uint8_t[::1] rx, const uint8_t[::1] tx, const int32_t[::1] pe_code, const int64_t[::1] mem_off,
                 float[::1] mem,
                 const int32_t[::1] task_color, const int32_t[::1] task_start, const int32_t[::1] task_len,
                 const int32_t[::1] ntasks,
                 const int32_t[::1] op, const int64_t[::1] length,
                 const int32_t[:, ::1] kind, const int64_t[:, ::1] arg, const int64_t[:, ::1] stride,
                 const float[:, ::1] immv, const int64_t[:, ::1] iarg, const int64_t[:, ::1] ranges,
                 const int32_t[::1] target, const uint8_t[::1] asyn,
                 uint32_t[::1] active, uint32_t[::1] blocked,
                 int64_t[::1] busy, int64_t[::1] stall, int64_t[::1] link):
        import numpy as np

        cdef int64_t P = <int64_t>W * H, j, ninstr = op.shape[0]
        cdef int k
        cdef uint8_t[::1] ins_buf = np.zeros(ninstr * sizeof(Ins), np.uint8)   # numpy memory: 16-byte aligned
        cdef Ins* ins = <Ins*>&ins_buf[0]
        for j in range(ninstr):
            ins[j].op, ins[j].asyn, ins[j].target, ins[j].length = op[j], asyn[j], target[j], length[j]
            ins[j].memonly = op[j] < OP_ACTIVATE and not asyn[j]
            for k in range(3):
                ins[j].kind[k], ins[j].arg[k], ins[j].stride[k] = kind[j, k], arg[j, k], stride[j, k]
                ins[j].iarg[k], ins[j].immv[k] = iarg[j, k], immv[j, k]
                if kind[j, k] == K_FIN or kind[j, k] == K_FOUT:
                    ins[j].memonly = 0
            ins[j].rlo, ins[j].rhi, ins[j].wlo, ins[j].whi = ranges[j, 0], ranges[j, 1], ranges[j, 2], ranges[j, 3]

        cdef int QS = 2 + 2 * Q
        self.rq_arr, self.cq_arr = np.zeros((P * C, QS), np.int32), np.zeros((P * C, QS), np.int32)
        cdef int32_t[:, ::1] rq = self.rq_arr, cq = self.cq_arr
        cdef uint32_t[::1] rq_mask = np.zeros(P, np.uint32), rq_wait = np.zeros(P, np.uint32)
        cdef int32_t[::1] ramp_out = np.full(P, -1, np.int32)
        self.cur_task, self.pending = np.full(P, -1, np.int32), np.zeros(P, np.int32)
        cdef int64_t[::1] cur_pc = np.zeros(P, np.int64), cur_e = np.zeros(P, np.int64), wake = np.zeros(P, np.int64)
        cdef int64_t[::1] sleep = np.full(P, -1, np.int64)
        cdef int64_t[::1] mt_pc = np.full(P * MT, -1, np.int64), mt_e = np.zeros(P * MT, np.int64)
        self.mt_busy = np.zeros(P, np.int32)
        self.keep = (rx, tx, pe_code, mem_off, mem, task_color, task_start, task_len, ntasks, active, blocked, busy,
                     stall, link, ins_buf, rq_mask, rq_wait, ramp_out, cur_pc, cur_e, wake, sleep, mt_pc, mt_e)
        cdef Eng* g = &self.g
        g.W, g.C, g.Q, g.latency, g.ins, g.tx, g.link = W, C, Q, latency, ins, &tx[0], &link[0]
        g.mem_off, g.mem, g.imem = &mem_off[0], &mem[0], <const int32_t*>&mem[0]
        g.pe_code, g.task_color, g.task_start = &pe_code[0], &task_color[0], &task_start[0]
        g.task_len, g.ntasks, g.active, g.blocked = &task_len[0], &ntasks[0], &active[0], &blocked[0]
        g.busy, g.stall = &busy[0], &stall[0]
        g.QS, g.rq, g.cq, g.rq_mask, g.rq_wait, g.rx = QS, &rq[0, 0], &cq[0, 0], &rq_mask[0], &rq_wait[0], &rx[0]
        g.pending, g.ramp_out = &self.pending[0], &ramp_out[0]
        g.cur_task, g.cur_pc, g.cur_e, g.wake, g.sleep = &self.cur_task[0], &cur_pc[0], &cur_e[0], &wake[0], &sleep[0]
        g.mt_pc, g.mt_e, g.mt_busy = &mt_pc[0], &mt_e[0], &self.mt_busy[0]
        self.P, self.S = P, W + 1
        self.cycle, self.status = 0, -1

    def advance(self, int64_t until):
        """Run until cycle ``until`` (at most ``LAST_CYCLE``) or the end, whichever comes first; returns
        the status: -1 if the program still runs at ``until``, else how it ended (0-3, module
        docstring), as every later call does."""
        if self.status >= 0:
            return self.status
        if until > LAST_CYCLE:
            until = LAST_CYCLE
        cdef Eng* g = &self.g
        cdef int64_t P = self.P, S = self.S, p, q, qi, cycle = self.cycle
        cdef int rot, f, status = -1
        cdef bint progress, future
        with nogil:
            while True:
                if cycle >= until:
                    if cycle >= LAST_CYCLE:
                        status = 2
                    break
                progress = False
                future = False
                g.cycle = cycle
                rot = <int>(cycle % g.C)
                # One sweep does the routers of every PE and then the cores, skewed by a row and one PE:
                # the core of q runs after the routers of its neighbours (up to q + W) and before any of
                # their cores, which is all the two-phase cycle asks, and its state is still in cache.
                for p in range(P + S):
                    if p < P:
                        f = _router(g, p, cycle, rot)
                        progress |= f & 1
                        future |= f >> 1
                    q = p - S
                    if q >= 0:
                        f = _core(g, q)
                        progress |= f & 1
                        future |= f >> 1
                cycle += 1
                if not progress and not future:
                    # Nothing moved and nothing is on its way: finished, or stuck.
                    status = 0
                    for p in range(P):
                        if (g.pending[p] or g.cur_task[p] >= 0 or g.mt_busy[p]
                                or (g.pe_code[p] >= 0 and (g.active[p] & ~g.blocked[p]))):
                            status = 1
                            break
                    if status == 0:
                        for qi in range(P * g.C):
                            if g.cq[qi * g.QS]:
                                status = 3
                                break
                    if status == 0:
                        cycle -= 1  # the last cycle did nothing
                    break
        self.cycle, self.status = cycle, status
        return status

    def state(self):
        """What ``run.Compiled`` names in an error: each PE's task, its routed and core-queued wavelets."""
        import numpy as np

        return {"cur_task": np.array(self.cur_task), "pending": np.array(self.pending),
                "rq_cnt": self.rq_arr[:, 0].copy(), "cq_cnt": self.cq_arr[:, 0].copy(),
                "mt_busy": np.array(self.mt_busy)}
