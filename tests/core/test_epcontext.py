"""EPContext export and restore: com.microsoft::EPContext nodes dispatched by source key."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import plugrt
from plugrt.errors import (
    EpContextAmbiguousError,
    EpContextAttributeError,
    EpContextError,
    EpContextMissingPrimaryError,
    EpContextOverwriteError,
    EpContextPathError,
    EpContextSourceError,
    ModelLimitError,
)
from plugrt.registry import ProviderRegistry

from helpers import NEG_ADD, fake_entry_points

X = np.array([1, -2, 3], np.float32)


def _context_model(folder, *nodes_attrs) -> str:
    """x -> EPContext(...) -> ... -> y, one EPContext node per attribute dict."""
    nodes = []
    previous = "x"
    for index, attrs in enumerate(nodes_attrs):
        out = "y" if index == len(nodes_attrs) - 1 else f"t{index}"
        nodes.append(helper.make_node("EPContext", [previous], [out], name=f"ctx{index}", domain="com.microsoft", **attrs))
        previous = out
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    path = os.path.join(folder, "model_ctx.onnx")
    onnx.save(model, path)
    return path


def _embedded(**extra):
    return {"main_context": 1, "embed_mode": 1, "ep_cache_context": b"neg:1", "source": "ctxaccel", **extra}


@pytest.fixture
def registry(monkeypatch):
    fake_entry_points(monkeypatch, ("ctxaccel", "fake_plugins:with_context"))
    return ProviderRegistry()


def test_export_then_restore_skips_compilation(tmp_path, registry):
    source = tmp_path / "m.onnx"
    source.write_bytes(NEG_ADD)
    session = plugrt.load(source, device="ctxaccel", registry=registry, **{"ep.context_enable": 1, "ep.context_embed_mode": 1})
    assert session.context_model_path == str(tmp_path / "m_ctx.onnx")
    exported = onnx.load(session.context_model_path)
    (node,) = [n for n in exported.graph.node if n.op_type == "EPContext"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.domain == "com.microsoft"
    assert attrs["source"] == b"ctxaccel" and attrs["main_context"] == 1 and attrs["embed_mode"] == 1
    assert attrs["ep_cache_context"] == b"neg:1"
    assert {"partition_name", "ep_sdk_version", "notes"} <= set(attrs)
    restored = plugrt.load(session.context_model_path, registry=registry)
    assert [p.restored for p in restored.placement.partitions] == [True, False]
    np.testing.assert_array_equal(restored.run({"x": X})["y"], session.run({"x": X})["y"])


def test_unknown_source_key_names_the_key_and_installed_providers(tmp_path, registry):
    path = _context_model(tmp_path, _embedded(source="acme-npu"))
    with pytest.raises(EpContextSourceError) as info:
        plugrt.load(path, registry=registry)
    err = info.value
    assert err.source == "acme-npu" and err.node == "ctx0"
    assert err.installed["ctxaccel"] == ("ctxaccel",) and "cpu" in err.installed


def test_secondary_context_without_primary_is_an_error(tmp_path, registry):
    path = _context_model(tmp_path, {"main_context": 0, "source": "ctxaccel", "partition_name": "p1"})
    with pytest.raises(EpContextMissingPrimaryError) as info:
        plugrt.load(path, registry=registry)
    assert (info.value.source, info.value.node) == ("ctxaccel", "ctx0")


def test_secondary_context_takes_the_primary_blob(tmp_path, registry):
    path = _context_model(tmp_path, _embedded(), {"main_context": 0, "source": "ctxaccel", "partition_name": "p1"})
    session = plugrt.load(path, registry=registry)
    np.testing.assert_array_equal(session.run({"x": X})["y"], X)  # negated twice


def test_two_providers_claiming_one_key_is_an_error(tmp_path, monkeypatch):
    fake_entry_points(monkeypatch, ("ctxaccel", "fake_plugins:with_context"), ("ctxtwin", "fake_plugins:with_context_twin"))
    path = _context_model(tmp_path, _embedded())
    with pytest.raises(EpContextAmbiguousError) as info:
        plugrt.load(path, registry=ProviderRegistry())
    assert sorted(info.value.providers) == ["ctxaccel", "ctxtwin"] and info.value.source == "ctxaccel"


@pytest.mark.parametrize("location", ["../outside.bin", "/etc/passwd"])
def test_context_file_may_not_leave_the_model_folder(tmp_path, registry, location):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "outside.bin").write_bytes(b"neg:1")
    path = _context_model(folder, {"main_context": 1, "embed_mode": 0, "ep_cache_context": location, "source": "ctxaccel"})
    with pytest.raises(EpContextPathError) as info:
        plugrt.load(path, registry=registry)
    assert info.value.path == location and info.value.node == "ctx0"


def test_context_file_through_a_link_out_of_the_folder_is_refused(tmp_path, registry):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "outside.bin").write_bytes(b"neg:1")
    os.symlink(tmp_path / "outside.bin", folder / "blob.bin")
    path = _context_model(folder, {"main_context": 1, "embed_mode": 0, "ep_cache_context": "blob.bin", "source": "ctxaccel"})
    with pytest.raises(EpContextPathError, match="outside"):
        plugrt.load(path, registry=registry)


def test_context_file_beside_the_model_is_read(tmp_path, registry):
    (tmp_path / "blob.bin").write_bytes(b"neg:1")
    path = _context_model(tmp_path, {"main_context": 1, "embed_mode": 0, "ep_cache_context": "blob.bin", "source": "ctxaccel"})
    np.testing.assert_array_equal(plugrt.load(path, registry=registry).run({"x": X})["y"], -X)


template = pytest.importorskip("plugrt_provider_template")

PARTIAL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 8] x) => (float[N, 4] y)
<float[8, 16] w1 = {0.1, -0.2, 0.3, 0.4, -0.5, 0.6, 0.7, -0.8, 0.9, 1.0, -1.1, 1.2, 0.1, -0.2, 0.3, 0.4,
                    0.5, 0.6, -0.7, 0.8, 0.9, -1.0, 1.1, 1.2, -0.1, 0.2, 0.3, -0.4, 0.5, 0.6, 0.7, -0.8,
                    0.9, -1.0, 1.1, 1.2, 0.1, 0.2, -0.3, 0.4, 0.5, -0.6, 0.7, 0.8, -0.9, 1.0, 1.1, -1.2,
                    0.1, 0.2, 0.3, -0.4, 0.5, 0.6, -0.7, 0.8, 0.9, 1.0, -1.1, 1.2, 0.1, -0.2, 0.3, 0.4,
                    -0.5, 0.6, 0.7, 0.8, -0.9, 1.0, 1.1, 1.2, 0.1, 0.2, -0.3, 0.4, 0.5, 0.6, 0.7, -0.8,
                    0.9, 1.0, -1.1, 1.2, -0.1, 0.2, 0.3, 0.4, 0.5, -0.6, 0.7, 0.8, 0.9, 1.0, 1.1, -1.2,
                    0.1, -0.2, 0.3, 0.4, 0.5, 0.6, -0.7, 0.8, 0.9, -1.0, 1.1, 1.2, 0.1, 0.2, 0.3, -0.4,
                    0.5, 0.6, 0.7, -0.8, 0.9, 1.0, 1.1, 1.2, -0.1, 0.2, 0.3, 0.4, -0.5, 0.6, 0.7, 0.8},
 float[16] b = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7, -0.8},
 int64[1] starts = {0}, int64[1] ends = {4}, int64[1] axes = {1}>
{
    m1 = MatMul(x, w1)
    a1 = Add(m1, b)
    r1 = Relu(a1)
    s1 = Softmax <axis = -1> (r1)
    t1 = Transpose <perm = [1, 0]> (s1)
    u1 = Transpose <perm = [1, 0]> (t1)
    e1 = Exp(u1)
    h1 = Tanh(e1)
    y = Slice(h1, starts, ends, axes)
}
"""


@pytest.mark.parametrize("embed_mode", [0, 1])
def test_template_partitions_round_trip_in_a_fresh_process(tmp_path, embed_mode):
    from helpers import model_bytes

    data = model_bytes(PARTIAL)
    source = tmp_path / "partial.onnx"
    source.write_bytes(data)
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    options = {"ep.context_enable": 1, "ep.context_embed_mode": embed_mode}
    session = plugrt.load(source, device="template", **options)
    template_parts = [p for p in session.placement.partitions if p.provider == "template"]
    assert len(template_parts) >= 2
    expected = session.run({"x": x})["y"]
    np.testing.assert_allclose(expected, plugrt.load(source, device="cpu").run({"x": x})["y"], rtol=1e-6)
    bins = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".bin")
    assert len(bins) == (len(template_parts) if embed_mode == 0 else 0)
    np.save(tmp_path / "x.npy", x)
    code = (
        "import sys, numpy as np, plugrt\n"
        f"s = plugrt.load({str(tmp_path / 'partial_ctx.onnx')!r})\n"
        f"np.save({str(tmp_path / 'y.npy')!r}, s.run({{'x': np.load({str(tmp_path / 'x.npy')!r})}})['y'])\n"
        "print(sorted((p.provider, p.restored) for p in s.placement.partitions))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), expected)
    restored = eval(out.strip())
    assert [r for r in restored if r[0] == "template"] == [("template", True)] * len(template_parts)


# -- attributes of the wrong type --------------------------------------------------------------


def test_embed_mode_that_is_a_string_names_the_attribute_and_the_expected_type(tmp_path, registry):
    path = _context_model(tmp_path, _embedded(embed_mode="zero"))
    with pytest.raises(EpContextAttributeError) as info:
        plugrt.load(path, registry=registry)
    err = info.value
    assert (err.node, err.attribute, err.expected) == ("ctx0", "embed_mode", "the int 0 or 1")
    assert "'zero'" in err.actual and "string" in err.actual


def test_main_context_that_is_a_string_names_the_attribute_and_the_expected_type(tmp_path, registry):
    path = _context_model(tmp_path, _embedded(main_context="x"))
    with pytest.raises(EpContextAttributeError) as info:
        plugrt.load(path, registry=registry)
    err = info.value
    assert (err.node, err.attribute, err.expected) == ("ctx0", "main_context", "the int 0 or 1")
    assert "'x'" in err.actual


@pytest.mark.parametrize("embed_mode", [0, 1])
def test_ep_cache_context_that_is_an_int_names_the_attribute_not_a_path(tmp_path, registry, embed_mode):
    path = _context_model(tmp_path, _embedded(embed_mode=embed_mode, ep_cache_context=7))
    with pytest.raises(EpContextAttributeError) as info:
        plugrt.load(path, registry=registry)
    err = info.value
    assert (err.node, err.attribute) == ("ctx0", "ep_cache_context")
    assert err.expected.startswith("a string") and err.actual == "int 7"
    assert not isinstance(err, EpContextPathError)


# -- hostile paths and safe export -------------------------------------------------------------


def test_context_model_from_bytes_never_reads_blobs_beside_the_working_directory(tmp_path, registry, monkeypatch):
    (tmp_path / "blob.bin").write_bytes(b"neg:1")
    path = _context_model(tmp_path, {"main_context": 1, "embed_mode": 0, "ep_cache_context": "blob.bin", "source": "ctxaccel"})
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the blob sits in the working directory's parent
    with pytest.raises(EpContextPathError, match="bytes"):
        plugrt.load(open(path, "rb").read(), registry=registry)


def test_context_model_from_bytes_reads_blobs_from_the_named_context_folder(tmp_path, registry):
    (tmp_path / "blob.bin").write_bytes(b"neg:1")
    path = _context_model(tmp_path, {"main_context": 1, "embed_mode": 0, "ep_cache_context": "blob.bin", "source": "ctxaccel"})
    session = plugrt.load(open(path, "rb").read(), registry=registry, **{"ep.context_file_path": path})
    np.testing.assert_array_equal(session.run({"x": X})["y"], -X)


def test_context_blob_over_the_limit_is_refused(tmp_path, registry):
    (tmp_path / "blob.bin").write_bytes(b"neg:1")
    path = _context_model(tmp_path, {"main_context": 1, "embed_mode": 0, "ep_cache_context": "blob.bin", "source": "ctxaccel"})
    with pytest.raises(ModelLimitError) as info:
        plugrt.load(path, registry=registry, **{"limits.context_bytes": 4})
    assert info.value.limit == "context_bytes"


def test_sparse_context_blob_above_the_default_limit_is_refused_before_it_is_read(tmp_path, registry):
    with open(tmp_path / "blob.bin", "wb") as f:
        f.truncate(3 << 30)  # claims 3 GiB, occupies nothing on disk
    path = _context_model(tmp_path, {"main_context": 1, "embed_mode": 0, "ep_cache_context": "blob.bin", "source": "ctxaccel"})
    tracemalloc.start()
    try:
        with pytest.raises(ModelLimitError) as info:
            plugrt.load(path, registry=registry)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (info.value.limit, info.value.value) == ("context_bytes", 3 << 30)
    assert "limits.context_bytes" in str(info.value)
    assert peak < 64 << 20, f"{peak} bytes allocated: the blob was read"


def test_context_blob_that_is_a_fifo_is_refused_as_not_a_regular_file(tmp_path, registry):
    os.mkfifo(tmp_path / "blob.bin")
    path = _context_model(tmp_path, {"main_context": 1, "embed_mode": 0, "ep_cache_context": "blob.bin", "source": "ctxaccel"})
    with pytest.raises(EpContextPathError, match="not a regular file") as info:
        plugrt.load(path, registry=registry)
    assert "outside" not in str(info.value)


def test_export_over_the_source_model_is_refused_and_the_source_kept(tmp_path, registry):
    source = tmp_path / "m.onnx"
    source.write_bytes(NEG_ADD)
    options = {"ep.context_enable": 1, "ep.context_file_path": str(source)}
    with pytest.raises(EpContextOverwriteError, match="source model"):
        plugrt.load(source, device="ctxaccel", registry=registry, **options)
    assert source.read_bytes() == NEG_ADD


def test_export_over_an_existing_context_model_is_refused(tmp_path, registry):
    source = tmp_path / "m.onnx"
    source.write_bytes(NEG_ADD)
    (tmp_path / "m_ctx.onnx").write_bytes(b"an earlier export")
    with pytest.raises(EpContextOverwriteError, match="already exists") as info:
        plugrt.load(source, device="ctxaccel", registry=registry, **{"ep.context_enable": 1})
    assert info.value.path == str(tmp_path / "m_ctx.onnx")
    assert (tmp_path / "m_ctx.onnx").read_bytes() == b"an earlier export"


def test_failed_export_leaves_no_model_and_no_blobs(tmp_path, registry, monkeypatch):
    source = tmp_path / "m.onnx"
    source.write_bytes(NEG_ADD)

    def reject(model, *args, **kwargs):
        raise onnx.checker.ValidationError("rejected for the test")

    monkeypatch.setattr(onnx.checker, "check_model", reject)
    with pytest.raises(EpContextError, match="not valid ONNX"):
        plugrt.load(source, device="ctxaccel", registry=registry, **{"ep.context_enable": 1, "ep.context_embed_mode": 0})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(LIGHT) if f.endswith(".onnx")))
def test_light_models_export_valid_context_models(tmp_path, name):
    pytest.importorskip("plugrt_provider_template")
    source = tmp_path / name
    source.write_bytes(open(os.path.join(LIGHT, name), "rb").read())
    assert onnx.load(str(source), load_external_data=False).ir_version == 3
    session = plugrt.load(source, device="template", **{"ep.context_enable": 1, "ep.context_embed_mode": 0})
    exported = onnx.load(session.context_model_path)
    onnx.checker.check_model(exported)
    assert any(n.op_type == "EPContext" for n in exported.graph.node)
    restored = plugrt.load(session.context_model_path)
    assert any(p.restored for p in restored.placement.partitions)


def test_light_model_context_export_runs_like_the_source(tmp_path):
    pytest.importorskip("plugrt_provider_template")
    source = tmp_path / "squeezenet.onnx"
    source.write_bytes(open(os.path.join(LIGHT, "light_squeezenet.onnx"), "rb").read())
    session = plugrt.load(source, device="template", **{"ep.context_enable": 1, "ep.context_embed_mode": 0})
    (spec,) = session.inputs
    feeds = {spec.name: np.random.default_rng(0).standard_normal(spec.shape).astype(np.float32)}
    restored = plugrt.load(session.context_model_path)
    expected = plugrt.load(source, device="cpu").run(feeds)
    for name, value in restored.run(feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-6)
