//! Named precision presets: what a kernel stores in which dtype, and the
//! known failure modes of SPEC §9 as switches. Each preset is a stage-by-stage
//! storage policy ([`Preset::policy`]), the compute scalar, and CP fault
//! injections. `fla-bf16` is each operator's own declaration of FLA's bf16
//! kernels (its registry entry's `fla_bf16`; the stage → tensor → dtype →
//! file table is in debug.md, "FLA's bf16 storage"); the other presets
//! change one stage. What each engine can round is `impls::supported`; a
//! preset asking for more is refused (`impls::check_policy`), never
//! silently ignored.

use deltaref::cp::Faults;
use deltaref::precision::{Policy, Stage};
use deltaref::registry::Options;
use deltaref::Dtype;

use crate::case::Op;
use crate::compute::Compute;

/// What a preset's rounding depends on: the operator, its options (FLA's
/// path for them: the safe gate, the in-kernel sigmoid) and CP.
#[derive(Clone, Copy, Debug)]
pub struct Target<'a> {
    pub op: Op,
    pub options: &'a Options,
    /// Under CP (the M chain, S_ext and the merged state exist).
    pub cp: bool,
}

/// A named emulation setting.
#[derive(Clone, Debug)]
pub struct Preset {
    pub name: &'static str,
    pub about: &'static str,
    rounding: fn(Target<'_>) -> Policy,
    pub faults: Faults,
    pub compute: Compute,
}

impl Preset {
    /// What this preset rounds for `target`.
    pub fn policy(&self, target: Target<'_>) -> Policy {
        (self.rounding)(target)
    }
}

/// FLA's bf16 kernels for `t`, as the operator declares them.
fn fla_bf16(t: Target<'_>) -> Policy {
    t.op.entry().fla_bf16(t.options, t.cp)
}

fn exact(_: Target<'_>) -> Policy {
    Policy::exact()
}

fn mchain_bf16(t: Target<'_>) -> Policy {
    fla_bf16(Target { cp: true, ..t }).with(Stage::MChain, Dtype::Bf16)
}

fn akk_bf16(_: Target<'_>) -> Policy {
    Policy::exact().with(Stage::Akk, Dtype::Bf16)
}

fn tf32_solve(_: Target<'_>) -> Policy {
    Policy::exact().with(Stage::Akk, Dtype::Tf32)
}

/// `fla-bf16` with `v_new` stored with 2 mantissa bits (e5m2): one stage far
/// coarser than all the others (and one every result depends on), which
/// `diagnose --bisect` must name first.
fn coarse_v_new(t: Target<'_>) -> Policy {
    fla_bf16(t).with(Stage::VNew, Dtype::E5m2)
}

/// All presets.
pub fn presets() -> Vec<Preset> {
    let mk = |name, about, rounding: fn(Target<'_>) -> Policy, faults, compute| Preset {
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

/// The preset names, in [`presets`] order: exactly the names [`find`]
/// accepts on their own (Python's `deltaref.PRECISIONS`).
pub fn preset_names() -> Vec<&'static str> {
    presets().iter().map(|p| p.name).collect()
}

/// Names, for error messages: the presets and how to combine them.
pub fn names() -> String {
    preset_names().join(", ") + "; or PRECISION+FAULT, e.g. fla-bf16+partial-merge-v"
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
    use crate::case::CaseMeta;

    fn target(meta: &CaseMeta, cp: bool) -> Target<'_> {
        Target {
            op: meta.op,
            options: &meta.options,
            cp,
        }
    }

    #[test]
    fn a_fault_goes_on_top_of_a_precision() {
        let p = find("fla-bf16+partial-merge-v", 8).expect("combines");
        let base = find("fla-bf16", 8).unwrap();
        let kda = CaseMeta::new(Op::Kda);
        assert_eq!(
            (p.policy(target(&kda, false)), p.compute),
            (base.policy(target(&kda, false)), base.compute)
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

    /// The list the Python binding exports as `deltaref.PRECISIONS`: every
    /// preset by name, each found, and nothing else (no prose from the
    /// error message's `names()`).
    #[test]
    fn preset_names_are_exactly_the_presets() {
        let names = preset_names();
        assert_eq!(names.len(), presets().len());
        for n in &names {
            assert!(find(n, 8).is_some(), "{n}");
            assert!(
                n.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
                "`{n}` is not a bare preset name"
            );
        }
        assert!(names.contains(&"exact") && names.contains(&"wrong-preprocess"));
    }

    use deltaref::precision::Feature;

    #[test]
    fn fla_bf16_rounds_per_operator() {
        let p = find("fla-bf16", 8).unwrap();
        let mut kda = CaseMeta::new(Op::Kda);
        let plain = p.policy(target(&kda, false));
        assert!(!plain.safe_gate_midpoint);
        kda.options.insert("gate".into(), "lowerbound".into());
        kda.options.insert("lower_bound".into(), (-5.0).into());
        let safe = p.policy(target(&kda, false));
        assert!(safe.exp2 && safe.safe_gate_midpoint);
        assert_eq!(safe.storage(Stage::Akk), Some(Dtype::Bf16));
        assert_eq!(safe.storage(Stage::MChain), None, "no M chain without CP");
        assert_eq!(
            p.policy(target(&kda, true)).storage(Stage::MChain),
            Some(Dtype::F32)
        );
        // DPLR solves its WY inverse with fp16 operands; its activation is
        // `q·scale` in bf16.
        let dplr = p.policy(target(&CaseMeta::new(Op::Dplr), false));
        assert_eq!(dplr.storage(Stage::Akk), Some(Dtype::F16));
        assert_eq!(dplr.storage(Stage::Activations), Some(Dtype::Bf16));
        let ts = p
            .policy(target(&CaseMeta::new(Op::TokenShift), true))
            .features();
        assert_eq!(
            ts,
            vec![
                Feature::Round(Stage::Inputs),
                Feature::Round(Stage::Outputs)
            ]
        );
    }
}
