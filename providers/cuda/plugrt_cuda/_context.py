"""The CUDA provider's EPContext blob: compiled kernels (cubins) for one GPU architecture
plus what decides whether they still load here (the architecture, and the NVRTC that built
them against the driver's CUDA version)."""

from __future__ import annotations

import dataclasses
import json
import struct

__all__ = ["FORMAT", "SavedContext", "dumps", "loads", "verdict", "version_text"]

FORMAT = "plugrt-cuda-context-1"
_MAGIC = b"PLUGRTCUDA\x00\x01"
_MAX_HEADER = 1 << 20


@dataclasses.dataclass
class SavedContext:
    """What a blob holds: where it was compiled, and cubins keyed by (module, dtype)."""

    arch: str
    driver_version: int
    runtime_version: int
    cupy_version: str
    cubins: dict[tuple[str, str], bytes]
    #: the NVRTC that compiled the cubins, as CUDA writes versions (13020 is 13.2); 0 when
    #: the blob does not say (written by an earlier plugrt-cuda)
    nvrtc_version: int = 0


def dumps(saved: SavedContext) -> bytes:
    entries, payload, offset = [], [], 0
    for (module, dtype), cubin in sorted(saved.cubins.items()):
        entries.append({"module": module, "dtype": dtype, "offset": offset, "size": len(cubin)})
        payload.append(cubin)
        offset += len(cubin)
    header = json.dumps(
        {
            "format": FORMAT,
            "arch": saved.arch,
            "driver_version": saved.driver_version,
            "runtime_version": saved.runtime_version,
            "cupy_version": saved.cupy_version,
            "nvrtc_version": saved.nvrtc_version,
            "cubins": entries,
        },
        sort_keys=True,
    ).encode("utf-8")
    return _MAGIC + struct.pack("<I", len(header)) + header + b"".join(payload)


def loads(blob: bytes) -> SavedContext:
    """Parse a blob; ValueError naming what is wrong when it is not one of ours or is cut short."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ValueError(f"a CUDA context is bytes, not {type(blob).__name__}")
    blob = bytes(blob)
    if not blob.startswith(_MAGIC):
        raise ValueError("not a plugrt CUDA context (bad magic bytes)")
    start = len(_MAGIC) + 4
    if len(blob) < start:
        raise ValueError("the context is cut short before its header")
    (length,) = struct.unpack("<I", blob[len(_MAGIC) : start])
    if length > _MAX_HEADER or start + length > len(blob):
        raise ValueError(f"the context header claims {length} bytes; the blob has {len(blob) - start}")
    try:
        header = json.loads(blob[start : start + length].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the context header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"context format {header.get('format') if isinstance(header, dict) else '?'!r}, expected {FORMAT!r}")
    payload = blob[start + length :]
    cubins: dict[tuple[str, str], bytes] = {}
    try:
        for entry in header["cubins"]:
            begin, size = int(entry["offset"]), int(entry["size"])
            if begin < 0 or size < 0 or begin + size > len(payload):
                raise ValueError(f"cubin {entry['module']}/{entry['dtype']} lies outside the blob")
            cubins[(str(entry["module"]), str(entry["dtype"]))] = payload[begin : begin + size]
        return SavedContext(
            str(header["arch"]), int(header["driver_version"]), int(header["runtime_version"]),
            str(header["cupy_version"]), cubins, int(header.get("nvrtc_version", 0)),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the context header lacks a field: {exc}") from exc


def verdict(saved: SavedContext, *, arch: str, driver_version: int) -> str | None:
    """None when the saved cubins load here, else why they must be recompiled.

    A cubin is machine code for one architecture; the driver loads it when the CUDA that
    built it is of a major version the driver runs (CUDA's minor-version compatibility:
    NVRTC 13.2's cubins load on a CUDA 13.0 driver). cupy's own runtime version says nothing
    about the cubins, so it is not compared."""
    if saved.arch != arch:
        return f"compiled for {saved.arch}, this GPU is {arch}"
    if not saved.nvrtc_version:
        return "the context does not say which NVRTC compiled it (written by an earlier plugrt-cuda)"
    if driver_version and saved.nvrtc_version // 1000 > driver_version // 1000:
        return (
            f"compiled by NVRTC {version_text(saved.nvrtc_version)}, and this driver runs CUDA "
            f"{version_text(driver_version)} at most"
        )
    return None


def version_text(version: int) -> str:
    """13020 -> "13.2" (CUDA's encoding of versions)."""
    return f"{version // 1000}.{version % 1000 // 10}"
