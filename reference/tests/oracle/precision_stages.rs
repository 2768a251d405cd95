//! Precision stages that only the backward's reductions use: each moves the
//! gradients it claims to and nothing else, and an engine without it does
//! not declare it (so `deltaref` refuses a preset asking for it there).

use deltaref::dtype::Dtype;
use deltaref::gates::Gate;
use deltaref::inputs::{self, KdaSpec, Layout};
use deltaref::kda::{Chunk, KdaGrads, KdaOptions};
use deltaref::op;
use deltaref::precision::{Feature, Policy, Stage};
use ndarray::ArrayD;

fn norm_ratio(a: &ArrayD<f64>, b: &ArrayD<f64>) -> f64 {
    let n = a.len() as f64;
    let d = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>() / n;
    let m = a.iter().map(|x| x * x).sum::<f64>() / n;
    d.sqrt() / (m.sqrt() + 1e-8)
}

/// One KDA gradient by FLA's name.
fn grad<'a>(g: &'a KdaGrads<f64>, name: &str) -> &'a ArrayD<f64> {
    let opt = |t: &'a Option<ArrayD<f64>>| t.as_ref().expect(name);
    match name {
        "dq" => &g.dq,
        "dk" => &g.dk,
        "dv" => &g.dv,
        "dg" => &g.dg,
        "dbeta" => &g.dbeta,
        "dA_log" => opt(&g.da_log),
        "ddt_bias" => opt(&g.ddt_bias),
        "dh0" => opt(&g.dh0),
        _ => panic!("no KDA gradient {name}"),
    }
}

/// A stage moved each of `moved` by a norm ratio inside `band` and left
/// every one of `unmoved` bit-identical.
fn assert_moves(
    before: &KdaGrads<f64>,
    after: &KdaGrads<f64>,
    moved: &[&str],
    (lo, hi): (f64, f64),
    unmoved: &[&str],
    stage: &str,
) {
    for name in moved {
        let r = norm_ratio(grad(before, name), grad(after, name));
        assert!(r > lo && r < hi, "{name}: {stage} moved it by {r:e}");
    }
    for name in unmoved {
        assert_eq!(
            grad(before, name),
            grad(after, name),
            "{name} moved under {stage}"
        );
    }
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
    let g = inputs::KdaSpec::generate(&spec);
    let run = |p: Policy| -> KdaGrads<f64> {
        let e = Chunk::new(64).unwrap().with_policy(p);
        op::backward(&e, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap()
    };
    let base = Policy::exact().with(Stage::BwdOperands, Dtype::Bf16);
    let serial = run(base.clone());
    let tree = run(base.with(Stage::HdhSum, Dtype::Bf16));
    assert_moves(
        &serial,
        &tree,
        &["dg", "dA_log", "ddt_bias"],
        (1e-4, 1e-1),
        &["dq", "dk", "dv", "dbeta", "dh0"],
        "bf16 h·dh sums",
    );
}

#[test]
fn hdh_sum_is_declared_by_the_kda_chunk_engine_only() {
    let stage = Feature::Round(Stage::HdhSum);
    assert!(Chunk::FEATURES.contains(&stage));
    // DPLR's `chunk_dplr_bwd_o` casts the products to fp32 before `tl.sum`.
    assert!(!deltaref::dplr::Chunk::FEATURES.contains(&stage));
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
    (inputs::KdaSpec::generate(&spec), opts)
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

#[test]
fn dplr_q_scale_is_read_in_bf16_only_when_scale_is_not_a_power_of_two() {
    use deltaref::dplr::{Chunk as DplrChunk, DplrOptions};
    let case = |k| {
        inputs::DplrSpec::generate(&inputs::DplrSpec {
            layout: Layout::varlen(&[40, 24]),
            h: 1,
            k,
            v: 16,
            initial_state: false,
            seed: 3,
        })
    };
    let o = |g: &inputs::Generated<deltaref::dplr::DplrInputs<f64>>, p: Policy| {
        let e = DplrChunk::new(16).unwrap().with_policy(p);
        op::forward(&e, &g.inputs, &DplrOptions::default())
            .unwrap()
            .o
    };
    let act = Policy::exact().with(Stage::Activations, Dtype::Bf16);
    // K = 32: scale 2^-2.5, q·scale needs more than bf16's 8 bits.
    let g = case(32);
    let r = norm_ratio(&o(&g, Policy::exact()), &o(&g, act.clone()));
    assert!(r > 1e-4 && r < 1e-2, "K=32: moved o by {r:e}");
    // K = 16: scale 1/4, q·scale of a bf16 q is a bf16 number.
    let mut g = case(16);
    g.inputs.q.mapv_inplace(|x| Dtype::Bf16.round(x));
    assert_eq!(
        o(&g, Policy::exact()),
        o(&g, act),
        "a power-of-two scale rounds nothing"
    );
    assert!(Chunk::FEATURES.contains(&Feature::Round(Stage::Activations)));
    assert!(DplrChunk::FEATURES.contains(&Feature::Round(Stage::Activations)));
}

#[test]
fn dplr_aqk_stage_rounds_all_four_blocks() {
    use deltaref::dplr::{Chunk as DplrChunk, DplrOptions};
    // `chunk_dplr_fwd_intra` stores `Aab`, `Aak` through `.to(Aqb.dtype)`:
    // they reach the state through `w`, `u`, where `Aqk`, `Aqb` (only `o`)
    // do not.
    let spec = inputs::DplrSpec {
        layout: Layout::varlen(&[40, 24]),
        h: 1,
        k: 16,
        v: 16,
        initial_state: true,
        seed: 3,
    };
    let g = inputs::DplrSpec::generate(&spec);
    let opt = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let state = |p: Policy| {
        let e = DplrChunk::new(16).unwrap().with_policy(p);
        op::forward(&e, &g.inputs, &opt)
            .unwrap()
            .final_state
            .unwrap()
    };
    let r = norm_ratio(
        &state(Policy::exact()),
        &state(Policy::exact().with(Stage::Aqk, Dtype::Bf16)),
    );
    assert!(r > 1e-5 && r < 1e-2, "moved final_state by {r:e}");
}

#[test]
fn dplr_stored_kg_reaches_dgk_only_through_the_chunk_end_term() {
    use deltaref::dplr::{Chunk as DplrChunk, DplrOptions};
    // FLA's `dgk_last` multiplies `dkg`, `dbg` by the stored bf16 `kg`, `bg`
    // (`chunk_dplr_bwd_o`), while the per-token `−dk·k`, `−db·b` read the
    // raw keys (`chunk_dplr_bwd_kernel_intra`): the rounding of `kg`, `bg`
    // lands once per chunk and key dim, the same at every position. In
    // sequences of one chunk without an initial state (h = 0) nothing else
    // of dgk reads a rounded `qg/kg`.
    let spec = inputs::DplrSpec {
        layout: Layout::varlen(&[16; 16]),
        h: 2,
        k: 32,
        v: 32,
        initial_state: false,
        seed: 9,
    };
    let g = inputs::DplrSpec::generate(&spec);
    let opt = DplrOptions::default();
    let run = |p: Policy| {
        let e = DplrChunk::new(16).unwrap().with_policy(p);
        op::backward(&e, &g.inputs, &opt, &g.d_o, Some(&g.dht)).unwrap()
    };
    let exact = run(Policy::exact());
    let gated = run(Policy::exact().with(Stage::Gated, Dtype::Bf16));
    let err = &gated.dgk - &exact.dgk;
    // Split the error into each chunk's mean and what varies along it (the
    // rounded `bg` also reaches `dv_new`, hence the A blocks, a little).
    let (mut mean_sq, mut spread_sq) = (0.0, 0.0);
    for n in 0..16 {
        for h in 0..2 {
            for d in 0..32 {
                let xs: Vec<f64> = (0..16).map(|p| err[[0, n * 16 + p, h, d]]).collect();
                let mean = xs.iter().sum::<f64>() / 16.0;
                mean_sq += mean * mean;
                spread_sq += xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 16.0;
            }
        }
    }
    assert!(mean_sq > 0.0, "the stored kg moves dgk");
    let ratio = (spread_sq / mean_sq).sqrt();
    assert!(
        ratio < 0.1,
        "dgk's error varies along the chunk: {ratio:e} of its mean"
    );
}

#[test]
fn k_beta_bwd_moves_only_dk_and_the_decay_gradients() {
    // A lower-bound gate (FLA safe_gate): ∂/∂k_s reads the rounded β·k of
    // every later row of its chunk; nothing else reads it.
    let opts = KdaOptions {
        gate: Gate::LowerBound { lower_bound: -5.0 },
        ..Default::default()
    };
    let spec = KdaSpec {
        layout: Layout::varlen(&[200, 56]),
        h: 1,
        hv: 1,
        k: 32,
        v: 16,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 4,
    };
    let g = inputs::KdaSpec::generate(&spec);
    let run = |p: Policy| {
        let e = Chunk::new(64).unwrap().with_policy(p);
        op::backward(&e, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap()
    };
    for dots in [false, true] {
        let mut base = Policy::exact();
        if dots {
            base = base.with(Stage::IntraDots, Dtype::Tf32);
            base.safe_gate_midpoint = true;
        }
        let without = run(base.clone());
        let with = run(base.with(Stage::KBetaBwd, Dtype::Bf16));
        assert_moves(
            &without,
            &with,
            &["dk", "dg", "dA_log"],
            (1e-5, 5e-2),
            &["dq", "dv", "dbeta"],
            "k-beta-bwd",
        );
    }
}
