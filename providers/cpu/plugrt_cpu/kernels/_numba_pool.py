"""numba-compiled float32 loops for 2-D MaxPool and AveragePool over NCHW planes: a few vectorised passes per plane where numpy needs a strided pass per tap.

Imported only through :func:`plugrt_cpu.kernels.pooling.compiled_pool`, which returns
None when numba is missing or ``PLUGRT_NUMBA=0``; the numpy path then gives the same
values (the same maxima; averages to float32 rounding). Compiled code is cached on disk
(``cache=True``), so only the first process on a machine pays the compile (~7 s per
entry point); later ones load it in ~0.1 s.

The window is separable. Its input rows are combined into a row buffer whose padding
holds the identity (-inf, or 0 for sums), so that the column passes need no bounds; the
row buffers of a band of output rows (a whole plane, for short rows) lie back to back,
and each column pass runs once over all of them, so that its loop is long; the results
are then copied (or, for averages, scaled) into the output rows. With stride 2 the
buffers are first split into their even and odd columns, so that every loop reads
contiguously and vectorises (a strided read measured ~2x slower). Stride-1 pooling whose
output rows are as long as the input's (3x3 with one column of padding) needs no row
buffers: small planes are pooled whole, each pass one loop over the plane, and the few
output columns whose windows reach into the padding are redone after. Averages are sums
times the reciprocal counts (within an ulp of numpy's division).

The fastmath flags allow contraction, reciprocal and reassociation but not
``nnan``/``ninf``: a NaN anywhere in a window makes its maximum or average NaN, as
numpy's ``maximum`` and ``add`` do. ``error_model="numpy"`` drops the division checks.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba.core.cpu import CPUTargetOptions

from ._numba_parallel import float32_pointer, int64_pointer

__all__ = ["PLANES_WORDS", "avg_pool2d", "max_pool2d", "pool_planes", "work_length"]

# ``_nrt=False``: no reference counting. These loops allocate nothing, and the arrays they
# take views of outlive the call; numba's count updates on each per-row view (atomic, and
# not pruned in these branchy loops) took ~30% of the time on SqueezeNet's first MaxPool.
_FLAGS: dict[str, Any] = dict(
    fastmath={"contract", "arcp", "nsz", "reassoc"},
    nogil=True,
    boundscheck=False,
    error_model="numpy",
    cache=True,
    _nrt=False,
)
if not hasattr(CPUTargetOptions, "_nrt"):  # a private option: a numba without it counts references
    del _FLAGS["_nrt"]
_compiled = numba.njit(**_FLAGS)
_I = numba.int64
_PLANES_IN = numba.types.Array(numba.float32, 3, "C", readonly=True)  # takes writable arrays too
# The innermost loops and their dispatch are inlined by numba, so that the row loops call
# no function; the rest is left to LLVM (inlining everything compiled twice as slowly).
_inlined = numba.njit(inline="always", **_FLAGS)

# Float32 elements of the row buffers pooled in one pass: whole planes of short rows,
# so that each loop runs long, yet small enough that the buffers stay in the L1 cache.
_BAND = 2048
# Floats of the vertical pass's rows ``_flat_planes`` keeps for a group of planes.
_FLAT_FLOATS = 8192
_FLAT_STRIDE_1_PLANE = 256  # floats of the planes stride-1 windows are stacked for (up to 16x16)


@_compiled
def _row_length(width, out_width, kw, sw, dw, pw):  # pragma: no cover  (compiled)
    """Length of a row buffer: the padded input row, long enough for every window of the
    output row (ceil_mode windows reach past the end padding), rounded up to even."""
    length = max(pw + width, (out_width - 1) * sw + (kw - 1) * dw + 1, 2)
    return length + length % 2


@_compiled
def _band_rows(out_h, length, sw):  # pragma: no cover  (compiled)
    """Row buffers pooled in one pass (strides above 2: one, their results do not line up)."""
    return max(1, min(out_h, _BAND // length)) if sw <= 2 else 1


@_compiled
def _whole_planes(out_h, width, out_w, sh, sw):  # pragma: no cover  (compiled)
    """Whether planes are pooled by ``_same_size_plane``: stride 1, output rows as long as
    the input's, and planes small enough that their rows are short."""
    return sh == 1 and sw == 1 and out_w == width and out_h * width <= _BAND


@_compiled
def _flat(height, width, out_h, out_w, kh, kw, sh, sw, dh, dw, ph, pw):  # pragma: no cover  (compiled)
    """Whether planes are pooled by ``_flat_planes``: a 3x3 window with stride 1 (one row
    and column of padding each side) or 2 (at most one before), the input exactly
    ``stride`` times the output, so that planes stacked one on another keep every window
    row and column a fixed step from its output's; or stride 2 without padding on odd
    sides (one more than twice the output: each row's last column is kept aside)."""
    if kh != 3 or kw != 3 or dh != 1 or dw != 1 or sh != sw:
        return False
    if sh == 2 and ph == 0 and pw == 0 and height == 2 * out_h + 1 and width == 2 * out_w + 1:
        return True  # no padding, odd sides (SqueezeNet's 111, 55, 27): the last column aside
    if height != sh * out_h or width != sw * out_w:
        return False
    if sh == 1:  # larger planes: _same_size_plane's passes are long enough (28x28 ran 1.2x slower here)
        return ph == 1 and pw == 1 and height >= 2 and width >= 2 and height * width <= _FLAT_STRIDE_1_PLANE
    return sh == 2 and 0 <= ph <= 1 and 0 <= pw <= 1


@numba.njit([_I(*(_I,) * 12)], **_FLAGS)  # compiled on import for every shape
def work_length(height, width, out_h, out_w, kh, kw, sh, sw, dh, dw, ph, pw):  # pragma: no cover  (compiled)
    """Float32 elements of the ``work`` buffer the pooling loops need (per thread)."""
    if _flat(height, width, out_h, out_w, kh, kw, sh, sw, dh, dw, ph, pw):
        return max(_FLAT_FLOATS, out_h * (width + 1))
    if _whole_planes(out_h, width, out_w, sh, sw):
        return out_h * width
    length = _row_length(width, out_w, kw, sw, dw, pw)
    return 3 * _band_rows(out_h, length, sw) * length


# The innermost loops, one per operation (no branch inside them, so each vectorises). The
# maximum keeps a NaN from either side, as np.maximum: the first select is x86's max
# instruction (which returns its second operand when either is NaN), the second keeps a
# NaN first operand; ~1.5x faster than testing v > acc or v != v. It is written out in
# each loop: numba inlines a nested helper slowly (each level adds seconds of compile).


@_inlined
def _max(acc, v):  # pragma: no cover  (compiled; inlined)
    """The larger of acc and v, NaN if either is (for the scalar loops)."""
    larger = acc if acc > v else v
    return larger if acc == acc else acc


@_inlined
def _three(a, b, c, out, n, is_max):  # pragma: no cover  (compiled; inlined)
    """out[i] = the combination of a[i], b[i] and c[i], i in [0, n)."""
    if is_max:
        for i in range(n):
            x, y, z = a[i], b[i], c[i]
            m = x if x > y else y
            m = m if x == x else x
            r = m if m > z else z
            out[i] = r if m == m else m
    else:
        for i in range(n):
            out[i] = a[i] + b[i] + c[i]


@_inlined
def _two(a, b, out, n, is_max):  # pragma: no cover  (compiled; inlined)
    """out[i] = the combination of a[i] and b[i], i in [0, n)."""
    if is_max:
        for i in range(n):
            x, y = a[i], b[i]
            m = x if x > y else y
            out[i] = m if x == x else x
    else:
        for i in range(n):
            out[i] = a[i] + b[i]


@_inlined
def _into(out, a, n, is_max):  # pragma: no cover  (compiled; inlined)
    """out[i] = the combination of out[i] and a[i], i in [0, n)."""
    if is_max:
        for i in range(n):
            x, y = out[i], a[i]
            m = x if x > y else y
            out[i] = m if x == x else x
    else:
        for i in range(n):
            out[i] += a[i]


@_inlined
def _pair(a, b, is_max):  # pragma: no cover  (compiled; inlined)
    """The combination of two values: their maximum (NaN if either is) or their sum."""
    return _max(a, b) if is_max else a + b


@_inlined
def _three_by_two(a, out, n, is_max):  # pragma: no cover  (compiled; inlined)
    """out[i] = the combination of a[2i], a[2i + 1] and a[2i + 2], i in [0, n)."""
    if is_max:
        for i in range(n):
            x, y, z = a[2 * i], a[2 * i + 1], a[2 * i + 2]
            m = x if x > y else y
            m = m if x == x else x
            r = m if m > z else z
            out[i] = r if m == m else m
    else:
        for i in range(n):
            out[i] = a[2 * i] + a[2 * i + 1] + a[2 * i + 2]


@_inlined
def _copy(a, out, n):  # pragma: no cover  (compiled)
    for i in range(n):
        out[i] = a[i]


@_inlined
def _scaled(a, factors, out, n):  # pragma: no cover  (compiled)
    for i in range(n):
        out[i] = a[i] * factors[i]


@_inlined
def _split(row, even, odd, half):  # pragma: no cover  (compiled)
    """The even and odd elements of ``row``: one interleaved read, two contiguous writes."""
    for i in range(half):
        even[i] = row[2 * i]
        odd[i] = row[2 * i + 1]


@_compiled
def _rows(xf, start, step, count, dst, n, is_max):  # pragma: no cover  (compiled)
    """dst[:n] = the combination of xf[start + i * step:][:n], i in [0, count) (one or
    more): the window's input rows, one or many output rows' worth (a flat plane)."""
    if count == 1:
        _copy(xf[start:], dst, n)
    elif count == 2:
        _two(xf[start:], xf[start + step :], dst, n, is_max)
    else:
        _three(xf[start:], xf[start + step :], xf[start + 2 * step :], dst, n, is_max)
        for i in range(3, count):
            _into(dst, xf[start + i * step :], n, is_max)


@_compiled
def _taps(source, shift, out, n, kw, dw, is_max):  # pragma: no cover  (compiled)
    """out[i] = the combination of source[i + j * dw // shift], i in [0, n), j in [0, kw),
    where ``shift`` is 1 (stride 1), or 2 with ``source`` the even half of the row (the
    odd taps read the odd half, which follows it at ``source.shape[0] // 2``)."""
    half = source.shape[0] // 2
    for j in range(kw):
        offset = j * dw
        start = offset if shift == 1 else offset // 2 + (offset % 2) * half
        if j == 0:
            _copy(source[start:], out, n)
        else:
            _into(out, source[start:], n, is_max)


@_compiled
def _columns(row, halves, out, n, kw, sw, dw, is_max):  # pragma: no cover  (compiled)
    """out[o] = the combination of row[o * sw + j * dw], j in [0, kw), o in [0, n):
    ``row`` is one or more row buffers back to back, ``halves`` a work array as long."""
    if sw == 1:
        if dw == 1 and kw == 3:
            _three(row, row[1:], row[2:], out, n, is_max)
        elif dw == 1 and kw == 2:
            _two(row, row[1:], out, n, is_max)
        else:
            _taps(row, sw, out, n, kw, dw, is_max)
    elif sw == 2:
        half = row.shape[0] // 2
        even, odd = halves[:half], halves[half : 2 * half]
        _split(row, even, odd, half)
        if dw == 1 and kw == 3:
            _three(even, odd, even[1:], out, n, is_max)
        elif dw == 1 and kw == 2:
            _two(even, odd, out, n, is_max)
        else:
            _taps(halves[: 2 * half], sw, out, n, kw, dw, is_max)
    else:
        for o in range(n):
            out[o] = row[o * sw]
        for j in range(1, kw):
            tap = row[j * dw :]
            for o in range(n):
                out[o] = _max(out[o], tap[o * sw]) if is_max else out[o] + tap[o * sw]


@_compiled
def _window_rows(oh, sh, dh, ph, kh, height):  # pragma: no cover  (compiled)
    """The window of output row ``oh``: its first input row r0 and the range [first,
    last) of its taps i whose row r0 + i * dh lies in the input (empty: none does)."""
    r0 = oh * sh - ph
    first = 0 if r0 >= 0 else (dh - 1 - r0) // dh
    last = kh
    if r0 + (kh - 1) * dh >= height:
        last = (height - 1 - r0) // dh + 1 if r0 < height else 0
    return r0, first, last


@_compiled
def _edge_columns(grid, yp, kw, dw, pw, span, identity, is_max):  # pragma: no cover  (compiled)
    """The output columns whose windows reach into the column padding (all but [pw, pw +
    span)): the combination of grid[oh, c], c = ow - pw + j * dw, over the taps j with c
    inside the row (the identity if none is). The usual 3-wide window with one column
    of padding has one such column at each end, written out; a loop over the taps with
    bounds per element ran 3x slower."""
    out_h, width = grid.shape
    if kw == 3 and dw == 1 and pw == 1 and width >= 2:
        for oh in range(out_h):
            g, out = grid[oh], yp[oh]
            if is_max:
                out[0] = _max(g[0], g[1])
                out[width - 1] = _max(g[width - 2], g[width - 1])
            else:
                out[0] = g[0] + g[1]
                out[width - 1] = g[width - 2] + g[width - 1]
        return
    for oh in range(out_h):
        g, out = grid[oh], yp[oh]
        for ow in range(width):
            if pw <= ow < pw + span:
                continue
            acc = identity
            for j in range(kw):
                c = ow - pw + j * dw
                if 0 <= c < width:
                    acc = _max(acc, g[c]) if is_max else acc + g[c]
            out[ow] = acc


@_compiled
def _same_size_plane(xp, yp, kh, kw, stride, dh, dw, ph, pw, is_max, scale, rows):  # pragma: no cover  (compiled)
    """Stride-1 pooling of one plane whose output rows are as long as its input rows (W),
    every pass over the whole plane at once: the windows' rows combined into ``rows``
    (OH x W, flat); their columns, for the windows inside the row, straight into the
    output; then the windows that reach into the column padding (which the flat pass got
    wrong: it read the neighbouring row). ``stride`` is 1, passed as a variable so that
    the helpers it shares with ``_pool2d`` compile once (a constant compiles its own)."""
    height, width = xp.shape
    out_h = yp.shape[0]
    identity = np.float32(-np.inf) if is_max else np.float32(0.0)
    xf, yf = xp.reshape(height * width), yp.reshape(out_h * width)
    # Rows: one flat pass over the output rows whose windows lie inside the input.
    top = min(ph, out_h)
    bottom = max(top, min(out_h, height + ph - (kh - 1) * dh))
    if bottom > top:
        start, step, n = (top - ph) * width, dh * width, (bottom - top) * width
        if kh == 3:  # the usual window, inlined: a call here cost ~20% on 14x14 planes
            _three(xf[start:], xf[start + step :], xf[start + 2 * step :], rows[top * width :], n, is_max)
        else:
            _rows(xf, start, step, kh, rows[top * width :], n, is_max)
    for oh in range(out_h):
        if top <= oh < bottom:
            continue
        r0, first, last = _window_rows(oh, stride, dh, ph, kh, height)
        row = rows[oh * width : (oh + 1) * width]
        if last <= first:
            for w in range(width):
                row[w] = identity
        else:
            _rows(xf, (r0 + first * dh) * width, dh * width, last - first, row, width, is_max)
    # Columns: output column ow = c + pw reads rows[c + j * dw], inside the row for c < span.
    span = width - (kw - 1) * dw
    if span > 0:
        n = (out_h - 1) * width + span
        if kw == 3 and dw == 1:
            _three(rows, rows[1:], rows[2:], yf[pw:], n, is_max)
        else:
            _columns(rows, rows, yf[pw:], n, kw, stride, dw, is_max)
    _edge_columns(rows[: out_h * width].reshape(out_h, width), yp, kw, dw, pw, max(span, 0), identity, is_max)
    if not is_max:
        _scaled(yf, scale.reshape(out_h * width), yf, out_h * width)


@_compiled
def _flat_planes(x, y, start, stop, stride, ph, pw, is_max, scale, work):  # pragma: no cover  (compiled)
    """3x3 pooling of planes [start, stop) whose input is ``stride`` (1 or 2) times the
    output (see ``_flat``), a group of planes at a time as if one tall plane: the window's
    rows combined into ``work`` (a row per output row), then one flat pass
    over all of the group's output for the columns; the rows and columns whose windows
    reach into the padding (or would read the next plane) redone after. Small planes cost
    per plane here what a pass costs, where ``_same_size_plane`` and the row buffers made
    a dozen short loops a plane (Inception v2's 1024 planes of 7x7: ~0.1 us each)."""
    height, width = x.shape[1], x.shape[2]
    out_h, out_w = y.shape[1], y.shape[2]
    # odd sides (stride 2, no padding): rows of the vertical pass keep 2 * out_w columns,
    # so that output q reads 2q, 2q + 1 and 2q + 2 across the group; the last column of
    # each goes to ``tail`` for the last output column of its row
    odd = stride == 2 and width == 2 * out_w + 1
    pitch = 2 * out_w if odd else width
    group = max(1, len(work) // (out_h * (pitch + 1)))
    last_row = height - 1
    for g0 in range(start, stop, group):
        g1 = min(stop, g0 + group)
        count = g1 - g0
        # rows: output row i reads input rows stride * i - ph + (0, 1, 2)
        tail = work[count * out_h * pitch :]
        for p in range(g0, g1):
            xp = x[p]
            base = (p - g0) * out_h * pitch
            for i in range(out_h):
                r = stride * i - ph
                v = work[base + i * pitch : base + (i + 1) * pitch]
                if r >= 0 and r + 2 <= last_row:
                    _three(xp[r], xp[r + 1], xp[r + 2], v, pitch, is_max)
                    if odd:
                        pair = _pair(xp[r, width - 1], xp[r + 1, width - 1], is_max)
                        tail[(p - g0) * out_h + i] = _pair(pair, xp[r + 2, width - 1], is_max)
                elif r < 0:  # the top padding: rows 0 and 1
                    _two(xp[0], xp[1], v, width, is_max)
                else:  # the bottom: rows r and r + 1 (r + 2 is past the end)
                    _two(xp[r], xp[r + 1], v, width, is_max)
        # columns: output (R, j) reads work[R * W + stride * j - pw + (0, 1, 2)], R over the group
        total = count * out_h * out_w
        flat = work[: count * out_h * pitch]
        yf = y[g0:g1].reshape(total)
        if stride == 1:  # pw == 1: j reads j - 1, j, j + 1
            if total > 2:
                _three(flat, flat[1:], flat[2:], yf[1:], total - 2, is_max)
        else:
            off = -pw  # q reads 2q + off + (0, 1, 2)
            lo = 1 if off < 0 else 0
            hi = total - 1 if off == 0 else total  # 2q + off + 2 must stay in the group
            n = hi - lo
            if n > 0:
                _three_by_two(flat[2 * lo + off :], yf[lo:], n, is_max)
        # the columns whose windows reach into the padding, in every row of the group
        rows = count * out_h
        for r in range(rows):
            v = flat[r * pitch : (r + 1) * pitch]
            out = yf[r * out_w : (r + 1) * out_w]
            j = out_w - 1
            if stride == 1:
                out[0] = _pair(v[0], v[1], is_max)
                out[j] = _pair(v[width - 2], v[width - 1], is_max)
            elif pw == 1:
                out[0] = _pair(v[0], v[1], is_max)
            elif odd:  # 2j + 2 is the column kept aside
                out[j] = _pair(_pair(v[2 * j], v[2 * j + 1], is_max), tail[r], is_max)
            else:  # 2j, 2j + 1 = width - 1; 2j + 2 is past the end
                out[j] = _pair(v[2 * j], v[2 * j + 1], is_max)
        if not is_max:
            plane = out_h * out_w
            factors = scale.reshape(plane)
            for p in range(count):
                _scaled(yf[p * plane :], factors, yf[p * plane :], plane)


@_compiled
def _pool2d(x, y, start, stop, kh, kw, sh, sw, dh, dw, ph, pw, is_max, scale, work):  # pragma: no cover  (compiled)
    """Pool planes [start, stop) of the float32 ``x`` (planes, H, W) into ``y`` (planes,
    OH, OW): the maximum over each window (``is_max``), else its sum times ``scale``
    (OH, OW: the reciprocal counts). ``ph``/``pw`` are the begin pads; windows reaching
    past the input read the identity. ``work``: float32, at least
    ``work_length(H, W, OH, OW, kh, kw, sh, sw, dh, dw, ph, pw)`` elements."""
    height, width = x.shape[1], x.shape[2]
    out_h, out_w = y.shape[1], y.shape[2]
    if _flat(height, width, out_h, out_w, kh, kw, sh, sw, dh, dw, ph, pw):
        _flat_planes(x, y, start, stop, sh, ph, pw, is_max, scale, work)
        return
    if _whole_planes(out_h, width, out_w, sh, sw):
        for plane in range(start, stop):
            _same_size_plane(x[plane], y[plane], kh, kw, sw, dh, dw, ph, pw, is_max, scale, work)
        return
    identity = np.float32(-np.inf) if is_max else np.float32(0.0)
    length = _row_length(width, out_w, kw, sw, dw, pw)
    band = _band_rows(out_h, length, sw)
    size = band * length
    buffers, halves, result = work[:size], work[size : 2 * size], work[2 * size : 3 * size]
    # The padding of every row buffer: written once, never overwritten.
    for r in range(band):
        for i in range(pw):
            buffers[r * length + i] = identity
        for i in range(r * length + pw + width, (r + 1) * length):
            buffers[i] = identity
    pitch = length if sw == 1 else length // 2  # of the results, a row buffer apart
    for plane in range(start, stop):
        xf, yp = x[plane].reshape(height * width), y[plane]
        for oh in range(out_h):
            r0, first, last = _window_rows(oh, sh, dh, ph, kh, height)
            slot = oh % band
            inner = buffers[slot * length + pw : slot * length + pw + width]
            if last <= first:  # the window lies in the padding only
                for w in range(width):
                    inner[w] = identity
            else:
                _rows(xf, (r0 + first * dh) * width, dh * width, last - first, inner, width, is_max)
            if slot == band - 1 or oh == out_h - 1:  # the band's columns in one pass
                count = slot + 1
                _columns(buffers[: count * length], halves, result, (count - 1) * pitch + out_w, kw, sw, dw, is_max)
                for r in range(count):
                    if is_max:
                        _copy(result[r * pitch :], yp[oh - slot + r], out_w)
                    else:
                        _scaled(result[r * pitch :], scale[oh - slot + r], yp[oh - slot + r], out_w)


@numba.njit([numba.void(_PLANES_IN, numba.float32[:, :, ::1], *(_I,) * 10, numba.float32[::1])], **_FLAGS)  # compiled on import for every shape
def max_pool2d(x, y, start, stop, kh, kw, sh, sw, dh, dw, ph, pw, work):  # pragma: no cover  (compiled)
    """MaxPool of planes [start, stop) of the float32 ``x`` (planes, H, W) into ``y``
    (planes, OH, OW); ``start < stop``. See ``_pool2d``."""
    _pool2d(x, y, start, stop, kh, kw, sh, sw, dh, dw, ph, pw, True, y[start], work)


@numba.njit([numba.void(_PLANES_IN, numba.float32[:, :, ::1], *(_I,) * 10, numba.types.Array(numba.float32, 2, "C", readonly=True), numba.float32[::1])], **_FLAGS)  # compiled on import for every shape
def avg_pool2d(x, y, start, stop, kh, kw, sh, sw, dh, dw, ph, pw, scale, work):  # pragma: no cover  (compiled)
    """AveragePool of planes [start, stop) of the float32 ``x`` (planes, H, W) into
    ``y`` (planes, OH, OW): each window's sum times ``scale`` (OH, OW, float32: one over
    the window's count). See ``_pool2d``."""
    _pool2d(x, y, start, stop, kh, kw, sh, sw, dh, dw, ph, pw, False, scale, work)


# The context of ``pool_planes`` (int64 words; see ``pooling._Pooling.compiled``).
(
    PLANES_X, PLANES_Y, PLANES_COUNT, PLANES_HEIGHT, PLANES_WIDTH, PLANES_OUT_HEIGHT, PLANES_OUT_WIDTH, PLANES_UNITS,
    PLANES_KH, PLANES_KW, PLANES_SH, PLANES_SW, PLANES_DH, PLANES_DW, PLANES_PH, PLANES_PW, PLANES_SCALE,
    PLANES_WORK, PLANES_WORK_LENGTH,
) = range(19)
PLANES_WORDS = 19


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def pool_planes(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units of planes for ``_compiled_parallel``'s pool: unit ``u`` pools planes
    ``[u * P // units, (u + 1) * P // units)`` with ``max_pool2d`` (no scale) or
    ``avg_pool2d``, in the slot's row buffers."""
    context = numba.carray(int64_pointer(c), PLANES_WORDS)
    planes, units = context[PLANES_COUNT], context[PLANES_UNITS]
    out_h, out_w = context[PLANES_OUT_HEIGHT], context[PLANES_OUT_WIDTH]
    x = numba.carray(float32_pointer(context[PLANES_X]), (planes, context[PLANES_HEIGHT], context[PLANES_WIDTH]))
    y = numba.carray(float32_pointer(context[PLANES_Y]), (planes, out_h, out_w))
    length = context[PLANES_WORK_LENGTH]
    work = numba.carray(float32_pointer(context[PLANES_WORK] + slot * length * 4), length)
    kh, kw, sh, sw = context[PLANES_KH], context[PLANES_KW], context[PLANES_SH], context[PLANES_SW]
    dh, dw, ph, pw = context[PLANES_DH], context[PLANES_DW], context[PLANES_PH], context[PLANES_PW]
    for unit in range(start, stop):
        first = unit * planes // units
        last = (unit + 1) * planes // units
        if last <= first:
            continue
        if context[PLANES_SCALE] == 0:
            max_pool2d(x, y, first, last, kh, kw, sh, sw, dh, dw, ph, pw, work)
        else:
            scale = numba.carray(float32_pointer(context[PLANES_SCALE]), (out_h, out_w))
            avg_pool2d(x, y, first, last, kh, kw, sh, sw, dh, dw, ph, pw, scale, work)
