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
    /// The operators whose FLA code a fault preset models (empty: any).
    pub ops: &'static [Op],
    /// Per-stage changes on top of the preset, in the order given.
    overrides: Vec<Override>,
    /// A fault in a kernel's own arithmetic (not CP's), applied to the
    /// policy after the overrides: FLA #1085's midpoint stride.
    kernel_fault: Option<fn(Policy) -> Policy>,
}

/// One `,STAGE=DTYPE` or `,midpoint=on|off` of a composed `--precision`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Override {
    Store(Stage, Dtype),
    Midpoint(bool),
}

/// The stages that exist only under CP: an override of one changes a CP
/// run and leaves a run without CP as it was (as `fla-bf16` itself does).
const CP_STAGES: [Stage; 3] = [Stage::MChain, Stage::SExt, Stage::Merged];

impl Preset {
    /// What this preset rounds for `target`: its own policy, then each
    /// override (a CP stage only under CP).
    pub fn policy(&self, target: Target<'_>) -> Policy {
        let mut p = (self.rounding)(target);
        for o in &self.overrides {
            match *o {
                Override::Store(s, _) if CP_STAGES.contains(&s) && !target.cp => {}
                Override::Store(s, d) => p = p.with(s, d),
                Override::Midpoint(on) => p = p.with_midpoint(on),
            }
        }
        match self.kernel_fault {
            Some(fault) => fault(p),
            None => p,
        }
    }

    /// Whether this preset injects a fault (CP's or a kernel's).
    pub fn is_fault(&self) -> bool {
        self.faults != Faults::default() || self.kernel_fault.is_some()
    }
}

/// FLA #1085: the safe-gate midpoint offset read with a token stride of
/// `K` instead of `H·K` (DPLR's `chunk_dplr_fwd_A_kernel_intra_tensorcore`
/// and its backward).
fn midpoint_stride(p: Policy) -> Policy {
    Policy {
        midpoint_stride_fault: true,
        ..p
    }
}

/// FLA's bf16 kernels for `t`, as the operator declares them.
fn fla_bf16(t: Target<'_>) -> Policy {
    t.op.entry().fla_bf16(t.options, t.cp)
}

/// `fla-bf16` with fp16 wherever it stores bf16 (FLA's kernels run in the
/// token dtype: fp16 inputs give fp16 intermediates).
fn fla_fp16(t: Target<'_>) -> Policy {
    let mut p = fla_bf16(t);
    for (_, d) in p.stages.iter_mut().filter(|(_, d)| *d == Dtype::Bf16) {
        *d = Dtype::F16;
    }
    p
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

/// The chunk size of FLA's CP kernels for KDA/GDN (`chunk_size = 64`).
const FLA_CP_CHUNK: usize = 64;
/// The chunk size of FLA's `chunk_dplr_delta_rule` (16 by default, and
/// always with `safe_gate`).
const FLA_DPLR_CHUNK: usize = 16;

/// All presets.
pub fn presets() -> Vec<Preset> {
    let mk = |name, about, rounding: fn(Target<'_>) -> Policy, faults, compute| Preset {
        name,
        about,
        rounding,
        faults,
        compute,
        ops: &[],
        overrides: vec![],
        kernel_fault: None,
    };
    let none = Faults::default;
    let fault_on = |ops, name, about, f: Faults| Preset {
        ops,
        ..mk(name, about, exact, f, Compute::F64)
    };
    let fault = |name, about, f: Faults| fault_on(DELTA_RULES, name, about, f);
    vec![
        mk("exact", "the f64 oracle: no rounding", exact, none(), Compute::F64),
        mk("f32", "the same algorithm in f32, nothing stored in lower precision", exact, none(), Compute::F32),
        mk("fla-bf16", "FLA's bf16 chunk kernels, stage by stage (see module docs / debug.md)", fla_bf16, none(), Compute::F32),
        mk("fla-fp16", "FLA's chunk kernels fed fp16: fla-bf16 with fp16 wherever it stores bf16", fla_fp16, none(), Compute::F32),
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
        fault(
            "h0-expand-late",
            "#822 pitfall 2: expand_h0 runs after the backward's recompute, so each later local sequence of a continuing rank recomputes from a stale state (here: the rank's merged state) instead of zeros; the forward is right",
            Faults { h0_expanded_late: true, ..Faults::default() },
        ),
        fault_on(
            &[Op::TokenShift],
            "shift-cache-drop",
            "token-shift under CP: the previous rank's last token is not carried across the cut (cache left zero, no gradient sent back)",
            Faults { carry_dropped: true, ..Faults::default() },
        ),
        fault_on(
            &[Op::TokenShift],
            "shift-cache-grad-drop",
            "token-shift under CP: the cache is carried, but its gradient is not added back into the previous rank's last token",
            Faults { carry_grad_dropped: true, ..Faults::default() },
        ),
        fault_on(
            &[Op::CausalConv1d],
            "conv-cache-drop",
            "causal conv1d under CP: the previous rank's last W-1 tokens are not carried across the cut (initial state left zero, no gradient sent back)",
            Faults { carry_dropped: true, ..Faults::default() },
        ),
        fault_on(
            &[Op::Kda, Op::Gdn2, Op::Dplr],
            "gk-offset",
            "FLA #781: the CP backward pre-process decays dh by head 0's chunk-end gate exp(gk_last) on every head (missing i_h*K offset); kda, gdn2, dplr",
            Faults { bwd_preprocess_head0_decay: Some(FLA_CP_CHUNK), ..Faults::default() },
        ),
        fault_on(
            &[Op::Kda, Op::Gdn, Op::Gdn2, Op::Dplr, Op::TokenShift, Op::CausalConv1d],
            "stale-cu-seqlens",
            "a stale cu_seqlens_cpu: each rank's chunk indices come from the global cu_seqlens, so the chunks they miss are never computed",
            Faults { stale_chunk_indices: Some(FLA_CP_CHUNK), ..Faults::default() },
        ),
        Preset {
            ops: &[Op::Dplr],
            kernel_fault: Some(midpoint_stride),
            ..mk(
                "dplr-midpoint-stride",
                "FLA #1085: DPLR's safe-gate midpoint offset read with a token stride of K instead of H*K \
                 (another token's and head's gate cumsum when H > 1), under fla-bf16 (a case with safe_gate or a safe lower_bound)",
                fla_bf16,
                none(),
                Compute::F32,
            )
        },
        fault_on(
            &[Op::Dplr],
            "dplr-bg-sign",
            "DPLR under CP: the pre-process transition takes Diag - bg^T w (KDA's sign) instead of Diag + bg^T w",
            Faults { transition_low_rank_negated: Some(FLA_DPLR_CHUNK), ..Faults::default() },
        ),
    ]
}

/// The delta rules: the operators with a CP state merge.
const DELTA_RULES: &[Op] = &[Op::Kda, Op::Gdn, Op::Gdn2, Op::Dplr];

/// Looks a preset up by name; `v` resolves `partial-merge-v`'s half of V.
/// `A+F` puts fault preset `F` on top of precision preset `A` (e.g.
/// `fla-bf16+partial-merge-v`: a fault under bf16 rounding noise).
/// `A,STAGE=DTYPE,…` changes stages of `A` (see [`parse`]).
pub fn find(name: &str, v: usize) -> Option<Preset> {
    parse(name, v).ok()
}

/// [`find`], saying what is wrong with a name it cannot resolve:
/// `PRESET[,STAGE=DTYPE|,midpoint=on|off]…[+FAULT]`, e.g.
/// `fla-bf16,S_ext=bf16,g=fp16,midpoint=off`. `STAGE` is a stage name of
/// [`Stage::ALL`] (`Akk`, `h`, `v_new`, `S_ext`, `M`, `merged`, `g` the
/// gate input, …); `DTYPE` one of [`Dtype::ALL`]; `midpoint` switches the
/// safe-gate midpoint factorisation.
pub fn parse(name: &str, v: usize) -> Result<Preset, String> {
    let (base, fault) = match name.split_once('+') {
        Some((b, f)) => (b, Some(f)),
        None => (name, None),
    };
    let mut parts = base.split(',');
    let head = parts.next().unwrap_or_default();
    let mut p = named(head, v)?;
    for o in parts {
        p.overrides.push(parse_override(o)?);
    }
    let Some(fault) = fault else {
        return Ok(p);
    };
    let f = named(fault, v)?;
    if p.is_fault() || !f.is_fault() {
        return Err(format!(
            "`{base}+{fault}`: PRECISION+FAULT puts one fault preset ({}) on a precision preset",
            fault_names()
        ));
    }
    Ok(Preset {
        about: f.about,
        faults: f.faults,
        ops: f.ops,
        kernel_fault: f.kernel_fault,
        ..p
    })
}

/// The preset called `name` exactly.
fn named(name: &str, v: usize) -> Result<Preset, String> {
    let mut p = presets()
        .into_iter()
        .find(|p| p.name == name)
        .ok_or_else(|| format!("unknown --precision `{name}` (available: {})", names()))?;
    if p.faults.merge_v_limit.is_some() {
        p.faults.merge_v_limit = Some(v / 2);
    }
    Ok(p)
}

/// One `STAGE=DTYPE` or `midpoint=on|off`.
fn parse_override(o: &str) -> Result<Override, String> {
    let stages = || {
        Stage::ALL
            .iter()
            .map(|s| s.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (key, value) = o.split_once('=').ok_or_else(|| {
        format!("--precision override `{o}`: expected STAGE=DTYPE or midpoint=on|off")
    })?;
    if key == "midpoint" {
        return match value {
            "on" => Ok(Override::Midpoint(true)),
            "off" => Ok(Override::Midpoint(false)),
            _ => Err(format!("--precision override `{o}`: midpoint is on or off")),
        };
    }
    let stage = Stage::parse(key).ok_or_else(|| {
        format!(
            "--precision override `{o}`: unknown stage `{key}` (stages: {}; or midpoint=on|off)",
            stages()
        )
    })?;
    let dtype = Dtype::parse(value).ok_or_else(|| {
        let all: Vec<&str> = Dtype::ALL.iter().map(|d| d.name()).collect();
        format!(
            "--precision override `{o}`: unknown dtype `{value}` (dtypes: {})",
            all.join(", ")
        )
    })?;
    Ok(Override::Store(stage, dtype))
}

/// The fault presets' names.
fn fault_names() -> String {
    presets()
        .iter()
        .filter(|p| p.is_fault())
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The preset names, in [`presets`] order: exactly the names [`find`]
/// accepts on their own (Python's `deltaref.PRECISIONS`).
pub fn preset_names() -> Vec<&'static str> {
    presets().iter().map(|p| p.name).collect()
}

/// Names, for error messages: the presets and how to combine them.
pub fn names() -> String {
    preset_names().join(", ")
        + "; or PRECISION+FAULT, e.g. fla-bf16+partial-merge-v; \
           or PRECISION,STAGE=DTYPE,midpoint=on|off, e.g. fla-bf16,S_ext=bf16,g=fp16,midpoint=off"
}

/// The preset with its fault switched off: the rounding-noise-only run a
/// fault is judged against (`exact` for a bare CP fault preset, `fla-bf16`
/// for a bare kernel fault, which runs on FLA's bf16 kernels).
pub fn without_fault(name: &str) -> &str {
    // The base keeps its overrides: `fla-bf16,S_ext=bf16+gk-offset` → `fla-bf16,S_ext=bf16`.
    match name.split_once('+') {
        Some((base, _)) => base,
        // A kernel fault runs on FLA's bf16 kernels: judged against them.
        None => match find(name, 2) {
            Some(p) if p.kernel_fault.is_some() => "fla-bf16",
            Some(p) if p.is_fault() => "exact",
            _ => name,
        },
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

    #[test]
    fn an_override_changes_exactly_its_stage() {
        let kda = CaseMeta::new(Op::Kda);
        let base = find("fla-bf16", 8).unwrap();
        let over = find("fla-bf16,S_ext=bf16,g=fp16", 8).unwrap();
        // Without CP the CP stage does not exist: only the gate changes.
        let (b, o) = (
            base.policy(target(&kda, false)),
            over.policy(target(&kda, false)),
        );
        assert_eq!(o.clone().without(Feature::Round(Stage::GateInput)), b);
        assert_eq!(o.storage(Stage::GateInput), Some(Dtype::F16));
        assert_eq!(o.storage(Stage::SExt), None);
        // Under CP, S_ext goes from fp32 to bf16 and nothing else moves.
        let (b, o) = (
            base.policy(target(&kda, true)),
            over.policy(target(&kda, true)),
        );
        assert_eq!(b.storage(Stage::SExt), Some(Dtype::F32));
        assert_eq!(o.storage(Stage::SExt), Some(Dtype::Bf16));
        for s in Stage::ALL {
            if s != Stage::SExt && s != Stage::GateInput {
                assert_eq!(o.storage(s), b.storage(s), "{}", s.name());
            }
        }
        let mut lb = CaseMeta::new(Op::Kda);
        lb.options.insert("gate".into(), "lowerbound".into());
        lb.options.insert("lower_bound".into(), (-5.0).into());
        assert!(base.policy(target(&lb, false)).safe_gate_midpoint);
        let off = find("fla-bf16,midpoint=off", 8).unwrap();
        assert!(!off.policy(target(&lb, false)).safe_gate_midpoint);
        // Overrides compose with a fault.
        let f = find("fla-bf16,S_ext=bf16+gk-offset", 8).unwrap();
        assert_eq!(
            f.policy(target(&kda, true)),
            over.policy(target(&kda, true))
                .without(Feature::Round(Stage::GateInput))
        );
        assert!(f.faults.bwd_preprocess_head0_decay.is_some());
        assert_eq!(
            without_fault("fla-bf16,S_ext=bf16+gk-offset"),
            "fla-bf16,S_ext=bf16"
        );
    }

    /// FLA #1085 as a preset: `fla-bf16` on the case's safe gate, with the
    /// midpoint read at the wrong stride; judged against `fla-bf16`; it
    /// composes with overrides; `midpoint=off` drops a bound's license.
    #[test]
    fn the_midpoint_stride_fault_is_fla_bf16_with_the_wrong_anchor() {
        let mut dplr = CaseMeta::new(Op::Dplr);
        dplr.options.insert("safe_gate".into(), true.into());
        let base = find("fla-bf16", 8).unwrap().policy(target(&dplr, false));
        assert!(base.safe_gate_at(64) && !base.midpoint_stride_fault);
        let f = find("dplr-midpoint-stride", 8).unwrap();
        assert!(f.is_fault() && f.ops == [Op::Dplr]);
        let p = f.policy(target(&dplr, false));
        assert_eq!(p.clone().without(Feature::MidpointStride), base);
        assert!(p.features().contains(&Feature::MidpointStride));
        assert_eq!(without_fault("dplr-midpoint-stride"), "fla-bf16");
        let composed = find("fla-bf16,Aqk=f32+dplr-midpoint-stride", 8).unwrap();
        let c = composed.policy(target(&dplr, false));
        assert!(c.midpoint_stride_fault && c.storage(Stage::Aqk) == Some(Dtype::F32));
        assert!(fault_names().contains("dplr-midpoint-stride"));
        // `midpoint=off` drops the safe gate itself, a bound's license too.
        let mut bounded = CaseMeta::new(Op::Dplr);
        bounded.options.insert("lower_bound".into(), (-5.0).into());
        let b = find("fla-bf16", 8).unwrap().policy(target(&bounded, false));
        assert!(b.safe_gate_at(16) && !b.safe_gate_at(64));
        let off = find("fla-bf16,midpoint=off", 8).unwrap();
        assert!(!off.policy(target(&bounded, false)).safe_gate_at(16));
        assert!(!off.policy(target(&dplr, false)).safe_gate_at(16));
    }

    #[test]
    fn fla_fp16_is_fla_bf16_with_fp16_storage() {
        let (bf, fp) = (find("fla-bf16", 8).unwrap(), find("fla-fp16", 8).unwrap());
        for op in [Op::Kda, Op::Dplr, Op::Gdn, Op::Gdn2, Op::TokenShift] {
            let meta = CaseMeta::new(op);
            let (b, f) = (
                bf.policy(target(&meta, true)),
                fp.policy(target(&meta, true)),
            );
            assert_eq!(b.features(), f.features(), "{op:?}");
            for s in Stage::ALL {
                let want = b
                    .storage(s)
                    .map(|d| if d == Dtype::Bf16 { Dtype::F16 } else { d });
                assert_eq!(f.storage(s), want, "{op:?} {}", s.name());
            }
        }
    }

    #[test]
    fn bad_overrides_name_the_valid_choices() {
        let e = parse("fla-bf16,S_xt=bf16", 8).unwrap_err();
        assert!(
            e.contains("unknown stage `S_xt`") && e.contains("S_ext") && e.contains("midpoint"),
            "{e}"
        );
        let e = parse("fla-bf16,Akk=fp8", 8).unwrap_err();
        assert!(
            e.contains("unknown dtype `fp8`") && e.contains("bf16, f16"),
            "{e}"
        );
        assert!(parse("fla-bf16,midpoint=1", 8)
            .unwrap_err()
            .contains("on or off"));
        assert!(parse("fla-bf16,Akk", 8)
            .unwrap_err()
            .contains("STAGE=DTYPE"));
        let e = parse("fla-bf16+fla-fp16", 8).unwrap_err();
        assert!(
            e.contains("one fault preset") && e.contains("gk-offset"),
            "{e}"
        );
    }
}
