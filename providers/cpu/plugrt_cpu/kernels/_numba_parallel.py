"""numba-compiled jobs shared between threads without the GIL: the claim loop, the pool
workers' bounded spin, and the primitives the compiled job bodies use (atomics on an
int64 shared state, a direct call of the BLAS GEMM through its address).

Imported only through :func:`plugrt_cpu.kernels._compiled_parallel.compiled_pool`, which
returns None when numba is missing or ``PLUGRT_NUMBA=0``. Compiled code is cached on
disk (``cache=True``): addresses (the GEMM's, a body's) are arguments, never constants.

A job is a body, a C function ``void body(int64 context, int64 start, int64 stop, int64
slot)`` (a ``numba.cfunc``), run once for every unit index in ``[0, count)``: the calling
thread and pool workers claim units one at a time from a counter that also holds the
job's sequence number, so a worker that comes late to a finished job claims nothing of
the next. ``slot`` is 0 on the calling thread and ``1 + worker index`` on a worker: a
body uses it to pick its own scratch.

Why: a pool worker blocked on a lock takes 30-100 us to start on this kind of machine (a
virtual CPU halts when idle; waking it is an inter-processor interrupt through the
hypervisor), then waits for the GIL. Most of a Conv's GEMMs take 50-300 us, so a woken
worker came too late to help. A worker that spins a few hundred microseconds after its
last job, GIL-free with ``pause``, starts the next one within a microsecond: on
SqueezeNet's 1x1 Convs (16 x 128 @ 128 x 3025 and the like) two threads take 50-60% of
one thread's time where the woken worker took 80-115%.
"""

from __future__ import annotations

import platform

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "ALONE",
    "PROGRAM_WORDS",
    "STATE_WORDS",
    "WORKER_WORDS",
    "participate",
    "publish",
    "run_alone",
    "run_program",
    "transpose_vectors",
    "wait",
]

# The shared state: int64 words, each field group on its own 64-byte line.
_SEQUENCE = 0  # the last job published
_NEXT = 8  # (sequence << 32) | next unit to claim
_DONE = 16  # units finished of the current job
_BODY, _CONTEXT, _COUNT, _HELPERS = 24, 25, 26, 27  # the current job; workers below _HELPERS take part
_SPIN = 32  # pause instructions a worker spins through before it sleeps
_SIGNAL = 40  # bumped when Python jobs are queued for the workers
STATE_WORDS = 48  # then, per worker, a line: [sleeping, last sequence seen]
WORKER_WORDS = 8
_SEQUENCE_MASK = 0x7FFFFFFF
_INDEX_MASK = 0xFFFFFFFF
#: A program's step: (serial, body, context): ``serial(context)``, a C function ``int64
#: serial(int64 context)`` (0: none), answers how many units of ``body`` to run next (a
#: job as above; 0: none), with ``ALONE`` set for "on the calling thread only"; a negative
#: answer means the step cannot run here (the caller runs it its own way).
PROGRAM_WORDS = 3
ALONE = 1 << 40
_UNITS_MASK = ALONE - 1

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_BYTES = ir.IntType(8).as_pointer()


def _address(builder, value):  # type: ignore[no-untyped-def]
    return builder.inttoptr(value, _I64.as_pointer())


@intrinsic
def load(typingctx, address):  # type: ignore[no-untyped-def]
    """The int64 at ``address``, with acquire ordering (never hoisted out of a loop)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.load_atomic(_address(builder, args[0]), "acquire", 8)

    return types.int64(types.int64), codegen


@intrinsic
def store(typingctx, address, value):  # type: ignore[no-untyped-def]
    """Store the int64 ``value`` at ``address`` with release ordering."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.store_atomic(args[1], _address(builder, args[0]), "release", 8)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def fetch_add(typingctx, address, value):  # type: ignore[no-untyped-def]
    """Atomically add ``value`` to the int64 at ``address``; returns the value before."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.atomic_rmw("add", _address(builder, args[0]), args[1], "seq_cst")

    return types.int64(types.int64, types.int64), codegen


@intrinsic
def swap(typingctx, address, value):  # type: ignore[no-untyped-def]
    """Atomically replace the int64 at ``address`` (a full fence); returns the value before."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.atomic_rmw("xchg", _address(builder, args[0]), args[1], "seq_cst")

    return types.int64(types.int64, types.int64), codegen


@intrinsic
def compare_swap(typingctx, address, expected, value):  # type: ignore[no-untyped-def]
    """Replace the int64 at ``address`` with ``value`` if it holds ``expected``; returns
    the value it held."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        pair = builder.cmpxchg(_address(builder, args[0]), args[1], args[2], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return types.int64(types.int64, types.int64, types.int64), codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def pause(typingctx):  # type: ignore[no-untyped-def]
    """The x86 spin-wait hint (``pause``): a spinning thread leaves its core's sibling the
    execution units, and saves power. Nothing elsewhere (``compiled_pool`` runs only on
    x86; the other compiled modules import this one)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if _X86:
            hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(hint, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def call_body(typingctx, body, context, start, stop, slot):  # type: ignore[no-untyped-def]
    """Call the job body at address ``body``: ``body(context, start, stop, slot)``."""

    def codegen(context_, builder, signature, args):  # type: ignore[no-untyped-def]
        function = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [_I64] * 4).as_pointer())
        builder.call(function, list(args[1:]))
        return context_.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64, types.int64, types.int64), codegen


@intrinsic
def call_serial(typingctx, function, context):  # type: ignore[no-untyped-def]
    """Call a program step's C function ``int64 f(int64 context)`` at address ``function``."""

    def codegen(context_, builder, signature, args):  # type: ignore[no-untyped-def]
        target = builder.inttoptr(args[0], ir.FunctionType(_I64, [_I64]).as_pointer())
        return builder.call(target, [args[1]])

    return types.int64(types.int64, types.int64), codegen


@intrinsic
def call_void(typingctx, function):  # type: ignore[no-untyped-def]
    """Call the C function ``int f(void)`` at address ``function`` (``sched_yield``)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        target = builder.inttoptr(args[0], ir.FunctionType(_I32, []).as_pointer())
        builder.call(target, [])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


def _sgemm_intrinsic(integer: ir.IntType, transposes: bool = False):  # type: ignore[no-untyped-def]
    _NO_TRANS, _TRANS = 111, 112  # CblasNoTrans, CblasTrans

    def flag(builder, value):  # type: ignore[no-untyped-def]
        """CblasTrans where the int64 ``value`` is non-zero, else CblasNoTrans."""
        on = builder.icmp_signed("!=", value, ir.Constant(_I64, 0))
        return builder.select(on, ir.Constant(_I32, _TRANS), ir.Constant(_I32, _NO_TRANS))

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if transposes:
            target, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc = args
            flags = [flag(builder, trans_a), flag(builder, trans_b)]
        else:
            target, m, n, k, a, lda, b, ldb, c, ldc = args
            flags = [ir.Constant(_I32, _NO_TRANS), ir.Constant(_I32, _NO_TRANS)]
        signature_ = ir.FunctionType(
            ir.VoidType(), [_I32, _I32, _I32, integer, integer, integer, _F32, _BYTES, integer, _BYTES, integer, _F32, _BYTES, integer]
        )
        function = builder.inttoptr(target, signature_.as_pointer())

        def size(value):  # type: ignore[no-untyped-def]
            return value if integer.width == 64 else builder.trunc(value, integer)

        builder.call(
            function,
            [
                ir.Constant(_I32, 101),  # CblasRowMajor
                *flags,
                size(m),
                size(n),
                size(k),
                ir.Constant(_F32, 1.0),
                builder.inttoptr(a, _BYTES),
                size(lda),
                builder.inttoptr(b, _BYTES),
                size(ldb),
                ir.Constant(_F32, 0.0),
                builder.inttoptr(c, _BYTES),
                size(ldc),
            ],
        )
        return context.get_dummy_value()

    if transposes:

        @intrinsic
        def sgemm_any(typingctx, function, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc):  # type: ignore[no-untyped-def]
            """``c = op(a) @ op(b)`` through the row-major cblas_sgemm at address
            ``function``, ``op`` a transpose where ``trans_a`` / ``trans_b`` is non-zero
            (alpha 1, beta 0); matrices are addresses, sizes int64."""
            return types.void(*(types.int64,) * 12), codegen

        return sgemm_any

    @intrinsic
    def sgemm(typingctx, function, m, n, k, a, lda, b, ldb, c, ldc):  # type: ignore[no-untyped-def]
        """``c = a @ b`` through the row-major cblas_sgemm at address ``function`` (no
        transposes, alpha 1, beta 0); matrices are addresses, sizes int64."""
        return types.void(*(types.int64,) * 10), codegen

    return sgemm


sgemm64 = _sgemm_intrinsic(_I64)
sgemm32 = _sgemm_intrinsic(_I32)
sgemm_any64 = _sgemm_intrinsic(_I64, transposes=True)
sgemm_any32 = _sgemm_intrinsic(_I32, transposes=True)


def _pointer_to(kind, llvm_type, name: str):  # type: ignore[no-untyped-def]
    """An intrinsic ``name(address)``: the int64 ``address`` as a pointer to ``kind``
    (``llvm_type`` in LLVM IR), for ``numba.carray``."""

    def pointer(typingctx, address):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            return builder.inttoptr(args[0], llvm_type.as_pointer())

        return types.CPointer(kind)(types.int64), codegen

    pointer.__name__ = pointer.__qualname__ = name
    pointer.__doc__ = f"``address`` as a {kind} pointer, for ``numba.carray``."
    return intrinsic(pointer)


float32_pointer = _pointer_to(types.float32, _F32, "float32_pointer")
float64_pointer = _pointer_to(types.float64, ir.DoubleType(), "float64_pointer")  # a float in a context's words
int64_pointer = _pointer_to(types.int64, _I64, "int64_pointer")
int32_pointer = _pointer_to(types.int32, _I32, "int32_pointer")
int8_pointer = _pointer_to(types.int8, ir.IntType(8), "int8_pointer")


_W = 8  # bytes per state word


@numba.njit(types.int64(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64), nogil=True, cache=True, boundscheck=False, error_model="numpy")
def _claim(state, sequence, body, context, count, slot):  # pragma: no cover  (compiled)
    """Run units of job ``sequence`` until none is left; returns how many this thread ran."""
    tag = (sequence & _SEQUENCE_MASK) << 32
    ran = 0
    while True:
        word = load(state + _NEXT * _W)
        if word & ~_INDEX_MASK != tag or word & _INDEX_MASK >= count:
            break
        if compare_swap(state + _NEXT * _W, word, word + 1) != word:
            continue
        index = word & _INDEX_MASK
        call_body(body, context, index, index + 1, slot)
        ran += 1
    if ran:
        fetch_add(state + _DONE * _W, ran)
    return ran


@numba.njit(types.void(types.int64, types.int64), nogil=True, cache=True, boundscheck=False, error_model="numpy")
def wait(state, worker):  # pragma: no cover  (compiled)
    """A pool worker's wait: run the compiled jobs published, spinning (``pause``) up to
    the state's spin count between them; return when Python jobs were signalled or the
    spin ran out. The worker is marked sleeping on return (``publish`` then wakes it)."""
    line = state + (STATE_WORDS + WORKER_WORDS * worker) * _W
    store(line, 0)
    seen = load(line + _W)
    signal = load(state + _SIGNAL * _W)
    idle = 0
    while True:
        sequence = load(state + _SEQUENCE * _W)
        if sequence != seen:
            seen = sequence
            store(line + _W, seen)
            if worker >= load(state + _HELPERS * _W):  # its slot is beyond the job's scratch
                continue
            _claim(
                state,
                sequence,
                load(state + _BODY * _W),
                load(state + _CONTEXT * _W),
                load(state + _COUNT * _W),
                worker + 1,
            )
            idle = 0
            continue
        if load(state + _SIGNAL * _W) != signal:
            break
        idle += 1
        if idle > load(state + _SPIN * _W):
            swap(line, 1)  # then look once more: publish reads the flag after its sequence
            if load(state + _SEQUENCE * _W) != seen:
                store(line, 0)
                continue
            return
        pause()
    swap(line, 1)


@numba.njit(
    types.int64(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64, types.int64),
    nogil=True,
    cache=True,
    boundscheck=False,
    error_model="numpy",
)
def publish(state, body, context, count, spin, workers, helpers):  # pragma: no cover  (compiled)
    """Publish a job of ``count`` units for the calling thread and the first ``helpers``
    of the ``workers`` (slots 0 to ``helpers``; at most 63); returns a mask of those that
    were asleep (bit ``w`` for worker ``w``: the caller wakes them). The job's sequence
    number is then the state's first word."""
    sequence = (load(state + _SEQUENCE * _W) + 1) & _SEQUENCE_MASK
    store(state + _BODY * _W, body)
    store(state + _CONTEXT * _W, context)
    store(state + _COUNT * _W, count)
    store(state + _HELPERS * _W, helpers)
    store(state + _SPIN * _W, spin)
    store(state + _DONE * _W, 0)
    store(state + _NEXT * _W, sequence << 32)
    swap(state + _SEQUENCE * _W, sequence)  # a full fence before reading the flags
    asleep = 0
    for worker in range(min(helpers, workers)):
        if swap(state + (STATE_WORDS + WORKER_WORDS * worker) * _W, 0) == 1:
            asleep |= 1 << worker
    return asleep


@numba.njit(types.void(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64, types.int64), nogil=True, cache=True, boundscheck=False, error_model="numpy")
def participate(state, sequence, body, context, count, patience, yield_address):  # pragma: no cover  (compiled)
    """The calling thread's share of job ``sequence``: claim units until none is left,
    then wait for the units the workers hold, spinning ``patience`` pauses before it
    yields its core at each look (a worker that lost its core then gets it back sooner)."""
    _claim(state, sequence, body, context, count, 0)
    looks = 0
    while load(state + _DONE * _W) < count:
        looks += 1
        if looks > patience and yield_address != 0:
            call_void(yield_address)
        else:
            pause()


@numba.njit(types.void(types.int64, types.int64, types.int64), nogil=True, cache=True, boundscheck=False, error_model="numpy")
def run_alone(body, context, count):  # pragma: no cover  (compiled)
    """Every unit of a job on the calling thread."""
    for index in range(count):
        call_body(body, context, index, index + 1, 0)


@numba.njit(types.void(types.int64, types.int64), nogil=True, cache=True, boundscheck=False, error_model="numpy")
def spin(state, pauses):  # pragma: no cover  (compiled)
    """``pauses`` spin-wait hints (calibrates how long one takes)."""
    for _ in range(pauses):
        pause()
    load(state)


@numba.njit(types.void(types.int64), nogil=True, cache=True, boundscheck=False, error_model="numpy")
def signal(state):  # pragma: no cover  (compiled)
    """Tell spinning workers that Python jobs are queued."""
    fetch_add(state + _SIGNAL * _W, 1)


@numba.njit(
    types.int64(
        types.Array(types.int64, 2, "C", readonly=True), types.int64, types.int64, types.int64, types.int64,
        types.int64, types.int64, types.int64, types.int64[::1],
    ),
    nogil=True,
    cache=True,
    boundscheck=False,
    error_model="numpy",
)
def run_program(program, start, state, threads, spin, workers, patience, yield_address, answer):  # pragma: no cover  (compiled)
    """Steps ``start``.. of ``program`` (rows of ``PROGRAM_WORDS``) one after the other
    without returning to Python: each step's serial function, then its job's units on
    this thread and up to ``threads - 1`` of the ``workers`` (as ``publish`` and
    ``participate``). Returns the number of steps when all ran; ``-(i + 1)`` when step
    ``i``'s serial function refused (nothing of the step ran after it); or ``i`` when step
    ``i``'s job was published to workers that were asleep: ``answer`` then holds their
    mask and the job's units, and the caller wakes them, takes its share of the job
    (``participate``) and resumes at ``i + 1``."""
    for i in range(start, program.shape[0]):
        serial, body, context = program[i, 0], program[i, 1], program[i, 2]
        units = call_serial(serial, context) if serial != 0 else 0
        if units < 0:
            return -(i + 1)
        alone = (units & ALONE) != 0
        units &= _UNITS_MASK
        if body == 0 or units == 0:
            continue
        helpers = min(threads, units, 64) - 1
        if alone or helpers <= 0:
            run_alone(body, context, units)
            continue
        asleep = publish(state, body, context, units, spin, workers, helpers)
        if asleep != 0:
            answer[0] = asleep
            answer[1] = units
            return i
        participate(state, load(state + _SEQUENCE * _W), body, context, units, patience, yield_address)
    return program.shape[0]


def transpose_vectors(builder, rows):  # type: ignore[no-untyped-def]
    """The square matrix of ``rows`` (n vectors of n lanes, n a power of two) transposed
    in registers: at each level ``s`` (1, 2, 4, ...) rows ``i`` and ``i + s`` swap their
    off-diagonal s x s blocks, two two-vector shuffles a pair."""
    rows = list(rows)
    lanes = len(rows)
    order = ir.VectorType(ir.IntType(32), lanes)
    s = 1
    while s < lanes:
        for i in range(lanes):
            if i & s:
                continue
            a, b = rows[i], rows[i + s]
            low = [j if not j & s else lanes + j - s for j in range(lanes)]
            high = [j + s if not j & s else lanes + j for j in range(lanes)]
            rows[i] = builder.shuffle_vector(a, b, ir.Constant(order, low))
            rows[i + s] = builder.shuffle_vector(a, b, ir.Constant(order, high))
        s *= 2
    return rows
