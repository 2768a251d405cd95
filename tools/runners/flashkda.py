"""FlashKDA (MoonshotAI, PyPI `tokenspeed-flashkda`): KDA forward only, bf16, K = V = 128.

Its convention (read from the wheel's `flash_kda/__init__.py` and the repo's
`csrc/flash_kda.cpp`, `tests/torch_ref.py`): the only gate is FLA's
lower-bound gate `lower_bound·sigmoid(exp(A_log)·(g + dt_bias))` from the raw
`g`, with `A_log [H]` and `dt_bias [H, K]` required; β arrives as logits
(sigmoid inside); q and k are always l2-normalised inside; the state is
`[N, H, V, K]` (V first); no grouped value heads; `scale` is required.
"""

import torch

NAME = "flashkda"
CONVENTION = "flashkda"


def why_not(meta, t):
    if meta["op"] != "kda":
        return "FlashKDA runs KDA only"
    need = {
        "gate": "lowerbound",
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "allow_neg_eigval": False,
    }
    for k, v in need.items():
        if meta.get(k, False) != v:
            return f"FlashKDA needs {k} = {v}"
    if "A_log" not in t or "dt_bias" not in t:
        return "FlashKDA needs A_log and dt_bias"
    K, V = t["q"].shape[-1], t["v"].shape[-1]
    if K != 128 or V != 128:
        return f"FlashKDA runs K = V = 128 only (case: K = {K}, V = {V})"
    if t["q"].shape[2] != t["v"].shape[2]:
        return "FlashKDA has no grouped value heads"
    return None


def run(meta, t):
    import flash_kda

    bf = torch.bfloat16
    q, k, v, g, beta = (t[n].to(bf).contiguous() for n in ("q", "k", "v", "g", "beta"))
    H, K = q.shape[2], q.shape[3]
    cu = t.get("cu_seqlens")
    n_seq = q.shape[0] if cu is None else cu.numel() - 1
    h0 = t.get("initial_state")
    h0 = None if h0 is None else h0.float().transpose(-1, -2).contiguous()  # FLA [N,H,K,V] -> [N,H,V,K]
    out = torch.empty_like(v)
    final = torch.empty(n_seq, H, v.shape[-1], K, device=q.device, dtype=torch.float32)
    scale = meta.get("scale") or K ** -0.5
    args = dict(q=q, k=k, v=v, g=g, beta=beta, out=out, h0=h0, final=final, cu=cu)
    print("flashkda inputs:", {n: (tuple(x.shape), str(x.dtype), str(x.device), x.is_contiguous())
                               for n, x in args.items() if x is not None}, "torch", torch.__version__, flush=True)
    flash_kda.fwd(
        q, k, v, g, beta, scale, out,
        t["A_log"].float().contiguous(), t["dt_bias"].float().reshape(H, K).contiguous(),
        float(meta["lower_bound"]),
        initial_state=h0, final_state=final,
        cu_seqlens=None if cu is None else cu.to(torch.int64),
    )
    return {"o": out, "final_state": final.transpose(-1, -2)}, "flash_kda.fwd"
