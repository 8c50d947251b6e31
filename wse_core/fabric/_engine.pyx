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

Return codes: 0 done (every core idle, every queue empty), 1 deadlock (nothing moved and nothing
is in flight), 2 the cycle limit, 3 wavelets left in a core queue that no task will read.
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


cdef struct Eng:
    int C
    int Q
    int64_t cycle
    const int32_t* kind
    const int64_t* arg
    const int64_t* stride
    const float* immv
    const int64_t* iarg
    const int32_t* op
    const int64_t* mem_off
    float* mem
    const int32_t* imem   # the same memory read as int32 (index words)
    int32_t* rq_cnt
    int32_t* rq_head
    int32_t* rq_rdy
    uint32_t* rq_mask
    int32_t* ramp_out   # the cycle this core last sent a wavelet into its router
    float* rq_val
    int32_t* cq_cnt
    int32_t* cq_head
    int32_t* cq_rdy
    float* cq_val
    int32_t* pending


cdef inline int64_t _wrap(int64_t i, int Q) noexcept nogil:
    """i mod Q for 0 <= i < 2Q, without a division (the engine's hottest arithmetic)."""
    return i - Q if i >= Q else i


cdef inline bint _can_read(Eng* g, int64_t p, int64_t pc, int k) noexcept nogil:
    cdef int64_t qi
    if g.kind[pc * 3 + k] != K_FIN:
        return True
    qi = p * g.C + g.arg[pc * 3 + k]
    return g.cq_cnt[qi] > 0 and g.cq_rdy[qi * g.Q + g.cq_head[qi]] <= g.cycle


cdef inline int64_t _addr(Eng* g, int64_t p, int64_t pc, int k, int64_t e) noexcept nogil:
    """Word address of element e of memory operand k (plain or indexed) of instruction pc on PE p."""
    cdef int64_t base = g.mem_off[p], j = pc * 3 + k
    if g.kind[j] == K_IDX:
        return base + g.arg[j] + g.imem[base + g.iarg[j] + e * g.stride[j]]
    return base + g.arg[j] + e * g.stride[j]


cdef inline bint _element(Eng* g, int64_t p, int64_t pc, int64_t e) noexcept nogil:
    """Process element e of vector instruction pc on PE p; False (and nothing done) if it must stall."""
    cdef int k, kd, o = g.op[pc]
    cdef int64_t qi, i, addr = -1
    cdef float va = 0, vb = 0, vd, res
    if not (_can_read(g, p, pc, 1) and _can_read(g, p, pc, 2)):
        return False
    if g.kind[pc * 3] == K_FOUT and (g.rq_cnt[p * g.C + g.arg[pc * 3]] >= g.Q or g.ramp_out[p] == g.cycle):
        return False   # output queue full, or the ramp link already carried a wavelet this cycle
    for k in range(1, 3):
        kd = g.kind[pc * 3 + k]
        if kd == K_MEM or kd == K_IDX:
            res = g.mem[_addr(g, p, pc, k, e)]
        elif kd == K_FIN:
            qi = p * g.C + g.arg[pc * 3 + k]
            res = g.cq_val[qi * g.Q + g.cq_head[qi]]
            g.cq_head[qi] = <int32_t>_wrap(g.cq_head[qi] + 1, g.Q)
            g.cq_cnt[qi] -= 1
        elif kd == K_IMM:
            res = g.immv[pc * 3 + k]
        else:
            res = 0
        if k == 1:
            va = res
        else:
            vb = res
    kd = g.kind[pc * 3]
    if kd == K_MEM or kd == K_IDX:
        addr = _addr(g, p, pc, 0, e)
    if o == OP_FMOV:
        vd = va
    elif o == OP_FADD:
        vd = va + vb
    elif o == OP_FSUB:
        vd = va - vb
    elif o == OP_FMUL:
        vd = va * vb
    elif o == OP_FMAC:
        vd = (g.mem[addr] if addr >= 0 else 0) + va * vb
    elif o == OP_FNEG:
        vd = -va
    elif o == OP_FDIV:
        vd = va / vb
    else:
        vd = va if va > vb else vb
    if addr >= 0:
        g.mem[addr] = vd
    elif g.kind[pc * 3] == K_FOUT:
        qi = p * g.C + g.arg[pc * 3]
        i = qi * g.Q + _wrap(g.rq_head[qi] + g.rq_cnt[qi], g.Q)
        g.rq_val[i] = vd
        g.rq_rdy[i] = <int32_t>(g.cycle + 1)
        g.rq_cnt[qi] += 1
        g.rq_mask[p] |= 1u << g.arg[pc * 3]
        g.ramp_out[p] = <int32_t>g.cycle
        g.pending[p] += 1
    return True


def run(int W, int H, int C, int Q, int latency, int64_t max_cycles,
        const uint8_t[::1] rx, const uint8_t[::1] tx, const int32_t[::1] pe_code, const int64_t[::1] mem_off,
        float[::1] mem,
        const int32_t[::1] task_color, const int32_t[::1] task_start, const int32_t[::1] task_len, const int32_t[::1] ntasks,
        const int32_t[::1] op, const int64_t[::1] length,
        const int32_t[:, ::1] kind, const int64_t[:, ::1] arg, const int64_t[:, ::1] stride, const float[:, ::1] immv,
        const int64_t[:, ::1] iarg, const int32_t[::1] target, const uint8_t[::1] asyn,
        uint32_t[::1] active, uint32_t[::1] blocked,
        int64_t[::1] busy, int64_t[::1] stall, int64_t[::1] link):
    """Run until done, deadlock or ``max_cycles``; returns (status, cycles). State arrays are updated in place."""
    if max_cycles > 2**31 - 2:
        max_cycles = 2**31 - 2   # arrival cycles are int32
    cdef int64_t P = <int64_t>W * H, p, qi, qn, slot, cycle = 0, i, pc, e
    cdef int c, ci, port, t, k, code, best, moved_ports, o, rot
    cdef bint ok, progress, future
    cdef float va
    cdef uint8_t txm
    cdef int32_t[:] rq_cnt, rq_head, cq_cnt, cq_head, cur_task
    cdef int32_t[:] rq_rdy, cq_rdy, ramp_out
    cdef uint32_t[:] rq_mask
    cdef uint32_t bits
    cdef int64_t[:] cur_pc, cur_e
    cdef float[:] rq_val, cq_val
    cdef int32_t[:] pending
    cdef int64_t[:] mt_pc, mt_e
    cdef int32_t[:] mt_busy
    cdef Eng g
    cdef int m
    import numpy as np

    rq_cnt = np.zeros(P * C, np.int32)
    rq_head = np.zeros(P * C, np.int32)
    rq_rdy = np.zeros(P * C * Q, np.int32)
    rq_mask = np.zeros(P, np.uint32)      # colors with wavelets queued in this PE's router
    ramp_out = np.full(P, -1, np.int32)
    rq_val = np.zeros(P * C * Q, np.float32)
    cq_cnt = np.zeros(P * C, np.int32)
    cq_head = np.zeros(P * C, np.int32)
    cq_rdy = np.zeros(P * C * Q, np.int32)
    cq_val = np.zeros(P * C * Q, np.float32)
    cur_task = np.full(P, -1, np.int32)
    cur_pc = np.zeros(P, np.int64)
    cur_e = np.zeros(P, np.int64)
    pending = np.zeros(P, np.int32)   # wavelets in this PE's router queues
    mt_pc = np.full(P * MT, -1, np.int64)   # instruction of each microthread (-1: free)
    mt_e = np.zeros(P * MT, np.int64)
    mt_busy = np.zeros(P, np.int32)         # microthreads in use per PE
    g.C, g.Q = C, Q
    g.kind, g.arg, g.stride, g.immv, g.op = &kind[0, 0], &arg[0, 0], &stride[0, 0], &immv[0, 0], &op[0]
    g.iarg = &iarg[0, 0]
    g.mem_off, g.mem = &mem_off[0], &mem[0]
    g.imem = <const int32_t*>&mem[0]
    g.rq_cnt, g.rq_head, g.rq_rdy, g.rq_val, g.rq_mask = &rq_cnt[0], &rq_head[0], &rq_rdy[0], &rq_val[0], &rq_mask[0]
    g.cq_cnt, g.cq_head, g.cq_rdy, g.cq_val = &cq_cnt[0], &cq_head[0], &cq_rdy[0], &cq_val[0]
    g.pending = &pending[0]
    g.ramp_out = &ramp_out[0]
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
                    slot = qi * Q + rq_head[qi]
                    if rq_rdy[slot] > cycle:
                        future = True
                        continue
                    txm = tx[qi]
                    ok = (txm & moved_ports) == 0
                    port = 0
                    while ok and port < 4:
                        if txm & (1 << port):
                            qn = nbr[port] * C + ci
                            if rq_cnt[qn] >= Q:
                                ok = False
                        port += 1
                    if ok and (txm & 16) and cq_cnt[qi] >= Q:
                        ok = False
                    if not ok:
                        continue
                    va = rq_val[slot]
                    rq_head[qi] = <int32_t>_wrap(rq_head[qi] + 1, Q)
                    rq_cnt[qi] -= 1
                    if rq_cnt[qi] == 0:
                        rq_mask[p] &= ~(1u << ci)
                    pending[p] -= 1
                    for port in range(4):
                        if txm & (1 << port):
                            qn = nbr[port] * C + ci
                            i = qn * Q + _wrap(rq_head[qn] + rq_cnt[qn], Q)
                            rq_val[i] = va
                            rq_rdy[i] = <int32_t>(cycle + latency)
                            rq_cnt[qn] += 1
                            rq_mask[nbr[port]] |= 1u << ci
                            pending[nbr[port]] += 1
                            link[p * 5 + port] += 1
                    if txm & 16:
                        i = qi * Q + _wrap(cq_head[qi] + cq_cnt[qi], Q)
                        cq_val[i] = va
                        cq_rdy[i] = <int32_t>(cycle + 1)
                        cq_cnt[qi] += 1
                        link[p * 5 + 4] += 1
                    moved_ports |= txm
                    progress = True
            # ---- cores ----
            g.cycle = cycle
            for p in range(P):
                code = pe_code[p]
                if code < 0:
                    continue
                # Microthreads first, in slot order: one element each per cycle.
                if mt_busy[p]:
                    for m in range(MT):
                        i = p * MT + m
                        pc = mt_pc[i]
                        if pc < 0:
                            continue
                        if _element(&g, p, pc, mt_e[i]):
                            mt_e[i] += 1
                            busy[p] += 1
                            progress = True
                            if mt_e[i] >= length[pc]:
                                mt_pc[i] = -1
                                mt_busy[p] -= 1
                                if target[pc] >= 0:   # the task to activate when this stream is done
                                    active[p] |= (1u << target[pc])
                        else:
                            stall[p] += 1
                if cur_task[p] < 0:
                    best = -1
                    for t in range(ntasks[code]):
                        if blocked[p] & (1u << t):
                            continue
                        if active[p] & (1u << t):
                            best = t
                            break
                        c = task_color[code * MAXT + t]
                        if c >= 0 and cq_cnt[p * C + c] > 0:
                            if cq_rdy[(p * C + c) * Q + cq_head[p * C + c]] <= cycle:
                                best = t
                                break
                            future = True
                    if best < 0:
                        continue
                    active[p] &= ~(1u << best)
                    cur_task[p] = best
                    cur_pc[p] = task_start[code * MAXT + best]
                    cur_e[p] = 0
                    if task_len[code * MAXT + best] == 0:
                        cur_task[p] = -1
                        progress = True
                        continue
                pc = cur_pc[p]
                e = cur_e[p]
                o = op[pc]
                if o >= OP_ACTIVATE:
                    t = target[pc]
                    if o == OP_ACTIVATE:
                        active[p] |= (1u << t)
                    elif o == OP_BLOCK:
                        blocked[p] |= (1u << t)
                    else:
                        blocked[p] &= ~(1u << t)
                    e = length[pc]
                elif asyn[pc]:
                    # Hand the instruction to a free microthread; the task goes on next cycle.
                    if mt_busy[p] >= MT:
                        stall[p] += 1
                        continue
                    for m in range(MT):
                        if mt_pc[p * MT + m] < 0:
                            mt_pc[p * MT + m] = pc
                            mt_e[p * MT + m] = 0
                            mt_busy[p] += 1
                            break
                    e = length[pc]
                elif _element(&g, p, pc, e):
                    e += 1
                else:
                    stall[p] += 1
                    continue
                busy[p] += 1
                progress = True
                if e >= length[pc]:
                    e = 0
                    pc += 1
                    if pc >= task_start[code * MAXT + cur_task[p]] + task_len[code * MAXT + cur_task[p]]:
                        cur_task[p] = -1
                cur_pc[p] = pc
                cur_e[p] = e
            cycle += 1
            if not progress and not future:
                # Nothing moved and nothing is on its way: finished, or stuck.
                for p in range(P):
                    if pending[p] or cur_task[p] >= 0 or mt_busy[p] or (pe_code[p] >= 0 and (active[p] & ~blocked[p])):
                        status = 1
                        break
                if status == 0:
                    for qi in range(P * C):
                        if cq_cnt[qi]:
                            status = 3
                            break
                if status == 0:
                    cycle -= 1  # the last cycle did nothing
                break
    state = {"cur_task": np.asarray(cur_task), "pending": np.asarray(pending), "rq_cnt": np.asarray(rq_cnt),
             "cq_cnt": np.asarray(cq_cnt), "mt_busy": np.asarray(mt_busy)}
    return status, cycle, state
