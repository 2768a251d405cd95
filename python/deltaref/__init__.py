"""deltaref: the float64 oracle for KDA, DPLR and token-shift, with FLA's names.

Swap FLA's fp32 naive reference for this one in a test::

    import deltaref
    o_ref, ht_ref = deltaref.chunk_kda(q, k, v, g, beta, initial_state=h0,
                                       output_final_state=True)      # float64 truth
    deltaref.assert_close("o", o_ref, o_tri, 5e-3)

Functions take NumPy arrays and anything NumPy can read (PyTorch CPU/CUDA
tensors, JAX arrays, objects with ``__array__`` or ``__dlpack__``) in
float64 or float32, compute in that dtype (the same generic Rust code), and
return the same dtype; PyTorch tensors in give PyTorch CPU tensors out.
Shapes and options are FLA's (``[B, T, H, K]``, ``cu_seqlens``, ...).
Every ``*_backward`` companion returns all outputs and gradients of the loss
``Σ o·do + Σ final_state·dht`` as a :class:`Results`, computed analytically.

Extra keywords select the implementation from the CLI's registry:
``impl`` (``"naive"``, ``"chunk"``, ``"cp"``), ``chunk_size``, ``cp`` (a
dict with ``world`` or ``cuts``, optionally ``engine``) and ``precision``
(the CLI's ``--precision`` presets, e.g. ``"fla-bf16"``). Bad inputs raise
``ValueError`` with the message the ``deltaref`` CLI prints.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np

from . import _deltaref as _core

__all__ = [
    "naive_recurrent_kda",
    "chunk_kda",
    "naive_recurrent_kda_backward",
    "chunk_kda_backward",
    "naive_recurrent_dplr_delta_rule",
    "chunk_dplr_delta_rule",
    "naive_recurrent_dplr_delta_rule_backward",
    "chunk_dplr_delta_rule_backward",
    "token_shift",
    "token_shift_backward",
    "norm_ratio",
    "max_abs",
    "assert_close",
    "verify",
    "gen",
    "read_case",
    "write_case",
    "Case",
    "Results",
    "Report",
    "PRECISIONS",
]

#: The ``precision=`` presets (the CLI's ``--precision`` names).
PRECISIONS: tuple[str, ...] = tuple(_core.precision_names())

_FLOATS = (np.dtype(np.float64), np.dtype(np.float32))


# --------------------------------------------------------------------------
# Arrays in and out


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _array(name: str, x: Any) -> np.ndarray:
    """A float64/float32 NumPy view or copy of ``x``; other dtypes are refused."""
    if _is_torch(x):
        if str(x.dtype) not in ("torch.float64", "torch.float32"):
            raise ValueError(
                f"tensor `{name}`: dtype {x.dtype}: expected float64 or float32 "
                "(cast with .double() or .float())"
            )
        return x.detach().cpu().numpy()
    if not hasattr(x, "__array__") and hasattr(x, "__dlpack__"):
        x = np.from_dlpack(x)
    a = np.asarray(x)
    if a.dtype not in _FLOATS:
        raise ValueError(f"tensor `{name}`: dtype {a.dtype}: expected float64 or float32")
    return a


def _cu_seqlens(cu: Any) -> list[int] | None:
    if cu is None:
        return None
    a = cu.detach().cpu().numpy() if _is_torch(cu) else np.asarray(cu)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(
            f"`cu_seqlens`: expected a 1-D integer array, got dtype {a.dtype} shape {list(a.shape)}"
        )
    return [int(v) for v in a]


class _Like:
    """Gives results the dtype (and the array type) of the leading input."""

    def __init__(self, lead: Any, lead_array: np.ndarray):
        self.torch = _is_torch(lead)
        self.dtype = lead_array.dtype
        self.compute = "f32" if self.dtype == np.float32 else "f64"

    def __call__(self, x: np.ndarray) -> Any:
        x = x.astype(self.dtype, copy=False)
        if self.torch:
            import torch

            return torch.from_numpy(x)
        return x


class Results(dict):
    """Name → array map of outputs and gradients (FLA's names), with
    attribute access: ``r.o``, ``r.final_state``, ``r.dq``, ``r.dA_log``, ...
    ``impl`` names the implementation that computed them."""

    impl: str = ""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"no tensor `{name}` in these results (have: {', '.join(self)})"
            ) from None

    def __repr__(self) -> str:
        items = ", ".join(f"{n}{list(np.shape(v))}" for n, v in self.items())
        return f"Results({self.impl}: {items})"


def _impl_args(
    impl: str | None, default: str, chunk_size: int | None, cp: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The registry request: ``impl`` picks the engine and ``cp`` wraps it."""
    world = layout = cuts = cp_engine = None
    name = impl or default
    if cp is not None:
        unknown = set(cp) - {"world", "layout", "cuts", "engine"}
        if unknown:
            raise ValueError(
                f"cp: unknown key(s) {sorted(unknown)} (world, layout, cuts, engine)"
            )
        world, layout, cuts = cp.get("world"), cp.get("layout"), cp.get("cuts")
        cp_engine = cp.get("engine")
        if cuts is not None:
            cuts = [int(c) for c in cuts]
        if name in ("naive", "chunk"):
            cp_engine = cp_engine or name
            name = "cp"
    return dict(
        impl_name=name,
        chunk_size=None if chunk_size is None else int(chunk_size),
        world=None if world is None else int(world),
        layout=layout,
        cuts=cuts,
        cp_engine=cp_engine,
    )


def _run(
    meta: dict[str, Any],
    named: Mapping[str, Any],
    cu_seqlens: Any,
    lead: str,
    impl: str | None,
    default_impl: str,
    chunk_size: int | None,
    cp: Mapping[str, Any] | None,
    precision: str | None,
) -> tuple[Results, _Like]:
    arrays = {n: _array(n, x) for n, x in named.items() if x is not None}
    like = _Like(named[lead], arrays[lead])
    # Without the main upstream gradient only the forward pass runs.
    forward_only = not ({"do", "dy"} & set(arrays))
    tensors = {n: np.asarray(a, dtype=np.float64) for n, a in arrays.items()}
    dtypes = {n: like.compute for n in tensors}
    name, out = _core.run(
        json.dumps(meta),
        tensors,
        dtypes,
        _cu_seqlens(cu_seqlens),
        compute=like.compute,
        precision=precision,
        forward_only=forward_only,
        **_impl_args(impl, default_impl, chunk_size, cp),
    )
    r = Results({n: like(v) for n, v in out.items()})
    r.impl = name
    return r, like


# --------------------------------------------------------------------------
# KDA


def _kda_meta(
    scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
    allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "op": "kda",
        "use_qk_l2norm_in_kernel": bool(use_qk_l2norm_in_kernel),
        "use_beta_sigmoid_in_kernel": bool(use_beta_sigmoid_in_kernel),
        "allow_neg_eigval": bool(allow_neg_eigval),
    }
    if scale is not None:
        meta["scale"] = float(scale)
    if not use_gate_in_kernel:
        if A_log is not None or dt_bias is not None or lower_bound is not None:
            raise ValueError(
                "`A_log`, `dt_bias` and `lower_bound` shape the in-kernel gate: "
                "pass use_gate_in_kernel=True (FLA ignores them otherwise)"
            )
        meta["gate"] = "none"
    elif lower_bound is not None:
        meta["gate"] = "lowerbound"
        meta["lower_bound"] = float(lower_bound)
    else:
        if safe_gate:
            raise ValueError(
                "`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`."
            )
        if A_log is None:
            raise ValueError(
                "`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set."
            )
        meta["gate"] = "kda"
    return meta


def _kda(
    default_impl, q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens,
    use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
    allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias, impl, chunk_size, cp, precision,
) -> tuple[Results, _Like]:
    meta = _kda_meta(
        scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias,
    )
    named = dict(
        q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
        initial_state=initial_state, do=do, dht=dht,
    )
    return _run(meta, named, cu_seqlens, "q", impl, default_impl, chunk_size, cp, precision)


def _forward(r: Results, main: str, last: str, output_final_state: bool):
    return r[main], (r[last] if output_final_state else None)


def naive_recurrent_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
    cu_seqlens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
    lower_bound=None, A_log=None, dt_bias=None, impl=None, chunk_size=None, cp=None,
    precision=None,
):
    """KDA by the token-by-token recurrence (FLA ``naive_recurrent_kda``).

    Shapes: ``q, k [B,T,H,K]``, ``v [B,T,HV,V]``, ``g [B,T,HV,K]`` (log-space
    decay, or the raw gate with ``use_gate_in_kernel``), ``beta [B,T,HV]``,
    ``initial_state [N,HV,K,V]``, ``A_log [HV]``, ``dt_bias [HV*K]``,
    ``cu_seqlens [N+1]`` (then B = 1). Returns ``(o [B,T,HV,V],
    final_state [N,HV,K,V] or None)``. Options as :func:`chunk_kda`.
    """
    r, _ = _kda(
        "naive", q, k, v, g, beta, None, None, scale, initial_state, cu_seqlens,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias, impl, chunk_size, cp, precision,
    )
    return _forward(r, "o", "final_state", output_final_state)


def chunk_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
    lower_bound=None, disable_recompute=False, return_intermediate_states=False,
    state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, *, A_log=None, dt_bias=None,
    impl=None, chunk_size=None, cp=None, precision=None,
):
    """KDA in the chunked (WY) form FLA's kernels use (FLA ``chunk_kda``).

    Same shapes and outputs as :func:`naive_recurrent_kda`. FLA's options:
    ``use_qk_l2norm_in_kernel``; ``use_gate_in_kernel`` with ``A_log``,
    ``dt_bias`` and ``lower_bound`` (the safe gate); ``safe_gate`` (a kernel
    speed switch: the oracle is exact either way, the precision preset
    ``fla-bf16`` emulates its midpoint factoring); ``use_beta_sigmoid_in_kernel``,
    ``allow_neg_eigval``. ``disable_recompute`` and ``cu_seqlens_cpu`` are
    accepted and change nothing; ``return_intermediate_states`` and
    ``state_v_first`` are refused. ``chunk_size`` 16, 32 or 64 (default 64).
    """
    del disable_recompute, cu_seqlens_cpu
    if return_intermediate_states or state_v_first:
        raise ValueError(
            "return_intermediate_states and state_v_first are not supported: the oracle "
            "returns (o, final_state) with the state in FLA's default [K, V] layout"
        )
    r, _ = _kda(
        "chunk", q, k, v, g, beta, None, None, scale, initial_state, cu_seqlens,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias, impl, chunk_size, cp, precision,
    )
    return _forward(r, "o", "final_state", output_final_state)


def _kda_backward(default_impl):
    def backward(
        q, k, v, g, beta, do, dht=None, *, scale=None, initial_state=None, cu_seqlens=None,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
        lower_bound=None, A_log=None, dt_bias=None, impl=None, chunk_size=None, cp=None,
        precision=None,
    ) -> Results:
        r, _ = _kda(
            default_impl, q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias, impl, chunk_size, cp,
            precision,
        )
        return r

    backward.__name__ = f"{'naive_recurrent' if default_impl == 'naive' else 'chunk'}_kda_backward"
    backward.__doc__ = f"""Outputs and every gradient of KDA ({default_impl} engine by default).

    ``do [B,T,HV,V]`` and optional ``dht [N,HV,K,V]`` define the loss
    ``Σ o·do + Σ final_state·dht``. Returns a :class:`Results` with ``o``,
    ``final_state``, ``dq``, ``dk``, ``dv``, ``dg``, ``dbeta`` and, when the
    inputs exist, ``dA_log``, ``ddt_bias``, ``dh0``. Keywords as
    :func:`chunk_kda`. With ``do=None`` only the forward pass runs
    (``o`` and ``final_state``).
    """
    return backward


naive_recurrent_kda_backward = _kda_backward("naive")
chunk_kda_backward = _kda_backward("chunk")


# --------------------------------------------------------------------------
# DPLR


def _dplr(
    default_impl, q, k, v, a, b, gk, do, dht, scale, initial_state, cu_seqlens,
    impl, chunk_size, cp, precision,
) -> tuple[Results, _Like]:
    meta: dict[str, Any] = {"op": "dplr"}
    if scale is not None:
        meta["scale"] = float(scale)
    named = dict(
        q=q, k=k, v=v, a=a, b=b, gk=gk, initial_state=initial_state, do=do, dht=dht,
    )
    return _run(meta, named, cu_seqlens, "q", impl, default_impl, chunk_size, cp, precision)


def naive_recurrent_dplr_delta_rule(
    q, k, v, a, b, gk, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, *, impl=None, chunk_size=None, cp=None, precision=None,
):
    """DPLR by the recurrence ``S_t = (Diag(exp gk_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ``.

    Time-major like FLA's ``chunk_dplr_delta_rule`` (FLA's own naive
    ``dplr_recurrence`` is head-major): ``q, k, a, b, gk [B,T,H,K]``,
    ``v [B,T,H,V]``, ``initial_state [N,H,K,V]``. Returns ``(o [B,T,H,V],
    final_state [N,H,K,V] or None)``.
    """
    r, _ = _dplr(
        "naive", q, k, v, a, b, gk, None, None, scale, initial_state, cu_seqlens,
        impl, chunk_size, cp, precision,
    )
    return _forward(r, "o", "final_state", output_final_state)


def chunk_dplr_delta_rule(
    q, k, v, a, b, gk, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
    disable_recompute=False, *, lower_bound=None, impl=None, cp=None, precision=None,
):
    """DPLR in the chunked form (FLA ``chunk_dplr_delta_rule``).

    Shapes and outputs as :func:`naive_recurrent_dplr_delta_rule`.
    ``chunk_size`` 16, 32 or 64 (default 64); ``safe_gate``, ``lower_bound``
    (FLA's kernel-speed hints), ``disable_recompute`` and ``cu_seqlens_cpu``
    change nothing in the oracle.
    """
    del cu_seqlens_cpu, safe_gate, disable_recompute, lower_bound
    r, _ = _dplr(
        "chunk", q, k, v, a, b, gk, None, None, scale, initial_state, cu_seqlens,
        impl, chunk_size, cp, precision,
    )
    return _forward(r, "o", "final_state", output_final_state)


def _dplr_backward(default_impl):
    def backward(
        q, k, v, a, b, gk, do, dht=None, *, scale=None, initial_state=None, cu_seqlens=None,
        impl=None, chunk_size=None, cp=None, precision=None,
    ) -> Results:
        r, _ = _dplr(
            default_impl, q, k, v, a, b, gk, do, dht, scale, initial_state, cu_seqlens,
            impl, chunk_size, cp, precision,
        )
        return r

    backward.__name__ = (
        f"{'naive_recurrent' if default_impl == 'naive' else 'chunk'}_dplr_delta_rule_backward"
    )
    backward.__doc__ = f"""Outputs and every gradient of DPLR ({default_impl} engine by default).

    ``do [B,T,H,V]``, optional ``dht [N,H,K,V]``. Returns a :class:`Results`
    with ``o``, ``final_state``, ``dq``, ``dk``, ``dv``, ``da``, ``db``,
    ``dgk`` and (with an initial state) ``dh0``. With ``do=None`` only the
    forward pass runs (``o`` and ``final_state``).
    """
    return backward


naive_recurrent_dplr_delta_rule_backward = _dplr_backward("naive")
chunk_dplr_delta_rule_backward = _dplr_backward("chunk")


# --------------------------------------------------------------------------
# Token-shift


def _token_shift(x, dy, dfinal_cache, cu_seqlens, cache, cp) -> tuple[Results, _Like]:
    named = dict(x=x, cache=cache, dy=dy, dfinal_cache=dfinal_cache)
    return _run(
        {"op": "token_shift"}, named, cu_seqlens, "x", None, "naive", None, cp, None
    )


def token_shift(x, cu_seqlens=None, cache=None, output_cache=False, chunk_indices=None, *,
                cp=None):
    """FLA ``token_shift``: ``y_t = x_{t-1} − x_t`` per sequence.

    ``x [B,T,D]``, optional ``cache [N,D]`` (the token before each sequence),
    ``cu_seqlens [N+1]``. Returns ``y [B,T,D]``, or ``(y, final_cache [N,D])``
    with ``output_cache``. ``cp`` simulates context parallel (``world``/``cuts``);
    ``chunk_indices`` (FLA's launch grid) changes nothing.
    """
    del chunk_indices
    r, _ = _token_shift(x, None, None, cu_seqlens, cache, cp)
    return (r.y, r.final_cache) if output_cache else r.y


def token_shift_backward(x, dy, dfinal_cache=None, *, cu_seqlens=None, cache=None, cp=None):
    """``y``, ``final_cache``, ``dx`` and (with a cache) ``dcache`` of the
    loss ``Σ y·dy + Σ final_cache·dfinal_cache``, as a :class:`Results`
    (``dy=None``: ``y`` and ``final_cache`` only)."""
    r, _ = _token_shift(x, dy, dfinal_cache, cu_seqlens, cache, cp)
    return r


# --------------------------------------------------------------------------
# Metrics


def _pair(ref: Any, tri: Any) -> tuple[np.ndarray, np.ndarray]:
    def f64(name, x):
        if _is_torch(x):
            x = x.detach().cpu().double()
        return np.ascontiguousarray(np.asarray(x, dtype=np.float64))

    return f64("ref", ref), f64("tri", tri)


def norm_ratio(ref: Any, tri: Any) -> float:
    """FLA ``get_err_ratio``: ``rms(ref − tri) / (rms(ref) + 1e-8)`` (NaN stays NaN)."""
    r, t = _pair(ref, tri)
    return _core.compare(r, t, 0.0, "norm_ratio")[0]


def max_abs(ref: Any, tri: Any) -> float:
    """``max |ref − tri|`` (NaN if any difference is NaN)."""
    r, t = _pair(ref, tri)
    return _core.compare(r, t, 0.0, "max_abs")[1]


def assert_close(prefix: str, ref: Any, tri: Any, ratio: float) -> None:
    """FLA ``assert_close``: passes when ``max_abs ≤ 1e-6``, else needs
    ``norm_ratio < ratio``; NaN anywhere fails. Raises ``AssertionError``
    naming ``prefix``, both figures and the index of the largest error in
    the tensors' shape (``[b, t, h, k]``)."""
    r, t = _pair(ref, tri)
    *_, message = _core.compare(r, t, float(ratio), prefix)
    if message is not None:
        raise AssertionError(message)


# --------------------------------------------------------------------------
# Case files


class Case:
    """One case (SPEC §8): ``meta`` (the ``case`` JSON: ``op`` and FLA's
    option names), float tensors by FLA name (float64 arrays holding the
    stored values), their storage ``dtypes`` and ``cu_seqlens``."""

    def __init__(
        self,
        meta: Mapping[str, Any],
        tensors: Mapping[str, Any],
        dtypes: Mapping[str, str] | None = None,
        cu_seqlens: Any = None,
        path: str | None = None,
    ):
        self.meta = dict(meta)
        self.tensors = {n: np.asarray(_array(n, t), dtype=np.float64) for n, t in tensors.items()}
        self.dtypes = dict(dtypes or {})
        self.cu_seqlens = _cu_seqlens(cu_seqlens)
        self.path = path

    @property
    def op(self) -> str:
        return self.meta["op"]

    def __getitem__(self, name: str) -> Any:
        if name == "cu_seqlens" and self.cu_seqlens is not None:
            return np.asarray(self.cu_seqlens, dtype=np.int64)
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or (name == "cu_seqlens" and self.cu_seqlens is not None)

    @property
    def name(self) -> str:
        return self.path if self.path is not None else "(in memory)"

    def _core_args(self) -> tuple[str, dict, dict, list[int] | None]:
        return json.dumps(self.meta), self.tensors, self.dtypes, self.cu_seqlens

    @classmethod
    def _from_core(cls, parts, path: str | None = None) -> "Case":
        meta, tensors, dtypes, cu = parts
        return cls(json.loads(meta), tensors, dtypes, cu, path)

    def write(self, path: str | os.PathLike) -> None:
        """Writes the case file atomically (tensors rounded to their dtypes)."""
        _core.write_case(os.fspath(path), *self._core_args())

    def run(
        self, impl: str = "naive", *, chunk_size: int | None = None,
        cp: Mapping[str, Any] | None = None, precision: str | None = None,
        compute: str = "f64",
    ) -> Results:
        """Every output and gradient of the case under an implementation
        (``deltaref run``); float64 arrays."""
        args = _impl_args(impl, "naive", chunk_size, cp)
        name, out = _core.run(
            *self._core_args(), compute=compute, precision=precision, forward_only=False, **args
        )
        r = Results(out)
        r.impl = name
        return r

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}{list(t.shape)}" for n, t in self.tensors.items())
        cu = f", cu_seqlens={self.cu_seqlens}" if self.cu_seqlens is not None else ""
        return f"Case({self.name}: {json.dumps(self.meta)}; {shapes}{cu})"


def read_case(path: str | os.PathLike) -> Case:
    """Reads and validates a case file (as ``deltaref`` does)."""
    p = os.fspath(path)
    return Case._from_core(_core.read_case(p), p)


def write_case(case: Case, path: str | os.PathLike) -> None:
    """Writes ``case`` to ``path`` (atomic)."""
    case.write(path)


def gen(
    op: str, shape=None, lengths=None, seed: int = 0, *, gate: str = "none",
    lower_bound: float | None = None, use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
    initial_state: bool = False, scale: float | None = None, dtype: str = "f64",
    expected: bool = False, out: str | os.PathLike | None = None,
) -> Case:
    """``deltaref gen``: a deterministic case (same bytes as the CLI for the
    same arguments). ``shape``: KDA ``B,T,H,HV,K,V``, DPLR ``B,T,H,K,V``,
    token-shift ``B,T,D``; ``lengths`` packs sequences (B = 1). With
    ``expected`` it also stores the float64 truth; with ``out`` it writes it."""
    parts = _core.gen(
        op,
        None if shape is None else [int(s) for s in shape],
        None if lengths is None else [int(n) for n in lengths],
        int(seed), gate, lower_bound, use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, initial_state, scale, dtype, expected,
    )
    case = Case._from_core(parts)
    if out is not None:
        case.write(out)
        case.path = os.fspath(out)
    return case


# --------------------------------------------------------------------------
# verify


class Report:
    """The comparison ``deltaref verify`` prints: ``rows`` (one dict per
    tensor: ``tensor``, ``shape``, ``norm_ratio``, ``max_abs``, ``argmax``,
    ``pass``, ``problem``), ``passed``, and the CLI's table as ``str()``."""

    def __init__(self, json_text: str, table: str, passed: bool):
        self.json = json_text
        d = json.loads(json_text)
        self.case: str = d["case"]
        self.reference: str = d["reference"]
        self.candidate: str = d["candidate"]
        self.max_ratio: float = d["max_ratio"]
        self.rows: list[dict[str, Any]] = d["rows"]
        #: Outputs and final state only (``forward_only=True``).
        self.forward_only: bool = d.get("forward_only", False)
        #: Tensors left unchecked (partial truth, or ``allow_partial=True``).
        self.unchecked: list[str] = d.get("unchecked", [])
        self.passed = passed
        self._table = table

    def __bool__(self) -> bool:
        return self.passed

    def __getitem__(self, tensor: str) -> dict[str, Any]:
        for r in self.rows:
            if r["tensor"] == tensor:
                return r
        raise KeyError(tensor)

    def __str__(self) -> str:
        return self._table

    def __repr__(self) -> str:
        return self._table


def _candidate_tensors(case: Case, candidate: Any) -> tuple[dict[str, np.ndarray], str]:
    if isinstance(candidate, (str, os.PathLike)):
        p = os.fspath(candidate)
        _, tensors, _, _ = _core.read_candidate(p, case.op)
        return tensors, p
    if isinstance(candidate, Case):
        return candidate.tensors, candidate.name
    return {n: np.asarray(_array(n, t), dtype=np.float64) for n, t in candidate.items()}, "(in memory)"


def verify(
    case: Case | str | os.PathLike, candidate: Any = None, *, max_ratio: float = 5e-3,
    impl: str | None = None, chunk_size: int | None = None,
    cp: Mapping[str, Any] | None = None, precision: str | None = None,
    compute: str | None = None, forward_only: bool = False, allow_partial: bool = False,
) -> Report:
    """``deltaref verify``: compare ``candidate`` (a candidate file, a
    :class:`Case`, or a dict of FLA-named arrays) with the case's stored
    truth (or, when it stores none, the float64 oracle); without a candidate,
    compare an implementation (``impl`` ...) with the stored truth.
    A tensor passes when ``max_abs ≤ 1e-6`` or ``norm_ratio < max_ratio``.
    ``forward_only``: the outputs and final state alone (a forward-only
    port; the report says so). ``allow_partial``: tensors the candidate (or
    the stored truth) lacks are listed as unchecked instead of failing."""
    if not isinstance(case, Case):
        case = read_case(case)
    flags_given = impl not in (None, "naive") or any(
        f is not None for f in (chunk_size, cp, precision, compute)
    )
    cand = cname = None
    if candidate is not None:
        if flags_given:
            raise ValueError(
                "--impl and its flags choose what to run; with --candidate nothing runs "
                "but the f64 oracle (when the case stores no truth): drop them"
            )
        cand, cname = _candidate_tensors(case, candidate)
    args = _impl_args(impl, "naive", chunk_size, cp)
    out = _core.verify(
        *case._core_args(), cand, float(max_ratio), case.name, cname or "",
        precision=precision, compute=compute, forward_only=bool(forward_only),
        allow_partial=bool(allow_partial), **args,
    )
    return Report(*out)
