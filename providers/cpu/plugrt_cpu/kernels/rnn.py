"""Recurrent kernels: RNN, GRU, LSTM."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .._registry import kernel

# name -> (default alpha, default beta); None where the function takes no such parameter.
_ACTIVATION_PARAMETERS: dict[str, tuple[float | None, float | None]] = {
    "relu": (None, None),
    "tanh": (None, None),
    "sigmoid": (None, None),
    "softsign": (None, None),
    "softplus": (None, None),
    "affine": (1.0, 0.0),
    "leakyrelu": (0.01, None),
    "thresholdedrelu": (1.0, None),
    "scaledtanh": (1.0, 1.0),
    "hardsigmoid": (0.2, 0.5),
    "elu": (1.0, None),
}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a non-positive argument only, so large |x| never overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _activation_function(name: str, alpha: float | None, beta: float | None) -> Callable[[np.ndarray], np.ndarray]:
    if name == "relu":
        return lambda x: np.maximum(x, 0)
    if name == "tanh":
        return np.tanh
    if name == "sigmoid":
        return _sigmoid
    if name == "softsign":
        return lambda x: x / (1 + np.abs(x))
    if name == "softplus":
        return lambda x: np.logaddexp(x, 0)
    if name == "affine":
        return lambda x: x * x.dtype.type(alpha) + x.dtype.type(beta)
    if name == "leakyrelu":
        return lambda x: np.where(x >= 0, x, x * x.dtype.type(alpha))
    if name == "thresholdedrelu":
        return lambda x: np.where(x > alpha, x, 0)
    if name == "scaledtanh":
        return lambda x: x.dtype.type(alpha) * np.tanh(x * x.dtype.type(beta))
    if name == "hardsigmoid":
        return lambda x: np.clip(x * x.dtype.type(alpha) + x.dtype.type(beta), 0, 1)
    if name == "elu":
        return lambda x: np.where(x >= 0, x, x.dtype.type(alpha) * np.expm1(np.minimum(x, 0)))
    raise NotImplementedError(f"recurrent activation function {name!r} is not supported")


class _Activations:
    """The activation functions of one recurrent node, per direction.

    ``activation_alpha``/``activation_beta`` are consumed in order by the functions
    that take such a parameter (as onnxruntime does); the others use their defaults.
    """

    def __init__(
        self,
        names: list[str] | None,
        alphas: list[float] | None,
        betas: list[float] | None,
        defaults: list[str],
        num_directions: int,
    ) -> None:
        if names is None:
            names = defaults * num_directions
        per_direction = len(defaults)
        if num_directions == 1 and len(names) == 2 * per_direction:
            # Older exporters write both directions' functions for a one-direction node
            # (RNN's schema once defaulted to ["Tanh", "Tanh"]); the first set applies.
            names = names[:per_direction]
        if len(names) != per_direction * num_directions:
            raise ValueError(
                f"expected {per_direction * num_directions} activation functions "
                f"({per_direction} per direction), got {len(names)}"
            )
        alpha_values = iter(alphas or [])
        beta_values = iter(betas or [])
        keys = []
        for name in names:
            lowered = name.lower()
            if lowered not in _ACTIVATION_PARAMETERS:
                raise NotImplementedError(f"recurrent activation function {name!r} is not supported")
            default_alpha, default_beta = _ACTIVATION_PARAMETERS[lowered]
            alpha = None if default_alpha is None else float(next(alpha_values, default_alpha))
            beta = None if default_beta is None else float(next(beta_values, default_beta))
            keys.append((lowered, alpha, beta))
        self._keys = [keys[d * per_direction : (d + 1) * per_direction] for d in range(num_directions)]
        self._functions = [[_activation_function(*key) for key in row] for row in self._keys]
        # When every direction uses the same functions they apply to both at once.
        self._shared = all(row == self._keys[0] for row in self._keys)

    def __call__(self, index: int, x: np.ndarray) -> np.ndarray:
        """Apply function ``index`` of each direction to ``x`` (directions on axis 0)."""
        if self._shared:
            return self._functions[0][index](x)
        return np.stack([row[index](x[d]) for d, row in enumerate(self._functions)])


class _Recurrence:
    """Layout, direction and ``sequence_lens`` handling shared by RNN, GRU and LSTM.

    The cells run on time-major data with directions stacked on a leading axis, so one
    batched matmul per step serves both directions of a bidirectional node. The
    reverse direction's input is reversed in time per batch entry (within its
    sequence length) beforehand, so every direction walks its steps in order.
    """

    def __init__(self, x: np.ndarray, sequence_lens: np.ndarray | None, direction: str, layout: int) -> None:
        if direction not in ("forward", "reverse", "bidirectional"):
            raise ValueError(f"unknown recurrent direction {direction!r}")
        if layout not in (0, 1):
            raise ValueError(f"layout must be 0 or 1, got {layout}")
        self.layout = layout
        self.x = np.swapaxes(x, 0, 1) if layout == 1 else x  # [seq, batch, input]
        self.seq_length, self.batch_size = self.x.shape[:2]
        self.num_directions = 2 if direction == "bidirectional" else 1
        self.reversed = [False, True] if direction == "bidirectional" else [direction == "reverse"]
        self.active = None  # [seq, batch, 1] bool, None when every sequence is full length
        self.reverse_index = None  # [seq, batch] time index of each reversed step
        if sequence_lens is not None:
            lens = np.asarray(sequence_lens, dtype=np.int64).reshape(-1)
            if lens.shape[0] != self.batch_size:
                raise ValueError(f"sequence_lens has {lens.shape[0]} entries for a batch of {self.batch_size}")
            if np.any(lens < 0) or np.any(lens > self.seq_length):
                raise ValueError(f"sequence_lens must lie in [0, {self.seq_length}], got {lens.tolist()}")
            if np.any(lens != self.seq_length):
                steps = np.arange(self.seq_length)[:, None]
                self.active = (steps < lens)[:, :, None]
                self.reverse_index = np.where(steps < lens, lens - 1 - steps, steps)

    def initial_state(self, state: np.ndarray | None, hidden_size: int, dtype: np.dtype) -> np.ndarray:
        """An initial state as [directions, batch, hidden] in the compute dtype."""
        if state is None:
            return np.zeros((self.num_directions, self.batch_size, hidden_size), dtype=dtype)
        if self.layout == 1:
            state = np.swapaxes(state, 0, 1)
        return state.astype(dtype, copy=False)

    def _reverse_time(self, values: np.ndarray) -> np.ndarray:
        """Reverse [seq, batch, ...] in time within each batch entry's sequence length."""
        if self.reverse_index is None:
            return values[::-1]
        index = self.reverse_index.reshape(self.reverse_index.shape + (1,) * (values.ndim - 2))
        return np.take_along_axis(values, index, axis=0)

    def project_input(self, w: np.ndarray, bias: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
        """X @ W^T (+ bias) for every step and direction: [directions, seq, batch, gates]."""
        # One (seq * batch, input) x (input, gates) GEMM per direction.
        x = self.x.astype(dtype, copy=False).reshape(self.seq_length * self.batch_size, -1)
        projected = np.matmul(x, np.swapaxes(w.astype(dtype, copy=False), 1, 2))
        if bias is not None:
            projected += bias.astype(dtype, copy=False)[:, None, :]
        projected = projected.reshape(w.shape[0], self.seq_length, self.batch_size, -1)
        for d, reverse in enumerate(self.reversed):
            if reverse:
                projected[d] = self._reverse_time(projected[d])
        return projected

    def run(
        self,
        step: Callable[[np.ndarray, tuple[np.ndarray, ...]], tuple[np.ndarray, ...]],
        projected: np.ndarray,
        states: tuple[np.ndarray, ...],
        dtype: np.dtype,
    ) -> tuple[np.ndarray, ...]:
        """Run ``step`` over time; returns Y and the final states in the node's layout.

        ``step(projected_t, states) -> new_states`` where ``new_states[0]`` is H.
        """
        hidden_size = states[0].shape[-1]
        y = np.zeros((self.seq_length, self.num_directions, self.batch_size, hidden_size), dtype=dtype)
        for t in range(self.seq_length):
            new_states = step(projected[:, t], states)
            if self.active is not None:
                active = self.active[t]
                new_states = tuple(np.where(active, new, old) for new, old in zip(new_states, states))
                y[t] = np.where(active, new_states[0], 0)
            else:
                y[t] = new_states[0]
            states = new_states
        for d, reverse in enumerate(self.reversed):
            if reverse:
                y[:, d] = self._reverse_time(y[:, d])
        if self.layout == 1:
            return (np.transpose(y, (2, 0, 1, 3)),) + tuple(np.swapaxes(s, 0, 1) for s in states)
        return (y,) + states


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """Half-precision types accumulate in float32; float32/float64 compute natively."""
    return dtype if dtype in (np.float32, np.float64) else np.dtype(np.float32)


def _clipper(clip: float | None) -> Callable[[np.ndarray], np.ndarray]:
    if clip is None:
        return lambda x: x
    return lambda x: np.clip(x, -clip, clip)


def _check_hidden_size(hidden_size: int | None, r: np.ndarray) -> int:
    actual = r.shape[-1]
    if hidden_size is not None and hidden_size != actual:
        raise ValueError(f"hidden_size={hidden_size} disagrees with R's last dimension {actual}")
    return actual


def _outputs(results: tuple[np.ndarray, ...], dtype: np.dtype) -> tuple[np.ndarray, ...]:
    return tuple(r.astype(dtype, copy=False) for r in results)


@kernel("RNN", 1, multi_output=True)
def rnn(
    x,
    w,
    r,
    b=None,
    sequence_lens=None,
    initial_h=None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip=None,
    direction="forward",
    hidden_size=None,
    layout=0,
    output_sequence=0,
):
    """Ht = f(Xt*(Wi^T) + Ht-1*(Ri^T) + Wbi + Rbi)."""
    hidden = _check_hidden_size(hidden_size, r)
    dtype = _compute_dtype(x.dtype)
    seq = _Recurrence(x, sequence_lens, direction, layout)
    act = _Activations(activations, activation_alpha, activation_beta, ["Tanh"], seq.num_directions)
    clipped = _clipper(clip)
    bias = None if b is None else b[:, :hidden] + b[:, hidden:]
    projected = seq.project_input(w, bias, dtype)
    r_t = np.swapaxes(r.astype(dtype, copy=False), 1, 2)

    def step(xw, states):
        (h,) = states
        return (act(0, clipped(xw + np.matmul(h, r_t))),)

    h0 = seq.initial_state(initial_h, hidden, dtype)
    return _outputs(seq.run(step, projected, (h0,), dtype), x.dtype)


@kernel("GRU", 1, multi_output=True)
def gru(
    x,
    w,
    r,
    b=None,
    sequence_lens=None,
    initial_h=None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip=None,
    direction="forward",
    hidden_size=None,
    layout=0,
    linear_before_reset=0,
    output_sequence=0,
):
    """Gates z, r, h: zt = f(..), rt = f(..), ht = g(..), Ht = (1 - zt) (.) ht + zt (.) Ht-1."""
    hidden = _check_hidden_size(hidden_size, r)
    dtype = _compute_dtype(x.dtype)
    seq = _Recurrence(x, sequence_lens, direction, layout)
    act = _Activations(activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh"], seq.num_directions)
    clipped = _clipper(clip)
    r = r.astype(dtype, copy=False)
    r_zr_t = np.swapaxes(r[:, : 2 * hidden], 1, 2)
    r_h_t = np.swapaxes(r[:, 2 * hidden :], 1, 2)
    r_t = np.swapaxes(r, 1, 2)
    if b is None:
        bias = None
        recurrent_bias_h = None
    else:
        b = b.astype(dtype, copy=False)
        input_bias, recurrent_bias = b[:, : 3 * hidden], b[:, 3 * hidden :]
        if linear_before_reset:
            # Rbh sits inside the reset product, so only Rbz and Rbr fold into the input side.
            bias = input_bias + np.concatenate([recurrent_bias[:, : 2 * hidden], np.zeros_like(recurrent_bias[:, :hidden])], axis=1)
            recurrent_bias_h = recurrent_bias[:, None, 2 * hidden :]
        else:
            bias = input_bias + recurrent_bias
            recurrent_bias_h = None
    projected = seq.project_input(w, bias, dtype)

    if linear_before_reset:

        def step(xw, states):
            (h,) = states
            hr = np.matmul(h, r_t)
            z = act(0, clipped(xw[..., :hidden] + hr[..., :hidden]))
            reset = act(0, clipped(xw[..., hidden : 2 * hidden] + hr[..., hidden : 2 * hidden]))
            recurrent_h = hr[..., 2 * hidden :]
            if recurrent_bias_h is not None:
                recurrent_h = recurrent_h + recurrent_bias_h
            candidate = act(1, clipped(xw[..., 2 * hidden :] + reset * recurrent_h))
            return (candidate + z * (h - candidate),)

    else:

        def step(xw, states):
            (h,) = states
            hr = np.matmul(h, r_zr_t)
            z = act(0, clipped(xw[..., :hidden] + hr[..., :hidden]))
            reset = act(0, clipped(xw[..., hidden : 2 * hidden] + hr[..., hidden:]))
            candidate = act(1, clipped(xw[..., 2 * hidden :] + np.matmul(reset * h, r_h_t)))
            return (candidate + z * (h - candidate),)

    h0 = seq.initial_state(initial_h, hidden, dtype)
    return _outputs(seq.run(step, projected, (h0,), dtype), x.dtype)


@kernel("LSTM", 1, multi_output=True)
def lstm(
    x,
    w,
    r,
    b=None,
    sequence_lens=None,
    initial_h=None,
    initial_c=None,
    p=None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip=None,
    direction="forward",
    hidden_size=None,
    input_forget=0,
    layout=0,
    output_sequence=0,
):
    """Gates i, o, f, c with optional peepholes P = [Pi, Po, Pf]."""
    hidden = _check_hidden_size(hidden_size, r)
    dtype = _compute_dtype(x.dtype)
    seq = _Recurrence(x, sequence_lens, direction, layout)
    act = _Activations(activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh", "Tanh"], seq.num_directions)
    clipped = _clipper(clip)
    bias = None if b is None else b[:, : 4 * hidden] + b[:, 4 * hidden :]
    projected = seq.project_input(w, bias, dtype)
    r_t = np.swapaxes(r.astype(dtype, copy=False), 1, 2)
    if p is None:
        p_i = p_o = p_f = None
    else:
        p = p.astype(dtype, copy=False)[:, None, :]
        p_i, p_o, p_f = p[..., :hidden], p[..., hidden : 2 * hidden], p[..., 2 * hidden :]

    def step(xw, states):
        h, c = states
        gates = xw + np.matmul(h, r_t)
        gate_i, gate_o = gates[..., :hidden], gates[..., hidden : 2 * hidden]
        gate_f, gate_c = gates[..., 2 * hidden : 3 * hidden], gates[..., 3 * hidden :]
        if p_f is not None:
            gate_i = gate_i + p_i * c
            gate_f = gate_f + p_f * c
        inp = act(0, clipped(gate_i))
        # Coupled gates: the forget gate is the complement of the input gate.
        forget = 1 - inp if input_forget else act(0, clipped(gate_f))
        c_new = forget * c + inp * act(1, clipped(gate_c))
        if p_o is not None:
            gate_o = gate_o + p_o * c_new
        out = act(0, clipped(gate_o))
        # Like onnxruntime, clip bounds the gate pre-activations but not the cell state.
        return out * act(2, c_new), c_new

    h0 = seq.initial_state(initial_h, hidden, dtype)
    c0 = seq.initial_state(initial_c, hidden, dtype)
    return _outputs(seq.run(step, projected, (h0, c0), dtype), x.dtype)
