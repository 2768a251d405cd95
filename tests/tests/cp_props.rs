//! Context parallel against non-CP, in f64: for random shapes, varlen
//! layouts (with 0- and 1-length sequences), world sizes 1..8 and random cut
//! points, CP outputs, final states and every gradient agree to ≤ 1e-10
//! norm_ratio; merged states equal the non-CP state at each rank's first
//! token. Plus FLA's debugging-guide example and intra-card splitting.

use deltaref::cp::intra::{compute_subseq_len, split_points, IntraParams};
use deltaref::cp::plan::PlanSpec;
use deltaref::cp::{self, CpOptions};
use deltaref::dplr::{self, DplrOptions};
use deltaref::gates::Gate;
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout, TokenShiftSpec};
use deltaref::kda::{self, chunk::Chunk, naive::Naive, KdaEngine, KdaOptions};
use deltaref::token_shift;
use deltaref_tests::ratio;
use ndarray::ArrayD;
use proptest::prelude::*;

const TOL: f64 = 1e-10;

/// ≤ 1e-10 norm_ratio, or (for an all-but-zero reference, where the ratio's
/// 1e-8 floor dominates, e.g. dg with a zero state) max_abs ≤ 1e-12.
fn close(what: &str, a: &ArrayD<f64>, b: &ArrayD<f64>) -> Result<(), TestCaseError> {
    let r = ratio(a, b);
    let m = a
        .iter()
        .zip(b.iter())
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    prop_assert!(
        r <= TOL || m <= 1e-12,
        "{}: norm_ratio {:e}, max_abs {:e}",
        what,
        r,
        m
    );
    Ok(())
}

/// Lengths (some 0 or 1) and interior cuts.
fn layout_and_cuts() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    prop::collection::vec(prop_oneof![Just(0usize), Just(1usize), 2usize..120], 1..5)
        .prop_filter("at least one token", |l| l.iter().sum::<usize>() >= 1)
        .prop_flat_map(|lengths| {
            let t: usize = lengths.iter().sum();
            let max_cuts = (t - 1).min(7);
            let cuts = if max_cuts == 0 {
                Just(vec![]).boxed()
            } else {
                prop::collection::btree_set(1..t, 0..=max_cuts)
                    .prop_map(|s| s.into_iter().collect())
                    .boxed()
            };
            (Just(lengths), cuts)
        })
}

fn gate_of(i: u8) -> Gate {
    match i % 3 {
        0 => Gate::None,
        1 => Gate::Kda,
        _ => Gate::LowerBound { lower_bound: -5.0 },
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn kda_cp_equals_non_cp(
        (lengths, cuts) in layout_and_cuts(),
        h in 1usize..3, g in 1usize..3, k in 1usize..6, v in 1usize..6,
        gate in 0u8..3, l2 in any::<bool>(), h0 in any::<bool>(), chunk in any::<bool>(), cs in prop::sample::select(vec![16usize, 32, 64]), seed in 0u64..1000,
    ) {
        let opts = KdaOptions { output_final_state: true, gate: gate_of(gate), use_qk_l2norm_in_kernel: l2, ..Default::default() };
        let spec = KdaSpec { layout: Layout::varlen(&lengths), h, hv: h * g, k, v, opts, initial_state: h0, scalar_gate: false, seed };
        let x = inputs::kda(&spec);
        let plan = PlanSpec::Cuts(cuts);
        let cpo = CpOptions::default();
        let run = |e: &dyn KdaEngineDyn| -> Result<(), TestCaseError> {
            let (o, _) = e.cp_fwd(&x.inputs, &opts, &plan, &cpo);
            let full = kda::naive::forward(&x.inputs, &opts).unwrap();
            close("o", &full.o, &o.o)?;
            close("final_state", full.final_state.as_ref().unwrap(), o.final_state.as_ref().unwrap())?;
            let (gr, diags) = e.cp_bwd(&x.inputs, &opts, &x.d_o, &x.dht, &plan, &cpo);
            let want = kda::naive::backward(&x.inputs, &opts, &x.d_o, Some(&x.dht)).unwrap();
            close("dq", &want.dq, &gr.dq)?;
            close("dk", &want.dk, &gr.dk)?;
            close("dv", &want.dv, &gr.dv)?;
            close("dg", &want.dg, &gr.dg)?;
            close("dbeta", &want.dbeta, &gr.dbeta)?;
            if let (Some(a), Some(b)) = (&want.da_log, &gr.da_log) { close("dA_log", a, b)?; }
            if let (Some(a), Some(b)) = (&want.ddt_bias, &gr.ddt_bias) { close("ddt_bias", a, b)?; }
            if let (Some(a), Some(b)) = (&want.dh0, &gr.dh0) { close("dh0", a, b)?; }
            for d in &diags {
                if let Some(e) = d.h0_error() { prop_assert!(e <= 1e-12, "rank {} merged h0 off by {:e}", d.meta.rank, e); }
                if let Some(e) = d.dht_error() { prop_assert!(e <= 1e-12, "rank {} merged dht off by {:e}", d.meta.rank, e); }
            }
            Ok(())
        };
        if chunk { run(&Chunk::new(cs).unwrap())?; } else { run(&Naive)?; }
    }

    #[test]
    fn dplr_cp_equals_non_cp((lengths, cuts) in layout_and_cuts(), h in 1usize..3, k in 1usize..6, v in 1usize..6, h0 in any::<bool>(), chunk in any::<bool>(), cs in prop::sample::select(vec![16usize, 32, 64]), seed in 0u64..1000) {
        let spec = DplrSpec { layout: Layout::varlen(&lengths), h, k, v, initial_state: h0, seed };
        let x = inputs::dplr(&spec);
        let opts = DplrOptions { output_final_state: true, ..Default::default() };
        let plan = PlanSpec::Cuts(cuts);
        let cpo = CpOptions::default();
        let engine: Box<dyn DplrCp> = if chunk { Box::new(dplr::chunk::Chunk::new(cs).unwrap()) } else { Box::new(dplr::naive::Naive) };
        let (o, _) = engine.fwd(&x.inputs, &opts, &plan, &cpo);
        let full = dplr::naive::forward(&x.inputs, &opts).unwrap();
        close("o", &full.o, &o.o)?;
        close("final_state", full.final_state.as_ref().unwrap(), o.final_state.as_ref().unwrap())?;
        let (gr, diags) = engine.bwd(&x.inputs, &opts, &x.d_o, &x.dht, &plan, &cpo);
        let want = dplr::naive::backward(&x.inputs, &opts, &x.d_o, Some(&x.dht)).unwrap();
        for (n, a, b) in [("dq", &want.dq, &gr.dq), ("dk", &want.dk, &gr.dk), ("dv", &want.dv, &gr.dv), ("da", &want.da, &gr.da), ("db", &want.db, &gr.db), ("dgk", &want.dgk, &gr.dgk)] {
            close(n, a, b)?;
        }
        if let (Some(a), Some(b)) = (&want.dh0, &gr.dh0) { close("dh0", a, b)?; }
        for d in &diags {
            if let Some(e) = d.h0_error() { prop_assert!(e <= 1e-12, "rank {} merged h0 off by {:e}", d.meta.rank, e); }
        }
    }

    #[test]
    fn token_shift_cp_equals_non_cp((lengths, cuts) in layout_and_cuts(), dim in 1usize..5, cache in any::<bool>(), seed in 0u64..1000) {
        let x = inputs::token_shift(&TokenShiftSpec { layout: Layout::varlen(&lengths), d: dim, cache, seed });
        let plan = PlanSpec::Cuts(cuts);
        let full = token_shift::forward(&x.inputs).unwrap();
        let got = cp::token_shift::forward(&x.inputs, &plan).unwrap();
        prop_assert_eq!(&full.y, &got.y);
        prop_assert_eq!(&full.final_cache, &got.final_cache);
        let want = token_shift::backward(&x.inputs, &x.d_o, Some(&x.dht)).unwrap();
        let got = cp::token_shift::backward(&x.inputs, &x.d_o, Some(&x.dht), &plan).unwrap();
        close("dx", &want.dx, &got.dx)?;
        if let (Some(a), Some(b)) = (&want.dcache, &got.dcache) { close("dcache", a, b)?; }
    }
}

/// Object-safe DPLR CP runner over either engine.
trait DplrCp {
    fn fwd(
        &self,
        x: &dplr::DplrInputs<f64>,
        o: &DplrOptions,
        p: &PlanSpec,
        c: &CpOptions,
    ) -> (dplr::DplrOutputs<f64>, Vec<cp::RankDiag<f64>>);
    fn bwd(
        &self,
        x: &dplr::DplrInputs<f64>,
        o: &DplrOptions,
        d_o: &ArrayD<f64>,
        dht: &ArrayD<f64>,
        p: &PlanSpec,
        c: &CpOptions,
    ) -> (dplr::DplrGrads<f64>, Vec<cp::RankDiag<f64>>);
}

impl<E: dplr::DplrEngine<f64>> DplrCp for E {
    fn fwd(
        &self,
        x: &dplr::DplrInputs<f64>,
        o: &DplrOptions,
        p: &PlanSpec,
        c: &CpOptions,
    ) -> (dplr::DplrOutputs<f64>, Vec<cp::RankDiag<f64>>) {
        cp::dplr::forward(self, x, o, p, c).expect("valid")
    }
    fn bwd(
        &self,
        x: &dplr::DplrInputs<f64>,
        o: &DplrOptions,
        d_o: &ArrayD<f64>,
        dht: &ArrayD<f64>,
        p: &PlanSpec,
        c: &CpOptions,
    ) -> (dplr::DplrGrads<f64>, Vec<cp::RankDiag<f64>>) {
        cp::dplr::backward(self, x, o, d_o, Some(dht), p, c).expect("valid")
    }
}

/// Object-safe wrapper so one property body runs with either engine.
trait KdaEngineDyn {
    fn cp_fwd(
        &self,
        x: &kda::KdaInputs<f64>,
        o: &KdaOptions,
        p: &PlanSpec,
        c: &CpOptions,
    ) -> (kda::KdaOutputs<f64>, Vec<cp::RankDiag<f64>>);
    #[allow(clippy::too_many_arguments)]
    fn cp_bwd(
        &self,
        x: &kda::KdaInputs<f64>,
        o: &KdaOptions,
        d_o: &ArrayD<f64>,
        dht: &ArrayD<f64>,
        p: &PlanSpec,
        c: &CpOptions,
    ) -> (kda::KdaGrads<f64>, Vec<cp::RankDiag<f64>>);
}

impl<E: KdaEngine<f64>> KdaEngineDyn for E {
    fn cp_fwd(
        &self,
        x: &kda::KdaInputs<f64>,
        o: &KdaOptions,
        p: &PlanSpec,
        c: &CpOptions,
    ) -> (kda::KdaOutputs<f64>, Vec<cp::RankDiag<f64>>) {
        cp::kda::forward(self, x, o, p, c).expect("valid")
    }
    fn cp_bwd(
        &self,
        x: &kda::KdaInputs<f64>,
        o: &KdaOptions,
        d_o: &ArrayD<f64>,
        dht: &ArrayD<f64>,
        p: &PlanSpec,
        c: &CpOptions,
    ) -> (kda::KdaGrads<f64>, Vec<cp::RankDiag<f64>>) {
        cp::kda::backward(self, x, o, d_o, Some(dht), p, c).expect("valid")
    }
}

#[test]
fn fla_debug_guide_example() {
    // lengths [400, 624], chunk 64, world 2: rank 1's merged state is the
    // non-CP state at global token 512.
    let opts = KdaOptions {
        output_final_state: true,
        gate: Gate::LowerBound { lower_bound: -5.0 },
        use_qk_l2norm_in_kernel: true,
        ..Default::default()
    };
    let spec = KdaSpec {
        layout: Layout::varlen(&[400, 624]),
        h: 2,
        hv: 2,
        k: 16,
        v: 16,
        opts,
        initial_state: false,
        scalar_gate: false,
        seed: 7,
    };
    let x = inputs::kda(&spec);
    let chunk = Chunk::new(64).unwrap();
    let plan = PlanSpec::World(2);
    let cpo = CpOptions::default();
    let (o, diags) = cp::kda::forward(&chunk, &x.inputs, &opts, &plan, &cpo).unwrap();
    let full = kda::naive::forward(&x.inputs, &opts).unwrap();
    assert!(ratio(&full.o, &o.o) <= TOL);
    assert_eq!(diags[1].meta.cu_seqlens, vec![0, 512]);
    assert_eq!(diags[1].meta.pre_num_ranks, 1);
    // Independent reference: the naive state after the first 112 tokens of sequence 1.
    let p = kda::Prepared::new(&x.inputs, &opts).unwrap();
    let seg = deltaref::varlen::Segment {
        seq: 1,
        batch: 0,
        start: 400,
        end: 512,
    };
    for h in 0..2 {
        let state = Naive
            .forward(&p.head(&seg, h), p.initial_state(1, h).view())
            .1;
        let merged = &diags[1].merged_h0.as_ref().unwrap()[h];
        let d = (merged - &state).iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert!(d <= 1e-12, "head {h}: {d:e}");
    }
    let (gr, _) = cp::kda::backward(&chunk, &x.inputs, &opts, &x.d_o, None, &plan, &cpo).unwrap();
    let want = kda::naive::backward(&x.inputs, &opts, &x.d_o, None).unwrap();
    for (n, a, b) in [
        ("dq", &want.dq, &gr.dq),
        ("dk", &want.dk, &gr.dk),
        ("dv", &want.dv, &gr.dv),
        ("dg", &want.dg, &gr.dg),
        ("dbeta", &want.dbeta, &gr.dbeta),
    ] {
        assert!(ratio(a, b) <= TOL, "{n}");
    }
    let table = cp::table(&diags);
    assert!(
        table.contains("0..512") && table.contains("512..1024"),
        "{table}"
    );
}

#[test]
fn bad_cp_plans_are_rejected() {
    let x = inputs::kda(&KdaSpec {
        layout: Layout::batch(2, 8),
        h: 1,
        hv: 1,
        k: 2,
        v: 2,
        opts: KdaOptions::default(),
        initial_state: false,
        scalar_gate: false,
        seed: 1,
    });
    let e = cp::kda::forward(
        &Naive,
        &x.inputs,
        &KdaOptions::default(),
        &PlanSpec::World(2),
        &CpOptions::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("B must be 1"), "{e}");
    let y = inputs::kda(&KdaSpec {
        layout: Layout::varlen(&[5, 4]),
        ..KdaSpec {
            layout: Layout::batch(1, 1),
            h: 1,
            hv: 1,
            k: 2,
            v: 2,
            opts: KdaOptions::default(),
            initial_state: false,
            scalar_gate: false,
            seed: 1,
        }
    });
    for plan in [
        PlanSpec::World(2),
        PlanSpec::Cuts(vec![0]),
        PlanSpec::Cuts(vec![3, 3]),
        PlanSpec::Cuts(vec![10]),
    ] {
        assert!(
            cp::kda::forward(
                &Naive,
                &y.inputs,
                &KdaOptions::default(),
                &plan,
                &CpOptions::default()
            )
            .is_err(),
            "{plan:?}"
        );
    }
}

#[test]
fn intra_card_split_follows_flas_rule_and_matches_non_cp() {
    // FLA's formula, evaluated by hand: T = 40960, chunk 64 → 640 chunks;
    // 132 SMs, 4 heads → target 16 splits → 40 chunks, floored at 128 →
    // subseq_len 8192. 40960 ≥ 3·8192, pieces = min(32, ⌈640/128⌉) = 5 of
    // ⌈640/5⌉·64 = 8192 tokens.
    assert_eq!(compute_subseq_len(40960, 132, 4, 64), 8192);
    assert_eq!(compute_subseq_len(400, 132, 4, 64), 400);
    let p = IntraParams {
        num_sms: 132,
        num_heads: 4,
        chunk_size: 64,
        max_splits: 32,
        subseq_len: None,
    };
    assert_eq!(
        split_points(&[0, 40960], &p).unwrap(),
        vec![8192, 16384, 24576, 32768]
    );
    // An explicit sub-sequence length on a small problem (threshold 3·64 = 192):
    // 300 tokens → 5 chunks → 5 pieces of 64 (cuts 64..256); 10 tokens stay
    // whole; 200 tokens at 310 → 4 chunks → 4 pieces of 64 (cuts 374, 438, 502).
    let q = IntraParams {
        subseq_len: Some(64),
        chunk_size: 64,
        ..p
    };
    let cuts = split_points(&[0, 300, 310, 510], &q).unwrap();
    assert_eq!(cuts, vec![64, 128, 192, 256, 374, 438, 502]);
    let opts = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    let spec = KdaSpec {
        layout: Layout::varlen(&[300, 10, 200]),
        h: 1,
        hv: 2,
        k: 4,
        v: 4,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 3,
    };
    let x = inputs::kda(&spec);
    let plan = deltaref::cp::intra::plan_spec(&[0, 300, 310, 510], &q).unwrap();
    let (o, _) = cp::kda::forward(
        &Chunk::new(64).unwrap(),
        &x.inputs,
        &opts,
        &plan,
        &CpOptions::default(),
    )
    .unwrap();
    let full = kda::naive::forward(&x.inputs, &opts).unwrap();
    assert!(ratio(&full.o, &o.o) <= TOL);
    assert!(
        ratio(
            full.final_state.as_ref().unwrap(),
            o.final_state.as_ref().unwrap()
        ) <= TOL
    );
}
