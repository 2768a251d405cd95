//! DPLR's safe-gate path (FLA `safe_gate` / `lower_bound`): the midpoint
//! anchored A stage changes no value in f64; in the bf16 emulation it keeps
//! `Aab`, `Aak` in fp32 (tf32 operands) where the non-safe kernel rounds
//! them to bf16; `midpoint=off` switches it off; FLA #1085's wrong-stride
//! anchor overflows fp32 on a head with strong gates.

use deltaref::dplr::Chunk;
use deltaref::dplr::{Dplr, DplrInputs, DplrOptions};
use deltaref::inputs::{DplrSpec, Layout};
use deltaref::op::Operator;
use deltaref::precision::{Policy, Stage};
use deltaref::registry;
use deltaref::Dtype;
use deltaref_tests::assert_maps_close;
use deltaref_verify::outputs::{self, Tensors};
use ndarray::{s, Array2};

fn spec(seed: u64) -> DplrSpec {
    DplrSpec {
        layout: Layout::varlen(&[37, 50]),
        h: 2,
        k: 8,
        v: 6,
        initial_state: true,
        seed,
    }
}

fn run<T: deltaref::scalar::Scalar>(policy: Policy, s: &DplrSpec) -> Tensors {
    let g = s.generate();
    let engine = Chunk::new(16).unwrap().with_policy(policy);
    outputs::all::<T, _>(
        &engine,
        &g.inputs,
        &DplrOptions::default(),
        &g.d_o,
        Some(&g.dht),
    )
    .expect("valid")
}

fn safe() -> Policy {
    Policy {
        safe_gate_midpoint: true,
        ..Policy::exact()
    }
}

/// The anchor cancels: forward and backward agree with the oracle's own
/// factorisation to 1e-12 in f64, also with #1085's wrong anchor (which
/// moves the exponents, not the products, where f64 does not overflow).
#[test]
fn the_safe_gate_path_changes_nothing_in_f64() {
    for seed in [3, 4] {
        let s = spec(seed);
        let exact = run::<f64>(Policy::exact(), &s);
        assert_maps_close("safe gate", &exact, &run::<f64>(safe(), &s), 1e-12);
        let stride = Policy {
            midpoint_stride_fault: true,
            ..safe()
        };
        assert_maps_close("#1085 anchor", &exact, &run::<f64>(stride, &s), 1e-12);
        // The bound licenses the scheme at chunk 16 (|lb| ≤ 9.55).
        let bound = Policy {
            safe_gate_bound: Some(-5.0),
            ..Policy::exact()
        };
        assert!(bound.safe_gate_at(16) && !bound.safe_gate_at(64));
        assert_maps_close("lower_bound", &exact, &run::<f64>(bound, &s), 1e-12);
    }
}

/// Head `h` of the first sequence of `x`, in f32, through chunk 1 (tokens
/// 16..32) of `engine`: its `Aak`, and the f64 oracle's.
fn aak(engine: &Chunk, x: &DplrInputs<f64>, h: usize) -> (Array2<f64>, Array2<f64>) {
    let opt = DplrOptions::default();
    let xf = x.cast::<f32>();
    let pf = Dplr::prepare(&xf, &opt).unwrap();
    let got = engine
        .intra(&Dplr::head(&pf, &pf.segments[0], h), 16, 16)
        .aak;
    let p = Dplr::prepare(x, &opt).unwrap();
    let want = Chunk::new(16)
        .unwrap()
        .intra(&Dplr::head(&p, &p.segments[0], h), 16, 16)
        .aak;
    (got.mapv(f64::from), want)
}

/// FLA's bf16 storage plan for a DPLR case with these case options.
fn bf16_policy(options: serde_json::Value) -> Policy {
    let serde_json::Value::Object(o) = options else {
        panic!("case options are a JSON object")
    };
    registry::find("dplr")
        .expect("dplr is registered")
        .fla_bf16(&o, false)
}

fn max_rel(got: &Array2<f64>, want: &Array2<f64>) -> f64 {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    (got - want).iter().fold(0.0f64, |m, v| m.max(v.abs())) / scale
}

/// FLA's bf16 policy for DPLR: with `safe_gate` the emulation asks for the
/// midpoint scheme and tf32 operands; `Aak` then carries tf32's error (about
/// 2^-11; measured 4.6e-4 of max |Aak|), under half the non-safe kernel's
/// bf16 store (2^-9; measured 1.8e-3).
#[test]
fn the_bf16_emulation_keeps_aak_in_fp32_under_the_safe_gate() {
    let plain = bf16_policy(serde_json::json!({}));
    let with_safe = bf16_policy(serde_json::json!({"safe_gate": true}));
    assert!(!plain.safe_gate_at(16) && with_safe.safe_gate_at(64));
    assert_eq!(with_safe.storage(Stage::FwdDots), Some(Dtype::Tf32));
    assert_eq!(plain.storage(Stage::FwdDots), None);
    let bounded = bf16_policy(serde_json::json!({"lower_bound": -5.0}));
    assert!(bounded.safe_gate_at(32) && !bounded.safe_gate_at(64));
    let g = spec(7).generate();
    for h in 0..2 {
        let (safe_aak, want) = aak(
            &Chunk::new(16).unwrap().with_policy(with_safe.clone()),
            &g.inputs,
            h,
        );
        let (plain_aak, _) = aak(
            &Chunk::new(16).unwrap().with_policy(plain.clone()),
            &g.inputs,
            h,
        );
        let (e_safe, e_plain) = (max_rel(&safe_aak, &want), max_rel(&plain_aak, &want));
        println!("head {h}: Aak max error / max |Aak|: safe {e_safe:.2e}, non-safe {e_plain:.2e}");
        assert!(
            e_safe > 0.0 && e_safe < e_plain / 2.0,
            "{e_safe:e} vs {e_plain:e}"
        );
        assert!(e_plain > 2f64.powi(-12), "bf16 store: {e_plain:e}");
    }
    // midpoint=off: the non-safe A stage again, bit for bit.
    let off = with_safe.clone().with_midpoint(false);
    let (off_aak, _) = aak(&Chunk::new(16).unwrap().with_policy(off), &g.inputs, 0);
    let (plain_aak, _) = aak(&Chunk::new(16).unwrap().with_policy(plain), &g.inputs, 0);
    assert_eq!(off_aak, plain_aak);
}

/// Two heads, head 0 with `gk = −9` (inside FLA's safe bound at chunk 16,
/// 9.55): the right anchor keeps every exponent within 72 (e^72 < f32's
/// max), while #1085's read (token `(i_h + 16 n + 8) / 2`, for H = 2 its
/// own head) puts up to 99 between a row and the anchor: `o` overflows to
/// Inf/NaN on head 0 only.
#[test]
fn the_1085_anchor_overflows_fp32_on_the_strongly_gated_head() {
    let s = DplrSpec {
        layout: Layout::batch(1, 64),
        ..spec(9)
    };
    let mut g = s.generate();
    g.inputs.gk.slice_mut(s![.., .., 0, ..]).fill(-9.0);
    let opts = DplrOptions {
        safe_gate: true,
        ..Default::default()
    };
    let policy = bf16_policy(serde_json::json!({"safe_gate": true}));
    let o_of = |policy: Policy| {
        let engine = Chunk::new(16).unwrap().with_policy(policy);
        outputs::all::<f32, _>(&engine, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap()["o"]
            .clone()
    };
    let honest = o_of(policy.clone());
    assert!(honest.iter().all(|v| v.is_finite()));
    let faulty = o_of(Policy {
        midpoint_stride_fault: true,
        ..policy
    });
    let bad = |h: usize| {
        faulty
            .slice(s![.., .., h, ..])
            .iter()
            .filter(|v| !v.is_finite())
            .count()
    };
    assert!(bad(0) > 0, "head 0 overflows");
    assert_eq!(bad(1), 0, "head 1's gates are mild");
    let _ = <Dplr as Operator<f64>>::narrow;
}
