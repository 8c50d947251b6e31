"""HDF5's Fletcher-32 checksum, to verify chunks read raw (docs/design/data.md "Reading").

The loader reads our uncompressed chunks with ``read_direct_chunk``, past HDF5's filter
pipeline (its selection machinery costs more than the read), and checks each chunk here exactly
as HDF5's fletcher32 filter would: the sum over big-endian 16-bit words in blocks of 360, stored
little-endian after the data; the byte-swapped form written by HDF5 before 1.6.3 is accepted too.
"""
from libc.stdint cimport uint8_t, uint16_t, uint32_t


cdef uint32_t _fletcher32(const uint8_t* data, Py_ssize_t nbytes) noexcept nogil:
    # HDF5's loop adds word i to sum1 and sum1 to sum2, word by word, folding both every 360
    # words. Over a block of t words that is sum1 += S0 and sum2 += t*sum1 + S1, with S0 = sum of
    # w_i and S1 = sum of (t - i) w_i: two independent sums the compiler can vectorize. uint32
    # arithmetic wraps the same way in either order, so the result is HDF5's bit for bit.
    cdef Py_ssize_t n = nbytes // 2, t, i
    cdef uint32_t sum1 = 0, sum2 = 0, s0, s1, w
    cdef const uint16_t* words
    while n > 0:
        t = 360 if n > 360 else n
        s0 = 0
        s1 = 0
        words = <const uint16_t*>data  # little-endian loads, swapped to HDF5's big-endian words
        for i in range(t):
            w = words[i]
            w = ((w & 0xff) << 8) | (w >> 8)
            s0 += w
            s1 += <uint32_t>(t - i) * w
        sum2 += <uint32_t>t * sum1 + s1
        sum1 += s0
        data += 2 * t
        n -= t
        sum1 = (sum1 & 0xffff) + (sum1 >> 16)
        sum2 = (sum2 & 0xffff) + (sum2 >> 16)
    if nbytes % 2:
        sum1 += <uint32_t>data[0] << 8
        sum2 += sum1
        sum1 = (sum1 & 0xffff) + (sum1 >> 16)
        sum2 = (sum2 & 0xffff) + (sum2 >> 16)
    sum1 = (sum1 & 0xffff) + (sum1 >> 16)
    sum2 = (sum2 & 0xffff) + (sum2 >> 16)
    return (sum2 << 16) | sum1


def fletcher32(const uint8_t[::1] data):
    """HDF5's Fletcher-32 of ``data`` (bytes-like)."""
    cdef uint32_t r
    with nogil:
        r = _fletcher32(&data[0], data.shape[0]) if data.shape[0] else 0
    return r


def chunk_ok(const uint8_t[::1] buf, Py_ssize_t start, Py_ssize_t nbytes):
    """Does the checksum of ``buf[start:start + nbytes]`` match the 4 bytes stored after it?"""
    cdef uint32_t f, stored, swapped
    cdef const uint8_t* p
    if start < 0 or nbytes < 0 or start + nbytes + 4 > buf.shape[0]:
        raise ValueError(f"chunk_ok: bytes {start}..{start + nbytes + 4} outside a buffer of {buf.shape[0]}")
    with nogil:
        p = &buf[start + nbytes]
        f = _fletcher32(&buf[start], nbytes)
        stored = <uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)
        swapped = ((f & 0x00ff00ff) << 8) | ((f >> 8) & 0x00ff00ff)
    return stored == f or stored == swapped
