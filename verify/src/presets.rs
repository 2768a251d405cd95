//! Named precision presets: what a kernel stores in which dtype, and the
//! known failure modes of SPEC §9 as switches. Each preset is a stage-by-stage
//! storage policy, the compute scalar, and CP fault injections.
//!
//! `fla-bf16` follows FLA's source (fla-core, `fla/ops/kda/`, `fla/ops/common/`,
//! `fla/ops/cp/`) for bf16 inputs:
//! - inputs q, k, v, beta, do, dht in bf16 (the gate output g is fp32);
//! - `g_cumsum`: fp32 (`chunk_local_cumsum(..., output_dtype=torch.float)`),
//!   exp in base 2 (`RCP_LN2` scaling, `exp2`);
//! - `Aqk`, `Akk`: `torch.empty(..., dtype=k.dtype)` → bf16 (the diagonal
//!   blocks are solved in fp32, the stored inverse is bf16);
//! - `w`, `u`, `qg`, `kg`: `recompute_w_u_fwd` allocates `k.dtype`/`v` → bf16;
//! - `h`: `k.new_empty(B, NT, HV, K, V)` → bf16; the running state is fp32
//!   registers; `v_new`: `empty_like(u)` → bf16; final state fp32;
//! - backward `dh`: `q.new_empty(...)` → bf16; `dv`: bf16;
//! - CP: the `M` chain accumulates in fp32 (`tl.dot(b_m_i.to(tl.float32), …)`),
//!   `S_ext` and the merged state in fp32;
//! - `safe_gate`: exp(Γ_r − Γ_c) through the sub-chunk midpoint.
//!
//! Everything else computes in fp32 (the kernels' `tl.float32` accumulators).

use deltaref::cp::Faults;
use deltaref::precision::{Policy, Stage, Storage};

use crate::compute::Compute;

/// A named emulation setting.
#[derive(Clone, Debug, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub about: &'static str,
    pub policy: Policy,
    pub faults: Faults,
    pub compute: Compute,
}

fn fla_bf16() -> Policy {
    let mut p = Policy {
        exp2: true,
        safe_gate_midpoint: true,
        ..Policy::exact()
    };
    for (stage, storage) in [
        (Stage::Inputs, Storage::Bf16),
        (Stage::GCumsum, Storage::F32),
        (Stage::Aqk, Storage::Bf16),
        (Stage::Akk, Storage::Bf16),
        (Stage::W, Storage::Bf16),
        (Stage::U, Storage::Bf16),
        (Stage::Gated, Storage::Bf16),
        (Stage::H, Storage::Bf16),
        (Stage::VNew, Storage::Bf16),
        (Stage::MChain, Storage::F32),
        (Stage::SExt, Storage::F32),
        (Stage::Merged, Storage::F32),
        (Stage::Dh, Storage::Bf16),
        (Stage::Dv, Storage::Bf16),
    ] {
        p = p.with(stage, storage);
    }
    p
}

fn fault(f: Faults) -> (Policy, Faults, Compute) {
    (Policy::exact(), f, Compute::F64)
}

/// All presets.
pub fn presets() -> Vec<Preset> {
    let f32_ = || Policy::exact();
    let mk = |name, about, (policy, faults, compute): (Policy, Faults, Compute)| Preset {
        name,
        about,
        policy,
        faults,
        compute,
    };
    vec![
        mk("exact", "the f64 oracle: no rounding", (Policy::exact(), Faults::default(), Compute::F64)),
        mk("f32", "the same algorithm in f32, nothing stored in lower precision", (f32_(), Faults::default(), Compute::F32)),
        mk("fla-bf16", "FLA's bf16 chunk kernels, stage by stage (see module docs)", (fla_bf16(), Faults::default(), Compute::F32)),
        mk(
            "fla-bf16-mchain-bf16",
            "failure mode 1: fla-bf16 with the CP transition chain M multiplied in bf16",
            (fla_bf16().with(Stage::MChain, Storage::Bf16), Faults::default(), Compute::F32),
        ),
        mk("akk-bf16", "failure mode 2: f32, but the WY inverse Akk stored in bf16", (f32_().with(Stage::Akk, Storage::Bf16), Faults::default(), Compute::F32)),
        mk(
            "tf32-solve",
            "failure mode 3: f32, but the triangular solve's result carries tf32 (10-bit) precision instead of tf32x3",
            (f32_().with(Stage::Akk, Storage::Tf32), Faults::default(), Compute::F32),
        ),
        mk(
            "drop-merged-state",
            "failure mode 4: the merged CP initial state dropped before the backward recompute",
            fault(Faults { drop_merged_state_in_backward: true, ..Faults::default() }),
        ),
        mk(
            "partial-merge-v",
            "failure mode 5: the merge covers only the first half of V (a stale block size)",
            fault(Faults { merge_v_limit: Some(usize::MAX), ..Faults::default() }),
        ),
        mk(
            "wrong-preprocess",
            "failure mode 6: the pre-process runs on the rank's first local sequence instead of its last",
            fault(Faults { preprocess_first_piece: true, ..Faults::default() }),
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
        assert_eq!((p.policy, p.compute), (base.policy, base.compute));
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
}
