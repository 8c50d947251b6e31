"""Code regions of programs whose PEs differ only by which neighbours they have and the parity of x
and y: one strided region per such class (at most 36, whatever the fabric size)."""


def spans(n):
    """Contiguous index ranges with the same neighbours: (start, stop, has_low, has_high)."""
    if n == 1:
        return [(0, 1, False, False)]
    if n == 2:
        return [(0, 1, False, True), (1, 2, True, False)]
    return [(0, 1, False, True), (1, n - 1, True, True), (n - 1, n, True, False)]


def grid(prog, W, H):
    """Code regions by neighbourhood and parity: [(region, {"W": has_w, "E": .., "N": .., "S": ..}, px, py)]."""
    out = []
    for (x0, x1, has_w, has_e) in spans(W):
        for (y0, y1, has_n, has_s) in spans(H):
            for px in range(2):
                for py in range(2):
                    xa, ya = x0 + (px - x0) % 2, y0 + (py - y0) % 2
                    if xa < x1 and ya < y1:
                        out.append((prog.region(xa, ya, x1 - xa, y1 - ya, step=(2, 2)),
                                    {"W": has_w, "E": has_e, "N": has_n, "S": has_s}, px, py))
    return out

