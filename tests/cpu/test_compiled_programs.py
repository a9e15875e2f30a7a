"""Compiled programs: a capture's consecutive compiled steps (a decode step's 4-bit
products, RMS norms, attention and SwiGLU gate) run as one compiled call
(``_numba_parallel.run_program`` through ``CompiledPool.run_program``) instead of one
Python-level call each.

What must hold: the steps run in order, each job's units once; a step its serial function
refuses runs its own replay (which raises what it raises, named by its node) and the
program goes on after it; workers asleep when a step's job is published are woken and
take part; and a decoder replayed through programs gives bitwise the logits of the same
capture replayed step by step."""

from __future__ import annotations

import time
import types
from pathlib import Path

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from plugrt import threads  # noqa: E402
from plugrt.errors import KernelError  # noqa: E402
from plugrt_cpu import _capture  # noqa: E402
from plugrt_cpu.kernels import _compiled, _compiled_parallel  # noqa: E402

TINY_LLAMA = Path(__file__).resolve().parents[1] / "genai" / "assets" / "tiny_llama"


# A test step's context (int64 words): [log address, log length address, step id, units,
# alone, refuse, counts address, slots address]. Its serial function appends the step's id
# to the log; its body counts each unit it runs and the slot (thread) that ran it.
_LOG, _LENGTH, _ID, _UNITS, _ALONE, _REFUSE, _COUNTS, _SLOTS = range(8)


@pytest.fixture(scope="module")
def steps(pool):
    from plugrt_cpu.kernels._numba_parallel import ALONE, fetch_add, int64_pointer, load, pause

    @numba.cfunc(numba.int64(numba.int64), nogil=True)
    def serial(c):
        context = numba.carray(int64_pointer(c), 8)
        at = fetch_add(context[_LENGTH], 1)
        fetch_add(context[_LOG] + 8 * at, context[_ID] + 1)  # the log starts zeroed: ids + 1
        if context[_REFUSE] != 0:
            return -1
        return context[_UNITS] | ALONE if context[_ALONE] != 0 else context[_UNITS]

    @numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True)
    def count(c, start, stop, slot):
        context = numba.carray(int64_pointer(c), 8)
        for unit in range(start, stop):
            fetch_add(context[_COUNTS] + 8 * unit, 1)
            fetch_add(context[_SLOTS] + 8 * slot, 1)

    @numba.njit(nogil=True)
    def any_other(slots):
        for s in range(1, 64):
            if load(slots + 8 * s) > 0:
                return True
        return False

    @numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True)
    def meet(c, start, stop, slot):
        """As count; the caller's first unit holds it until another thread ran a unit (~2 s at most)."""
        context = numba.carray(int64_pointer(c), 8)
        for unit in range(start, stop):
            fetch_add(context[_COUNTS] + 8 * unit, 1)
            fetch_add(context[_SLOTS] + 8 * slot, 1)
            if slot == 0 and unit == 0:
                for _ in range(100_000_000):
                    if any_other(context[_SLOTS]):
                        break
                    pause()

    return types.SimpleNamespace(serial=serial, count=count, meet=meet)


class _Program:
    """A program of test steps, with everything it records."""

    def __init__(self, steps, count: int, units: int = 8, body=None) -> None:
        self.log = np.zeros(count + 4, np.int64)
        self.length = np.zeros(1, np.int64)
        self.counts = np.zeros((count, units), np.int64)
        self.slots = np.zeros((count, 64), np.int64)
        self.contexts = np.zeros((count, 8), np.int64)
        for i in range(count):
            self.contexts[i] = [
                self.log.ctypes.data, self.length.ctypes.data, i, units, 0, 0,
                self.counts[i].ctypes.data, self.slots[i].ctypes.data,
            ]
        body = (body or steps.count).address
        self.table = np.array([[steps.serial.address, body, self.contexts[i].ctypes.data] for i in range(count)], np.int64)
        self.answer = np.zeros(2, np.int64)
        self.refused: list[int] = []

    def run(self, pool) -> None:
        pool.run_program(self.table, self.answer, self.refused.append)

    def order(self) -> list[int]:
        return [int(v) - 1 for v in self.log[: int(self.length[0])]]


def test_the_steps_run_in_order_each_unit_once(pool, steps):
    program = _Program(steps, 6, units=11)
    program.run(pool)
    assert program.order() == list(range(6))
    assert program.counts.tolist() == [[1] * 11] * 6
    assert program.slots.sum(axis=1).tolist() == [11] * 6
    assert program.refused == []


def test_a_step_asked_to_run_alone_runs_on_the_caller(pool, steps):
    program = _Program(steps, 3, units=16)
    program.contexts[1, _ALONE] = 1
    program.run(pool)
    assert program.counts.tolist() == [[1] * 16] * 3
    assert program.slots[1, 0] == 16  # every unit on slot 0, the calling thread


def test_a_refused_step_runs_its_own_way_and_the_program_goes_on(pool, steps):
    program = _Program(steps, 5)
    program.contexts[2, _REFUSE] = 1
    program.run(pool)
    assert program.refused == [2]
    assert program.order() == [0, 1, 2, 3, 4]  # step 2's serial ran (and refused), then 3 and 4
    assert program.counts[2].sum() == 0  # a refused step's job does not run
    assert program.counts[[0, 1, 3, 4]].tolist() == [[1] * 8] * 4


def test_workers_asleep_when_a_job_is_published_are_woken_and_take_part(pool, steps):
    """The first unit of each step's job waits until another thread ran a unit: each step
    ends early only if a worker took part, the first one after the workers fell asleep."""
    if threads.threads_for(threads.PARALLEL_MIN_WORK) < 2:
        pytest.skip("one usable core (or the others busy): no worker takes part")
    for _ in range(3):
        time.sleep(0.01)  # longer than the workers' spin: they sleep on their queues
        program = _Program(steps, 3, body=steps.meet)
        started = time.perf_counter()
        program.run(pool)
        assert program.counts.tolist() == [[1] * 8] * 3
        assert all(np.count_nonzero(row) >= 2 for row in program.slots), program.slots[:, :4]
        assert time.perf_counter() - started < 1.5


def test_a_step_refused_with_an_error_is_a_kernel_error_naming_its_node(steps):
    """``_capture._Program``: a step whose compiled function refuses runs its replay; what
    that raises comes out as a KernelError naming the step's node."""
    pool = _compiled_parallel.compiled_pool()
    if pool is None:
        pytest.skip("no compiled pool")
    log, length = np.zeros(4, np.int64), np.zeros(1, np.int64)
    contexts = [np.array([log.ctypes.data, length.ctypes.data, i, 0, 0, int(i == 1), 0, 0], np.int64) for i in range(3)]
    ran: list[str] = []

    def replay(name: str, context: np.ndarray):
        def run() -> None:
            ran.append(name)
            if name == "b":
                raise ValueError("seqlens_k do not fit the cache")

        run.program = (steps.serial.address, 0, int(context.ctypes.data))  # type: ignore[attr-defined]
        return run

    group = [(types.SimpleNamespace(name=n, op_type="GroupQueryAttention"), replay(n, c)) for n, c in zip("abc", contexts)]
    program = _capture._Program(group, "cpu", pool)
    with pytest.raises(KernelError) as raised:
        program()
    assert raised.value.node == "b" and raised.value.op_type == "GroupQueryAttention"
    assert "seqlens_k do not fit" in str(raised.value)
    assert ran == ["b"]  # the compiled steps ran without their replays; "c" not after the error


def test_attention_step_refuses_what_the_replay_raises_for():
    """Lengths outside the cache and rotary positions past cos/sin's rows: -1, before any
    array but the lengths is touched (the replay then raises its ValueError)."""
    loops = _compiled.compiled_module("_numba_decode") or _compiled._LOADER.load("_numba_decode")
    if loops is None:
        pytest.skip("numba cannot load here")
    lengths, starts = np.zeros(1, np.int64), np.zeros(1, np.int64)
    seqlens, totals = np.zeros(1, np.int32), np.zeros(1, np.int32)
    context = np.zeros(loops.ATT_STEP_WORDS, np.int64)
    for word, value in (
        (loops.ATT_LENGTHS, lengths.ctypes.data), (loops.ATT_STARTS, starts.ctypes.data),
        (loops.ATT_SEQLENS, seqlens.ctypes.data), (loops.ATT_TOTALS, totals.ctypes.data),
        (loops.ATT_BATCH, 1), (loops.ATT_HEADS, 2), (loops.ATT_SEQ, 1), (loops.ATT_SIZE, 8),
        (loops.ATT_KV_HEADS, 1), (loops.ATT_CAPACITY, 16), (loops.ATT_ROWS, 10), (loops.ATT_ROTARY, 1),
    ):
        context[word] = value
    step = loops.attention_step.ctypes
    seqlens[0], totals[0] = 16, 17  # the new token would be the cache's 17th row
    assert step(context.ctypes.data) == -1
    assert lengths.tolist() == [17]
    seqlens[0], totals[0] = 10, 11  # position 10, and cos/sin have rows 0-9
    assert step(context.ctypes.data) == -1


def _generate(model, programs: bool, monkeypatch) -> tuple[list[int], list[np.ndarray], int]:
    """24 greedy tokens after a 7-token prompt; the logits of each, and how many times a
    program ran."""
    from plugrt import genai

    monkeypatch.setattr(_capture, "_PROGRAM_MIN_STEPS", 2 if programs else 10**9)
    calls = [0]
    run = _capture._Program.__call__

    def counted(self) -> None:
        calls[0] += 1
        run(self)

    monkeypatch.setattr(_capture._Program, "__call__", counted)
    generator = genai.Generator(model, max_length=40, capture=True)
    generator.append_tokens([1, 17, 42, 99, 7, 200, 3])
    logits = []
    for _ in range(24):
        generator.generate_next_token()
        logits.append(np.array(generator.get_logits(), copy=True))
    return generator.get_sequence(), logits, calls[0]


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_a_decoder_through_programs_gives_the_step_by_step_bits(precision, monkeypatch):
    """The tiny Llama decoders (4-bit and float32) generate the same tokens with bitwise
    the same logits through programs as through the step-by-step replay of the same
    captures; the 4-bit decoder's decode steps in fact run as programs."""
    from plugrt import genai

    folder = TINY_LLAMA / precision
    if not (folder / "genai_config.json").is_file():
        pytest.skip(f"no tiny decoder at {folder}")
    if _compiled_parallel.compiled_pool() is None or not _compiled.wait_ready(120):
        pytest.skip("no compiled pool")
    tokens, logits, programs = _generate(genai.Model(folder), True, monkeypatch)
    expected_tokens, expected, none = _generate(genai.Model(folder), False, monkeypatch)
    assert none == 0
    if precision == "int4":
        assert programs >= 22, programs  # each replayed decode step (the first is captured)
    assert tokens == expected_tokens
    for step, (got, want) in enumerate(zip(logits, expected)):
        assert np.array_equal(got, want), f"token {step}: logits differ by {np.abs(got - want).max()}"
