"""Weights shared between sessions: a store of read-only initializers keyed by content."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import os
import threading
from typing import Any, Callable, ContextManager, Hashable, Iterator, TypeVar

import numpy as np
import onnx_ir as ir

from ._dtypes import numpy_dtype
from .errors import WeightStoreError
from .ir_utils import subgraphs

__all__ = ["WeightStore", "WeightStats", "shared_transform", "share_initializers", "building"]

T = TypeVar("T")

#: Initializers smaller than this are not shared: a look-up costs more than they weigh.
MIN_SHARED_BYTES = 1024

# The store of the session being built, for providers' build-time transforms.
_BUILDING: contextvars.ContextVar["WeightStore | None"] = contextvars.ContextVar("plugrt_weight_store", default=None)


@dataclasses.dataclass
class WeightStats:
    """What a :class:`WeightStore` holds and what sharing it saved.

    ``arrays``/``bytes``: distinct initializers held. ``reused``/``bytes_reused``: times a
    session took an initializer already held instead of keeping its own copy.
    ``transforms``/``transform_bytes``: provider-prepared forms of initializers held (a
    transposed Gemm weight, a reshaped Conv weight); ``transforms_reused`` and
    ``transform_bytes_reused``: times a build took one instead of preparing it again.
    """

    arrays: int = 0
    bytes: int = 0
    reused: int = 0
    bytes_reused: int = 0
    transforms: int = 0
    transform_bytes: int = 0
    transforms_reused: int = 0
    transform_bytes_reused: int = 0


class WeightStore:
    """Initializers, and the forms providers prepare from them, shared by every session
    built with this store (``plugrt.load(path, weights=store)``,
    ``SessionBuilder().weights(store)``, or ``SessionBuilder().share_weights_with(session)``).

    Two sessions of one model (for two devices, a prefill and a decode graph, or a second
    load of the same file) then hold one copy of each weight. An initializer is matched
    by content (dtype, shape and a SHA-256 of its bytes; external data by file identity
    and range, without reading it), so it does not matter how the model was given.
    Shared arrays are read-only: no session can change another's weights. The store keeps
    what it holds alive until it is dropped or cleared.

    :meth:`add_initializer` supplies an initializer by name, like onnxruntime's
    ``SessionOptions.add_initializer``: sessions built with the store use that array (no
    copy) instead of the model's own data.
    """

    def __init__(self) -> None:
        self._arrays: dict[Hashable, np.ndarray] = {}
        self._key_of: dict[int, Hashable] = {}  # id of a held array -> its key (held arrays keep their id)
        self._transforms: dict[tuple[Hashable, Hashable], Any] = {}
        self._named: dict[str, np.ndarray] = {}
        self._lock = threading.RLock()
        self._stats = WeightStats()

    def __repr__(self) -> str:
        s = self._stats
        return f"WeightStore(arrays={s.arrays}, bytes={s.bytes}, transforms={s.transforms}, reused={s.reused})"

    def __len__(self) -> int:
        """The number of arrays held (initializers, those given with add_initializer included)."""
        return len(self._arrays)

    def stats(self) -> WeightStats:
        """A snapshot of the counters (see :class:`WeightStats`)."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def clear(self) -> None:
        """Let go of every array and prepared form held, those given with
        :meth:`add_initializer` too (sessions keep those they use); later sessions start
        afresh. The reuse counters are kept."""
        with self._lock:
            self._stats.arrays = self._stats.bytes = self._stats.transforms = self._stats.transform_bytes = 0
            self._arrays.clear()
            self._key_of.clear()
            self._transforms.clear()
            self._named.clear()

    def add_initializer(self, name: str, array: Any) -> None:
        """Use ``array`` for the initializer ``name`` in every session built with this store
        from now on (it must match the model's dtype and shape). The store keeps a read-only
        view; the caller must not write to ``array`` while sessions use it."""
        if not isinstance(name, str) or not name:
            raise WeightStoreError(f"add_initializer needs an initializer name, got {name!r}", name=str(name))
        value = np.asarray(array)
        if value.dtype == object:
            raise WeightStoreError(f"initializer {name!r}: an object array cannot be shared", name=name)
        held = _read_only(value)
        with self._lock:
            self._named[name] = held
            # its prepared forms are shared too: the store holds it, so its id is its identity
            key = ("given", name, id(held))
            self._arrays[key] = held
            self._key_of[id(held)] = key

    # -- used while sessions are built ----------------------------------------------------

    def _intern(self, name: str, tensor: ir.TensorProtocol) -> ir.TensorProtocol:
        """The tensor a session should hold for initializer ``name``: one the store already
        has with the same content, else ``tensor`` itself (now held by the store)."""
        given = self._named.get(name)
        if given is not None:
            return _as_tensor(_checked(given, tensor, name), tensor)
        if tensor.dtype == ir.DataType.STRING or tensor.nbytes < MIN_SHARED_BYTES:
            return tensor
        key = _external_key(tensor)
        with self._lock:
            if key is not None and key in self._arrays:
                return self._reuse(key, tensor)
            array = _read_only(np.asarray(tensor.numpy()))
            if key is None:
                key = _content_key(array)
                if key in self._arrays:
                    return self._reuse(key, tensor)
            self._arrays[key] = array
            self._key_of[id(array)] = key
            self._stats.arrays += 1
            self._stats.bytes += array.nbytes
            return _as_tensor(array, tensor)

    def _reuse(self, key: Hashable, tensor: ir.TensorProtocol) -> ir.TensorProtocol:
        held = self._arrays[key]
        self._stats.reused += 1
        self._stats.bytes_reused += held.nbytes
        return _as_tensor(held, tensor)

    def _source_key(self, source: Any) -> Hashable | None:
        """The content key of a source (None when unknown: then nothing can be matched)."""
        if source is None:
            return ("absent",)
        if isinstance(source, tuple):
            keys = tuple(self._source_key(s) for s in source)
            return None if any(k is None for k in keys) else keys
        key = self._key_of.get(id(source))
        if key is not None and self._arrays.get(key) is source:
            return key
        if isinstance(source, np.ndarray) and source.dtype != object and source.nbytes < MIN_SHARED_BYTES:
            return _content_key(source)  # too small for the store to hold, cheap to hash here
        return None

    def _transform(self, source: Any, transform: Hashable, make: Callable[[], T]) -> T:
        key = self._source_key(source)
        if key is None:
            return make()
        with self._lock:
            held = self._transforms.get((key, transform))
            if held is not None:
                self._stats.transforms_reused += 1
                self._stats.transform_bytes_reused += _nbytes(held, source)
                return held
            made = make()
            _freeze(made)
            self._transforms[(key, transform)] = made
            self._stats.transforms += 1
            self._stats.transform_bytes += _nbytes(made, source)
            return made

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Make this the store that :func:`shared_transform` uses, for one session's build."""
        token = _BUILDING.set(self)
        try:
            yield
        finally:
            _BUILDING.reset(token)


def shared_transform(source: Any, transform: Hashable, make: Callable[[], T]) -> T:
    """``make()``, shared between the sessions of one :class:`WeightStore`.

    For providers: call it at compile time for anything prepared from a constant input
    (``source``, as the provider received it, or a tuple of them, None for an absent one).
    When the session being built has a store that holds ``source`` (initializers under
    1 KiB are matched by content), the result is kept under (``source``'s content,
    ``transform``) and every later session gets that same object instead of a new one.
    ``transform`` must name everything the result depends on besides ``source``'s content
    (the op, attributes, dtype), e.g. ``("Gemm.B", trans_b, alpha)``. Arrays in a shared
    result (it, a tuple's items, an object's attributes) are made read-only. Without a
    store this is ``make()``.
    """
    store = _BUILDING.get()
    if store is None:
        return make()
    return store._transform(source, transform, make)


def building(store: WeightStore | None) -> ContextManager[None]:
    """The context a session's plan is built in: with a store, providers' build-time
    transforms are shared through it (:func:`shared_transform`)."""
    return store.building() if store is not None else contextlib.nullcontext()


def share_initializers(model: ir.Model, store: WeightStore | None) -> WeightStore | None:
    """Point every initializer of ``model`` (subgraphs included) at the store's copy of the
    same content, adding those it does not hold yet; the model's own copies are dropped
    with its references to them. Returns ``store`` (nothing happens without one)."""
    if store is None:
        return None
    for graph in _graphs(model.graph):
        for name, value in graph.initializers.items():
            if value.const_value is not None:
                value.const_value = store._intern(name, value.const_value)
    return store


def _graphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    yield graph
    for node in ir.traversal.RecursiveGraphIterator(graph):
        yield from subgraphs(node)


def _read_only(array: np.ndarray) -> np.ndarray:
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def _freeze(made: Any) -> None:
    items = made if isinstance(made, (tuple, list)) else [made]
    for item in items:
        if isinstance(item, np.ndarray):
            item.flags.writeable = False
        elif hasattr(item, "__dict__"):
            for attribute in vars(item).values():
                if isinstance(attribute, np.ndarray):
                    attribute.flags.writeable = False


def _nbytes(made: Any, source: Any) -> int:
    """The bytes of the arrays in ``made`` that are not views of ``source`` (or of one of them)."""
    items = made if isinstance(made, (tuple, list)) else [made]
    arrays = []
    total = 0
    for item in items:
        if isinstance(item, np.ndarray):
            arrays.append(item)
        elif isinstance(getattr(item, "nbytes", None), int):
            total += item.nbytes  # an array of another library (device memory)
        elif hasattr(item, "__dict__"):
            arrays.extend(a for a in vars(item).values() if isinstance(a, np.ndarray))
    sources = [s for s in (source if isinstance(source, tuple) else (source,)) if isinstance(s, np.ndarray)]
    return total + sum(a.nbytes for a in arrays if not any(np.may_share_memory(a, s) for s in sources))


def _content_key(array: np.ndarray) -> Hashable:
    data = np.ascontiguousarray(array)
    digest = hashlib.sha256(data.reshape(-1).view(np.uint8).data).hexdigest()
    # the name tells apart dtypes numpy spells alike (ml_dtypes' float8 kinds are all "|V1")
    return ("content", data.dtype.str, data.dtype.name, data.shape, digest)


def _external_key(tensor: ir.TensorProtocol) -> Hashable | None:
    """The identity of an external tensor's bytes (file, range, modification time), or
    None for a tensor held in memory."""
    if not isinstance(tensor, ir.ExternalTensor):
        return None
    try:
        info = os.stat(tensor.path)
    except OSError:
        return None
    shape = tuple(d if isinstance(d, int) else -1 for d in tensor.shape)
    return ("file", info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, tensor.offset, tensor.length,
            int(tensor.dtype), shape)


def _checked(given: np.ndarray, tensor: ir.TensorProtocol, name: str) -> np.ndarray:
    shape = tuple(int(d) if isinstance(d, int) else -1 for d in tensor.shape)
    try:
        dtype = numpy_dtype(int(tensor.dtype))
    except ValueError:
        dtype = None
    if given.shape != shape or (dtype is not None and given.dtype != dtype):
        raise WeightStoreError(
            f"initializer {name!r} given with add_initializer has dtype {given.dtype} and shape "
            f"{list(given.shape)}, but the model's is {dtype} {list(shape)}; pass an array of the model's",
            name=name,
        )
    return given


def _as_tensor(array: np.ndarray, like: ir.TensorProtocol) -> ir.TensorProtocol:
    return ir.Tensor(array, dtype=like.dtype, name=like.name, doc_string=like.doc_string)


def adopt_session(session: Any) -> WeightStore:
    """``session``'s store; one is made for a session built without, holding the arrays its
    model already has (no copy: the store takes the same read-only arrays)."""
    store: WeightStore | None = session.weights
    if store is None:
        store = WeightStore()
        share_initializers(session.model, store)
        session.weights = store
    return store
