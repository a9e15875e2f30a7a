"""Graphs for plain runs: ``run()`` records a capture per input signature on its second
sight and replays it afterwards, checked, bounded, switchable, counted and thread-safe."""

from __future__ import annotations

import threading
import tracemalloc
import types

import numpy as np
import pytest

import plugrt
from plugrt.conformance.light_models import light_models
from plugrt.errors import InvalidOptionValueError, ReplayStreamError
from plugrt.hookspecs import hookimpl

from device.fake_device import FakeDevice
from helpers import NONZERO_MIDDLE, model_bytes

MLP = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    mlp (float[N, 4] x) => (float[N, 3] y, float[N, 3] r) <float[4, 3] w = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, float[3] b = {0.5, -1, 2}> {
        h = MatMul(x, w)
        a = Add(h, b)
        r = Relu(a)
        y = Softmax <axis = -1> (r)
    }
    """
)
W = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
B = np.array([0.5, -1, 2], np.float32)


def _mlp_expected(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, r) of MLP, in independent numpy."""
    r = np.maximum(x @ W + B, 0)
    e = np.exp(r - r.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True), r


def _x(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 4)).astype(np.float32)


class _Count:
    """What a GraphDevice counts while entered (its ``count_allocations``)."""

    def __init__(self, active: list) -> None:
        self._active, self.count, self.bytes = active, 0, 0

    def __enter__(self) -> "_Count":
        self._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._active.remove(self)


class GraphDevice(FakeDevice):
    """The fake device (its own memory, a capture that replays into buffers), saying its
    captures beat eager runs, counting the device arrays it makes during a replay and
    reporting a stream error when told to. ``skew`` makes every replay add it to each
    output (a capture that is wrong); ``tolerance`` is its ``replay_tolerance``."""

    name = "graphdevice"
    capture_plain_runs = True

    def __init__(self, *, skew: float = 0.0, tolerance: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.skew = skew
        self.error = ""
        self.replays = 0  # replay callables run
        self.counting: list[_Count] = []
        if tolerance is not None:
            self.replay_tolerance = tolerance

    def _wrap(self, data: np.ndarray):
        for counter in self.counting:
            counter.count += 1
            counter.bytes += data.nbytes
        return super()._wrap(data)

    def count_allocations(self) -> _Count:
        return _Count(self.counting)

    def stream_error(self) -> str:
        return self.error

    def capture(self, compiled, ctx):
        captured = super().capture(compiled, ctx)
        captured.runs = [self._counted(run) for run in captured.runs]
        return captured

    def _counted(self, run):
        outs = run.args[1]  # functools.partial(_replay_into, kernel, outs, inputs, multi)

        def replay() -> None:
            run()
            self.replays += 1
            for out in outs:
                if out is not None and self.skew:
                    out += np.asarray(self.skew, out.dtype)

        return replay


def _registry(*providers) -> plugrt.ProviderRegistry:
    from plugrt_cpu import CPUProvider

    plugin = types.SimpleNamespace(plugrt_providers=hookimpl(lambda: [*providers, CPUProvider()]))
    return plugrt.ProviderRegistry(entry_points=[], plugins=[plugin], disabled=())


def _session(device: GraphDevice | None = None, model: bytes = MLP, **options) -> plugrt.Session:
    device = device if device is not None else GraphDevice()
    return plugrt.load(model, providers=[device.name, "cpu"], registry=_registry(device), **options)


def _graph_counts(session) -> tuple[int, int, int, int]:
    stats = session.stats()
    return stats.graph_hits, stats.graph_misses, stats.graph_captures, stats.graph_evictions


# -- recording and replaying --------------------------------------------------------------


def test_the_second_run_records_a_graph_and_the_third_replays_it():
    device = GraphDevice()
    session = _session(device)
    assert session.placement.nodes_per_provider.get("graphdevice") == 4
    x = _x(2)
    expected_y, expected_r = _mlp_expected(x)
    first = session.run({"x": x})
    assert _graph_counts(session) == (0, 1, 0, 0) and device.replays == 0
    second = session.run({"x": x})
    assert _graph_counts(session) == (0, 2, 1, 0)
    assert device.replays == 4  # the check at capture replayed each of the 4 steps once
    third = session.run({"x": x})
    assert _graph_counts(session) == (1, 2, 1, 0) and device.replays == 8
    for result in (first, second, third):
        np.testing.assert_allclose(result["y"], expected_y, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(result["r"], expected_r, rtol=1e-6, atol=1e-6)
    assert third["y"].tobytes() == first["y"].tobytes() and third["r"].tobytes() == first["r"].tobytes()
    assert session.graph_signatures == ["run(x: float32[2, 4])"]


def test_replayed_outputs_belong_to_the_caller_and_feeds_are_copied_in():
    session = _session()
    x = _x(2)
    session.run({"x": x})
    session.run({"x": x})
    kept = session.run({"x": x})
    other = _x(2, seed=1)
    later = session.run({"x": other})  # the same signature: replayed on the new values
    assert session.stats().graph_hits == 2
    np.testing.assert_allclose(kept["y"], _mlp_expected(x)[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(later["y"], _mlp_expected(other)[0], rtol=1e-6, atol=1e-7)
    kept["y"][:] = -1  # the caller may write to what it got; the next replay is not affected
    np.testing.assert_allclose(session.run({"x": x})["y"], _mlp_expected(x)[0], rtol=1e-6, atol=1e-7)


def test_output_names_and_run_list_are_served_by_the_graph():
    session = _session()
    x = _x(3)
    session.run({"x": x})
    session.run({"x": x})
    only_r = session.run({"x": x}, ["r"])
    listed = session.run_list(["r", "y"], {"x": x})
    assert list(only_r) == ["r"] and session.stats().graph_hits == 2
    np.testing.assert_allclose(only_r["r"], _mlp_expected(x)[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(listed[1], _mlp_expected(x)[0], rtol=1e-6, atol=1e-7)


def test_a_new_shape_is_recorded_on_its_own_second_run():
    session = _session()
    small, large = _x(1), _x(5)
    for _ in range(3):
        session.run({"x": small})
    assert _graph_counts(session)[:3] == (1, 2, 1)
    first_large = session.run({"x": large})
    assert _graph_counts(session)[:3] == (1, 3, 1)  # seen once: eager, nothing recorded
    session.run({"x": large})
    replayed = session.run({"x": large})
    assert _graph_counts(session)[:3] == (2, 4, 2)
    assert sorted(session.graph_signatures) == ["run(x: float32[1, 4])", "run(x: float32[5, 4])"]
    np.testing.assert_allclose(replayed["y"], _mlp_expected(large)[0], rtol=1e-6, atol=1e-7)
    assert replayed["y"].tobytes() == first_large["y"].tobytes()


def test_at_most_max_graphs_are_kept_the_least_recently_used_dropped():
    session = _session(max_graphs=2)
    for rows in (1, 2, 3):  # three signatures, each recorded on its second run
        session.run({"x": _x(rows)})
        session.run({"x": _x(rows)})
    assert session.stats().graph_captures == 3 and session.stats().graph_evictions == 1
    assert session.graph_signatures == ["run(x: float32[2, 4])", "run(x: float32[3, 4])"]
    session.run({"x": _x(2)})  # replayed: now the most recently used
    again = session.run({"x": _x(1)})  # evicted earlier, seen before: recorded again at once
    np.testing.assert_allclose(again["y"], _mlp_expected(_x(1))[0], rtol=1e-6, atol=1e-7)
    stats = session.stats()
    assert (stats.graph_captures, stats.graph_evictions) == (4, 2)
    assert session.graph_signatures == ["run(x: float32[2, 4])", "run(x: float32[1, 4])"]


# -- switching them ------------------------------------------------------------------------


@pytest.mark.parametrize("off", [False, "off", "false", "0"])
def test_graphs_off_runs_every_run_eagerly(off):
    device = GraphDevice()
    session = _session(device, graphs=off)
    x = _x(2)
    for _ in range(4):
        np.testing.assert_allclose(session.run({"x": x})["y"], _mlp_expected(x)[0], rtol=1e-6, atol=1e-7)
    assert _graph_counts(session) == (0, 0, 0, 0) and device.replays == 0
    assert session.stats().runs == 4 and session.graph_signatures == []


def test_the_cpu_provider_runs_eagerly_unless_graphs_are_asked_for():
    x = _x(2)
    auto = plugrt.load(MLP, device="cpu")
    for _ in range(3):
        auto.run({"x": x})
    assert _graph_counts(auto) == (0, 0, 0, 0) and auto.stats().runs == 3
    on = plugrt.load(MLP, device="cpu", graphs=True)
    results = [on.run({"x": x}) for _ in range(3)]
    assert _graph_counts(on) == (1, 2, 1, 0)
    for result in results:
        np.testing.assert_allclose(result["y"], _mlp_expected(x)[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "options",
    [{"graphs": "sometimes"}, {"graphs": 2}, {"graphs": None}, {"max_graphs": 0}, {"max_graphs": True}, {"max_graphs": 2.5}],
)
def test_bad_graph_options_are_typed_errors_naming_the_option(options):
    with pytest.raises(InvalidOptionValueError) as info:
        plugrt.load(MLP, device="cpu", **options)
    assert info.value.key == next(iter(options))


def test_a_profiling_session_runs_eagerly():
    session = _session(profiling=True)
    for _ in range(3):
        session.run({"x": _x(2)})
    assert session.stats().graph_hits == 0
    assert any(e.get("cat") == "Node" for e in session.profile())


# -- checked at capture ----------------------------------------------------------------------


def test_a_replay_that_differs_from_the_eager_run_is_refused_and_the_signature_stays_eager():
    device = GraphDevice(skew=1e-3)
    session = _session(device)
    x = _x(2)
    results = [session.run({"x": x}) for _ in range(4)]
    stats = session.stats()
    assert (stats.graph_hits, stats.graph_captures) == (0, 0)
    [(reason, count)] = stats.graph_refusals.items()
    assert count == 1 and "differed from the eager run" in reason and "y" in reason
    assert session.graph_signatures == []
    replays = device.replays
    session.run({"x": x})
    assert device.replays == replays  # refused once: never recorded again
    for result in results:  # every run was eager and right
        np.testing.assert_allclose(result["y"], _mlp_expected(x)[0], rtol=1e-6, atol=1e-7)


def test_a_difference_within_the_providers_tolerance_is_accepted():
    device = GraphDevice(skew=1e-6, tolerance=(0.0, 1e-3))
    session = _session(device)
    x = _x(2)
    for _ in range(3):
        result = session.run({"x": x})
    stats = session.stats()
    assert (stats.graph_hits, stats.graph_captures, stats.graph_refusals) == (1, 1, {})
    np.testing.assert_allclose(result["r"], _mlp_expected(x)[1], atol=1e-4)


class FailingCapture(GraphDevice):
    name = "failingcapture"

    def capture(self, compiled, ctx):
        raise RuntimeError("recording exploded")


def test_a_capture_that_raises_is_refused_and_the_run_still_returns_the_eager_outputs():
    session = _session(FailingCapture())
    x = _x(2)
    results = [session.run({"x": x}) for _ in range(3)]
    for result in results:
        np.testing.assert_allclose(result["y"], _mlp_expected(x)[0], rtol=1e-6, atol=1e-7)
    [reason] = session.stats().graph_refusals
    assert "recording exploded" in reason and session.stats().graph_hits == 0


def test_a_stream_error_after_a_replay_is_raised_and_drops_the_graph():
    device = GraphDevice()
    session = _session(device)
    x = _x(2)
    session.run({"x": x})
    session.run({"x": x})
    device.error = "an illegal memory access was encountered"
    with pytest.raises(ReplayStreamError) as info:
        session.run({"x": x})
    assert "illegal memory access" in str(info.value) and info.value.site == "run(x: float32[2, 4])"
    device.error = ""
    result = session.run({"x": x})  # the signature now runs eagerly
    np.testing.assert_allclose(result["y"], _mlp_expected(x)[0], rtol=1e-6, atol=1e-7)
    stats = session.stats()
    assert session.graph_signatures == [] and stats.capture_sites["run(x: float32[2, 4])"]["stream_errors"] == 1
    assert any("stream recorded an error" in r for r in stats.graph_refusals)


# -- seams ---------------------------------------------------------------------------------------


def _nonzero_expected(x: np.ndarray) -> np.ndarray:
    b = np.maximum(x, 0) ** 2
    return np.sqrt(b.reshape(-1)[np.nonzero(b)[0]])


def test_a_data_dependent_seam_falls_back_to_an_eager_run_when_its_shape_changes():
    session = plugrt.load(NONZERO_MIDDLE, device="cpu", optimization="none", graphs=True)
    x = np.arange(16, dtype=np.float32).reshape(4, 4) - 6
    for _ in range(3):
        np.testing.assert_allclose(session.run({"x": x})["y"], _nonzero_expected(x), rtol=1e-6)
    assert session.stats().graph_hits == 1
    fewer = np.where(x > 5, x, -1).astype(np.float32)  # same signature, fewer non-zeros
    np.testing.assert_allclose(session.run({"x": fewer})["y"], _nonzero_expected(fewer), rtol=1e-6)
    stats = session.stats()
    assert stats.graph_hits == 1 and sum(stats.graph_fallbacks.values()) == 1
    assert "NonZero" in next(iter(stats.graph_fallbacks))


def test_non_tensor_feeds_run_eagerly():
    session = plugrt.load(MLP, device="cpu", graphs=True)
    rows = [[0.5, -1.0, 2.0, 0.25]]
    for _ in range(3):
        result = session.run({"x": np.asarray(rows, np.float32).tolist()})
    np.testing.assert_allclose(result["y"], _mlp_expected(np.asarray(rows, np.float32))[0], rtol=1e-6)
    assert _graph_counts(session) == (0, 0, 0, 0)


# -- threads -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["graphdevice", "cpu"])
def test_threads_sharing_a_session_each_get_their_own_right_outputs(provider):
    session = _session() if provider == "graphdevice" else plugrt.load(MLP, device="cpu", graphs=True)
    failures: list[str] = []
    runs_per_thread, threads = 40, 6
    start = threading.Barrier(threads)

    def work(seed: int) -> None:
        start.wait()
        for i in range(runs_per_thread):
            x = _x(2, seed=seed * 1000 + i)
            y = session.run({"x": x})["y"]
            if not np.allclose(y, _mlp_expected(x)[0], rtol=1e-5, atol=1e-7):
                failures.append(f"thread {seed} run {i}")

    pool = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert failures == []
    stats = session.stats()
    assert stats.graph_hits + stats.graph_misses == runs_per_thread * threads
    assert stats.graph_captures == 1 and stats.graph_hits > 0


# -- allocations during replays ------------------------------------------------------------------------


def test_replays_on_the_fake_device_allocate_no_device_arrays_and_eager_runs_do():
    device = GraphDevice()
    session = _session(device)
    x = _x(2)
    for _ in range(4):
        session.run({"x": x})
    site = session.capture_stats.sites["run(x: float32[2, 4])"]
    assert (site.replays, site.allocations, site.last_allocations) == (3, 0, 0)  # the check and 2 hits
    eager_session = _session(device, graphs=False)
    with device.count_allocations() as eager:  # the counter itself sees an eager run's arrays
        eager_session.run({"x": x})
    assert eager.count == 5  # the upload of x and one array per node


ELEMENTWISE = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    chain (float[N, 64] x, float[N, 64] y) => (float[N, 64] z) {
        a = Add(x, y)
        b = Relu(a)
        c = Mul(b, x)
        d = Sub(c, y)
        z = Abs(d)
    }
    """
)


def _traced_peak(fn) -> int:
    """Bytes ``fn`` allocated at its peak, as tracemalloc sees them (numpy reports every
    array's memory to it)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_replays_on_the_cpu_provider_allocate_nothing_where_its_kernels_make_no_temporaries():
    session = plugrt.load(ELEMENTWISE, device="cpu", graphs=True)
    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal((1024, 64)).astype(np.float32) for _ in range(2))
    for _ in range(4):
        z = session.run({"x": x, "y": y})["z"]
    np.testing.assert_allclose(z, np.abs(np.maximum(x + y, 0) * x - y), rtol=1e-6)
    [site] = session.capture_stats.sites.values()
    assert (site.replays, site.allocations, site.bytes_allocated) == (3, 0, 0)
    # independently of the provider's counter: every tensor here is 256 KiB, and a replay's
    # peak of traced memory stays under 16 KiB (Python's own objects), so it made none
    session.try_capture({"x": x, "y": y})
    session.replay({"x": x, "y": y}, copy_outputs=False)
    assert _traced_peak(lambda: session.replay({"x": x, "y": y}, copy_outputs=False)) < 16 * 1024
    assert session.capture_stats.sites["default"].allocations == 0
    assert _traced_peak(lambda: session.run({"x": x, "y": y}, ["z"])) > 256 * 1024  # an eager run's arrays are seen


def test_the_cpu_count_of_a_light_models_replay_agrees_with_tracemalloc():
    """The convolutions' packed windows are made on every call, captured or not: the
    provider counts them (measured when the capture ran each step), and what tracemalloc
    sees a replay allocate at its peak is no more than that sum."""
    model = {m.name: m for m in light_models()}["squeezenet"]
    session = plugrt.load(model.path, device="cpu", graphs=True)
    for _ in range(3):
        session.run(model.inputs)
    [(name, site)] = session.capture_stats.sites.items()
    assert name.startswith("run(") and site.replays == 2
    per_replay = site.bytes_allocated // site.replays
    assert site.allocations == 2 * site.last_allocations and site.last_allocations > 0
    session.try_capture(model.inputs)
    session.replay(model.inputs, copy_outputs=False)
    peak = _traced_peak(lambda: session.replay(model.inputs, copy_outputs=False))
    assert 1024 < peak <= per_replay + 16 * 1024, (peak, per_replay)


def test_an_eager_seam_counts_the_arrays_it_makes_on_every_replay():
    session = plugrt.load(NONZERO_MIDDLE, device="cpu", optimization="none", graphs=True)
    x = np.arange(16, dtype=np.float32).reshape(4, 4) - 6
    for _ in range(3):
        session.run({"x": x})
    [site] = session.capture_stats.sites.values()
    assert site.replays == 2 and site.last_allocations >= 1 and site.allocations == 2 * site.last_allocations
    assert site.bytes_allocated > 0
