"""Profiles: onnxruntime's Chrome-trace format, build phases, capture and replay, OpenTelemetry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import plugrt
from plugrt.cli import main
from plugrt.conformance.light_models import light_models
from plugrt.errors import OptionError

from helpers import NONZERO_MIDDLE, model_bytes

SQUEEZENET = {m.name: m for m in light_models()}["squeezenet"]
NODE_FIELDS = ("op_name", "input_type_shape", "output_type_shape", "activation_size", "parameter_size", "output_size")

X = np.arange(16, dtype=np.float32).reshape(4, 4) - 6

# the template provider claims Exp, Tanh and Neg, not Softmax or Transpose: two template
# partitions with CPU ones between them
TEMPLATE_THEN_CPU = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 8] x) => (float[8, N] y) {
        e = Exp(x)
        s = Softmax <axis = -1> (e)
        t = Transpose <perm = [1, 0]> (s)
        h = Tanh(t)
        y = Neg(h)
    }
    """
)


def _onnxruntime_profile(path: str, feeds: dict, tmp_path: Path) -> list[dict]:
    """onnxruntime's own profile of one run, graph optimisations off (node for node)."""
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "onnxruntime")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    with open(session.end_profiling(), encoding="utf-8") as f:
        return json.load(f)


def _nodes(events: list[dict]) -> dict[str, dict]:
    return {e["name"]: e["args"] for e in events if e["cat"] == "Node"}


def _named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["name"] == name]


def _profile_by_cli(tmp_path: Path, *extra: str) -> list[dict]:
    out = tmp_path / "profile.json"
    assert main(["run", SQUEEZENET.path, "--profile", str(out), *extra]) == 0
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def test_cli_profile_has_the_nodes_onnxruntime_reports_with_the_same_fields(tmp_path):
    events = _profile_by_cli(tmp_path, "--optimization", "none")
    ours = _nodes(events)
    feeds = {k: np.random.default_rng(0).random(v.shape).astype(v.dtype) for k, v in SQUEEZENET.inputs.items()}
    theirs = _nodes(_onnxruntime_profile(SQUEEZENET.path, feeds, tmp_path))
    assert len(theirs) == 105 and set(ours) == set(theirs)
    for name, args in theirs.items():
        assert {k: ours[name][k] for k in NODE_FIELDS} == {k: args[k] for k in NODE_FIELDS}, name
        assert ours[name]["provider"] == "cpu"


def test_cli_profile_is_a_valid_chrome_trace(tmp_path):
    events = _profile_by_cli(tmp_path)
    assert isinstance(events, list) and events
    for event in events:
        assert event["ph"] in ("X", "i") and isinstance(event["name"], str) and event["name"]
        assert all(isinstance(event[k], (int, float)) for k in ("ts", "pid", "tid"))
        if event["ph"] == "X":
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0
        else:
            assert event["s"] in ("t", "p", "g")
    # complete events on one thread nest or follow each other: never overlap partly
    spans = sorted((e["ts"], -e["dur"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X")
    open_ends: list[float] = []
    for start, _, end in spans:
        while open_ends and open_ends[-1] <= start + 1e-6:
            open_ends.pop()
        assert not open_ends or end <= open_ends[-1] + 1e-6, (start, end, open_ends[-1])
        open_ends.append(end)


def test_cli_profile_to_an_unwritable_path_says_so(tmp_path, capsys):
    missing = tmp_path / "no such folder" / "profile.json"
    assert main(["run", "--profile", str(missing)]) == 2
    assert re.match(r"plugrt: error: cannot write the profile to .*no such folder", capsys.readouterr().err)


def test_build_phases_are_session_spans_inside_the_session_initialization(tmp_path):
    events = _profile_by_cli(tmp_path)
    session_events = {e["name"]: e for e in events if e["cat"] == "Session"}
    (whole,) = _named(events, "session_initialization")
    for phase in ("model_loading_uri", "device_selection", "optimization", "pass:fold_constants",
                  "pass:remove_dead_nodes", "pass:name_nodes", "placement", "compile", "plan"):
        event = session_events[phase]
        assert whole["ts"] <= event["ts"] and event["ts"] + event["dur"] <= whole["ts"] + whole["dur"] + 1e-3, phase
    (compile_span,) = _named(events, "compile")
    assert compile_span["args"]["provider"] == "cpu" and compile_span["args"]["partition"]
    assert len(_named(events, "model_run")) == 1
    (run,) = _named(events, "model_run")
    nodes = [e for e in events if e["cat"] == "Node"]
    assert nodes and all(run["ts"] <= e["ts"] <= run["ts"] + run["dur"] for e in nodes)


def test_optimization_span_counts_what_the_passes_did(tmp_path):
    session = plugrt.load(SQUEEZENET.path, device="cpu", profiling=True)
    (span,) = _named(session.profile(), "optimization")
    assert span["args"]["folded"] == session.optimization_stats["folded"] > 0
    assert span["args"]["nodes_before"] == 105 and span["args"]["nodes_after"] < 105


def test_each_run_adds_a_model_run_and_its_kernels(add_relu_model):
    session = plugrt.load(add_relu_model, profiling=True, optimization="none")
    x = np.ones((3, 4), np.float32)
    for _ in range(3):
        session.run({"x": x, "y": x})
    events = session.profile()
    assert len(_named(events, "model_run")) == 3
    nodes = [e for e in events if e["cat"] == "Node"]
    assert [e["name"] for e in nodes] == ["Add_0_kernel_time", "Relu_0_kernel_time"] * 3
    assert nodes[0]["args"]["input_type_shape"] == [{"float": [3, 4]}, {"float": [3, 4]}]
    assert nodes[0]["args"]["activation_size"] == str(2 * x.nbytes) and nodes[0]["args"]["parameter_size"] == "0"


def test_warmup_is_a_span_around_its_runs(add_relu_model):
    shapes = [{"x": (2, 4), "y": (2, 4)}, {"x": (5, 4), "y": (5, 4)}]
    session = plugrt.SessionBuilder().model_bytes(add_relu_model).option("profiling", True).warmup(shapes).build()
    events = session.profile()
    (warmup,) = _named(events, "warmup")
    assert warmup["args"] == {"shape_sets": 2, "runs": 1}
    runs = _named(events, "model_run")
    assert len(runs) == 2 and all(warmup["ts"] <= r["ts"] <= warmup["ts"] + warmup["dur"] for r in runs)
    shapes_seen = [e["args"]["input_type_shape"] for e in events if e["name"] == "Add_0_kernel_time"]
    assert shapes_seen == [[{"float": [2, 4]}] * 2, [{"float": [5, 4]}] * 2]


def test_capture_and_replay_are_events_with_seams_and_fallback_reasons():
    session = plugrt.load(NONZERO_MIDDLE, optimization="none", profiling=True)
    session.try_capture({"x": X})
    session.replay({"x": X})
    fewer = np.where(X > 5, X, -1).astype(np.float32)  # fewer non-zeros than captured: eager run
    result = session.replay({"x": fewer})
    assert not result.replayed
    events = session.profile()
    (capture,) = _named(events, "capture")
    assert capture["args"]["segments"] == 2 and capture["args"]["captured"] is True
    assert len(capture["args"]["seams"]) == 1 and capture["args"]["seams"][0].startswith("NonZero_0: ")
    (seam,) = _named(events, "capture_seam")
    assert seam["args"]["node"] == "NonZero_0" and "depends on the input values" in seam["args"]["reason"]
    replays = _named(events, "replay")
    assert [r["args"]["replayed"] for r in replays] == [True, False]
    (fallback,) = _named(events, "eager_fallback")
    assert fallback["args"]["reason"] == result.reason and "NonZero_0" in result.reason
    # the eager fallback is a plain run, with its kernels, inside the replay event
    fallback_runs = [r for r in _named(events, "model_run") if replays[1]["ts"] <= r["ts"] <= replays[1]["ts"] + replays[1]["dur"]]
    assert len(fallback_runs) == 1


def test_placement_fallbacks_and_epcontext_export_and_restore_are_events(tmp_path):
    pytest.importorskip("plugrt_provider_template")
    source = tmp_path / "partial.onnx"
    source.write_bytes(TEMPLATE_THEN_CPU)
    session = plugrt.load(source, device="template", profiling=True, **{"ep.context_enable": 1})
    events = session.profile()
    fallbacks = _named(events, "fallback")
    assert fallbacks and {e["args"]["declined_by"] for e in fallbacks} == {"template"}
    assert {e["args"]["node"] for e in fallbacks} == {fb.node for fb in session.placement.fallbacks}
    assert len(_named(events, "epcontext_export")) == 1
    template_parts = [p.name for p in session.placement.partitions if p.provider == "template"]
    restored = plugrt.load(tmp_path / "partial_ctx.onnx", profiling=True).profile()
    spans = _named(restored, "epcontext_restore")
    assert sorted(e["args"]["partition"] for e in spans) == sorted(template_parts)
    assert all(e["args"]["provider"] == "template" and e["args"]["blob_bytes"] > 0 for e in spans)


def test_profiling_off_records_nothing_and_adds_no_per_node_work(add_relu_model):
    session = plugrt.load(add_relu_model, optimization="none")
    session.run({"x": np.ones((2, 4), np.float32), "y": np.ones((2, 4), np.float32)})
    # the plan is one kernel call per step, releases and the return: nothing else runs
    body = session.plan_source.splitlines()[1:]
    assert all(re.fullmatch(r"    (\w+(, \w+)*,? = k\d+\(.*\)(\[:\d+\])?|del .*|return \[.*\])", line) for line in body)
    assert sum(" = k" in line for line in body) == 2 and len(body) == 5
    with pytest.raises(OptionError):
        session.profile()


def test_a_session_built_during_a_profiled_build_stays_out_of_its_profile(add_relu_model, monkeypatch):
    import plugrt.passes

    name_nodes = plugrt.passes.name_nodes
    inner = []

    def name_nodes_and_build_another(model):
        if not inner:  # the inner build names its nodes too
            inner.append(None)
            inner[0] = plugrt.load(add_relu_model, optimization="none")  # not profiled
        return name_nodes(model)

    monkeypatch.setattr(plugrt.passes, "name_nodes", name_nodes_and_build_another)
    events = plugrt.load(add_relu_model, profiling=True, optimization="none").profile()
    assert len(inner) == 1
    assert len(_named(events, "compile")) == 1 and len(_named(events, "device_selection")) == 1


def test_profile_records_keep_shapes_not_arrays(add_relu_model):
    session = plugrt.load(add_relu_model, profiling=True, optimization="none")
    session.run({"x": np.ones((2, 4), np.float32), "y": np.ones((2, 4), np.float32)})
    records = session._plan.profile_records
    assert len(records) == 3  # two kernels and the run
    flat = [item for record in records for part in record[4:] for item in part]
    assert flat and not any(isinstance(v, np.ndarray) for t in flat for v in t)


def test_end_profiling_of_the_onnxruntime_api_writes_its_format(tmp_path, add_relu_model):
    options = plugrt.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "ort_")
    session = plugrt.InferenceSession(add_relu_model, options, providers=["CPUExecutionProvider"])
    x = np.ones((2, 4), np.float32)
    session.run(None, {"x": x, "y": x})
    with open(session.end_profiling(), encoding="utf-8") as f:
        events = json.load(f)
    nodes = [e for e in events if e["cat"] == "Node"]
    assert [e["args"]["op_name"] for e in nodes] == ["Add", "Relu"]
    assert {e["args"]["provider"] for e in nodes} == {"CPUExecutionProvider"}
    assert _named(events, "model_loading_array") and _named(events, "session_initialization")


def test_end_profiling_writes_a_json_array(tmp_path, add_relu_model):
    session = plugrt.load(add_relu_model, profiling=True)
    x = np.ones((2, 4), np.float32)
    session.run({"x": x, "y": x})
    path = session.end_profiling(tmp_path / "trace.json")
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == json.loads(json.dumps(session.profile()))


def test_start_profiling_on_a_session_built_without_it_records_per_node_events(tmp_path, add_relu_model):
    session = plugrt.load(add_relu_model)
    x = np.ones((2, 4), np.float32)
    session.run({"x": x, "y": x})  # before profiling: not in the profile
    session.start_profiling()
    session.run({"x": x, "y": x})
    with open(session.end_profiling(tmp_path / "late.json"), encoding="utf-8") as f:
        events = json.load(f)
    nodes = [e for e in events if e["cat"] == "Node"]
    assert [e["args"]["op_name"] for e in nodes] == ["Add", "Relu"]
    assert all(set(NODE_FIELDS) <= set(e["args"]) and e["args"]["provider"] == "cpu" for e in nodes)
    assert nodes[0]["args"]["input_type_shape"] == [{"float": [2, 4]}, {"float": [2, 4]}]
    assert len(_named(events, "model_run")) == 1


def test_start_profiling_records_capture_and_replay_spans(add_relu_model):
    session = plugrt.load(add_relu_model)
    session.start_profiling()
    x = np.ones((2, 4), np.float32)
    session.try_capture({"x": x, "y": x})
    session.replay({"x": x, "y": x})
    events = session.profile()
    assert len(_named(events, "capture")) == 1 and _named(events, "capture")[0]["args"]["captured"] is True
    assert [e["args"]["replayed"] for e in _named(events, "replay")] == [True]


def test_a_session_without_profiling_runs_a_plan_with_no_recording_until_started(add_relu_model):
    session = plugrt.load(add_relu_model)
    assert "_rec" not in session.plan_source
    session.start_profiling()
    assert "_rec.append" in session.plan_source


def test_end_profiling_without_profiling_says_how_to_switch_it_on(tmp_path, add_relu_model):
    session = plugrt.load(add_relu_model)
    with pytest.raises(OptionError, match=r"start_profiling\(\)") as info:
        session.end_profiling(tmp_path / "never.json")
    assert info.value.key == "profiling"
    assert not (tmp_path / "never.json").exists()


def test_end_profiling_of_the_onnxruntime_api_without_profiling_says_how_to_switch_it_on(add_relu_model):
    session = plugrt.InferenceSession(add_relu_model, providers=["CPUExecutionProvider"])
    with pytest.raises(OptionError, match="enable_profiling = True") as info:
        session.end_profiling()
    assert info.value.key == "enable_profiling"


def test_profiling_says_whether_a_session_records(add_relu_model):
    session = plugrt.load(add_relu_model)
    assert session.profiling is False
    session.start_profiling()
    assert session.profiling is True


# -- OpenTelemetry --------------------------------------------------------------------------


@pytest.fixture
def otel_spans():
    """Finished OpenTelemetry spans, from an in-memory exporter on the global provider."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider() is provider, "another tracer provider is set globally"
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


def test_spans_go_to_opentelemetry_nested_as_in_the_profile(otel_spans, add_relu_model):
    session = plugrt.load(add_relu_model, profiling=True, optimization="none")
    x = np.ones((2, 4), np.float32)
    session.run({"x": x, "y": x})
    session.profile()
    spans = {s.name: s for s in otel_spans.get_finished_spans()}
    whole = spans["session_initialization"]
    for phase in ("model_loading_array", "device_selection", "placement", "compile", "plan"):
        assert spans[phase].parent.span_id == whole.context.span_id, phase
    assert spans["compile"].attributes["plugrt.provider"] == "cpu"
    run = spans["model_run"]
    add = spans["Add_0_kernel_time"]
    assert add.parent.span_id == run.context.span_id
    assert add.attributes["plugrt.op_name"] == "Add" and add.attributes["plugrt.output_size"] == str(x.nbytes)
    assert run.start_time <= add.start_time <= add.end_time <= run.end_time
    session.profile()  # each run goes to OpenTelemetry once
    assert sum(s.name == "model_run" for s in otel_spans.get_finished_spans()) == 1


def test_without_profiling_nothing_goes_to_opentelemetry(otel_spans, add_relu_model):
    session = plugrt.load(add_relu_model)
    session.run({"x": np.ones((2, 4), np.float32), "y": np.ones((2, 4), np.float32)})
    assert otel_spans.get_finished_spans() == ()


# -- decode --------------------------------------------------------------------------------

TINY_LLAMA = Path(__file__).parents[1] / "genai" / "assets" / "tiny_llama" / "fp32"


def test_generation_is_a_gen_ai_span_with_token_counts_and_latencies(otel_spans):
    if not (TINY_LLAMA / "genai_config.json").is_file():
        pytest.skip("the tiny Llama decoder asset is missing")
    from plugrt import genai

    model = genai.Model(TINY_LLAMA, profiling=True)
    prompt = [1, 17, 42, 99, 7]
    tokens = genai.generate(model, prompt, max_length=len(prompt) + 4)
    (event,) = [e for e in model.session.profile() if e["name"].startswith("text_completion ")]
    args = event["args"]
    assert args["gen_ai.usage.input_tokens"] == len(prompt)
    assert args["gen_ai.usage.output_tokens"] == len(tokens) == 4
    assert args["gen_ai.response.finish_reasons"] == ["length"]
    first = args["gen_ai.server.time_to_first_token"]
    assert 0 < first <= event["dur"] / 1e6 + 1e-6
    assert args["plugrt.tokens_per_second"] == pytest.approx(4 / (event["dur"] / 1e6), rel=1e-3)
    runs = _named(model.session.profile(), "model_run") + _named(model.session.profile(), "replay")
    assert len(runs) >= 4  # the prefill and each decode step ran inside the span
    (span,) = [s for s in otel_spans.get_finished_spans() if s.name == event["name"]]
    assert span.attributes["gen_ai.operation.name"] == "text_completion"
    assert span.attributes["gen_ai.usage.output_tokens"] == 4
