"""opengdn (PyPI `opengdn` 0.1.0): GDN in PyTorch, three paths (`reference`, `chunkwise`, `triton`).

Its convention (read from the wheel's `opengdn/reference.py`, `chunkwise.py`,
`triton.py`): the gate is linear, `alpha = exp(g)`; there is no scale
(`o = S q`: FLA's `scale` is applied to q before the call); the state is
`[B, H, V, K]` (V first) and must share q's dtype; no grouped value heads, no
varlen (a dense batch only), no in-kernel l2norm, gate or β sigmoid. The
backward is torch autograd through each path.
"""

import torch

from .common import grads, loss, token_dtype

PATHS = ("reference", "chunkwise", "triton")
CONVENTION = "opengdn"


def why_not(meta, t):
    if meta["op"] != "gdn":
        return "opengdn runs GDN only"
    for k in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval"):
        if meta.get(k, False):
            return f"opengdn has no {k}"
    if "cu_seqlens" in t:
        return "opengdn has no varlen (dense batches only)"
    if t["q"].shape[2] != t["v"].shape[2]:
        return "opengdn has no grouped value heads"
    return None


def make(path):
    def run(meta, t):
        import opengdn

        fn = {"reference": opengdn.gated_delta, "chunkwise": opengdn.gated_delta_chunkwise,
              "triton": opengdn.gated_delta_triton}[path]
        dt = token_dtype(t)
        leaves = {n: t[n].detach().clone().to(dt).requires_grad_() for n in ("q", "k", "v", "g", "beta")}
        if "initial_state" in t:
            leaves["initial_state"] = t["initial_state"].detach().clone().float().requires_grad_()
        K = leaves["q"].shape[-1]
        scale = meta.get("scale") or K ** -0.5
        state = leaves.get("initial_state")
        # FLA [N,H,K,V] -> [B,H,V,K]; contiguous, as its Triton path requires.
        state = None if state is None else state.transpose(-1, -2).to(dt).contiguous()
        alpha = torch.exp(leaves["g"].float()).to(dt)
        o, final = fn((leaves["q"] * scale).contiguous(), leaves["k"], leaves["v"], alpha, leaves["beta"], state)
        final = final.transpose(-1, -2)  # back to FLA's [N,H,K,V]
        loss(t, o, final).backward()
        return {"o": o, "final_state": final} | grads(leaves), f"opengdn.{fn.__name__}"

    return run
