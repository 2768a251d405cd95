"""Dao-AILab `causal-conv1d` (PyPI sdist 1.7.0, a CUDA extension built with
nvcc on the GPU machine): causal depthwise conv1d, forward and backward.

Its convention (read from the sdist's `causal_conv1d/causal_conv1d_interface.py`
and `csrc/causal_conv1d.cpp`): `x [B, D, T]`, channel-last in memory (the
layout its states and `seq_idx` need: FLA's `[B, T, D]` transposed, no copy);
`weight [D, W]` and `bias [D]` in float32 or the token dtype; width 2–4;
D a multiple of 8; states hold the last **W − 1** tokens (`[B, D, W − 1]`,
in the token dtype), where FLA's `initial_state`/`final_state` hold W. Varlen
goes through `seq_idx [B, T]` (int32), which admits neither an initial nor a
final state.

Mapping (this runner's, not the kernel's): the kernel gets the last W − 1
columns of FLA's `initial_state` (column 0 is never read: a width-W window
over the first token reaches back W − 1 tokens); FLA's W-column
`final_state` is the kernel's W − 1 columns with the oldest token put in
front, taken in torch from the inputs. For a packed batch the whole
`final_state` is taken that way, since the kernel returns none there.
"""

import torch

from .common import grads, loss, sequences, token_dtype

CONVENTION = "fla"  # FLA's tensors in and out: the layout changes happen here


def why_not(meta, t):
    if meta["op"] != "causal_conv1d":
        return "causal-conv1d runs the causal depthwise conv1d only"
    width = t["weight"].shape[-1]
    if not 2 <= width <= 4:
        return f"causal-conv1d supports width 2 to 4, the case has {width}"
    if t["x"].shape[-1] % 8:
        return f"causal-conv1d needs D divisible by 8 (channel-last), the case has D = {t['x'].shape[-1]}"
    if meta.get("activation", "none") not in ("none", "silu", "swish"):
        return f"causal-conv1d has no activation {meta['activation']}"
    if "cu_seqlens" in t and "initial_state" in t:
        return "causal-conv1d takes no initial state with seq_idx (varlen)"
    return None


def window(h0, x_bdt, width):
    """The last `width` tokens of [h0 | x] along time: FLA's final state [B, D, W]."""
    return torch.cat([h0, x_bdt], dim=2)[:, :, -width:]


def seq_idx_of(cu, T, device):
    """Token → sequence index [1, T] (int32), what the kernel takes for a packed batch."""
    idx = torch.empty(T, dtype=torch.int32, device=device)
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        idx[a:b] = n
    return idx[None]


def make(channel_last_grad):
    """The runner; with `channel_last_grad` the final state's gradient is
    handed to the kernel channel-last (stride 1 along D). The kernel reads
    `dfinal_states` with its channel stride inside a block of channels but
    steps between blocks as if that stride were 1 (`causal_conv1d_bwd.cu`),
    and the C++ entry checks the stride for `initial_states` and
    `final_states` but not for `dfinal_states`: autograd's gradient of a
    state sliced out of a `[B, D, W]` tensor has stride W along D."""
    def run(meta, t):
        return conv(meta, t, channel_last_grad)

    return run


def conv(meta, t, channel_last_grad):
    from causal_conv1d import causal_conv1d_fn

    dt = token_dtype(t, "x")
    leaves = {"x": t["x"].detach().clone().to(dt).requires_grad_()}
    for n in ("weight", "bias", "initial_state"):
        if n in t:
            leaves[n] = t[n].detach().clone().float().requires_grad_()
    x_bdt = leaves["x"].transpose(1, 2)  # [B, D, T], channel-last: stride(1) == 1
    width = leaves["weight"].shape[-1]
    act = meta.get("activation", "none")
    act = None if act == "none" else act
    spans = sequences(t)
    if spans is None:
        B, D, _ = x_bdt.shape
        h0 = leaves.get("initial_state")
        h0 = torch.zeros(B, D, width, device=x_bdt.device) if h0 is None else h0
        # the kernel wants its initial state channel-last and in the token dtype
        h0_kernel = h0[:, :, 1:].to(dt).transpose(1, 2).contiguous().transpose(1, 2)
        y, last = causal_conv1d_fn(x_bdt, leaves["weight"], leaves.get("bias"),
                                   initial_states=h0_kernel, return_final_states=True, activation=act)
        if channel_last_grad:
            last.register_hook(lambda g: g.transpose(1, 2).contiguous().transpose(1, 2))
        oldest = window(h0.to(dt), x_bdt, width)[:, :, :1]
        final = torch.cat([oldest, last], dim=2)
        served = "causal_conv1d_fn (dense, states" + (", dfinal_states channel-last)" if channel_last_grad else ")")
    else:
        idx = seq_idx_of(t["cu_seqlens"].tolist(), x_bdt.shape[2], x_bdt.device)
        y = causal_conv1d_fn(x_bdt, leaves["weight"], leaves.get("bias"), seq_idx=idx, activation=act)
        D = x_bdt.shape[1]
        zeros = torch.zeros(1, D, width, dtype=dt, device=x_bdt.device)
        final = torch.cat([window(zeros, x_bdt[:, :, a:b], width) for a, b in spans], dim=0)
        served = "causal_conv1d_fn (seq_idx; final state taken in torch)"
    y = y.transpose(1, 2)  # back to FLA's [B, T, D]
    loss(t, y, final, d_out="dy").backward()
    return {"y": y, "final_state": final} | grads(leaves), served
