//! The built-in conventions, each read from its kernel's source (the
//! versions and lines named in `source`; the research notes behind them
//! are summarised in the README's conventions table).

use super::{Activation, Convention, GateSpace, HeadMap, L2norm, ScaleRule, StateLayout};

/// FLA (fla-core 0.6.0): `chunk_kda` (`fla/ops/kda/chunk.py:216`),
/// `chunk_gated_delta_rule` (`fla/ops/gated_delta_rule/chunk.py:397`);
/// grouped value heads `i_h = i_hv // (HV // H)` (`fla/ops/kda/fused_recurrent.py:89`).
pub static FLA: Convention = Convention {
    name: "fla",
    source: "fla-core 0.6.0: fla/ops/kda/chunk.py:216, fla/ops/gated_delta_rule/chunk.py:397, GVA fla/ops/kda/fused_recurrent.py:89",
    ops: &["kda", "gdn", "dplr", "token_shift", "causal_conv1d", "gdn2"],
    gate: GateSpace::Ln,
    activation: Activation::Either,
    state: StateLayout::KFirst,
    packed: false,
    heads: HeadMap::Grouped,
    scale: ScaleRule::Free,
    l2norm: L2norm::Either,
    varlen: true,
    dense: true,
    backward: true,
    k_equals_v: false,
};

/// FlashKDA (`tokenspeed-flashkda` 0.0.1.post20260901, MoonshotAI/FlashKDA
/// @1ce47ea3): `flash_kda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias,
/// lower_bound, initial_state, final_state, cu_seqlens)`; raw lower-bound
/// gate and β logits (`tests/torch_ref.py`), q/k l2norm always, state
/// `[N,H,V,K]`, no GVA (`csrc/flash_kda.cpp` shape checks), forward only
/// (FlashKDA issue #4). Its kernel further needs K = V = 128 and bf16 (pin
/// them with `fuzz --fix H,128,128 --dtype bf16`).
pub static FLASHKDA: Convention = Convention {
    name: "flashkda",
    source: "FlashKDA @1ce47ea3: flash_kda/__init__.py fwd, csrc/flash_kda.cpp, tests/torch_ref.py",
    ops: &["kda"],
    gate: GateSpace::Ln,
    activation: Activation::Raw,
    state: StateLayout::VFirst,
    packed: false,
    heads: HeadMap::Equal,
    scale: ScaleRule::Free,
    l2norm: L2norm::Inside,
    varlen: true,
    dense: true,
    backward: false,
    k_equals_v: true,
};

/// FlashInfer GDN prefill (flashinfer-python 0.7.2.post1,
/// `flashinfer/gdn_prefill.py:617`): `[T,H,D]` with `cu_seqlens` required,
/// linear α (`log2(alpha + 1e-10)` in `gdn_kernels/delta_rule_dsl/alpha.py:37`;
/// flashinfer#2490), β linear, state `[N,H,V,K]` (docstring), grouped heads
/// (`delta_rule_sm90.py:206–209`), K = V (one head size), forward only.
pub static FLASHINFER_GDN: Convention = Convention {
    name: "flashinfer-gdn",
    source: "flashinfer-python 0.7.2.post1: flashinfer/gdn_prefill.py:617, gdn_kernels/delta_rule_dsl/alpha.py:37, delta_rule_sm90.py:206-209",
    ops: &["gdn"],
    gate: GateSpace::Linear,
    activation: Activation::Activated,
    state: StateLayout::VFirst,
    packed: true,
    heads: HeadMap::Grouped,
    scale: ScaleRule::Free,
    l2norm: L2norm::Either,
    varlen: true,
    dense: false,
    backward: false,
    k_equals_v: true,
};

/// FlashQLA (flash-qla 0.1.3, `flash_qla/ops/gated_delta_rule/chunk/__init__.py`):
/// FLA's layout and names, natural-log g (`hopper/fused_fwd.py` ~286–387),
/// grouped heads (`hopper/fused_fwd.py:109–110`), no in-kernel gate or β
/// sigmoid, backward. Its kernel needs K = V = 128 and fp16/bf16.
pub static FLASHQLA: Convention = Convention {
    name: "flashqla",
    source: "flash-qla 0.1.3: flash_qla/ops/gated_delta_rule/chunk/__init__.py, hopper/fused_fwd.py:109-110",
    ops: &["gdn"],
    gate: GateSpace::Ln,
    activation: Activation::Activated,
    state: StateLayout::KFirst,
    packed: false,
    heads: HeadMap::Grouped,
    scale: ScaleRule::Free,
    l2norm: L2norm::Either,
    varlen: true,
    dense: true,
    backward: true,
    k_equals_v: true,
};

/// opengdn 0.1.0 (`opengdn/reference.py` `gated_delta(q, k, v, alpha, beta,
/// state)`): linear α, no scale (`o = S q`), state `[B,H,V,K]`, no GVA, no
/// varlen, no l2norm in the op; backward through torch autograd.
pub static OPENGDN: Convention = Convention {
    name: "opengdn",
    source: "opengdn 0.1.0: opengdn/reference.py gated_delta, opengdn/chunkwise.py",
    ops: &["gdn"],
    gate: GateSpace::Linear,
    activation: Activation::Activated,
    state: StateLayout::VFirst,
    packed: false,
    heads: HeadMap::Equal,
    scale: ScaleRule::None,
    l2norm: L2norm::Outside,
    varlen: false,
    dense: true,
    backward: true,
    k_equals_v: false,
};

/// ggml GATED_DELTA_NET (ggml 0.15.3 as vendored by ggml-python 0.0.45;
/// ggml-org/ggml @d99724f2 `src/ggml-cpu/ops.cpp` ~10755–10948): tiled value
/// heads `iq1 = iv1 % neq1`, state `[B,H,V,K]`, fixed scale `1/sqrtf(S_v)`,
/// `S_k = S_v`, natural-log g, linear β, no varlen, no l2norm, forward only.
pub static GGML: Convention = Convention {
    name: "ggml",
    source: "ggml 0.15.3 (ggml-python 0.0.45): src/ggml-cpu/ops.cpp ~10613 (ggml-org/ggml @d99724f2 ~10755-10948), include/ggml.h ~2572-2595",
    ops: &["kda", "gdn"],
    gate: GateSpace::Ln,
    activation: Activation::Activated,
    state: StateLayout::VFirst,
    packed: false,
    heads: HeadMap::Tiled,
    scale: ScaleRule::Fixed,
    l2norm: L2norm::Outside,
    varlen: false,
    dense: true,
    backward: false,
    k_equals_v: true,
};

/// Every built-in convention, `fla` first.
pub static BUILTIN: [&Convention; 6] =
    [&FLA, &FLASHKDA, &FLASHINFER_GDN, &FLASHQLA, &OPENGDN, &GGML];

/// The built-in convention called `name`.
pub fn find(name: &str) -> Option<&'static Convention> {
    BUILTIN.iter().copied().find(|c| c.name == name)
}

/// `fla, flashkda, …`, for messages.
pub fn names() -> String {
    BUILTIN.map(|c| c.name).join(", ")
}
