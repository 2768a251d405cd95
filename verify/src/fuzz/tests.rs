//! The fuzzer against planted faults and against correct runners
//! (issue 49's evidence): a fault is caught, shrunk and named; the oracle,
//! in every built-in convention, never fails.

use ndarray::{ArrayD, Axis, IxDyn};

use super::*;
use crate::case::{Dtype, Op};
use crate::cause::Mistake;
use crate::convention::{
    self, Activation, Convention, GateSpace, HeadMap, L2norm, ScaleRule, StateLayout,
};

fn op(name: &str) -> Op {
    Op::parse(name).expect("registered")
}

fn options(cases: u64) -> FuzzOptions {
    FuzzOptions {
        cases: Some(cases),
        ..FuzzOptions::default()
    }
}

/// The f32 oracle's forward results on an FLA case.
fn oracle_f32(case: &Case) -> Result<Tensors, String> {
    Impl::NAIVE
        .compute_forward(case, Compute::F32)
        .map_err(|e| e.to_string())
}

/// The sequences `(batch row, first token, length)` of an FLA case.
fn sequences(case: &Case) -> Vec<(usize, usize, usize)> {
    let q = &case.tensors["q"];
    match &case.cu_seqlens {
        Some(cu) => cu
            .windows(2)
            .map(|w| (0, w[0] as usize, (w[1] - w[0]) as usize))
            .collect(),
        None => (0..q.shape()[0]).map(|b| (b, 0, q.shape()[1])).collect(),
    }
}

/// Sets every `[b, t, …]` entry of token tensor `x` to `value`.
fn set_token(x: &mut ArrayD<f64>, b: usize, t: usize, value: f64) {
    x.index_axis_mut(Axis(0), b)
        .index_axis_mut(Axis(0), t)
        .fill(value);
}

/// A kernel that drops the last token of every sequence whose length is not
/// a multiple of 16: that token neither updates the state nor gets an output.
fn drops_last_token(k: &KernelCase) -> Result<Tensors, String> {
    let mut case = k.to_fla()?;
    let raw_gate = case.meta.flag("use_gate_in_kernel")
        || case
            .meta
            .options
            .get("gate")
            .and_then(|g| g.as_str())
            .is_some_and(|g| g != "none");
    let sigmoid = case.meta.flag("use_beta_sigmoid_in_kernel");
    let dropped: Vec<(usize, usize)> = sequences(&case)
        .into_iter()
        .filter(|&(_, _, l)| l > 0 && l % 16 != 0)
        .map(|(b, s, l)| (b, s + l - 1))
        .collect();
    for &(b, t) in &dropped {
        // No update (β = 0) and no decay (g = 0, or a raw gate whose decay is 1).
        set_token(
            case.tensors.get_mut("beta").unwrap(),
            b,
            t,
            if sigmoid { -1e4 } else { 0.0 },
        );
        set_token(
            case.tensors.get_mut("g").unwrap(),
            b,
            t,
            if raw_gate { -1e4 } else { 0.0 },
        );
    }
    let mut out = oracle_f32(&case)?;
    for &(b, t) in &dropped {
        set_token(out.get_mut("o").unwrap(), b, t, 0.0);
    }
    Ok(out)
}

/// FLA's convention with ggml's tiled value heads: what a kernel that maps
/// value head j to q/k head j % H computes, read in FLA's layout.
static TILED_FLA: Convention = Convention {
    name: "tiled-fla",
    source: "test",
    ops: &["kda", "gdn"],
    gate: GateSpace::Ln,
    activation: Activation::Either,
    state: StateLayout::KFirst,
    packed: false,
    heads: HeadMap::Tiled,
    scale: ScaleRule::Free,
    l2norm: L2norm::Either,
    varlen: true,
    dense: true,
    backward: false,
    k_equals_v: false,
};

fn tiled_heads(k: &KernelCase) -> Result<Tensors, String> {
    // The kernel's inputs as a grouped oracle needs them, computed, and its
    // outputs put where the tiled kernel writes them.
    let fla = k.to_fla()?;
    let dims = convention::Dims::of(&fla)?;
    let mut grouped = fla.clone();
    grouped.tensors = TILED_FLA.to_fla(fla.meta.op, &dims, fla.tensors.clone())?;
    let results = oracle_f32(&grouped)?;
    let names: Vec<String> = results.keys().cloned().collect();
    let mut out = fla.clone();
    out.tensors.extend(results);
    let mut tiled = TILED_FLA.to_kernel(&out)?;
    tiled.retain(|n, _| names.contains(n));
    Ok(tiled)
}

/// A kernel that stores the state `[V, K]` in FLA's `[K, V]`-shaped buffers.
fn transposed_state(k: &KernelCase) -> Result<Tensors, String> {
    let mut case = k.to_fla()?;
    if let Some(h0) = case.tensors.get_mut("initial_state") {
        let s = h0.shape().to_vec();
        let mut m = h0
            .clone()
            .into_shape_with_order(IxDyn(&[s[0], s[1], s[3], s[2]]))
            .unwrap();
        m.swap_axes(2, 3);
        *h0 = m.as_standard_layout().into_owned();
    }
    let mut out = oracle_f32(&case)?;
    let st = out.get_mut("final_state").unwrap();
    let shape = st.shape().to_vec();
    let mut t = st.clone();
    t.swap_axes(2, 3);
    *st = t
        .as_standard_layout()
        .into_owned()
        .into_shape_with_order(IxDyn(&shape))
        .unwrap();
    Ok(out)
}

fn run_fault(
    name: &str,
    opname: &str,
    f: fn(&KernelCase) -> Result<Tensors, String>,
) -> FuzzReport {
    let cfg = FuzzConfig::new(op(opname), &convention::FLA);
    let mut r = FnRunner {
        name: name.into(),
        f,
    };
    fuzz(&cfg, &mut r, &options(200), |_, _| {}).unwrap()
}

#[test]
fn a_dropped_last_token_is_caught_and_shrunk_to_at_most_32_tokens() {
    for opname in ["kda", "gdn"] {
        let r = run_fault("drops-last-token", opname, drops_last_token);
        assert!(!r.pass(), "{}", render(&r));
        let f = &r.failures[0];
        assert!(f.index < 200);
        assert!(f.shrunk.tokens() <= 32, "{}", render(&r));
        assert!(
            f.verdict.failing.contains(&"o".to_string()),
            "{}",
            render(&r)
        );
    }
}

#[test]
fn the_tiled_head_mapping_under_fla_is_caught_and_named() {
    for opname in ["kda", "gdn"] {
        let r = run_fault("tiled-heads", opname, tiled_heads);
        assert!(!r.pass(), "{}", render(&r));
        let f = &r.failures[0];
        let cause = f
            .verdict
            .cause
            .as_ref()
            .unwrap_or_else(|| panic!("no cause: {}", render(&r)));
        assert_eq!(cause.mistake, Mistake::HeadMapping, "{}", render(&r));
        assert!(
            cause.sentence.contains("`j % H` (tiled)"),
            "{}",
            cause.sentence
        );
        assert!(f.shrunk.hv > f.shrunk.h && f.shrunk.h > 1, "{}", render(&r));
    }
}

#[test]
fn a_transposed_state_is_caught_and_named() {
    for opname in ["kda", "gdn"] {
        let r = run_fault("transposed-state", opname, transposed_state);
        assert!(!r.pass(), "{}", render(&r));
        let cause = r.failures[0]
            .verdict
            .cause
            .as_ref()
            .unwrap_or_else(|| panic!("no cause: {}", render(&r)));
        assert_eq!(cause.mistake, Mistake::StateLayout, "{}", render(&r));
        assert!(r.failures[0]
            .verdict
            .failing
            .contains(&"final_state".to_string()));
    }
}

/// The f32 oracle, in FLA's convention and in every built-in one (each op
/// it applies to), passes 500 cases.
#[test]
fn the_f32_oracle_passes_500_cases_in_every_convention() {
    for conv in convention::BUILTIN {
        for opname in conv.ops.iter().filter(|o| ["kda", "gdn"].contains(o)) {
            let cfg = FuzzConfig::new(op(opname), conv);
            let mut r = OracleRunner::new(Compute::F32);
            let rep = fuzz(&cfg, &mut r, &options(500), |_, _| {}).unwrap();
            assert!(rep.pass() && rep.cases == 500, "{}", render(&rep));
        }
    }
}

/// Every drawn case is valid: the oracle's validation accepts it and the
/// convention can express it.
#[test]
fn every_drawn_case_is_valid_for_its_convention() {
    for conv in convention::BUILTIN {
        for opname in conv.ops {
            let cfg = FuzzConfig::new(op(opname), conv);
            for i in 0..300 {
                let p = cfg.draw(7, i);
                assert!(cfg.allows(&p), "{} {}: {}", conv.name, opname, p.describe());
                let case = p
                    .case(cfg.op, conv, Dtype::F32)
                    .unwrap_or_else(|e| panic!("{}: {e}", p.describe()));
                conv.check(&case)
                    .unwrap_or_else(|e| panic!("{}: {e}", p.describe()));
            }
        }
    }
}

/// Mapping an FLA case into a convention and back is the identity.
#[test]
fn conventions_map_back_to_the_same_tensors() {
    for conv in convention::BUILTIN {
        for opname in conv.ops {
            let cfg = FuzzConfig::new(op(opname), conv);
            let p = cfg.draw(3, 1);
            let case = p.case(cfg.op, conv, Dtype::F64).unwrap();
            let k = KernelCase::of(&case, conv, Dtype::F64).unwrap();
            let back = k.to_fla().unwrap();
            for (n, x) in &case.tensors {
                let y = &back.tensors[n];
                assert_eq!(x.shape(), y.shape(), "{} {n}", conv.name);
                let d = x
                    .iter()
                    .zip(y.iter())
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                assert!(
                    d <= 1e-12 * (1.0 + x.iter().fold(0.0f64, |m, v| m.max(v.abs()))),
                    "{} {n}: {d}",
                    conv.name
                );
            }
        }
    }
}

#[test]
fn a_convention_refuses_what_it_cannot_express() {
    let cfg = FuzzConfig::new(op("gdn"), &convention::FLA);
    let mut p = cfg.draw(1, 0);
    p.h = 2;
    p.hv = 4;
    p.k = 4;
    p.v = 4;
    p.varlen = true;
    p.lengths = vec![3, 5];
    p.l2norm = false;
    let case = p.case(cfg.op, &convention::FLA, Dtype::F32).unwrap();
    let e = convention::find("opengdn")
        .unwrap()
        .check(&case)
        .unwrap_err();
    assert!(e.contains("HV = H") && e.contains("cu_seqlens"), "{e}");
    let e = convention::find("flashkda")
        .unwrap()
        .check(&case)
        .unwrap_err();
    assert!(e.contains("applies to --op kda"), "{e}");
}

#[test]
fn a_bad_fix_or_op_is_a_usage_error() {
    let mut cfg = FuzzConfig::new(op("gdn"), convention::find("ggml").unwrap());
    cfg.fix = Some([2, 8, 4]);
    let e = cfg.check().unwrap_err().to_string();
    assert!(e.contains("K = V") && e.contains("K = 8, V = 4"), "{e}");
    let mut cfg = FuzzConfig::new(op("token_shift"), &convention::FLA);
    cfg.fix = Some([1, 8, 1]);
    let e = cfg.check().unwrap_err().to_string();
    assert!(e.contains("--fix") && e.contains("B,T,D"), "{e}");
    let cfg = FuzzConfig::new(op("dplr"), convention::find("ggml").unwrap());
    let e = cfg.check().unwrap_err().to_string();
    assert!(e.contains("applies to --op kda, gdn, not dplr"), "{e}");
}

/// The ops beyond KDA and GDN (DPLR, GDN-2, token-shift, causal conv1d).
const NEW_OPS: [&str; 4] = ["dplr", "gdn2", "token_shift", "causal_conv1d"];

/// The f32 oracle passes 500 cases of every other op under `fla`.
#[test]
fn the_f32_oracle_passes_500_cases_of_every_other_op() {
    for opname in NEW_OPS {
        let cfg = FuzzConfig::new(op(opname), &convention::FLA);
        let mut r = OracleRunner::new(Compute::F32);
        let rep = fuzz(&cfg, &mut r, &options(500), |_, _| {}).unwrap();
        assert!(rep.pass() && rep.cases == 500, "{}", render(&rep));
    }
}

/// Any op's kernel that zeroes the output of the last token of every
/// sequence whose length is not a multiple of 16.
fn zeroes_last_output(k: &KernelCase) -> Result<Tensors, String> {
    let case = k.to_fla()?;
    let first = case.meta.op.first_input();
    let shape = case.tensors[first].shape().to_vec();
    let seqs: Vec<(usize, usize)> = match &case.cu_seqlens {
        Some(cu) => cu
            .windows(2)
            .filter(|w| (w[1] - w[0]) % 16 != 0)
            .map(|w| (0, w[1] as usize - 1))
            .collect(),
        None if shape[1] % 16 != 0 => (0..shape[0]).map(|b| (b, shape[1] - 1)).collect(),
        None => vec![],
    };
    let mut out = Impl::NAIVE
        .compute_forward(&case, Compute::F32)
        .map_err(|e| e.to_string())?;
    let o = out.get_mut(case.meta.op.info().outputs[0]).unwrap();
    for (b, t) in seqs {
        set_token(o, b, t, 0.0);
    }
    Ok(out)
}

#[test]
fn a_zeroed_last_output_of_every_other_op_is_caught_and_shrunk() {
    for opname in NEW_OPS {
        let r = run_fault("zeroes-last-output", opname, zeroes_last_output);
        assert!(!r.pass(), "{}", render(&r));
        let f = &r.failures[0];
        let out = op(opname).info().outputs[0];
        assert_eq!(f.verdict.failing, vec![out.to_string()], "{}", render(&r));
        assert!(f.shrunk.tokens() <= 2, "{}", render(&r));
        assert!(
            f.shrunk.cuts.is_none() && f.shrunk.lengths.len() == 1,
            "{}",
            render(&r)
        );
    }
}

/// The oracle with FLA's CP fault 5 (the merge covers half of V) is caught
/// on a case with cut points, shrunk with its cut kept (without CP it
/// passes), and every drawn CP plan is valid.
#[test]
fn a_cp_fault_is_caught_and_shrunk_keeping_its_cut() {
    for opname in ["gdn", "kda"] {
        let cfg = FuzzConfig::new(op(opname), &convention::FLA);
        let mut r = OracleRunner::parse("builtin:partial-merge-v").unwrap();
        let rep = fuzz(&cfg, &mut r, &options(200), |_, _| {}).unwrap();
        assert!(!rep.pass(), "{}", render(&rep));
        let f = &rep.failures[0];
        assert!(f.drawn.cuts.is_some(), "{}", render(&rep));
        let cuts = f.shrunk.cuts.as_ref().expect("the cut is what fails");
        assert!(
            f.shrunk.tokens() <= 64
                && f.shrunk.tokens() <= f.drawn.tokens()
                && cuts.len() == 1
                && f.shrunk.v >= 2,
            "{}",
            render(&rep)
        );
        let mut plain = f.shrunk.clone();
        plain.cuts = None;
        let o = evaluate(&cfg, &plain, &mut r, 1e-4).unwrap();
        assert!(o.verdict.pass(), "{}", plain.describe());
    }
}

#[test]
fn drawn_cut_points_are_valid_and_reach_the_runner() {
    let cfg = FuzzConfig::new(op("gdn"), &convention::FLA);
    let mut with = 0;
    for i in 0..300 {
        let p = cfg.draw(5, i);
        let Some(cuts) = &p.cuts else { continue };
        with += 1;
        assert!(p.varlen || p.lengths.len() == 1, "{}", p.describe());
        assert!(cuts.windows(2).all(|w| w[0] < w[1]) && cuts[cuts.len() - 1] < p.tokens());
        let case = p.case(cfg.op, cfg.convention, Dtype::F32).unwrap();
        let k = KernelCase::of(&case, cfg.convention, Dtype::F32).unwrap();
        assert_eq!(k.meta.cp, Some(crate::case::CpLayout::Cuts(cuts.clone())));
        let back = Case::from_bytes(&k.to_bytes().unwrap(), "the runner's case").unwrap();
        assert_eq!(back.meta.cp, k.meta.cp);
    }
    assert!((60..=140).contains(&with), "{with} of 300 draws carry CP");
    let mut off = FuzzConfig::new(op("gdn"), &convention::FLA);
    off.cp = false;
    assert!((0..100).all(|i| off.draw(5, i).cuts.is_none()));
}

fn band_options(cases: u64, preset: &str) -> FuzzOptions {
    FuzzOptions {
        cases: Some(cases),
        tolerance: 5e-3,
        band: Some(BandRule {
            preset: preset.into(),
            samples: 4,
        }),
        ..FuzzOptions::default()
    }
}

/// `--band fla-bf16`: FLA's bf16 emulation itself stays in every case's
/// band; the same with `v_new` stored in e5m2 (`coarse-v-new`) falls out
/// of it, and the failure says where it sits.
#[test]
fn band_judging_passes_the_preset_and_catches_a_coarser_one() {
    let cfg = FuzzConfig {
        dtype: Dtype::Bf16,
        max_tokens: 128,
        ..FuzzConfig::new(op("gdn"), &convention::FLA)
    };
    let mut good = OracleRunner::parse("builtin:fla-bf16").unwrap();
    let rep = fuzz(&cfg, &mut good, &band_options(40, "fla-bf16"), |_, _| {}).unwrap();
    assert!(rep.pass() && rep.cases == 40, "{}", render(&rep));
    assert!(rep.judged.contains("band fla-bf16"), "{}", rep.judged);
    let mut bad = OracleRunner::parse("builtin:coarse-v-new").unwrap();
    let rep = fuzz(&cfg, &mut bad, &band_options(40, "fla-bf16"), |_, _| {}).unwrap();
    assert!(!rep.pass(), "{}", render(&rep));
    let f = &rep.failures[0];
    let out = f
        .verdict
        .checks
        .iter()
        .find(|c| !c.pass)
        .and_then(|c| c.band.clone())
        .unwrap_or_default();
    assert!(out.starts_with("OUT above"), "{}", render(&rep));
}

#[test]
fn a_band_of_a_preset_without_rounding_is_refused() {
    let cfg = FuzzConfig::new(op("gdn"), &convention::FLA);
    let mut r = OracleRunner::new(Compute::F32);
    let e = fuzz(&cfg, &mut r, &band_options(2, "f32"), |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--band f32") && e.contains("single point"),
        "{e}"
    );
    assert!(OracleRunner::parse("builtin:nope")
        .err()
        .unwrap()
        .contains("fla-bf16"));
}

/// ggml's kernel called with FLA's layout (what `--convention fla` makes
/// of a ggml runner): the FLA tensors it is handed are read as ggml's
/// (tiled value heads, state `[V, K]`), its results written ggml's way.
fn ggml_read_as_fla(k: &KernelCase) -> Result<Tensors, String> {
    let ggml = convention::find("ggml").unwrap();
    let fla = k.to_fla()?;
    let dims = convention::Dims::of(&fla)?;
    let mut seen = fla.clone();
    seen.tensors = ggml.to_fla(fla.meta.op, &dims, fla.tensors.clone())?;
    let results = oracle_f32(&seen)?;
    let names: Vec<String> = results.keys().cloned().collect();
    seen.tensors.extend(results);
    let mut out = ggml.to_kernel(&seen)?;
    out.retain(|n, _| names.contains(n));
    Ok(out)
}

/// Every way ggml's kernel under `fla` fails (with grouped value heads and
/// initial states among the draws) gets a cause: the head mapping, the
/// state layout, or both (the 12 "unexplained" failures of ggml-python
/// were both, with an initial state).
#[test]
fn ggml_under_fla_is_caught_and_every_failure_named() {
    for opname in ["gdn", "kda"] {
        let cfg = FuzzConfig {
            within: convention::find("ggml"),
            ..FuzzConfig::new(op(opname), &convention::FLA)
        };
        let mut r = FnRunner {
            name: "ggml-as-fla".into(),
            f: ggml_read_as_fla,
        };
        let opt = FuzzOptions {
            keep_going: true,
            ..options(100)
        };
        let rep = fuzz(&cfg, &mut r, &opt, |_, _| {}).unwrap();
        assert!(!rep.pass(), "{}", render(&rep));
        assert!(
            rep.failing_cases.keys().all(|s| !s.contains("unexplained")),
            "{}",
            render(&rep)
        );
        assert!(
            rep.failing_cases
                .keys()
                .any(|s| s.contains("head-mapping+state-layout")),
            "{}",
            render(&rep)
        );
    }
}
