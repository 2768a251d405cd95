#!/usr/bin/env python3
"""Run FLA's kernels (fla-core) on a deltaref case file; write a candidate.

    python3 tools/fla_candidate.py CASE.safetensors CAND.safetensors [CASE CAND ...] [--dtype bf16|f32] [--time N] [--intermediates]
    deltaref verify --case CASE.safetensors --candidate CAND.safetensors

KDA runs `chunk_kda`, DPLR `chunk_dplr_delta_rule`, GDN
`chunk_gated_delta_rule`, token-shift `fla.modules.token_shift`, causal conv1d
`fla.modules.causal_conv1d.causal_conv1d` (Triton backend), with the options
of the case's `case` metadata.
Token inputs (and `do`/`dy`) go in the chosen dtype (default: the dtype the
case stores `q`/`x` in, bf16 or else f32); `A_log`, `dt_bias`,
`initial_state` and `dht` in fp32, as FLA requires (conv: `weight`, `bias`
too). The loss is the case's: Σ o·do + Σ final_state·dht (token-shift:
Σ y·dy + Σ final_cache·dfinal_cache; conv: Σ y·dy + Σ final_state·dht).
With --time N it also prints FLA's best forward and backward time over N runs.
With --intermediates (KDA, no CP) the candidate also holds FLA's own forward
intermediates, from `fla.ops.kda.chunk_fwd.chunk_kda_fwd(...,
disable_recompute=True)` on the pre-processed inputs (l2norm, beta sigmoid
as `chunk_kda` applies them): `g_cumsum` (base-2 in-chunk cumsum), `Aqk`, `Akk`
(upper triangles of each chunk zeroed: FLA leaves them unwritten), `w`,
`u`, `qg`, `kg`, `v_new`, `h`; `deltaref verify` compares each with the
oracle's and names the first chunk out of band.
Several case/candidate pairs run in one process (Triton compiles once).
Each phase (load, forward, backward, intermediates) prints its wall time.

Autotuning cost (measured on a cold H100, fla-core 0.6.0, triton 3.6, with
tools/fla_fidelity.py): FLA autotunes each kernel once per key, and the keys
include more than (H, K, V): the gate variant (safe_gate, in-kernel gate or
none) and T's chunk count too. The first KDA case took 311 s (forward 112 s,
backward 198 s); a second case with the same key 14 s; each new variant
60-260 s (K=V=64: 117 s, gate none: 213 s, T=8192: 60 s); the first DPLR
case 257 s. FLA keeps Triton's autotune results on disk (FLA_CACHE_RESULTS=1,
its default) next to the compiled kernels in TRITON_CACHE_DIR (default
~/.triton/cache; 230 MB after those 8 cases, 45 kB of it `*.autotune.json`):
keep that directory between runs, or carry it to a fresh machine, and a rerun
skips the autotuning (the compiled kernels too when the whole directory goes).
Carrying only the 45 kB of autotune JSONs to a fresh H100 (unpacked under
TRITON_CACHE_DIR, same wheel) is enough: measured, the first KDA case took
31 s instead of 311 s, the first DPLR K=128 case 10 s instead of 257 s,
K=V=64 KDA 10 s instead of 117 s (what is left is Triton compiling); a variant
the JSONs lack still autotunes (DPLR K=V=64: 212 s).
With --dump (tools/fla_fidelity.py) the results of the stage functions of
FLA's chunked path are recorded too (`Stages`), for per-token diagnosis.
"""

import argparse
import json
import time

import safetensors
import safetensors.torch as st
import torch

TOKEN_INPUTS = {
    "kda": ["q", "k", "v", "g", "beta"],
    "dplr": ["q", "k", "v", "a", "b", "gk"],
    "gdn": ["q", "k", "v", "g", "beta"],
    "token_shift": ["x"],
    "causal_conv1d": ["x"],
}
STATE_INPUTS = {
    "kda": ["A_log", "dt_bias", "initial_state"],
    "dplr": ["initial_state"],
    "gdn": ["A_log", "dt_bias", "initial_state"],
    "token_shift": ["cache"],
    "causal_conv1d": ["weight", "bias", "initial_state"],
}
# (main output, final state) and their upstream gradients, where not o/final_state and do/dht.
RESULT_NAMES = {"token_shift": ("y", "final_cache"), "causal_conv1d": ("y", "final_state")}
UPSTREAM_NAMES = {"token_shift": ("dy", "dfinal_cache"), "causal_conv1d": ("dy", "dht")}
GRAD_NAME = {"A_log": "dA_log", "dt_bias": "ddt_bias", "initial_state": "dh0"}


class Phases:
    """Prints each phase of a case with its wall time (CUDA synchronised), so a
    long first call (Triton compile + autotune) is visible as it happens."""

    def __init__(self, case):
        self.case, self.t = case, time.time()

    def done(self, phase):
        torch.cuda.synchronize()
        now = time.time()
        print(f"  {self.case}: {phase} {now - self.t:.1f} s", flush=True)
        self.t = now


def load(path):
    t = st.load_file(path, device="cuda")
    with safetensors.safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["case"])
    return t, meta


def kda_options(meta, p):
    """`chunk_kda`'s keyword arguments for a case's options and parameters `p`."""
    gate = meta.get("gate", "none")
    return dict(
        scale=meta.get("scale"),
        use_qk_l2norm_in_kernel=meta.get("use_qk_l2norm_in_kernel", False),
        use_gate_in_kernel=gate != "none",
        A_log=p.get("A_log"),
        dt_bias=p.get("dt_bias"),
        lower_bound=meta.get("lower_bound") if gate == "lowerbound" else None,
        safe_gate=gate == "lowerbound",
        use_beta_sigmoid_in_kernel=meta.get("use_beta_sigmoid_in_kernel", False),
        allow_neg_eigval=meta.get("allow_neg_eigval", False),
    )


def forward(op, meta, x, p, cu):
    """Returns (main output, final state) of FLA's kernel."""
    if op == "kda":
        from fla.ops.kda import chunk_kda

        return chunk_kda(
            **x,
            **kda_options(meta, p),
            initial_state=p.get("initial_state"),
            output_final_state=True,
            cu_seqlens=cu,
        )
    if op == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        chunk = {"chunk_size": meta["chunk_size"]} if "chunk_size" in meta else {}
        return chunk_gated_delta_rule(
            **x,
            scale=meta.get("scale"),
            initial_state=p.get("initial_state"),
            output_final_state=True,
            use_qk_l2norm_in_kernel=meta.get("use_qk_l2norm_in_kernel", False),
            use_beta_sigmoid_in_kernel=meta.get("use_beta_sigmoid_in_kernel", False),
            allow_neg_eigval=meta.get("allow_neg_eigval", False),
            state_v_first=meta.get("state_v_first", False),
            cu_seqlens=cu,
            use_gate_in_kernel=meta.get("use_gate_in_kernel", False),
            A_log=p.get("A_log"),
            dt_bias=p.get("dt_bias"),
            **chunk,
        )
    if op == "causal_conv1d":
        from fla.modules.causal_conv1d import causal_conv1d

        act = meta.get("activation", "none")
        return causal_conv1d(
            x=x["x"],
            weight=p["weight"],
            bias=p.get("bias"),
            initial_state=p.get("initial_state"),
            output_final_state=True,
            activation=None if act == "none" else act,
            cu_seqlens=cu,
        )
    if op == "dplr":
        from fla.ops.generalized_delta_rule.dplr import chunk_dplr_delta_rule

        return chunk_dplr_delta_rule(
            **x,
            scale=meta.get("scale"),
            initial_state=p.get("initial_state"),
            output_final_state=True,
            cu_seqlens=cu,
        )
    from fla.modules.token_shift import token_shift

    y, cache = token_shift(x["x"], cu_seqlens=cu, cache=p.get("cache"), output_cache=True)
    return y, cache.reshape(-1, cache.shape[-1])


def run(op, meta, t, dtype):
    x = {n: t[n].to(dtype).requires_grad_() for n in TOKEN_INPUTS[op]}
    p = {n: t[n].float().requires_grad_() for n in STATE_INPUTS[op] if n in t}
    if op == "token_shift" and "cache" in p:
        p["cache"] = t["cache"].to(dtype).requires_grad_()
    cu = t.get("cu_seqlens")
    out, last = forward(op, meta, x, p, cu)
    d_out, d_last = UPSTREAM_NAMES.get(op, ("do", "dht"))
    loss = (out.float() * t[d_out].to(dtype).float()).sum()
    if d_last in t:
        loss = loss + (last.float() * t[d_last].float()).sum()
    return x, p, out, last, loss


def kda_intermediates(meta, t, dtype):
    """FLA's chunk_kda_fwd results for the case's inputs (no autograd): `o`,
    `final_state` and the intermediates."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.gate import fused_beta_sigmoid
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd
    from fla.ops.utils import prepare_chunk_indices

    q, k, v, g, beta = (t[n].to(dtype) for n in TOKEN_INPUTS["kda"])
    if meta.get("use_qk_l2norm_in_kernel", False):
        q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
    if meta.get("use_beta_sigmoid_in_kernel", False):
        beta = fused_beta_sigmoid(x=beta, scale=2.0 if meta.get("allow_neg_eigval", False) else 1.0)
    cu = t.get("cu_seqlens")
    bt = meta.get("chunk_size", 64)
    gate = meta.get("gate", "none")
    f32 = lambda n: t[n].float() if n in t else None  # noqa: E731
    res = chunk_kda_fwd(
        q=q, k=k, v=v, g=g, beta=beta,
        scale=meta.get("scale") or q.shape[-1] ** -0.5,
        initial_state=f32("initial_state"),
        output_final_state=True,
        cu_seqlens=cu,
        chunk_indices=prepare_chunk_indices(cu, bt) if cu is not None else None,
        chunk_size=bt,
        safe_gate=gate == "lowerbound",
        lower_bound=meta.get("lower_bound") if gate == "lowerbound" else None,
        use_gate_in_kernel=gate != "none",
        A_log=f32("A_log"),
        dt_bias=f32("dt_bias"),
        disable_recompute=True,
    )
    names = ["o", "final_state", "g_cumsum", "Aqk", "Akk", "w", "u", "qg", "kg", "v_new", "h"]
    inter = dict(zip(names, res))
    # Position of each token inside its chunk: mask the unwritten upper triangles.
    T = q.shape[1]
    starts = cu.tolist() if cu is not None else [0, T]
    pos = torch.cat([torch.arange(e - s, device=q.device) % bt for s, e in zip(starts[:-1], starts[1:])])
    upper = torch.arange(bt, device=q.device)[None, :] > pos[:, None]
    for n in ("Aqk", "Akk"):
        inter[n] = inter[n].masked_fill(upper[None, :, None, :], 0)
    return inter


# Functions each op's chunked path calls through its module's globals, so that
# wrapping them there records every stage's output (forward, the backward's
# recompute, the backward's own stages), in calling order.
STAGE_FUNCTIONS = {
    "kda": (
        "fla.ops.kda.chunk_bwd",
        [
            "kda_gate_chunk_cumsum", "recompute_w_u_fwd", "chunk_gated_delta_rule_fwd_h", "chunk_kda_bwd_dAv",
            "chunk_gated_delta_rule_bwd_dhu", "chunk_kda_bwd_wy_dqkg_fused", "chunk_kda_bwd_intra",
            "chunk_local_cumsum", "kda_gate_bwd",
        ],
    ),
    "dplr": (
        "fla.ops.generalized_delta_rule.dplr.chunk",
        [
            "chunk_rwkv6_fwd_cumsum", "chunk_dplr_fwd_intra", "prepare_wy_repr_fwd", "chunk_dplr_fwd_h",
            "chunk_dplr_fwd_o", "chunk_dplr_bwd_dAu", "chunk_dplr_bwd_dhu", "chunk_dplr_bwd_dv",
            "chunk_dplr_bwd_o", "chunk_dplr_bwd_wy", "chunk_dplr_bwd_dqk_intra",
        ],
    ),
}


class Stages:
    """Records the tensor results of an op's stage functions while active:
    `stages["<function>#<call>.<result index>"]`, in FLA's own dtype."""

    def __init__(self, op):
        self.op, self.stages, self.saved = op, {}, {}

    def __enter__(self):
        import importlib

        if self.op not in STAGE_FUNCTIONS:
            return self
        module, names = STAGE_FUNCTIONS[self.op]
        self.module = importlib.import_module(module)
        calls = {}
        for name in names:
            f = getattr(self.module, name, None)
            if f is None:
                continue
            self.saved[name] = f

            def wrapped(*a, _f=f, _name=name, **kw):
                r = _f(*a, **kw)
                calls[_name] = calls.get(_name, -1) + 1
                for j, x in enumerate(r if isinstance(r, tuple) else (r,)):
                    if isinstance(x, torch.Tensor):
                        self.stages[f"{_name}#{calls[_name]}.{j}"] = x.detach().clone()
                return r

            setattr(self.module, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, f in self.saved.items():
            setattr(self.module, name, f)


def candidate(case, out, dtype_name, reps, intermediates=False, dump=None, dump_mib=15.0):
    """Writes FLA's candidate for `case` to `out`. With `dump` (a path), also
    writes FLA's results in its own dtypes (bf16 stays bf16) plus the stage
    results recorded by `Stages`, under `stage/<function>#<call>.<index>`,
    within `dump_mib` MiB: results and gradients first, then the backward's
    stages, the forward intermediates, the rest, each group smallest first."""
    ph = Phases(case)
    t, meta = load(case)
    ph.done("load")
    op = meta["op"]
    first = TOKEN_INPUTS[op][0]
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}.get(
        dtype_name, torch.bfloat16 if t[first].dtype == torch.bfloat16 else torch.float32
    )
    with Stages(op if dump else None) as rec:
        x, p, out_t, last, loss = run(op, meta, t, dtype)
        ph.done("forward")
        loss.backward()
        ph.done("backward")
    names = RESULT_NAMES.get(op, ("o", "final_state"))
    cand = {names[0]: out_t, names[1]: last}
    cand |= {GRAD_NAME.get(n, "d" + n): v.grad for n, v in (x | p).items()}
    if intermediates:
        if op != "kda" or meta.get("cp"):
            raise ValueError("--intermediates captures KDA without CP (chunk_kda_fwd)")
        with torch.no_grad():
            inter = kda_intermediates(meta, t, dtype)
        ph.done("intermediates")
        cand |= {n: v for n, v in inter.items() if n not in ("o", "final_state")}
    st.save_file({n: v.detach().float().contiguous().cpu() for n, v in cand.items()}, out)
    print(f"FLA {op} ({dtype}): wrote {out}: {', '.join(sorted(cand))}")
    if dump:
        try:  # the candidate is written: a failing dump must not lose the case
            write_dump(dump, cand, rec.stages, dump_mib)
        except Exception as e:
            print(f"dump {dump} failed: {type(e).__name__}: {e}", flush=True)
    if reps > 0:
        best_f = best_b = float("inf")
        for _ in range(reps):
            s, m, e = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            s.record()
            *_, loss = run(op, meta, t, dtype)
            m.record()
            loss.backward()
            e.record()
            torch.cuda.synchronize()
            best_f, best_b = min(best_f, s.elapsed_time(m)), min(best_b, m.elapsed_time(e))
        print(f"FLA {op} ({dtype}) best of {reps}: forward {best_f:.3f} ms, backward {best_b:.3f} ms")


# Stage results kept first (in this order), "function.index" or a whole "function":
# those that feed the gate and decay gradients, then the forward's blocks.
DUMP_FIRST = [
    "kda_gate_bwd.0", "kda_gate_bwd.1", "kda_gate_bwd.2", "chunk_local_cumsum.0", "chunk_kda_bwd_intra.3",
    "chunk_kda_bwd_wy_dqkg_fused.4", "chunk_kda_bwd_intra.2", "chunk_kda_bwd_dAv.0",
    "chunk_kda_bwd_wy_dqkg_fused.5", "kda_gate_chunk_cumsum.0",
    "chunk_dplr_bwd_dqk_intra.4", "chunk_dplr_bwd_dqk_intra.3", "chunk_dplr_bwd_o.4", "chunk_dplr_bwd_o.3",
    "chunk_dplr_bwd_wy.3", "chunk_dplr_fwd_o.0", "chunk_dplr_fwd_h.1", "chunk_dplr_bwd_dqk_intra",
    "chunk_dplr_bwd_o", "chunk_dplr_bwd_wy", "chunk_dplr_bwd_dAu", "prepare_wy_repr_fwd", "chunk_dplr_fwd_intra",
]
RESULT_TENSORS = {"o", "final_state", "y", "final_cache"}


def dump_rank(name, size):
    """Sort key of a dumped tensor: results and gradients, the stages of
    DUMP_FIRST in its order, the forward intermediates, the other stages."""
    if not name.startswith("stage/"):
        first = name in RESULT_TENSORS or name.startswith("d")
        return (0 if first else 2, 0, size)
    function, index = name[6:].split("#")[0], name.rsplit(".", 1)[1]
    for rank, key in enumerate(DUMP_FIRST):
        if key in (function, f"{function}.{index}"):
            return (1, rank, size)
    return (3, 0, size)


def write_dump(path, cand, stages, mib):
    items = {n: v.detach().contiguous().cpu() for n, v in cand.items()}
    items |= {f"stage/{n}": v.contiguous().cpu() for n, v in stages.items()}
    size = {n: v.numel() * v.element_size() for n, v in items.items()}
    budget, kept, left = mib * 2**20, {}, []
    for n in sorted(items, key=lambda n: (dump_rank(n, size[n]), n)):
        if size[n] <= budget:
            kept[n], budget = items[n], budget - size[n]
        else:
            left.append(n)
    st.save_file(kept, path)
    print(f"dump {path}: kept {', '.join(kept)}; left out: {', '.join(left) or 'none'}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+", metavar="CASE CAND")
    ap.add_argument("--dtype", choices=["bf16", "f32"])
    ap.add_argument("--time", type=int, default=0, metavar="N")
    ap.add_argument("--intermediates", action="store_true", help="KDA: also capture FLA's forward intermediates")
    a = ap.parse_args()
    if len(a.paths) % 2:
        ap.error("give case/candidate pairs: CASE CAND [CASE CAND ...]")
    failed = 0
    pairs = list(zip(a.paths[::2], a.paths[1::2]))
    for i, (case, out) in enumerate(pairs):
        print(f"case {i + 1}/{len(pairs)}: {case}", flush=True)
        try:
            candidate(case, out, a.dtype, a.time, a.intermediates)
        except Exception as e:  # one unsupported case must not hide the others
            failed += 1
            print(f"FLA failed on {case}: {type(e).__name__}: {e}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
