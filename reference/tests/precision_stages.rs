//! Precision stages that only the backward's reductions use: each moves the
//! gradients it claims to and nothing else, and an engine without it does
//! not declare it (so `deltaref` refuses a preset asking for it there).

use deltaref::dtype::Dtype;
use deltaref::gates::Gate;
use deltaref::inputs::{self, KdaSpec, Layout};
use deltaref::kda::{chunk::Chunk, KdaGrads, KdaOptions};
use deltaref::op;
use deltaref::precision::{Feature, Policy, Stage};
use ndarray::ArrayD;

fn norm_ratio(a: &ArrayD<f64>, b: &ArrayD<f64>) -> f64 {
    let n = a.len() as f64;
    let d = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>() / n;
    let m = a.iter().map(|x| x * x).sum::<f64>() / n;
    d.sqrt() / (m.sqrt() + 1e-8)
}

#[test]
fn hdh_sum_moves_only_the_decay_gradients() {
    let opts = KdaOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        gate: Gate::Kda,
        ..Default::default()
    };
    // V = 128: two 64-value blocks per key dim; a length-1 sequence with an
    // initial state, where FLA's error in `dg` is largest.
    let spec = KdaSpec {
        layout: Layout::varlen(&[1, 70]),
        h: 1,
        hv: 1,
        k: 16,
        v: 128,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 11,
    };
    let g = inputs::kda(&spec);
    let run = |p: Policy| -> KdaGrads<f64> {
        let e = Chunk::new(64).unwrap().with_policy(p);
        op::backward(&e, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap()
    };
    let base = Policy::exact().with(Stage::BwdOperands, Dtype::Bf16);
    let serial = run(base.clone());
    let tree = run(base.with(Stage::HdhSum, Dtype::Bf16));
    for (name, a, b) in [
        ("dg", &serial.dg, &tree.dg),
        (
            "dA_log",
            serial.da_log.as_ref().unwrap(),
            tree.da_log.as_ref().unwrap(),
        ),
        (
            "ddt_bias",
            serial.ddt_bias.as_ref().unwrap(),
            tree.ddt_bias.as_ref().unwrap(),
        ),
    ] {
        let r = norm_ratio(a, b);
        assert!(r > 1e-4 && r < 1e-1, "{name}: bf16 sums moved it by {r:e}");
    }
    for (name, a, b) in [
        ("dq", &serial.dq, &tree.dq),
        ("dk", &serial.dk, &tree.dk),
        ("dv", &serial.dv, &tree.dv),
        ("dbeta", &serial.dbeta, &tree.dbeta),
        (
            "dh0",
            serial.dh0.as_ref().unwrap(),
            tree.dh0.as_ref().unwrap(),
        ),
    ] {
        assert_eq!(a, b, "{name} does not read the decay sums");
    }
}

#[test]
fn hdh_sum_is_declared_by_the_kda_chunk_engine_only() {
    let stage = Feature::Round(Stage::HdhSum);
    assert!(Chunk::FEATURES.contains(&stage));
    // DPLR's `chunk_dplr_bwd_o` casts the products to fp32 before `tl.sum`.
    assert!(!deltaref::dplr::chunk::Chunk::FEATURES.contains(&stage));
}

/// A small KDA problem (raw keys, `kda` gate, an initial state: `w` reaches
/// `o` through the state from the first chunk on) for the forward stages.
fn forward_case() -> (inputs::Generated<deltaref::kda::KdaInputs<f64>>, KdaOptions) {
    let opts = KdaOptions {
        output_final_state: true,
        gate: Gate::Kda,
        ..Default::default()
    };
    let spec = KdaSpec {
        layout: Layout::varlen(&[100, 40]),
        h: 1,
        hv: 1,
        k: 32,
        v: 16,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 5,
    };
    (inputs::kda(&spec), opts)
}

#[test]
fn k_beta_and_fwd_dots_each_move_the_forward_alone() {
    let (g, opts) = forward_case();
    let o = |p: Policy| {
        let e = Chunk::new(64).unwrap().with_policy(p);
        op::forward(&e, &g.inputs, &opts).unwrap().o
    };
    let exact = o(Policy::exact());
    for (stage, storage) in [(Stage::KBeta, Dtype::Bf16), (Stage::FwdDots, Dtype::Tf32)] {
        let r = norm_ratio(&exact, &o(Policy::exact().with(stage, storage)));
        assert!(r > 1e-6 && r < 1e-2, "{}: moved o by {r:e}", stage.name());
    }
}
