"""Case files in and candidate files out, and the case's loss, shared by the runners."""

import json

import safetensors
import safetensors.torch as st
import torch

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64}
# FLA's gradient names for inputs whose name does not take a plain `d` prefix.
GRAD_NAME = {"A_log": "dA_log", "dt_bias": "ddt_bias", "initial_state": "dh0"}


def load(path, device="cuda"):
    """The case's tensors (on `device`, in their stored dtype) and its `case` options."""
    t = st.load_file(path, device=device)
    with safetensors.safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["case"])
    return t, meta


def save(cand, path):
    """Writes a candidate: every tensor as float32 (deltaref widens it to float64)."""
    st.save_file({n: v.detach().float().contiguous().cpu() for n, v in cand.items()}, path)


def token_dtype(t, first="q"):
    """The dtype a kernel gets its token inputs in: the case's storage dtype (bf16 stays bf16)."""
    return torch.bfloat16 if t[first].dtype == torch.bfloat16 else torch.float32


def loss(t, out, last, d_out="do", d_last="dht"):
    """The case's loss: Σ out·do (+ Σ last·dht when the case has dht)."""
    total = (out.float() * t[d_out].float()).sum()
    if last is not None and d_last in t:
        total = total + (last.float() * t[d_last].float()).sum()
    return total


def grads(leaves):
    """FLA-named gradients of the leaf tensors that received one."""
    return {GRAD_NAME.get(n, "d" + n): v.grad for n, v in leaves.items() if v.grad is not None}


def sequences(t):
    """The case's sequences as (start, end) token ranges of the packed batch, or None for a dense batch."""
    cu = t.get("cu_seqlens")
    if cu is None:
        return None
    cu = cu.tolist()
    return list(zip(cu[:-1], cu[1:]))
