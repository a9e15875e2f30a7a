"""The template's compiler: a partition becomes a Program, a Program becomes one function."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from typing import Any, Callable

import numpy as np
import onnx_ir as ir

from plugrt.provider import Partition, constant_array, node_label

from ._kernels import CLAIMED_OPS, ELEMENT_TYPE, KERNELS

__all__ = ["Instruction", "Program", "lower", "validate", "generate_source", "build_function"]

#: The register of an omitted optional input.
ABSENT = -1


@dataclasses.dataclass(frozen=True)
class Instruction:
    """``outputs = KERNELS[opcode](*inputs, **attributes)`` over numbered registers."""

    opcode: str
    inputs: tuple[int, ...]  # registers; ABSENT for an omitted optional input
    outputs: tuple[int, ...]
    attributes: dict[str, float | int] = dataclasses.field(default_factory=dict)
    node: str = ""  # the graph node it was lowered from, for errors and traces


@dataclasses.dataclass
class Program:
    """A compiled partition: what the template's "hardware" runs, and what a context saves.

    Registers ``0 .. len(input_names) - 1`` hold the step's inputs (the partition's
    non-constant inputs), in order; ``constants`` fills more registers with the weights
    the partition reads; every instruction writes fresh registers. Everything here is plain data (names, integers,
    numbers, float32 arrays), so it serialises without pickle.
    """

    input_names: list[str]
    output_names: list[str]
    output_registers: list[int]
    constants: dict[int, np.ndarray]
    instructions: list[Instruction]
    nodes: list[str]  # labels of the graph nodes this program computes


def lower(partition: Partition) -> Program:
    """Turn a partition's nodes into a Program: one instruction per node, constants
    (initializers) baked in, and the compile-time rewrites the CPU provider also does."""
    registers: dict[ir.Value, int] = {}
    constants: dict[int, np.ndarray] = {}
    inputs = [v for v in partition.inputs if constant_array(v) is None]
    for value in inputs:
        registers[value] = len(registers)
    counter = itertools.count(len(inputs))

    def add_constant(array: np.ndarray) -> int:
        register = next(counter)
        constants[register] = array
        return register

    def read(value: ir.Value | None) -> int:
        if value is None:
            return ABSENT
        if value not in registers:
            array = constant_array(value)
            if array is None:
                raise ValueError(f"value {value.name!r} is read before the partition computes it")
            registers[value] = add_constant(array)
        return registers[value]

    instructions = []
    for node in partition.nodes:
        spec = CLAIMED_OPS[node.op_type]
        attributes = {
            name: type(default)(node.attributes[name].value) if name in node.attributes else default
            for name, default in spec.attributes.items()
        }
        opcode, args, attributes = _rewrite(node.op_type, [read(v) for v in node.inputs], attributes, constants, add_constant)
        outputs = []
        for value in node.outputs:
            registers[value] = next(counter)
            outputs.append(registers[value])
        instructions.append(Instruction(opcode, tuple(args), tuple(outputs), attributes, node_label(node)))

    used = {r for instruction in instructions for r in instruction.inputs}
    return Program(
        input_names=[v.name or "" for v in inputs],
        output_names=[v.name or "" for v in partition.outputs],
        output_registers=[registers[v] for v in partition.outputs],
        constants={r: a for r, a in constants.items() if r in used},
        instructions=instructions,
        nodes=[node_label(n) for n in partition.nodes],
    )


def _rewrite(
    opcode: str,
    args: list[int],
    attributes: dict[str, Any],
    constants: dict[int, np.ndarray],
    add_constant: Callable[[np.ndarray], int],
) -> tuple[str, list[int], dict[str, Any]]:
    """Specialise an instruction on its constant inputs, as a real compiler would."""
    while args and args[-1] == ABSENT:
        args.pop()
    if opcode == "Pow":
        exponent = constants.get(args[1])
        if exponent is not None and exponent.ndim == 0 and float(exponent) == 2.0:
            return "Square", args[:1], {}  # x ** 2 (variances, norms) is much faster as a square
    if opcode == "Gemm":
        b = constants.get(args[1])
        if b is not None and b.ndim == 2:
            # Weights are laid out once at compile: B transposed into a contiguous
            # array with alpha multiplied in, so each run is one plain matmul.
            packed = np.ascontiguousarray(b.T if attributes["transB"] else b)
            if attributes["alpha"] != 1.0:
                packed = packed * np.float32(attributes["alpha"])
            args[1] = add_constant(packed)
            attributes = dict(attributes, transB=0, alpha=1.0)
        if len(args) == 3:
            c = constants.get(args[2])
            if attributes["beta"] == 0.0:
                args.pop()
            elif c is not None and attributes["beta"] != 1.0:
                args[2] = add_constant(c * np.float32(attributes["beta"]))
                attributes = dict(attributes, beta=1.0)
    return opcode, args, attributes


@functools.lru_cache(maxsize=None)
def _signature(opcode: str) -> tuple[int, int, frozenset[str]]:
    """(fewest inputs, most inputs, attribute names) the kernel of ``opcode`` accepts."""
    kernel = KERNELS[opcode]
    if isinstance(kernel, np.ufunc):
        return kernel.nin, kernel.nin, frozenset()
    parameters = inspect.signature(kernel).parameters.values()
    positional = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    required = sum(1 for p in positional if p.default is inspect.Parameter.empty)
    keywords = frozenset(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)
    return required, len(positional), keywords


def _is_register(value: Any) -> bool:
    return type(value) is int and value >= 0


def validate(program: Program) -> None:
    """Check that ``program`` is well formed (raises ValueError saying what is wrong).

    A restored program comes from a file: nothing in it runs before it passes here.
    """
    defined = set(range(len(program.input_names)))
    for register, array in program.constants.items():
        if not _is_register(register) or register in defined:
            raise ValueError(f"constant register {register!r} is invalid or defined twice")
        if not isinstance(array, np.ndarray) or array.dtype != ELEMENT_TYPE:
            raise ValueError(f"constant register {register} is not a {ELEMENT_TYPE} array")
        defined.add(register)
    for index, instruction in enumerate(program.instructions):
        where = f"instruction {index} ({instruction.opcode}, node {instruction.node!r})"
        if instruction.opcode not in KERNELS:
            raise ValueError(f"{where}: unknown opcode; known: {', '.join(sorted(KERNELS))}")
        fewest, most, attribute_names = _signature(instruction.opcode)
        if not fewest <= len(instruction.inputs) <= most:
            raise ValueError(f"{where}: takes {fewest}..{most} inputs, has {len(instruction.inputs)}")
        for register in instruction.inputs:
            if register != ABSENT and not (_is_register(register) and register in defined):
                raise ValueError(f"{where}: reads register {register!r} before it is written")
        for name, value in instruction.attributes.items():
            if name not in attribute_names or type(value) not in (int, float):
                raise ValueError(f"{where}: unexpected attribute {name}={value!r}")
        if len(instruction.outputs) != 1:
            raise ValueError(f"{where}: writes {len(instruction.outputs)} registers; every opcode writes one")
        for register in instruction.outputs:
            if not _is_register(register) or register in defined:
                raise ValueError(f"{where}: output register {register!r} is invalid or written twice")
            defined.add(register)
    if len(program.output_names) != len(program.output_registers):
        raise ValueError("output names and output registers differ in number")
    for register in program.output_registers:
        if not _is_register(register) or register not in defined or register < len(program.input_names):
            raise ValueError(f"output register {register!r} is not computed by the program")


def generate_source(program: Program) -> str:
    """The program as straight-line Python: one line per instruction, each intermediate
    deleted after its last use. Built only from validated integers, never from text in
    a saved context."""

    def name(register: int) -> str:
        if register == ABSENT:
            return "None"
        return f"c{register:d}" if register in program.constants else f"r{register:d}"

    last_use = {r: i for i, instruction in enumerate(program.instructions) for r in instruction.inputs}
    keep = set(range(len(program.input_names))) | set(program.constants) | set(program.output_registers)
    lines = [f"def run({', '.join(name(r) for r in range(len(program.input_names)))}):"]
    for index, instruction in enumerate(program.instructions):
        args = ", ".join(name(r) for r in instruction.inputs)
        lines.append(f"    {', '.join(name(r) for r in instruction.outputs)} = k{index:d}({args})")
        dead = [r for r in instruction.inputs if last_use.get(r) == index and r not in keep and r != ABSENT]
        if dead:
            lines.append(f"    del {', '.join(name(r) for r in dict.fromkeys(dead))}")
    returned = [name(r) for r in program.output_registers]
    lines.append(f"    return {', '.join(returned)}")  # several outputs: a tuple
    return "\n".join(lines) + "\n"


def build_function(program: Program, label: str = "template") -> Callable[..., Any]:
    """One Python function that runs the whole program; validates it first, so nothing
    malformed ever reaches ``exec``."""
    validate(program)
    namespace: dict[str, Any] = {"__builtins__": {}}
    for register, array in program.constants.items():
        namespace[f"c{register:d}"] = array
    for index, instruction in enumerate(program.instructions):
        kernel = KERNELS[instruction.opcode]
        namespace[f"k{index:d}"] = functools.partial(kernel, **instruction.attributes) if instruction.attributes else kernel
    exec(compile(generate_source(program), f"<{label}>", "exec"), namespace)
    return namespace["run"]
