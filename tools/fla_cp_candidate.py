#!/usr/bin/env python3
"""Run FLA's real multi-GPU context parallel on a deltaref case; write a candidate.

    torchrun --nproc-per-node N tools/fla_cp_candidate.py CASE CAND [--layout contiguous|zigzag]
                                                        [--dtype bf16|f32] [--ran-case RAN]
    deltaref verify --case RAN --candidate CAND --allow-partial

Each rank loads the case, takes its shard of the packed batch (contiguous:
tokens [r·T/N, (r+1)·T/N); zigzag: intervals r and 2N−1−r of T/(2N) tokens,
concatenated as [front; back]), builds FLA's `build_cp_context(cu_seqlens,
group, layout=...)` and runs `chunk_kda`, `chunk_dplr_delta_rule` or
`token_shift_cp` forward and backward with `cp_context=`. Token tensors and
their gradients are all-gathered and put back in global order; the gradients
of `A_log` / `dt_bias` (per-rank partial sums) are all-reduced. Rank 0 writes
one candidate in deltaref's format.

FLA's CP takes no `initial_state` and returns no final state, so: a case with
`initial_state` (or a token-shift `cache`) is refused; the final-state term of
the loss is dropped, and rank 0 writes the case FLA actually ran (`--ran-case`,
default CAND with `.ran` before the suffix: the same inputs and `do`, no `dht`,
no stored truth) so that `deltaref verify` recomputes the f64 truth of that
loss. The candidate has no `final_state`: verify it with `--allow-partial`,
which lists it as unchecked.

Token-shift CP supports only the contiguous layout in fla-core 0.6.0.
"""

import argparse
import json
import os
import time

import safetensors
import safetensors.torch as st
import torch
import torch.distributed as dist
from fla_candidate import GRAD_NAME, TOKEN_INPUTS, kda_options  # same directory

# FLA's CP takes no initial state or cache: the parameters are the gate's alone.
PARAM_INPUTS = {"kda": ["A_log", "dt_bias"], "dplr": [], "token_shift": []}
# Stored truth and the final-state upstream gradient, dropped from the ran case.
RESULTS = {
    "o", "final_state", "y", "final_cache", "dq", "dk", "dv", "dg", "dbeta", "dA_log",
    "ddt_bias", "dh0", "da", "db", "dgk", "dx", "dcache", "dht", "dfinal_cache",
}


def log(msg):
    if dist.get_rank() == 0:
        print(f"[fla_cp {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shard_ranges(t, world, rank, layout):
    """Global token ranges of `rank`'s local buffer, in buffer order."""
    parts = world if layout == "contiguous" else 2 * world
    if t % parts:
        raise SystemExit(f"T = {t} must be divisible by {parts} for the {layout} layout over {world} ranks")
    p = t // parts
    if layout == "contiguous":
        return [(rank * p, (rank + 1) * p)]
    back = 2 * world - 1 - rank
    return [(rank * p, (rank + 1) * p), (back * p, (back + 1) * p)]


def local(x, ranges):
    return torch.cat([x[:, a:b] for a, b in ranges], dim=1).contiguous()


def unshard(local_t, t, world, layout):
    """All-gathers a [1, T/world, ...] tensor and returns it in global token order."""
    out = torch.empty((world, *local_t.shape), dtype=local_t.dtype, device=local_t.device)
    dist.all_gather_into_tensor(out, local_t.contiguous())
    full = torch.empty((1, t, *local_t.shape[2:]), dtype=local_t.dtype, device=local_t.device)
    for r in range(world):
        off = 0
        for a, b in shard_ranges(t, world, r, layout):
            full[:, a:b] = out[r][:, off:off + b - a]
            off += b - a
    return full


def forward(op, meta, x, p, ctx):
    if op == "kda":
        from fla.ops.kda import chunk_kda

        o, _ = chunk_kda(**x, **kda_options(meta, p), cp_context=ctx)
        return o
    if op == "dplr":
        from fla.ops.generalized_delta_rule.dplr import chunk_dplr_delta_rule

        o, _ = chunk_dplr_delta_rule(**x, scale=meta.get("scale"), cp_context=ctx)
        return o
    from fla.modules.token_shift_cp import token_shift_cp

    return token_shift_cp(x["x"], cp_context=ctx)


def write_ran_case(case, path, meta_text):
    """The case FLA's CP ran: inputs and `do`/`dy` only (no `dht`, no truth)."""
    with safetensors.safe_open(case, "pt") as f:
        keep = {n: f.get_tensor(n) for n in f.keys() if n not in RESULTS}
    st.save_file(keep, path, metadata={"case": meta_text})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("case")
    ap.add_argument("candidate")
    ap.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous")
    ap.add_argument("--dtype", choices=["bf16", "f32"])
    ap.add_argument("--ran-case")
    a = ap.parse_args()

    # Bind this process to its GPU before NCCL sees any device: otherwise
    # every rank's communicator lands on device 0 ("Duplicate GPU detected").
    gpu = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", device_id=torch.device("cuda", gpu))
    rank, world = dist.get_rank(), dist.get_world_size()
    from fla.ops.cp import build_cp_context

    t = st.load_file(a.case, device=f"cuda:{gpu}")  # plain "cuda" is device 0 here
    with safetensors.safe_open(a.case, "pt") as f:
        meta_text = f.metadata()["case"]
    meta = json.loads(meta_text)
    op = meta["op"]
    for refused in ("initial_state", "cache"):
        if refused in t:
            raise SystemExit(f"{a.case}: FLA's CP takes no `{refused}`; generate the case without --initial-state")
    if op == "token_shift" and a.layout != "contiguous":
        raise SystemExit("fla-core 0.6.0's token_shift_cp supports only the contiguous layout")
    first = "x" if op == "token_shift" else "q"
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}.get(
        a.dtype, torch.bfloat16 if t[first].dtype == torch.bfloat16 else torch.float32
    )
    T = t[first].shape[1]
    if t[first].shape[0] != 1:
        raise SystemExit(f"{a.case}: CP needs one packed row (B = 1), got B = {t[first].shape[0]}")
    cu = t["cu_seqlens"] if "cu_seqlens" in t else torch.tensor([0, T], device="cuda")
    ranges = shard_ranges(T, world, rank, a.layout)
    ctx = build_cp_context(cu.long(), group=dist.group.WORLD, cu_seqlens_cpu=cu.long().cpu(), layout=a.layout)
    log(f"{op} T={T} world={world} layout={a.layout} dtype={dtype}; rank 0 holds {ranges}")

    x = {n: local(t[n].to(dtype), ranges).requires_grad_() for n in TOKEN_INPUTS[op]}
    p = {n: t[n].float().requires_grad_() for n in PARAM_INPUTS[op] if n in t}
    d_out = "dy" if op == "token_shift" else "do"
    start = time.perf_counter()
    out = forward(op, meta, x, p, ctx)
    loss = (out.float() * local(t[d_out].to(dtype), ranges).float()).sum()
    loss.backward()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    log(f"forward+backward (first call, autotuning included): {wall:.2f} s")

    cand = {("y" if op == "token_shift" else "o"): unshard(out.detach().float(), T, world, a.layout)}
    for n, v in x.items():
        cand["d" + n] = unshard(v.grad.float(), T, world, a.layout)
    for n, v in p.items():
        g = v.grad.float().contiguous()
        dist.all_reduce(g)
        cand[GRAD_NAME[n]] = g
    if rank == 0:
        st.save_file({n: v.cpu().contiguous() for n, v in cand.items()}, a.candidate)
        stem, ext = os.path.splitext(a.candidate)
        ran = a.ran_case or f"{stem}.ran{ext}"
        write_ran_case(a.case, ran, meta_text)
        log(f"wrote {a.candidate} ({', '.join(sorted(cand))}) and the case FLA ran: {ran}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
