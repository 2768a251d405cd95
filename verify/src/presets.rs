//! Named precision presets: what a kernel stores in which dtype, and the
//! known failure modes of SPEC §9 as switches. Each preset is a stage-by-stage
//! storage policy per operator ([`Preset::policy`]: the one place that says
//! what preset X rounds for op Y), the compute scalar, and CP fault
//! injections. What each engine can round is `impls::supported`; a preset
//! asking for more is refused (`impls::check_policy`), never silently ignored.
//!
//! `fla-bf16` follows fla-core 0.6.0's source for bf16 token inputs (the
//! stage → tensor → dtype → file table is in debug.md, "FLA's bf16 storage"):
//! - inputs q, k, v, g, beta, do in bf16; `A_log`, `dt_bias`, `dht`,
//!   `initial_state` fp32;
//! - activations: q/k after the in-kernel l2norm (`l2norm_fwd`) in bf16; β
//!   after the in-kernel sigmoid stays fp32 (`fused_beta_sigmoid`); DPLR's
//!   `q·scale` in bf16 (`chunk_dplr_fwd_intra`);
//! - `g_cumsum`: fp32 (`chunk_local_cumsum`/`kda_gate_chunk_cumsum`), exp in
//!   base 2 (KDA: `RCP_LN2` scaling, `exp2`);
//! - KDA `Aqk`, `Akk`: bf16 (`chunk_kda_fwd_intra`: `dtype=k.dtype`; the
//!   diagonal blocks are solved in fp32, the stored inverse is bf16); DPLR
//!   `Aqk`, `Aqb` bf16, `Aab`, `Aak` fp32, the inverse solved with fp16
//!   operands (`chunk_A_fwd`, `wy_fast_fwd`);
//! - `w`, `u`, `qg`, `kg` (DPLR also `ag`, `bg`): bf16; KDA: `β k` rounded
//!   to bf16 before the decay when β is the bf16 input (`k-beta`), and so in
//!   the intra backward's `∂/∂k` (`k-beta-bwd`); the
//!   intra-chunk `Aqk`/`L` dot operands in tf32 (`fwd-dots`);
//! - `h`: bf16 (`k.new_empty`), the running state fp32 registers; `v_new`:
//!   bf16; final state fp32;
//! - backward `dh`, `dv`: bf16; KDA's backward casts `Aqkᵀ do`, `−dw`,
//!   `k ⊙ exp(Γ)` and the masked `dAkk` to bf16 for its `tl.dot`s; its
//!   decay gradient sums the bf16 products `h·dh` in bf16 (`hdh-sum`);
//!   DPLR rounds those products to bf16 and sums in fp32;
//! - outputs: `o` and the token gradients in bf16 (`o.type_as(q)`,
//!   `dq.to(q)`, …); `dA_log`, `ddt_bias`, `dh0` fp32;
//! - CP: the `M` chain accumulates in fp32 (`tl.dot(b_m_i.to(tl.float32), …)`),
//!   `S_ext` and the merged state in fp32;
//! - `safe_gate` (KDA with `--gate lowerbound`): exp(Γ_r − Γ_c) through the
//!   16-token sub-chunk anchor.
//!
//! Everything else computes in fp32 (the kernels' `tl.float32` accumulators).

use deltaref::cp::Faults;
use deltaref::gates::Gate;
use deltaref::precision::{Policy, Stage};
use deltaref::Dtype;

use crate::case::Op;
use crate::compute::Compute;

/// What a preset's rounding depends on: the operator and FLA's path for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub op: Op,
    /// KDA with a lower-bound gate: FLA runs `safe_gate=True`.
    pub safe_gate: bool,
    /// Under CP (the M chain, S_ext and the merged state exist).
    pub cp: bool,
    /// β is computed in the kernel (`use_beta_sigmoid_in_kernel`): fp32,
    /// where the input β is bf16.
    pub beta_sigmoid: bool,
}

impl Target {
    /// A plain KDA target (no safe gate, no CP).
    pub const KDA: Target = Target {
        op: Op::Kda,
        safe_gate: false,
        cp: false,
        beta_sigmoid: false,
    };

    /// The target of a case of `op` with gate `gate`, under CP or not, with
    /// the in-kernel beta sigmoid or not.
    pub fn of(op: Op, gate: Gate, cp: bool, beta_sigmoid: bool) -> Target {
        Target {
            op,
            safe_gate: op == Op::Kda && matches!(gate, Gate::LowerBound { .. }),
            cp,
            beta_sigmoid,
        }
    }
}

/// A named emulation setting.
#[derive(Clone, Debug)]
pub struct Preset {
    pub name: &'static str,
    pub about: &'static str,
    rounding: fn(Target) -> Policy,
    pub faults: Faults,
    pub compute: Compute,
}

impl Preset {
    /// What this preset rounds for `target`.
    pub fn policy(&self, target: Target) -> Policy {
        (self.rounding)(target)
    }
}

/// FLA's bf16 kernels for `t` (see the module docs).
fn fla_bf16(t: Target) -> Policy {
    let bf16 = Dtype::Bf16;
    let mut p = Policy::exact().with(Stage::Inputs, bf16);
    let stages: &[(Stage, Dtype)] = match t.op {
        Op::TokenShift | Op::CausalConv1d => &[],
        // GDN runs KDA's engines with the gate repeated over K, and FLA's
        // `chunk_gated_delta_rule` stores the same intermediates in bf16.
        Op::Kda | Op::Gdn => &[
            (Stage::Activations, bf16),
            (Stage::GCumsum, Dtype::F32),
            (Stage::Aqk, bf16),
            (Stage::Akk, bf16),
            (Stage::W, bf16),
            (Stage::U, bf16),
            (Stage::Gated, bf16),
            (Stage::H, bf16),
            (Stage::VNew, bf16),
            (Stage::Dh, bf16),
            (Stage::Dv, bf16),
            (Stage::FwdDots, Dtype::Tf32),
            (Stage::BwdOperands, bf16),
            (Stage::HdhSum, bf16),
            (Stage::IntraDots, Dtype::Tf32),
        ],
        Op::Dplr => &[
            // `q·scale` in bf16 (`chunk_dplr_fwd_intra`).
            (Stage::Activations, bf16),
            (Stage::GCumsum, Dtype::F32),
            (Stage::Aqk, bf16),
            // `wy_fast_fwd`'s solve multiplies fp16 operands (`.to(tl.float16)`).
            (Stage::Akk, Dtype::F16),
            (Stage::W, bf16),
            (Stage::U, bf16),
            (Stage::Gated, bf16),
            (Stage::H, bf16),
            (Stage::VNew, bf16),
            (Stage::Dh, bf16),
            (Stage::Dv, bf16),
            (Stage::BwdOperands, bf16),
        ],
    };
    for &(s, d) in stages {
        p = p.with(s, d);
    }
    if t.cp && t.op.is_delta_rule() {
        for s in [Stage::MChain, Stage::SExt, Stage::Merged] {
            p = p.with(s, Dtype::F32);
        }
    }
    // Read from KDA's `recompute_w_u_fwd` only; GDN's kernel is not checked.
    if t.op == Op::Kda && !t.beta_sigmoid {
        p = p.with(Stage::KBeta, bf16).with(Stage::KBetaBwd, bf16);
    }
    // KDA's and GDN's chunk kernels use exp2 on a base-2 cumsum; DPLR's exp.
    p.exp2 = matches!(t.op, Op::Kda | Op::Gdn);
    p.safe_gate_midpoint = t.safe_gate;
    p.with(Stage::Outputs, bf16)
}

fn exact(_: Target) -> Policy {
    Policy::exact()
}

fn mchain_bf16(t: Target) -> Policy {
    fla_bf16(Target { cp: true, ..t }).with(Stage::MChain, Dtype::Bf16)
}

fn akk_bf16(_: Target) -> Policy {
    Policy::exact().with(Stage::Akk, Dtype::Bf16)
}

fn tf32_solve(_: Target) -> Policy {
    Policy::exact().with(Stage::Akk, Dtype::Tf32)
}

/// `fla-bf16` with `v_new` stored with 2 mantissa bits (e5m2): one stage far
/// coarser than all the others (and one every result depends on), which
/// `diagnose --bisect` must name first.
fn coarse_v_new(t: Target) -> Policy {
    fla_bf16(t).with(Stage::VNew, Dtype::E5m2)
}

/// All presets.
pub fn presets() -> Vec<Preset> {
    let mk = |name, about, rounding: fn(Target) -> Policy, faults, compute| Preset {
        name,
        about,
        rounding,
        faults,
        compute,
    };
    let none = Faults::default;
    let fault = |name, about, f: Faults| mk(name, about, exact, f, Compute::F64);
    vec![
        mk("exact", "the f64 oracle: no rounding", exact, none(), Compute::F64),
        mk("f32", "the same algorithm in f32, nothing stored in lower precision", exact, none(), Compute::F32),
        mk("fla-bf16", "FLA's bf16 chunk kernels, stage by stage (see module docs / debug.md)", fla_bf16, none(), Compute::F32),
        mk(
            "fla-bf16-mchain-bf16",
            "failure mode 1: fla-bf16 with the CP transition chain M multiplied in bf16",
            mchain_bf16,
            none(),
            Compute::F32,
        ),
        mk("akk-bf16", "failure mode 2: f32, but the WY inverse Akk stored in bf16", akk_bf16, none(), Compute::F32),
        mk(
            "tf32-solve",
            "failure mode 3: f32, but the triangular solve's result carries tf32 (10-bit) precision instead of tf32x3",
            tf32_solve,
            none(),
            Compute::F32,
        ),
        mk(
            "coarse-v-new",
            "bisection demo: fla-bf16 with v_new stored in a 2-mantissa-bit format (e5m2), far coarser than every other stage",
            coarse_v_new,
            none(),
            Compute::F32,
        ),
        fault(
            "drop-merged-state",
            "failure mode 4: the merged CP initial state dropped before the backward recompute",
            Faults { drop_merged_state_in_backward: true, ..Faults::default() },
        ),
        fault(
            "partial-merge-v",
            "failure mode 5: the merge covers only the first half of V (a stale block size)",
            Faults { merge_v_limit: Some(usize::MAX), ..Faults::default() },
        ),
        fault(
            "wrong-preprocess",
            "failure mode 6: the pre-process runs on the rank's first local sequence instead of its last",
            Faults { preprocess_first_piece: true, ..Faults::default() },
        ),
    ]
}

/// Looks a preset up by name; `v` resolves `partial-merge-v`'s half of V.
/// `A+F` puts fault preset `F` on top of precision preset `A` (e.g.
/// `fla-bf16+partial-merge-v`: a fault under bf16 rounding noise).
pub fn find(name: &str, v: usize) -> Option<Preset> {
    if let Some((base, fault)) = name.split_once('+') {
        let (b, f) = (find(base, v)?, find(fault, v)?);
        if b.faults != Faults::default() || f.faults == Faults::default() {
            return None;
        }
        return Some(Preset {
            about: f.about,
            faults: f.faults,
            ..b
        });
    }
    let mut p = presets().into_iter().find(|p| p.name == name)?;
    if p.faults.merge_v_limit.is_some() {
        p.faults.merge_v_limit = Some(v / 2);
    }
    Some(p)
}

/// Names, for error messages.
pub fn names() -> String {
    presets()
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
        + "; or PRECISION+FAULT, e.g. fla-bf16+partial-merge-v"
}

/// The preset with its fault switched off: the rounding-noise-only run a
/// fault is judged against (`exact` for a bare fault preset).
pub fn without_fault(name: &str) -> &str {
    match name.split_once('+') {
        Some((base, _)) => base,
        None if find(name, 2).is_some_and(|p| p.faults != Faults::default()) => "exact",
        None => name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_goes_on_top_of_a_precision() {
        let p = find("fla-bf16+partial-merge-v", 8).expect("combines");
        let base = find("fla-bf16", 8).unwrap();
        assert_eq!(
            (p.policy(Target::KDA), p.compute),
            (base.policy(Target::KDA), base.compute)
        );
        assert_eq!(p.faults.merge_v_limit, Some(4));
        assert!(find("fla-bf16+akk-bf16", 8).is_none(), "not a fault");
        assert!(
            find("drop-merged-state+partial-merge-v", 8).is_none(),
            "two faults"
        );
        assert!(find("fla-bf16+nope", 8).is_none());
        assert_eq!(without_fault("fla-bf16+partial-merge-v"), "fla-bf16");
        assert_eq!(without_fault("drop-merged-state"), "exact");
        assert_eq!(without_fault("fla-bf16"), "fla-bf16");
    }

    use deltaref::precision::Feature;

    #[test]
    fn fla_bf16_rounds_per_operator() {
        let p = find("fla-bf16", 8).unwrap();
        let t = |op, safe_gate, cp| Target {
            op,
            safe_gate,
            cp,
            beta_sigmoid: false,
        };
        let kda = p.policy(t(Op::Kda, true, false));
        assert!(kda.exp2 && kda.safe_gate_midpoint);
        assert_eq!(kda.storage(Stage::Akk), Some(Dtype::Bf16));
        assert_eq!(kda.storage(Stage::MChain), None, "no M chain without CP");
        assert!(!p.policy(t(Op::Kda, false, false)).safe_gate_midpoint);
        assert_eq!(
            p.policy(t(Op::Kda, false, true)).storage(Stage::MChain),
            Some(Dtype::F32)
        );
        // DPLR solves its WY inverse with fp16 operands; its activation is
        // `q·scale` in bf16.
        let dplr = p.policy(t(Op::Dplr, false, false));
        assert_eq!(dplr.storage(Stage::Akk), Some(Dtype::F16));
        assert_eq!(dplr.storage(Stage::Activations), Some(Dtype::Bf16));
        let ts = p.policy(t(Op::TokenShift, false, true)).features();
        assert_eq!(
            ts,
            vec![
                Feature::Round(Stage::Inputs),
                Feature::Round(Stage::Outputs)
            ]
        );
    }
}
