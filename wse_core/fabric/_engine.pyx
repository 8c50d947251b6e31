"""The cycle engine of the PE-mesh simulator: routers, queues and cores as flat arrays, no GIL.

Each cycle has two phases, each visiting PEs in index order (the deterministic tie-break):

* routers: for each PE with wavelets queued and each color (starting from ``cycle % colors`` so no
  color starves), the head wavelet moves when it has arrived (hop latency) and every destination
  of its route has room: the neighbour's queue of that color through a link used at most once per
  cycle per direction, and/or the core's input queue (RAMP). A multicast moves all copies at once.
* cores: a core without a running task picks its lowest-numbered task that is activated, or bound
  to a color with a wavelet waiting, and not blocked; a running instruction processes one element
  per cycle, stalling while a fabric input is empty or a fabric output queue is full.

Return codes: 0 done (every core idle, every queue empty), 1 deadlock (nothing moved and nothing
is in flight), 2 the cycle limit, 3 wavelets left in a core queue that no task will read.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t

cdef enum:
    K_NONE = 0
    K_MEM = 1
    K_FIN = 2
    K_FOUT = 3
    K_IMM = 4
    OP_FMOV = 0
    OP_FADD = 1
    OP_FSUB = 2
    OP_FMUL = 3
    OP_FMAC = 4
    OP_FNEG = 5
    OP_FMAX = 6
    OP_ACTIVATE = 7
    OP_BLOCK = 8
    OP_UNBLOCK = 9
    MAXT = 32


cdef inline bint _can_read(int kind, int64_t arg, int64_t qbase, const int32_t* cq_cnt, const int32_t* cq_head,
                           const int64_t* cq_rdy, int Q, int64_t cycle) noexcept nogil:
    cdef int64_t qi
    if kind != K_FIN:
        return True
    qi = qbase + arg
    return cq_cnt[qi] > 0 and cq_rdy[qi * Q + cq_head[qi]] <= cycle


def run(int W, int H, int C, int Q, int latency, int64_t max_cycles,
        const uint8_t[::1] rx, const uint8_t[::1] tx, const int32_t[::1] pe_code, const int64_t[::1] mem_off,
        float[::1] mem,
        const int32_t[::1] task_color, const int32_t[::1] task_start, const int32_t[::1] task_len, const int32_t[::1] ntasks,
        const int32_t[::1] op, const int64_t[::1] length,
        const int32_t[:, ::1] kind, const int64_t[:, ::1] arg, const int64_t[:, ::1] stride, const float[:, ::1] immv,
        const int32_t[::1] target,
        uint32_t[::1] active, uint32_t[::1] blocked,
        int64_t[::1] busy, int64_t[::1] stall, int64_t[::1] link):
    """Run until done, deadlock or ``max_cycles``; returns (status, cycles). State arrays are updated in place."""
    cdef int64_t P = <int64_t>W * H, p, nb, qi, qn, slot, cycle = 0, i, pc, e, addr
    cdef int c, ci, port, t, k, code, best, moved_ports, o, kd
    cdef bint ok, progress, future, stalled, anywork
    cdef float va, vb, vd, res
    cdef uint8_t txm
    cdef int32_t[:] rq_cnt, rq_head, cq_cnt, cq_head, cur_task
    cdef int64_t[:] rq_rdy, cq_rdy, cur_pc, cur_e
    cdef float[:] rq_val, cq_val
    cdef int32_t[:] pending
    import numpy as np

    rq_cnt = np.zeros(P * C, np.int32)
    rq_head = np.zeros(P * C, np.int32)
    rq_rdy = np.zeros(P * C * Q, np.int64)
    rq_val = np.zeros(P * C * Q, np.float32)
    cq_cnt = np.zeros(P * C, np.int32)
    cq_head = np.zeros(P * C, np.int32)
    cq_rdy = np.zeros(P * C * Q, np.int64)
    cq_val = np.zeros(P * C * Q, np.float32)
    cur_task = np.full(P, -1, np.int32)
    cur_pc = np.zeros(P, np.int64)
    cur_e = np.zeros(P, np.int64)
    pending = np.zeros(P, np.int32)   # wavelets in this PE's router queues
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
            for p in range(P):
                if pending[p] == 0:
                    continue
                nbr[0] = p - W if p >= W else -1                       # N
                nbr[1] = p + 1 if (p % W) + 1 < W else -1              # E
                nbr[2] = p + W if p + W < P else -1                    # S
                nbr[3] = p - 1 if p % W > 0 else -1                    # W
                moved_ports = 0
                for k in range(C):
                    ci = <int>((cycle + k) % C)
                    qi = p * C + ci
                    if rq_cnt[qi] == 0:
                        continue
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
                    rq_head[qi] = (rq_head[qi] + 1) % Q
                    rq_cnt[qi] -= 1
                    pending[p] -= 1
                    for port in range(4):
                        if txm & (1 << port):
                            qn = nbr[port] * C + ci
                            i = qn * Q + (rq_head[qn] + rq_cnt[qn]) % Q
                            rq_val[i] = va
                            rq_rdy[i] = cycle + latency
                            rq_cnt[qn] += 1
                            pending[nbr[port]] += 1
                            link[p * 5 + port] += 1
                    if txm & 16:
                        i = qi * Q + (cq_head[qi] + cq_cnt[qi]) % Q
                        cq_val[i] = va
                        cq_rdy[i] = cycle + 1
                        cq_cnt[qi] += 1
                        link[p * 5 + 4] += 1
                    moved_ports |= txm
                    progress = True
            # ---- cores ----
            anywork = False
            for p in range(P):
                code = pe_code[p]
                if code < 0:
                    continue
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
                anywork = True
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
                else:
                    # Can this element run? Fabric inputs need a wavelet, the fabric output room.
                    stalled = not (_can_read(kind[pc, 1], arg[pc, 1], p * C, &cq_cnt[0], &cq_head[0], &cq_rdy[0], Q, cycle)
                                   and _can_read(kind[pc, 2], arg[pc, 2], p * C, &cq_cnt[0], &cq_head[0], &cq_rdy[0], Q, cycle))
                    if not stalled and kind[pc, 0] == K_FOUT and rq_cnt[p * C + arg[pc, 0]] >= Q:
                        stalled = True
                    if stalled:
                        stall[p] += 1
                        continue
                    va = 0
                    vb = 0
                    for k in range(1, 3):
                        kd = kind[pc, k]
                        if kd == K_MEM:
                            res = mem[mem_off[p] + arg[pc, k] + e * stride[pc, k]]
                        elif kd == K_FIN:
                            qi = p * C + arg[pc, k]
                            res = cq_val[qi * Q + cq_head[qi]]
                            cq_head[qi] = (cq_head[qi] + 1) % Q
                            cq_cnt[qi] -= 1
                        elif kd == K_IMM:
                            res = immv[pc, k]
                        else:
                            res = 0
                        if k == 1:
                            va = res
                        else:
                            vb = res
                    addr = -1
                    if kind[pc, 0] == K_MEM:
                        addr = mem_off[p] + arg[pc, 0] + e * stride[pc, 0]
                    if o == OP_FMOV:
                        vd = va
                    elif o == OP_FADD:
                        vd = va + vb
                    elif o == OP_FSUB:
                        vd = va - vb
                    elif o == OP_FMUL:
                        vd = va * vb
                    elif o == OP_FMAC:
                        vd = (mem[addr] if addr >= 0 else 0) + va * vb
                    elif o == OP_FNEG:
                        vd = -va
                    else:
                        vd = va if va > vb else vb
                    if addr >= 0:
                        mem[addr] = vd
                    elif kind[pc, 0] == K_FOUT:
                        qi = p * C + arg[pc, 0]
                        i = qi * Q + (rq_head[qi] + rq_cnt[qi]) % Q
                        rq_val[i] = vd
                        rq_rdy[i] = cycle + 1
                        rq_cnt[qi] += 1
                        pending[p] += 1
                    e += 1
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
                    if pending[p] or cur_task[p] >= 0 or (pe_code[p] >= 0 and (active[p] & ~blocked[p])):
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
             "cq_cnt": np.asarray(cq_cnt)}
    return status, cycle, state
