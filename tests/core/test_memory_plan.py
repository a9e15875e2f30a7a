"""The activation memory plan: lifetimes in run order and best-fit reuse, checked against hand-computed plans."""

from __future__ import annotations

import onnx_ir as ir

from plugrt.memory_plan import dims_of, plan_graph, plan_memory

ROW = 1024 * 4  # one float32 row of 1024 values: 4096 bytes


def _graph(text: str) -> ir.Graph:
    return ir.from_onnx_text(text).graph


RELU_CHAIN = _graph(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 1024] x) => (float[N, 1024] y) <float[N, 1024] a, float[N, 1024] b, float[N, 1024] c> {
        a = Relu(x)
        b = Relu(a)
        c = Relu(b)
        y = Relu(c)
    }
    """
)


def test_a_chain_of_relus_alternates_two_buffers():
    plan = plan_graph(RELU_CHAIN, {"N": 1})
    # a -> new buffer 0; b -> new buffer 1 (a is read while b is written), then a dies;
    # c -> buffer 0 again, b dies; y -> buffer 1 again: 2 buffers, 2 reuses
    assert (plan.buffers, plan.buffers_reused) == (2, 2)
    assert plan.peak_bytes == 2 * ROW  # 8192
    assert plan.total_bytes == 4 * ROW  # 16384: a, b, c, y without reuse


def test_a_symbolic_dim_is_sized_from_the_mapping():
    plan = plan_graph(RELU_CHAIN, {"N": 3})
    # each value is 3 rows: 3 * 4096 = 12288 bytes, two buffers of them
    assert plan.peak_bytes == 2 * 3 * ROW  # 24576
    assert plan.inputs == {"x": (3, 1024)}


def test_values_with_a_dim_of_no_size_are_counted_unsized_not_guessed():
    plan = plan_graph(RELU_CHAIN, {})
    assert (plan.values, plan.unsized, plan.peak_bytes, plan.buffers) == (4, 4, 0, 0)
    assert plan.inputs == {"x": ("N", 1024)}


def test_a_diamond_keeps_the_shared_value_until_its_last_reader():
    graph = _graph(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 1024] x) => (float[1, 1024] y) <float[1, 1024] a, float[1, 1024] b, float[1, 1024] c> {
            a = Relu(x)
            b = Sigmoid(a)
            c = Tanh(a)
            y = Add(b, c)
        }
        """
    )
    plan = plan_graph(graph, {})
    # a -> buffer 0; b -> buffer 1 (a still read by Tanh); c -> buffer 2, then a dies;
    # y -> buffer 0 (freed by a), then b and c die: 3 buffers, 1 reuse
    assert (plan.buffers, plan.buffers_reused) == (3, 1)
    assert plan.peak_bytes == 3 * ROW  # 12288


def test_a_graph_output_stays_live_to_the_end():
    graph = _graph(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 1024] x) => (float[1, 1024] a, float[1, 1024] y) <float[1, 1024] b, float[1, 1024] c> {
            a = Relu(x)
            b = Relu(a)
            c = Relu(b)
            y = Relu(c)
        }
        """
    )
    plan = plan_graph(graph, {})
    # a (an output) -> buffer 0, never freed; b -> buffer 1; c -> buffer 2, b dies;
    # y -> buffer 1: 3 buffers, 1 reuse (as an intermediate, a's buffer would serve c)
    assert (plan.buffers, plan.buffers_reused) == (3, 1)
    assert plan.peak_bytes == 3 * ROW  # 12288


def test_a_freed_buffer_goes_to_the_smallest_request_that_fits():
    graph = _graph(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 1024] x) => (float[1, 6144] y)
          <float[1, 2048] a, float[1, 1024] b, float[1, 3072] c, float[1, 1024] d, float[1, 2048] e> {
            a = Concat <axis = 1> (x, x)
            b = Relu(x)
            c = Concat <axis = 1> (a, b)
            d = Relu(x)
            e = Concat <axis = 1> (x, x)
            y = Concat <axis = 1> (c, d, e)
        }
        """
    )
    plan = plan_graph(graph, {})
    # a 8 KiB -> buffer 0; b 4 KiB -> buffer 1; c 12 KiB -> buffer 2, then a and b die
    # (free: 8 KiB, 4 KiB); d 4 KiB -> buffer 1, the best fit (first fit would take the
    # 8 KiB one); e 8 KiB -> buffer 0; y 24 KiB -> buffer 3.
    # buffers 8 + 4 + 12 + 24 KiB = 48 KiB; all values 8 + 4 + 12 + 4 + 8 + 24 = 60 KiB
    assert (plan.buffers, plan.buffers_reused) == (4, 2)
    assert plan.peak_bytes == 48 * 1024
    assert plan.total_bytes == 60 * 1024


def test_graph_inputs_and_initializers_are_not_activations():
    graph = _graph(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 4] x) => (float[1, 4] y) <float[1, 4] w = {1.0, 2.0, 3.0, 4.0}> {
            y = Add(x, w)
        }
        """
    )
    plan = plan_graph(graph, {})
    assert (plan.values, plan.total_bytes) == (1, 16)  # y alone: 4 float32


def test_an_output_written_into_a_callers_buffer_is_not_planned():
    graph = RELU_CHAIN
    plan = plan_memory(graph, graph.inputs, graph.outputs, {"N": 1}, bound=frozenset(graph.outputs))
    # a, b, c planned as before (a -> 0, b -> 1, c -> 0); y is the caller's
    assert (plan.values, plan.buffers, plan.buffers_reused) == (3, 2, 1)


def test_a_value_read_inside_a_subgraph_lives_until_the_node_that_holds_it():
    graph = _graph(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (bool cond, float[1, 1024] x) => (float[1, 1024] y) <float[1, 1024] a, float[1, 1024] b, float[1, 1024] c> {
            a = Relu(x)
            b = Sigmoid(x)
            c = Neg(b)
            y = If(cond) <
                then_branch = t () => (float[1, 1024] ta) { ta = Identity(a) },
                else_branch = e () => (float[1, 1024] eb) { eb = Identity(c) }
            >
        }
        """
    )
    plan = plan_graph(graph, {})
    # a -> 0; b -> 1; c -> 2, b dies (had the branches' reads of a not counted, a would
    # die at once and c take its buffer); y -> 1: 3 buffers, 1 reuse
    assert (plan.buffers, plan.buffers_reused) == (3, 1)


def test_int4_values_take_half_a_byte_per_element():
    graph = _graph(
        """
        <ir_version: 10, opset_import: ["" : 21]>
        g (float[1, 1024] x, float s, int4 z) => (int4[1, 1024] q) {
            q = QuantizeLinear(x, s, z)
        }
        """
    )
    assert plan_graph(graph, {}).total_bytes == 512


def test_as_dict_gives_lists_for_shapes():
    plan = plan_graph(RELU_CHAIN, {"N": 2}).as_dict()
    assert plan["inputs"] == {"x": [2, 1024]}
    assert plan["dims"] == {"N": 2}
    assert plan["peak_bytes"] == 2 * 2 * ROW


def test_dims_of_reads_symbol_sizes_from_shapes():
    declared = [("batch", "sequence"), ("batch", 2, "past", 16)]
    assert dims_of(declared, [(1, 7), (1, 2, 5, 16)]) == {"batch": 1, "sequence": 7, "past": 5}


def test_dims_of_sizes_a_symbol_by_a_nonempty_input_before_an_empty_one():
    declared = [("batch", "past"), ("batch", "past")]
    assert dims_of(declared, [(1, 0), (1, 9)]) == {"batch": 1, "past": 9}
    assert dims_of(declared[:1], [(1, 0)]) == {"batch": 1, "past": 0}
