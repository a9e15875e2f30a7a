"""Token generation over a decoder session: greedy, top-k and top-p sampling, KV cache in persistent bindings.

The decoder is an ONNX model as onnxruntime-genai's model builder writes it: inputs
``input_ids``, ``attention_mask`` (optionally ``position_ids``) and one past key and value
per layer, outputs ``logits`` and the present keys and values, named as its
``genai_config.json`` says. Each layer's cache lives in one binding that is the past input
and the present output at once, with a fixed capacity of ``max_length`` tokens.

When the model shares its past and present buffers (``past_present_share_buffer`` in
``genai_config.json``: GroupQueryAttention reads the valid part of a longer past), the
cache bindings keep their full capacity and the attention mask has the fixed shape
``[1, max_length]``, its ones marking the valid positions. Every decode step then has the
same shapes, so it is captured once (slot ``genai.decode.N``) and replayed; a prompt runs
through its own slot (``genai.prefill.N``), captured for its length. A step the provider
cannot capture runs eagerly, and ``Generator.capture_use`` says why::

    model = plugrt.genai.Model("tiny_llama/fp32")          # the folder with genai_config.json
    tokens = plugrt.genai.generate(model, [1, 17, 42], max_length=32)

    generator = plugrt.genai.Generator(model, plugrt.genai.SearchOptions(do_sample=True, top_k=40, seed=0))
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import weakref
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .capture import Captured, CaptureReport
from .errors import (
    InvalidInputError,
    InvalidOptionValueError,
    ModelLoadError,
    PlugrtError,
    StaleCaptureError,
)
from .provider import NotCapturable
from .tracing import trace_generation

__all__ = ["CaptureUse", "DecoderLayout", "Model", "SearchOptions", "Generator", "generate"]

#: The element type of the KV cache bindings.
_CACHE_DTYPE = np.float32


@dataclasses.dataclass(frozen=True)
class DecoderLayout:
    """Where a decoder keeps its tensors: names, cache geometry and special tokens."""

    input_ids: str = "input_ids"
    attention_mask: str | None = "attention_mask"
    position_ids: str | None = None
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    logits: str = "logits"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"
    num_layers: int = 0
    kv_heads: int = 0
    head_size: int = 0
    context_length: int = 0
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    past_present_share_buffer: bool = False  # the past buffer may be longer than its valid part

    @classmethod
    def from_genai_config(cls, path: str | os.PathLike[str]) -> "DecoderLayout":
        """Read an onnxruntime-genai ``genai_config.json``."""
        try:
            config = json.loads(Path(path).read_text())
            model = config["model"]
            decoder = model["decoder"]
            inputs, outputs = decoder.get("inputs", {}), decoder.get("outputs", {})
            eos = model.get("eos_token_id", ())
            search = config.get("search", {})
            return cls(
                input_ids=inputs.get("input_ids", "input_ids"),
                attention_mask=inputs.get("attention_mask"),
                position_ids=inputs.get("position_ids"),
                past_key=inputs.get("past_key_names", cls.past_key),
                past_value=inputs.get("past_value_names", cls.past_value),
                logits=outputs.get("logits", "logits"),
                present_key=outputs.get("present_key_names", cls.present_key),
                present_value=outputs.get("present_value_names", cls.present_value),
                num_layers=int(decoder["num_hidden_layers"]),
                kv_heads=int(decoder["num_key_value_heads"]),
                head_size=int(decoder["head_size"]),
                context_length=int(model.get("context_length", 0)),
                vocab_size=int(model.get("vocab_size", 0)),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
                past_present_share_buffer=bool(search.get("past_present_share_buffer", False)),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"cannot read the decoder layout from {path}: {type(e).__name__}: {e}") from e

    def cache_names(self) -> list[tuple[str, str]]:
        """(past input, present output) per layer, keys then values."""
        return [
            (past % layer, present % layer)
            for layer in range(self.num_layers)
            for past, present in ((self.past_key, self.present_key), (self.past_value, self.present_value))
        ]


class Model:
    """A decoder session and its layout. ``source``: a folder holding ``genai_config.json``
    and the model it names, or a model path with ``genai_config.json`` beside it (or a
    ``layout`` given explicitly). Other keyword arguments go to :func:`plugrt.load`.

    A generator reads the logits of the last position only, so the session computes them
    there alone (the ``outputs.last_position`` option, set to the layout's logits unless
    given): a prompt step's logits are (1, 1, vocab), and its LM head multiplies one row."""

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        device: str | None = "cpu",
        layout: DecoderLayout | None = None,
        **options: Any,
    ) -> None:
        from .session import load

        path = Path(source)
        folder = path if path.is_dir() else path.parent
        model_path = path
        if path.is_dir():
            config = folder / "genai_config.json"
            filename = "model.onnx"
            if config.is_file():
                filename = json.loads(config.read_text()).get("model", {}).get("decoder", {}).get("filename", filename)
            model_path = folder / filename
        if layout is None:
            layout = DecoderLayout.from_genai_config(folder / "genai_config.json")
        self.layout = layout
        options.setdefault("outputs.last_position", (layout.logits,))
        self.session = load(model_path, device=device, **options)
        names = {info.name for info in self.session.inputs}
        missing = [n for n in (layout.input_ids, *(past for past, _ in layout.cache_names())) if n not in names]
        if missing:
            raise ModelLoadError(f"the decoder {model_path} has no input(s) {missing}; its inputs are {sorted(names)}")
        # Fixed shapes need the valid length as an input: the attention mask's content.
        self.fixed_shape_steps = layout.past_present_share_buffer and layout.attention_mask is not None
        self._free_caches: dict[int, list[_Cache]] = {}  # by capacity: caches no generator holds
        self._cache_ids = itertools.count()
        self._prompt_lengths: set[int] = set()  # lengths of the prompts run so far

    def _take_cache(self, capacity: int) -> "_Cache":
        free = self._free_caches.get(capacity)
        if free:
            return free.pop()
        return _Cache(self, capacity, next(self._cache_ids))

    def _return_cache(self, cache: "_Cache") -> None:
        self._free_caches.setdefault(cache.capacity, []).append(cache)


class _Cache:
    """One sequence's KV cache bindings, its fixed-shape attention mask and the capture
    slots recorded with them (a capture is tied to its bindings, so a cache handed to the
    next generator keeps its captures)."""

    def __init__(self, model: Model, capacity: int, number: int):
        layout = model.layout
        session = model.session
        full = (1, layout.kv_heads, capacity, layout.head_size)
        # growing steps start from an empty logical cache; fixed-shape steps see it all
        shape = full if model.fixed_shape_steps else (1, layout.kv_heads, 0, layout.head_size)
        self.capacity = capacity
        self.bindings = [
            session.allocate_binding(input=past, output=present, dtype=_CACHE_DTYPE, shape=shape, capacity=full)
            for past, present in layout.cache_names()
        ]
        self.mask = np.zeros((1, capacity), np.int64)
        self.slots = {"prefill": f"genai.prefill.{number}", "decode": f"genai.decode.{number}"}
        self.captured_lengths: dict[str, int] = {}  # slot -> input_ids length it was captured for
        self.declined: dict[str, str] = {}  # slot -> why its capture failed (not retried)
        self.reports: dict[str, CaptureReport] = {}
        weakref.finalize(self, _drop_slots, weakref.ref(session), tuple(self.slots.values()))

    def reset(self, model: Model) -> None:
        """Ready for a new sequence: nothing valid, logical shapes back to empty when they grow."""
        self.mask[:] = 0
        if not model.fixed_shape_steps:
            layout = model.layout
            for binding in self.bindings:
                binding.set_shape((1, layout.kv_heads, 0, layout.head_size))


def _cache_bytes(layout: DecoderLayout, capacity: int) -> int:
    """The bytes of one sequence's KV cache of ``capacity`` tokens (a :class:`_Cache`'s bindings)."""
    return len(layout.cache_names()) * layout.kv_heads * capacity * layout.head_size * np.dtype(_CACHE_DTYPE).itemsize


def _refuse_over_memory_limit(model: Model, max_length: int) -> None:
    """MemoryLimitError when the session's weights, the activations of a prompt of
    ``max_length`` tokens and a KV cache of ``max_length`` tokens exceed the session's
    ``memory_limit`` option (nothing happens without one)."""
    from .memory_plan import dims_of

    session = model.session
    if session._memory.limit is None:
        return
    layout = model.layout
    # fixed-shape steps read the whole cache as their past; growing ones start from an empty one
    past_length = max_length if model.fixed_shape_steps else 0
    shapes: dict[str | None, tuple[int, ...]] = {
        layout.input_ids: (1, max_length),
        layout.attention_mask: (1, max_length),
        layout.position_ids: (1, max_length),
    }
    shapes.update((past, (1, layout.kv_heads, past_length, layout.head_size)) for past, _ in layout.cache_names())
    dims = dims_of([info.shape for info in session.inputs], [shapes.get(info.name) for info in session.inputs])
    # the present keys and values are written into the cache bindings, counted as the cache
    plan = session._memory.plan(session, dims, bound=[present for _, present in layout.cache_names()])
    session._memory.refuse_over_limit(session, plan, state=_cache_bytes(layout, max_length))


def _drop_slots(session_ref: Any, slots: tuple[str, ...]) -> None:
    session = session_ref()
    if session is not None:
        for slot in slots:
            session.reset(slot)


@dataclasses.dataclass
class CaptureUse:
    """How a :class:`Generator`'s steps ran: replayed from a capture or eagerly, with the
    reasons of eager steps and the capture reports by phase (``prefill``, ``decode``)."""

    replayed: dict[str, int] = dataclasses.field(default_factory=dict)  # phase -> steps
    eager: dict[str, int] = dataclasses.field(default_factory=dict)  # phase -> steps
    eager_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    reports: dict[str, CaptureReport] = dataclasses.field(default_factory=dict)

    @property
    def replayed_steps(self) -> int:
        return sum(self.replayed.values())

    @property
    def eager_steps(self) -> int:
        return sum(self.eager.values())

    def _replayed(self, phase: str) -> None:
        self.replayed[phase] = self.replayed.get(phase, 0) + 1

    def _eager(self, phase: str, reason: str) -> None:
        self.eager[phase] = self.eager.get(phase, 0) + 1
        self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """How the next token is chosen. ``max_length`` counts the prompt (default: the model's
    context length). Without ``do_sample`` the choice is greedy; with it, the logits are
    divided by ``temperature``, cut to the ``top_k`` best (0: no cut) and to the smallest set
    whose probability reaches ``top_p``, then sampled with a generator seeded by ``seed``."""

    max_length: int | None = None
    do_sample: bool = False
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length < 1:
            raise InvalidOptionValueError("max_length", self.max_length, "a positive number of tokens")
        if self.top_k < 0:
            raise InvalidOptionValueError("top_k", self.top_k, "0 (no cut) or a positive count")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidOptionValueError("top_p", self.top_p, "a probability in (0, 1]")
        if not self.temperature > 0.0:
            raise InvalidOptionValueError("temperature", self.temperature, "a positive number")


def _choose(logits: np.ndarray, options: SearchOptions, rng: np.random.Generator) -> int:
    if not options.do_sample:
        return int(np.argmax(logits))
    scores = logits.astype(np.float64) / options.temperature
    candidates = np.arange(scores.shape[0])
    if 0 < options.top_k < scores.shape[0]:
        candidates = np.argpartition(-scores, options.top_k - 1)[: options.top_k]
    order = candidates[np.argsort(-scores[candidates], kind="stable")]  # best first
    weights = np.exp(scores[order] - scores[order[0]])
    probabilities = weights / weights.sum()
    if options.top_p < 1.0:
        # the smallest best-first prefix whose probability reaches top_p
        keep = int(np.searchsorted(np.cumsum(probabilities), options.top_p)) + 1
        order, probabilities = order[:keep], probabilities[:keep] / probabilities[:keep].sum()
    return int(order[rng.choice(order.shape[0], p=probabilities)])


class Generator:
    """Feeds tokens through a :class:`Model` one step at a time (batch size 1).

    The cache of each layer is one persistent binding serving as past input and present
    output, its capacity ``max_length`` tokens, so a step allocates no cache memory. With
    ``capture`` (the default) and a model whose steps have fixed shapes, prompts and
    decode steps are replayed from captures in their own slots (see the module's notes);
    ``capture_use`` says how each step ran. A model loaded with ``memory_limit`` refuses a
    generator (MemoryLimitError, before its cache is allocated) when its weights, a prompt
    of ``max_length`` tokens' activations and the cache at ``max_length`` need more.
    """

    def __init__(
        self, model: Model, options: SearchOptions | None = None, *, capture: bool = True, **overrides: Any
    ) -> None:
        options = options or SearchOptions()
        if overrides:
            unknown = set(overrides) - {f.name for f in dataclasses.fields(SearchOptions)}
            if unknown:
                key = sorted(unknown)[0]
                raise InvalidOptionValueError(key, overrides[key], "a SearchOptions field")
            options = dataclasses.replace(options, **overrides)
        layout = model.layout
        max_length = options.max_length or layout.context_length
        if max_length < 1:
            raise InvalidOptionValueError("max_length", max_length, "a positive number (the model declares none)")
        if layout.context_length and max_length > layout.context_length:
            # positions past the context have no rotary rows: refused here, as onnxruntime-genai
            # does, rather than at the step that gets there
            raise InvalidOptionValueError(
                "max_length", max_length, f"at most the model's context length, {layout.context_length}"
            )
        self.model = model
        self.options = options
        self.max_length = max_length
        self._rng = np.random.default_rng(options.seed)
        _refuse_over_memory_limit(model, max_length)  # before the cache is allocated
        self._state = model._take_cache(max_length)
        self._state.reset(model)
        weakref.finalize(self, model._return_cache, self._state)
        self._cache = self._state.bindings
        self.capture_use = CaptureUse()
        if not capture:
            self._eager_reason: str | None = "capture=False"
        elif not model.fixed_shape_steps:
            self._eager_reason = (
                "the cache grows every step (the model does not declare past_present_share_buffer "
                "with an attention mask), so no two steps have the same shapes"
            )
        else:
            self._eager_reason = None
        self._sequence: list[int] = []
        self._pending: list[int] = []  # tokens appended but not yet run through the model
        self._cached = 0  # tokens whose keys and values are in the cache
        self._logits: np.ndarray | None = None
        self._done = False
        self._trace = trace_generation(model.session, max_length, options)  # a gen_ai span when profiling

    # -- feeding ----------------------------------------------------------------------------

    def append_tokens(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Queue prompt tokens; they run through the model with the next step."""
        array = np.asarray(tokens, dtype=np.int64).reshape(-1)
        vocab = self.model.layout.vocab_size
        if array.size == 0:
            raise InvalidInputError("append_tokens needs at least one token", input_name=self.model.layout.input_ids)
        if vocab and (array.min() < 0 or array.max() >= vocab):
            raise InvalidInputError(
                f"token ids must lie in [0, {vocab}), got [{array.min()}, {array.max()}]",
                input_name=self.model.layout.input_ids,
            )
        if len(self._sequence) + array.size > self.max_length:
            raise InvalidInputError(
                f"{len(self._sequence) + array.size} tokens exceed max_length={self.max_length}; "
                f"raise max_length (SearchOptions) up to the model's context length",
                input_name=self.model.layout.input_ids,
            )
        self._sequence.extend(int(t) for t in array)
        self._pending.extend(int(t) for t in array)
        self._done = len(self._sequence) >= self.max_length

    def _run_pending(self) -> None:
        layout = self.model.layout
        tokens = np.array([self._pending], np.int64)
        total = self._cached + tokens.shape[1]
        feeds: dict[str, np.ndarray] = {layout.input_ids: tokens}
        if layout.attention_mask is not None:
            if self.model.fixed_shape_steps:
                # the mask keeps its shape; its ones say how much of the cache is valid
                self._state.mask[0, self._cached:total] = 1
                feeds[layout.attention_mask] = self._state.mask
            else:
                feeds[layout.attention_mask] = np.ones((1, total), np.int64)
        if layout.position_ids is not None:
            feeds[layout.position_ids] = np.arange(self._cached, total, dtype=np.int64)[None, :]
        logits = self._step(feeds, "decode" if tokens.shape[1] == 1 else "prefill")
        self._logits = np.asarray(logits)[0, -1]
        self._cached = total
        self._pending = []

    def _step(self, feeds: dict[str, np.ndarray], phase: str) -> Any:
        """The step's logits: replayed from the phase's capture (made first when there is
        none for these shapes), or run eagerly with the reason counted. A prompt is
        captured only when a prompt of its length comes again: a capture costs about two
        runs, paid back only by replays."""
        logits_name = self.model.layout.logits
        session, state, use = self.model.session, self._state, self.capture_use
        length = feeds[self.model.layout.input_ids].shape[1]
        reason = self._eager_reason or state.declined.get(phase)
        if reason is None and phase == "prefill" and state.captured_lengths.get(phase) != length:
            if length not in self.model._prompt_lengths:
                reason = "a prompt of a new length (captured when a prompt of its length comes again)"
            self.model._prompt_lengths.add(length)
        if reason is None:
            slot = state.slots[phase]
            if state.captured_lengths.get(phase) != length:
                try:
                    result: Captured | NotCapturable = session.try_capture(feeds, bindings=self._cache, slot=slot)
                except PlugrtError as e:  # the eager run below says so again if the step itself fails
                    result = NotCapturable([("", f"{type(e).__name__}: {e}")])
                if not isinstance(result, Captured):
                    why = "; ".join(f"{node}: {why}" if node else why for node, why in result.report) or "declined"
                    state.declined[phase] = reason = f"the {phase} step cannot be captured ({why})"
                else:
                    state.captured_lengths[phase] = length
                    state.reports[phase] = result.report
            if reason is None:
                use.reports[phase] = state.reports[phase]
                try:
                    replayed = session.replay(feeds, bindings=self._cache, slot=slot)
                except StaleCaptureError as e:
                    state.captured_lengths.pop(phase, None)
                    reason = f"the {phase} capture went stale ({e.reason})"
                else:
                    if replayed.replayed:
                        use._replayed(phase)
                    else:
                        use._eager(phase, replayed.reason)
                    return replayed[logits_name]
        use._eager(phase, reason or "")
        return session.run(feeds, [logits_name], bindings=self._cache)[logits_name]

    # -- stepping ---------------------------------------------------------------------------

    def generate_next_token(self) -> int:
        """Run the queued tokens, choose the next one and queue it; returns it."""
        if self._done:
            raise InvalidInputError("the generator is done (end of sequence or max_length); start a new one")
        if not self._pending:
            raise InvalidInputError("append_tokens first: there is nothing to run")
        self._run_pending()
        assert self._logits is not None
        token = _choose(self._logits, self.options, self._rng)
        self._sequence.append(token)
        self._pending = [token]
        self._done = token in self.model.layout.eos_token_ids or len(self._sequence) >= self.max_length
        self._trace.token(len(self._sequence), self._done)
        return token

    def is_done(self) -> bool:
        return self._done

    def get_next_tokens(self) -> list[int]:
        """The token chosen by the last step (a list: one per batch entry)."""
        return self._sequence[-1:]

    def get_sequence(self) -> list[int]:
        """The prompt and every generated token."""
        return list(self._sequence)

    def get_logits(self) -> np.ndarray:
        """The last position's logits the last step chose from."""
        if self._logits is None:
            raise InvalidInputError("no step has run yet")
        return self._logits.copy()


def generate(model: Model, prompt: Sequence[int] | np.ndarray, *, capture: bool = True, **options: Any) -> list[int]:
    """The tokens generated after ``prompt`` (``options``: :class:`SearchOptions` fields;
    ``capture``: replay steps from captures where the model allows, see :class:`Generator`)."""
    generator = Generator(model, SearchOptions(**options), capture=capture)
    generator.append_tokens(prompt)
    start = len(generator.get_sequence())
    while not generator.is_done():
        generator.generate_next_token()
    return generator.get_sequence()[start:]
