"""PyTorch autograd wrappers: the oracle as differentiable functions.

    from deltaref.torch import chunk_kda
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    (o * do).sum().backward()        # q.grad, k.grad, ... : analytic float64 gradients

Same names, arguments and outputs as the functions of :mod:`deltaref`;
inputs are float64 or float32 tensors on any device (the computation runs on
the CPU; results come back on the inputs' device and dtype). ``.backward()``
calls the oracle's hand-derived backward pass: no autograd graph over T
steps, so memory stays O(state) rather than O(T·state).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import deltaref as _d

__all__ = [
    "naive_recurrent_kda",
    "chunk_kda",
    "naive_recurrent_dplr_delta_rule",
    "chunk_dplr_delta_rule",
    "token_shift",
]

# The tensor arguments of each op, in order, and the gradient of each.
_KDA = (("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"),
        ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"))
_DPLR = (("q", "k", "v", "a", "b", "gk", "initial_state"),
         ("dq", "dk", "dv", "da", "db", "dgk", "dh0"))
_TOKEN_SHIFT = (("x", "cache"), ("dx", "dcache"))


class _Oracle(torch.autograd.Function):
    """``forward(ctx, backward_fn, names, grads, outs, kwargs, *tensors)``:
    ``backward_fn`` is a ``deltaref.*_backward`` companion, ``outs`` the
    names of its two outputs (main output, final state)."""

    @staticmethod
    def forward(ctx, backward_fn: Callable, names, grads, outs, kwargs, *tensors):
        inputs = dict(zip(names, tensors))
        lead = tensors[0]
        r = backward_fn(**inputs, **kwargs, **{outs[2]: None})  # no `do`: forward only
        ctx.backward_fn, ctx.names, ctx.grads, ctx.outs, ctx.kwargs = (
            backward_fn, names, grads, outs, kwargs,
        )
        ctx.save_for_backward(*tensors)
        return tuple(r[n].to(device=lead.device, dtype=lead.dtype) for n in outs[:2])

    @staticmethod
    def backward(ctx, d_main, d_last):
        tensors = ctx.saved_tensors
        inputs = dict(zip(ctx.names, tensors))
        upstream = {ctx.outs[2]: d_main, ctx.outs[3]: d_last}
        r = _call(ctx.backward_fn, inputs, ctx.kwargs, upstream)
        grads = tuple(
            None if (t is None or g not in r) else r[g].to(device=t.device, dtype=t.dtype)
            for t, g in zip(tensors, ctx.grads)
        )
        return (None, None, None, None, None) + grads


def _call(fn: Callable, inputs: dict, kwargs: dict, upstream: dict) -> Any:
    return fn(**inputs, **kwargs, **{n: v for n, v in upstream.items() if v is not None})


def _apply(backward_fn, spec, outs, kwargs, given: dict):
    names, grads = spec
    present = [n for n in names if given.get(n) is not None]
    tensors = [given[n] for n in present]
    picked = [grads[names.index(n)] for n in present]
    return _Oracle.apply(backward_fn, tuple(present), tuple(picked), outs, kwargs, *tensors)


_KDA_OUTS = ("o", "final_state", "do", "dht")


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                        output_final_state=False, *, A_log=None, dt_bias=None, **options):
    """Differentiable :func:`deltaref.naive_recurrent_kda`."""
    given = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                 initial_state=initial_state)
    o, ht = _apply(_d.naive_recurrent_kda_backward, _KDA, _KDA_OUTS,
                   dict(scale=scale, **options), given)
    return o, (ht if output_final_state else None)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              *, A_log=None, dt_bias=None, **options):
    """Differentiable :func:`deltaref.chunk_kda`."""
    given = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                 initial_state=initial_state)
    for unused in ("disable_recompute", "cu_seqlens_cpu"):
        options.pop(unused, None)
    o, ht = _apply(_d.chunk_kda_backward, _KDA, _KDA_OUTS, dict(scale=scale, **options), given)
    return o, (ht if output_final_state else None)


def naive_recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                                    output_final_state=False, **options):
    """Differentiable :func:`deltaref.naive_recurrent_dplr_delta_rule`."""
    given = dict(q=q, k=k, v=v, a=a, b=b, gk=gk, initial_state=initial_state)
    o, ht = _apply(_d.naive_recurrent_dplr_delta_rule_backward, _DPLR, _KDA_OUTS,
                   dict(scale=scale, **options), given)
    return o, (ht if output_final_state else None)


def chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                          output_final_state=False, **options):
    """Differentiable :func:`deltaref.chunk_dplr_delta_rule`."""
    given = dict(q=q, k=k, v=v, a=a, b=b, gk=gk, initial_state=initial_state)
    for unused in ("disable_recompute", "cu_seqlens_cpu", "safe_gate"):
        options.pop(unused, None)
    o, ht = _apply(_d.chunk_dplr_delta_rule_backward, _DPLR, _KDA_OUTS,
                   dict(scale=scale, **options), given)
    return o, (ht if output_final_state else None)


def token_shift(x, cu_seqlens=None, cache=None, output_cache=False, *, cp=None):
    """Differentiable :func:`deltaref.token_shift`."""
    y, last = _apply(_d.token_shift_backward, _TOKEN_SHIFT, ("y", "final_cache", "dy", "dfinal_cache"),
                     dict(cu_seqlens=cu_seqlens, cp=cp), dict(x=x, cache=cache))
    return (y, last) if output_cache else y
