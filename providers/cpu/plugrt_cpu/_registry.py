"""The CPU provider's kernel registry: kernels keyed on (domain, op_type, since_version)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

__all__ = [
    "PROVIDER_NAME",
    "KernelSpec",
    "KernelContext",
    "kernel",
    "kernel_builder",
    "declare_into",
    "capture_variant",
    "lookup",
    "versions",
    "registered_ops",
]

#: The CPU provider's name (here so that kernels and fusions need not import the provider).
PROVIDER_NAME = "cpu"


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One registered kernel and the metadata the provider needs to bind it.

    ``fn`` is either the kernel itself (inputs positional, ONNX attributes keyword-only
    with the spec's defaults) or, when ``builder`` is true, a function that receives a
    :class:`KernelContext` at compile time and returns the kernel callable.
    """

    domain: str
    op_type: str
    since_version: int
    fn: Callable[..., Any]
    builder: bool = False
    multi_output: bool = False
    attribute_names: frozenset[str] | None = None  # None: accepts any attribute (**kwargs)
    data_dependent: bool = False  # output shape depends on input values: never captured
    inplace: bool = False  # its into variant may be given its first input as the output
    # the compiled-loops modules (``kernels._compiled.MODULES``) it runs with: asked for when
    # a node is bound, so that they load while the session is built, not at its first run
    compiled: tuple[str, ...] = ()
    # with ``inplace``: its output has the first input's shape and dtype whatever the other
    # inputs' shapes (``Step.inplace_keeps_first``): not an elementwise op, a per-channel gate
    inplace_keeps_first: bool = False


@dataclasses.dataclass
class KernelContext:
    """What a kernel builder may look at when it prepares a kernel at compile time."""

    op_type: str
    domain: str
    opset: int
    attributes: dict[str, Any]
    num_inputs: int
    num_outputs: int
    input_dtypes: list[Any]  # numpy dtype per input, or None where unknown / absent
    constant_inputs: list[Any]  # numpy array per input when it is a constant, else None
    node: Any = None  # the onnx_ir.Node, for builders that need more
    # Compiles an onnx_ir.Graph (a subgraph attribute) once into a SubgraphRunner whose
    # ``run(inputs: list, outer: dict[str, value]) -> list`` runs it — set by the provider.
    compile_subgraph: Callable[..., Any] | None = None
    # Names of outer-scope values a subgraph reads, in the order the kernel receives
    # them after its declared inputs (implicit inputs).
    implicit_inputs: tuple[str, ...] = ()


_KERNELS: dict[tuple[str, str], list[KernelSpec]] = {}


def _normalise_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def _attribute_names(fn: Callable[..., Any]) -> frozenset[str] | None:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _register(spec: KernelSpec) -> None:
    entries = _KERNELS.setdefault((spec.domain, spec.op_type), [])
    if any(e.since_version == spec.since_version for e in entries):
        raise ValueError(
            f"kernel {spec.domain or 'ai.onnx'}::{spec.op_type} since version "
            f"{spec.since_version} is registered twice"
        )
    entries.append(spec)
    entries.sort(key=lambda e: e.since_version)


def declare_into(into: Callable[..., Any], *kernels: Callable[..., Any]) -> Callable[..., Any]:
    """Declare ``into(out, *inputs, **attributes)`` as the capture variant of ``kernels``.

    The variant writes the kernel's result into the preallocated ``out`` instead of
    returning a new array, so a captured plan replays it without allocating. A kernel
    builder declares it on the callable it returns. Returns ``into``.
    """
    if not callable(into):
        raise TypeError(f"capture variant {into!r} is not callable")
    for fn in kernels:
        # stored on the kernel itself, so that partials binding its attributes find it too
        setattr(fn, "into", into)  # noqa: B010
    return into


def capture_variant(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """The capture variant declared for kernel ``fn`` (see :func:`declare_into`), or None."""
    return getattr(fn, "into", None)


def kernel(
    op_type: str,
    *since_versions: int,
    domain: str = "",
    multi_output: bool = False,
    data_dependent: bool = False,
    inplace: bool = False,
    into: Callable[..., Any] | None = None,
    compiled: tuple[str, ...] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a plain kernel for ``op_type`` at each of ``since_versions`` (default 1).

    The function takes the node's inputs positionally (``None`` for an omitted optional
    input) and the node's attributes as keyword-only arguments. It returns one array,
    or a tuple of all its outputs when ``multi_output`` is true. ``data_dependent``: its
    output depends on input values beyond shapes (never captured). ``inplace``: its
    ``into`` variant (or ufunc) is correct when given its first input as the output.
    ``into``: the capture variant, as for :func:`declare_into`. ``compiled``: the
    compiled-loops modules it runs with, loaded from when a node is bound.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if into is not None:
            declare_into(into, fn)
        names = _attribute_names(fn)
        for version in since_versions or (1,):
            _register(
                KernelSpec(
                    _normalise_domain(domain), op_type, version, fn, False, multi_output, names, data_dependent,
                    inplace, compiled,
                )
            )
        return fn

    return decorate


def kernel_builder(
    op_type: str,
    *since_versions: int,
    domain: str = "",
    multi_output: bool = False,
    data_dependent: bool = False,
    compiled: tuple[str, ...] = (),
    inplace_keeps_first: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a builder: ``fn(ctx: KernelContext) -> kernel`` runs once at compile.
    ``compiled`` as for :func:`kernel`. ``inplace_keeps_first``: the kernel's ``into``
    variant is correct given its first input as the output, and the output always has
    that input's shape and dtype (a per-channel gate: ``KernelSpec.inplace_keeps_first``)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for version in since_versions or (1,):
            _register(
                KernelSpec(
                    _normalise_domain(domain), op_type, version, fn, True, multi_output, None, data_dependent,
                    inplace=inplace_keeps_first, compiled=compiled, inplace_keeps_first=inplace_keeps_first,
                )
            )
        return fn

    return decorate


def lookup(domain: str, op_type: str, opset: int) -> KernelSpec | None:
    """The kernel with the highest since_version at or below ``opset``, or None."""
    entries = _KERNELS.get((_normalise_domain(domain), op_type))
    if not entries:
        return None
    found = None
    for entry in entries:
        if entry.since_version <= opset:
            found = entry
        else:
            break
    return found


def versions(domain: str, op_type: str) -> list[int]:
    """The since_versions registered for an op, ascending (empty when unknown)."""
    return [e.since_version for e in _KERNELS.get((_normalise_domain(domain), op_type), [])]


def registered_ops() -> list[tuple[str, str]]:
    """Every (domain, op_type) with at least one kernel."""
    return sorted(_KERNELS)
