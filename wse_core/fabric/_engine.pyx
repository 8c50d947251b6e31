"""The cycle engine of the PE-mesh simulator: routers, queues and cores as flat arrays, no GIL.

Each cycle has two phases, each visiting PEs in index order (the deterministic tie-break):

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
  A core touches only its own PE's state, so this phase runs on OpenMP threads on large fabrics,
  with the same result. A memory-only instruction that no busy microthread can observe runs all
  its elements at once and holds the task for as many cycles (``_batch``): same bits, same cycles.

Return codes: 0 done (every core idle, every queue empty), 1 deadlock (nothing moved and nothing
is in flight), 2 the cycle limit, 3 wavelets left in a core queue that no task will read.
"""
from cython.parallel cimport prange
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t

from wse_core._parallel cimport wse_threads_for

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
    CORE_GRAIN = 8192   # PEs per thread in the core phase: below it a fork/join per cycle costs more than it saves


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
    int C
    int Q
    int64_t cycle
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
    uint32_t* rq_mask
    int32_t* ramp_out   # the cycle this core last sent a wavelet into its router
    int32_t* pending
    int32_t* cur_task
    int64_t* cur_pc
    int64_t* cur_e
    int64_t* wake       # a batched instruction occupies the task until this cycle
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


cdef int _core(Eng* g, int64_t p) noexcept nogil:
    """One cycle of PE p's core (it touches only p's own state, so PEs may run in parallel).
    Returns bit 1 if it did something, bit 2 if it waits for something already on its way."""
    cdef int code = g.pe_code[p], m, t, best, c, o, flags = 0
    cdef int64_t i, pc, e, qi, n, cycle = g.cycle
    cdef const Ins* I
    if code < 0:
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


def run(int W, int H, int C, int Q, int latency, int64_t max_cycles,
        const uint8_t[::1] rx, const uint8_t[::1] tx, const int32_t[::1] pe_code, const int64_t[::1] mem_off,
        float[::1] mem,
        const int32_t[::1] task_color, const int32_t[::1] task_start, const int32_t[::1] task_len, const int32_t[::1] ntasks,
        const int32_t[::1] op, const int64_t[::1] length,
        const int32_t[:, ::1] kind, const int64_t[:, ::1] arg, const int64_t[:, ::1] stride, const float[:, ::1] immv,
        const int64_t[:, ::1] iarg, const int64_t[:, ::1] ranges, const int32_t[::1] target, const uint8_t[::1] asyn,
        uint32_t[::1] active, uint32_t[::1] blocked,
        int64_t[::1] busy, int64_t[::1] stall, int64_t[::1] link, int threads=0):
    """Run until done, deadlock or ``max_cycles``; returns (status, cycles, state). State arrays are
    updated in place. ``threads``: threads for the core phase (0: as many as OpenMP allows, for
    fabrics large enough); the result does not depend on it."""
    if max_cycles > 2**31 - 2:
        max_cycles = 2**31 - 2   # arrival cycles are int32
    cdef int64_t P = <int64_t>W * H, p, qi, qn, slot, cycle = 0, i
    cdef int c, ci, port, k, moved_ports, rot, nt, f, nprog, nfut
    cdef bint ok, progress, future
    cdef float va
    cdef uint8_t txm
    cdef uint32_t bits
    cdef Eng g
    import numpy as np

    cdef int64_t j, ninstr = op.shape[0]
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
    rq_arr, cq_arr = np.zeros((P * C, QS), np.int32), np.zeros((P * C, QS), np.int32)
    cdef int32_t[:, ::1] rq = rq_arr, cq = cq_arr
    cdef int32_t* qp
    cdef uint32_t[::1] rq_mask = np.zeros(P, np.uint32)      # colors with wavelets queued in this PE's router
    cdef int32_t[::1] ramp_out = np.full(P, -1, np.int32)
    cdef int32_t[::1] cur_task = np.full(P, -1, np.int32), pending = np.zeros(P, np.int32)
    cdef int64_t[::1] cur_pc = np.zeros(P, np.int64), cur_e = np.zeros(P, np.int64), wake = np.zeros(P, np.int64)
    cdef int64_t[::1] mt_pc = np.full(P * MT, -1, np.int64), mt_e = np.zeros(P * MT, np.int64)
    cdef int32_t[::1] mt_busy = np.zeros(P, np.int32)
    g.C, g.Q, g.ins = C, Q, ins
    g.mem_off, g.mem, g.imem = &mem_off[0], &mem[0], <const int32_t*>&mem[0]
    g.pe_code, g.task_color, g.task_start = &pe_code[0], &task_color[0], &task_start[0]
    g.task_len, g.ntasks, g.active, g.blocked = &task_len[0], &ntasks[0], &active[0], &blocked[0]
    g.busy, g.stall = &busy[0], &stall[0]
    g.QS, g.rq, g.cq, g.rq_mask = QS, &rq[0, 0], &cq[0, 0], &rq_mask[0]
    g.pending, g.ramp_out = &pending[0], &ramp_out[0]
    g.cur_task, g.cur_pc, g.cur_e, g.wake = &cur_task[0], &cur_pc[0], &cur_e[0], &wake[0]
    g.mt_pc, g.mt_e, g.mt_busy = &mt_pc[0], &mt_e[0], &mt_busy[0]
    nt = threads if threads > 0 else wse_threads_for(P, CORE_GRAIN)
    cdef int64_t nbr[4]
    cdef int status = 0
    with nogil:
        while True:
            if cycle >= max_cycles:
                status = 2
                break
            progress = False
            future = False
            # ---- routers ----
            rot = <int>(cycle % C)
            for p in range(P):
                bits = rq_mask[p]
                if bits == 0:
                    continue
                nbr[0] = p - W                                         # N (routes never point off the edge)
                nbr[1] = p + 1                                         # E
                nbr[2] = p + W                                         # S
                nbr[3] = p - 1                                         # W
                moved_ports = 0
                # Colors with something queued, starting at `rot` so that no color starves.
                if rot:
                    bits = ((bits >> rot) | (bits << (C - rot))) & ((1u << C) - 1)
                while bits:
                    k = __builtin_ctz(bits)
                    bits &= bits - 1
                    ci = rot + k
                    if ci >= C:
                        ci -= C
                    qi = p * C + ci
                    qp = &rq[qi, 0]
                    if qp[2 + qp[1]] > cycle:
                        future = True
                        continue
                    txm = tx[qi]
                    ok = (txm & moved_ports) == 0
                    port = 0
                    while ok and port < 4:
                        if txm & (1 << port):
                            qn = nbr[port] * C + ci
                            if rq[qn, 0] >= Q:
                                ok = False
                        port += 1
                    if ok and (txm & 16) and cq[qi, 0] >= Q:
                        ok = False
                    if not ok:
                        continue
                    va = _q_pop(qp, Q)
                    if qp[0] == 0:
                        rq_mask[p] &= ~(1u << ci)
                    pending[p] -= 1
                    for port in range(4):
                        if txm & (1 << port):
                            qn = nbr[port] * C + ci
                            _q_push(&rq[qn, 0], Q, va, cycle + latency)
                            rq_mask[nbr[port]] |= 1u << ci
                            pending[nbr[port]] += 1
                            link[p * 5 + port] += 1
                    if txm & 16:
                        _q_push(&cq[qi, 0], Q, va, cycle + 1)
                        link[p * 5 + 4] += 1
                    moved_ports |= txm
                    progress = True
            # ---- cores: each touches only its own PE's state ----
            g.cycle = cycle
            nprog = 0
            nfut = 0
            if nt > 1:
                for p in prange(P, num_threads=nt, schedule="static"):
                    f = _core(&g, p)
                    nprog += f & 1
                    nfut += f >> 1
            else:
                for p in range(P):
                    f = _core(&g, p)
                    nprog += f & 1
                    nfut += f >> 1
            progress = progress or nprog > 0
            future = future or nfut > 0
            cycle += 1
            if not progress and not future:
                # Nothing moved and nothing is on its way: finished, or stuck.
                for p in range(P):
                    if pending[p] or cur_task[p] >= 0 or mt_busy[p] or (pe_code[p] >= 0 and (active[p] & ~blocked[p])):
                        status = 1
                        break
                if status == 0:
                    for qi in range(P * C):
                        if cq[qi, 0]:
                            status = 3
                            break
                if status == 0:
                    cycle -= 1  # the last cycle did nothing
                break
    state = {"cur_task": np.asarray(cur_task), "pending": np.asarray(pending), "rq_cnt": rq_arr[:, 0].copy(),
             "cq_cnt": cq_arr[:, 0].copy(), "mt_busy": np.asarray(mt_busy)}
    return status, cycle, state
