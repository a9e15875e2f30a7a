"""Run ONNX's own node test cases through plugrt and compare with their expected outputs."""

from __future__ import annotations

import dataclasses
import fnmatch
import signal
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import onnx

__all__ = ["NodeCase", "CaseResult", "iter_node_cases", "run_case", "compare_outputs", "case_ops"]


@dataclasses.dataclass
class NodeCase:
    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list[Any], list[Any]]]
    rtol: float
    atol: float

    @property
    def ops(self) -> list[tuple[str, str]]:
        return case_ops(self.model)


@dataclasses.dataclass
class CaseResult:
    name: str
    ops: list[str]
    status: str  # "passed", "failed", "unsupported", "error"
    detail: str = ""
    seconds: float = 0.0


def case_ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    return sorted({(n.domain or "", n.op_type) for n in model.graph.node})


def iter_node_cases(patterns: Sequence[str] | None = None, names: Sequence[str] | None = None) -> Iterator[NodeCase]:
    """ONNX's node cases, optionally only those whose ops match ``patterns`` (fnmatch)."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    for case in cases:
        if case.model is None:  # a case onnx describes without a model: nothing to run
            continue
        if names and not any(fnmatch.fnmatchcase(case.name, n) for n in names):
            continue
        if patterns:
            ops = [op for _, op in case_ops(case.model)]
            if not any(fnmatch.fnmatchcase(op, p) for op in ops for p in patterns):
                continue
        data_sets = [(list(inputs), list(outputs)) for inputs, outputs in case.data_sets or []]
        yield NodeCase(case.name, case.model, data_sets, case.rtol, case.atol)


def _to_numpy(value: Any) -> Any:
    if isinstance(value, onnx.TensorProto):
        return onnx.numpy_helper.to_array(value)
    if isinstance(value, onnx.SequenceProto):
        return onnx.numpy_helper.to_list(value)
    if isinstance(value, onnx.OptionalProto):
        return onnx.numpy_helper.to_optional(value)
    return value


def _compare_arrays(expected: np.ndarray, actual: Any, rtol: float, atol: float, where: str) -> None:
    if not isinstance(actual, (np.ndarray, np.generic)):
        raise AssertionError(f"{where}: expected an array, got {type(actual).__name__}")
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if expected.dtype != actual.dtype:
        # onnx stores strings as bytes or str; both spell the same text
        if not (expected.dtype.kind in "OSU" and actual.dtype.kind in "OSU"):
            raise AssertionError(f"{where}: dtype {actual.dtype}, expected {expected.dtype}")
    if expected.shape != actual.shape:
        raise AssertionError(f"{where}: shape {actual.shape}, expected {expected.shape}")
    if expected.dtype.kind in "OSU":
        e = np.vectorize(lambda s: s.decode() if isinstance(s, bytes) else s, otypes=[object])(expected) if expected.size else expected
        a = np.vectorize(lambda s: s.decode() if isinstance(s, bytes) else s, otypes=[object])(actual) if actual.size else actual
        np.testing.assert_array_equal(a, e, err_msg=where)
        return
    if expected.dtype.kind not in "fciub" or expected.dtype.itemsize < 2 and expected.dtype.kind == "f" or expected.dtype.name.startswith(("float8", "float4", "bfloat", "int4", "uint4", "int2", "uint2", "float6")):
        expected = expected.astype(np.float64 if expected.dtype.kind != "c" else np.complex128)
        actual = actual.astype(expected.dtype)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True, err_msg=where)


def compare_outputs(expected: Sequence[Any], actual: Sequence[Any], rtol: float, atol: float) -> None:
    """Raise AssertionError naming the first output that differs."""
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} outputs, expected {len(expected)}")
    for index, (exp, act) in enumerate(zip(expected, actual)):
        where = f"output {index}"
        exp = _to_numpy(exp)
        if exp is None:
            if act is not None:
                raise AssertionError(f"{where}: expected an empty optional, got {type(act).__name__}")
        elif isinstance(exp, list):
            if not isinstance(act, list):
                raise AssertionError(f"{where}: expected a sequence, got {type(act).__name__}")
            if len(act) != len(exp):
                raise AssertionError(f"{where}: sequence of {len(act)}, expected {len(exp)}")
            for j, (e, a) in enumerate(zip(exp, act)):
                _compare_arrays(np.asarray(e), a, rtol, atol, f"{where}[{j}]")
        else:
            _compare_arrays(exp, act, rtol, atol, where)


class _Timeout(Exception):
    pass


def run_case(
    case: NodeCase,
    make_session: Callable[[bytes], Any] | None = None,
    *,
    timeout: float = 60.0,
) -> CaseResult:
    """Build a session for the case's model and compare every data set's outputs."""
    from ..errors import UnsupportedOpError

    if make_session is None:
        from ..ort import InferenceSession

        make_session = InferenceSession
    ops = [op for _, op in case.ops]
    started = time.perf_counter()
    use_alarm = timeout and hasattr(signal, "SIGALRM")
    if use_alarm:
        def on_alarm(signum, frame):
            raise _Timeout()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        session = make_session(case.model.SerializeToString())
        input_names = [i.name for i in case.model.graph.input]
        for inputs, expected in case.data_sets:
            feeds = {name: _to_numpy(value) for name, value in zip(input_names, inputs)}
            actual = session.run(None, feeds)
            compare_outputs(expected, actual, case.rtol, case.atol)
        status, detail = "passed", ""
    except _Timeout:
        status, detail = "error", f"timed out after {timeout:.0f} s"
    except UnsupportedOpError as exc:
        status, detail = "unsupported", str(exc).splitlines()[0] + " — " + " ".join(str(exc).splitlines()[1:2]).strip()
    except AssertionError as exc:
        status, detail = "failed", " ".join(str(exc).split())[:400]
    except Exception as exc:  # a typed plugrt error or anything else: reported, never fatal
        status, detail = "error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return CaseResult(case.name, ops, status, detail, time.perf_counter() - started)

