"""The template's context blob: a Program as a JSON header and an .npz of its constants."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from ._program import Instruction, Program, validate

__all__ = ["FORMAT", "FORMAT_VERSION", "dumps", "loads"]

#: The first bytes of every blob, so a blob of another provider is recognised at once.
FORMAT = b"plugrt-template-program\n"
FORMAT_VERSION = 1
_LENGTH_BYTES = 8


def dumps(program: Program) -> bytes:
    """``FORMAT``, the header's length (8 bytes, little-endian), the JSON header, then an
    uncompressed .npz holding constant register N as array ``cN``."""
    header = {
        "format_version": FORMAT_VERSION,
        "input_names": program.input_names,
        "output_names": program.output_names,
        "output_registers": program.output_registers,
        "constants": sorted(program.constants),
        "instructions": [
            [i.opcode, list(i.inputs), list(i.outputs), i.attributes, i.node] for i in program.instructions
        ],
        "nodes": program.nodes,
    }
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    arrays = io.BytesIO()
    constants: dict[str, Any] = {f"c{r}": np.ascontiguousarray(a) for r, a in program.constants.items()}
    np.savez(arrays, **constants)
    return FORMAT + len(text).to_bytes(_LENGTH_BYTES, "little") + text + arrays.getvalue()


def loads(blob: bytes) -> Program:
    """The Program in ``blob``; ValueError saying what is wrong when it is not one."""
    blob = bytes(blob)
    if not blob.startswith(FORMAT):
        raise ValueError("not a template context (it does not start with the template's format tag)")
    start = len(FORMAT) + _LENGTH_BYTES
    length = int.from_bytes(blob[len(FORMAT) : start], "little")
    if start + length > len(blob):
        raise ValueError(f"truncated: the header claims {length} bytes, {len(blob) - start} remain")
    try:
        header = json.loads(blob[start : start + length].decode("utf-8"))
        version = header["format_version"]
        if version != FORMAT_VERSION:
            raise ValueError(f"format version {version!r}; this template reads version {FORMAT_VERSION}")
        with np.load(io.BytesIO(blob[start + length :]), allow_pickle=False) as arrays:
            constants = {int(r): _read_only(arrays[f"c{int(r)}"]) for r in header["constants"]}
        instructions = [
            Instruction(str(opcode), tuple(inputs), tuple(outputs), dict(attributes), str(node))
            for opcode, inputs, outputs, attributes, node in header["instructions"]
        ]
        program = Program(
            input_names=[str(n) for n in header["input_names"]],
            output_names=[str(n) for n in header["output_names"]],
            output_registers=list(header["output_registers"]),
            constants=constants,
            instructions=instructions,
            nodes=[str(n) for n in header["nodes"]],
        )
    except ValueError:
        raise
    except Exception as exc:  # a malformed header: a missing key, a wrong shape of list
        raise ValueError(f"malformed header: {type(exc).__name__}: {exc}") from exc
    validate(program)
    return program


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array
