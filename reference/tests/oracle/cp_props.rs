//! Context parallel against non-CP, in f64: for random shapes, varlen
//! layouts (with 0- and 1-length sequences), world sizes 1..8 and random cut
//! points, CP outputs, final states and every gradient agree to ≤ 1e-10
//! norm_ratio; merged states equal the non-CP state at each rank's first
//! token. Plus FLA's debugging-guide example and intra-card splitting.

use crate::common;

use deltaref::cp::PlanSpec;
use deltaref::cp::{self, CpOptions};
use deltaref::cp::{compute_subseq_len, split_points, IntraParams};
use deltaref::dplr::{self, Dplr, DplrOptions};
use deltaref::gates::Gate;
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout, Regime, TokenShiftSpec};
use deltaref::kda::{self, Chunk, Kda, KdaOptions, Naive};
use deltaref::op::{self, Engine, Operator};
use deltaref::token_shift::{self, Shift};
use deltaref::varlen::Segment;
use ndarray::ArrayD;
use proptest::prelude::*;

use common::norm_ratio as ratio;

const TOL: f64 = 1e-10;
/// max_abs bar for merged states and state gradients, relative to max(1, max |reference|).
const STATE_TOL: f64 = 1e-12;

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

/// Bar of a gate reduction's error, relative to the `Σ |term|` it sums.
///
/// The chunked engines' decay gradient comes out of a reverse cumsum over
/// each chunk of terms (`q·dq − k·dk`, …) far larger than the result, so its
/// error is relative to those terms; `dA_log` and `ddt_bias` then add it up
/// over every token. Found by CI's proptest (the saved regression): a sharp,
/// K = 1 case, world 1, where chunked `dA_log` is 2.0e-10 of its `Σ |term|`
/// off naive's (5.9e-9 of the value itself), with `dg` itself within 1e-10.
const SUM_TOL: f64 = 1e-9;

/// Each element within [`SUM_TOL`] of `scale` (or 1e-12 absolute): for a
/// sum over every token whose terms cancel, `scale = Σ |term|` bounds its
/// rounding, while the sum itself can be far smaller than its terms.
fn close_sum(
    what: &str,
    a: &ArrayD<f64>,
    b: &ArrayD<f64>,
    scale: &[f64],
) -> Result<(), TestCaseError> {
    for ((i, (x, y)), s) in a.iter().zip(b.iter()).enumerate().zip(scale) {
        let e = (x - y).abs();
        prop_assert!(
            e <= SUM_TOL * s || e <= 1e-12,
            "{}[{}]: {:e} vs {:e}, off by {:e} = {:e} of Σ|term| {:e}",
            what,
            i,
            x,
            y,
            e,
            e / s,
            s
        );
    }
    Ok(())
}

/// `Σ |term|` of the gate's reductions from the per-token `dg [B, T, HV, K]`
/// (the gradient of the raw gate input): `dA_log_h = Σ_{t,k} dgate·∂g/∂A_log`
/// with `dgate = dg / (∂g/∂x)`, and `ddt_bias_{h,k} = Σ_t dg`.
fn gate_sum_scales(x: &kda::KdaInputs<f64>, gate: Gate, dg: &ArrayD<f64>) -> [Vec<f64>; 2] {
    if dg.ndim() != 4 {
        // A scalar gate per head has no in-kernel gate, hence no reductions.
        return [vec![], vec![]];
    }
    let (hv, kd) = (dg.shape()[2], dg.shape()[3]);
    let (mut da, mut dbias) = (vec![0.0; hv], vec![0.0; hv * kd]);
    let flat = |a: &Option<ArrayD<f64>>| a.as_ref().map(|a| a.iter().copied().collect::<Vec<_>>());
    let (a_log, dt_bias) = (flat(&x.a_log), flat(&x.dt_bias));
    for ((idx, &d), &raw) in dg.indexed_iter().zip(x.g.iter()) {
        let (h, k) = (idx[2], idx[3]);
        let xv = raw + dt_bias.as_ref().map_or(0.0, |b| b[h * kd + k]);
        let (_, dg_dx, dg_da) = gate.eval(xv, a_log.as_ref().map(|a| a[h]));
        if dg_dx != 0.0 {
            da[h] += (d * dg_da / dg_dx).abs();
        }
        dbias[h * kd + k] += d.abs();
    }
    [da, dbias]
}

/// Lengths (some 0 or 1), at least one token in all.
fn lengths() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(prop_oneof![Just(0usize), Just(1usize), 2usize..120], 1..5)
        .prop_filter("at least one token", |l| l.iter().sum::<usize>() >= 1)
}

/// A layout and a plan: the lengths packed as varlen, or (`varlen = false`)
/// one unpacked sequence of `T = Σ lengths` (B = 1); cut either by random
/// interior cuts (world 1..8), by FLA's equal split over a world size that
/// divides T, or by FLA's zigzag layout over a world size W with 2W | T.
fn layout_and_plan() -> impl Strategy<Value = (Layout, PlanSpec)> {
    (lengths(), any::<bool>(), 0u8..3).prop_flat_map(|(lengths, varlen, kind)| {
        let t: usize = lengths.iter().sum();
        let layout = if varlen {
            Layout::varlen(&lengths)
        } else {
            Layout::batch(1, t)
        };
        let zigzag = zigzag_worlds(t);
        let plan = if kind == 0 && !zigzag.is_empty() {
            prop::sample::select(zigzag)
                .prop_map(PlanSpec::Zigzag)
                .boxed()
        } else if kind < 2 {
            prop::sample::select(divisors(t))
                .prop_map(PlanSpec::World)
                .boxed()
        } else if t == 1 {
            Just(PlanSpec::Cuts(vec![])).boxed()
        } else {
            prop::collection::btree_set(1..t, 0..=(t - 1).min(7))
                .prop_map(|s| PlanSpec::Cuts(s.into_iter().collect()))
                .boxed()
        };
        (Just(layout), plan)
    })
}

/// Every input regime: FLA's draws forget within a chunk, so the merge is
/// only really exercised by the long-memory and mixed ones.
fn regimes() -> impl Strategy<Value = Regime> {
    prop::sample::select(Regime::ALL.to_vec())
}

/// World sizes 1..=8 that split `t` tokens evenly.
fn divisors(t: usize) -> Vec<usize> {
    (1..=8).filter(|&w| t.is_multiple_of(w)).collect()
}

/// World sizes 1..=4 whose zigzag layout (`2W` intervals) splits `t` evenly.
fn zigzag_worlds(t: usize) -> Vec<usize> {
    (1..=4).filter(|&w| t.is_multiple_of(2 * w)).collect()
}

/// Gate variants: none, kda, lower-bound, and GDN's scalar gate (no in-kernel gate).
fn gate_of(i: u8) -> (Gate, bool) {
    match i % 4 {
        0 => (Gate::None, false),
        1 => (Gate::Kda, false),
        2 => (Gate::LowerBound { lower_bound: -5.0 }, false),
        _ => (Gate::None, true),
    }
}

/// The global token range of sequence `seq` in `layout`.
fn seq_range(layout: &Layout, seq: usize) -> (usize, usize) {
    layout
        .cu_seqlens()
        .map_or((0, layout.t), |cu| (cu[seq] as usize, cu[seq + 1] as usize))
}

/// Each continuing rank's merged initial state against the naive state at
/// the rank's first token (`state_at(seq, seq_start, rank_start, h)`, an
/// independent prefix run): max_abs ≤ 1e-12 relative to the state's largest
/// entry (when above 1; states grow large with `allow_neg_eigval` and
/// unnormalised k).
fn merged_states_are_naive_prefix_states(
    layout: &Layout,
    diags: &[cp::RankDiag<f64>],
    state_at: impl Fn(usize, usize, usize, usize) -> ndarray::Array2<f64>,
) -> Result<(), TestCaseError> {
    for d in diags {
        let Some(merged) = &d.merged_h0 else {
            prop_assert!(d.meta.is_first_rank);
            continue;
        };
        let seq = d.meta.pieces[0].seq;
        let (a, _) = seq_range(layout, seq);
        for (h, m) in merged.iter().enumerate() {
            let want = state_at(seq, a, d.meta.start, h);
            let e = (m - &want).iter().fold(0.0f64, |x, v| x.max(v.abs()));
            let scale = want.iter().fold(1.0f64, |x, v| x.max(v.abs()));
            prop_assert!(
                e <= STATE_TOL * scale,
                "rank {} head {}: merged h0 off by {:e} (state max {:e})",
                d.meta.rank,
                h,
                e,
                scale
            );
        }
    }
    Ok(())
}

/// max(1, max |x|) over all heads.
fn state_scale(x: &[ndarray::Array2<f64>]) -> f64 {
    x.iter().flatten().fold(1.0f64, |m, v| m.max(v.abs()))
}

/// The diagnostics' own merged-vs-non-CP errors, and which ranks have them.
fn diag_errors_are_small(diags: &[cp::RankDiag<f64>]) -> Result<(), TestCaseError> {
    for d in diags {
        prop_assert_eq!(d.merged_h0.is_some(), d.meta.pre_num_ranks > 0);
        prop_assert_eq!(d.merged_dht.is_some(), d.meta.post_num_ranks > 0);
        if let (Some(e), Some(r)) = (d.h0_error(), &d.reference_h0) {
            let bar = STATE_TOL * state_scale(r);
            prop_assert!(
                e <= bar,
                "rank {} merged h0 off by {:e} > {:e}",
                d.meta.rank,
                e,
                bar
            );
        }
        if let (Some(e), Some(r)) = (d.dht_error(), &d.reference_dht) {
            let bar = STATE_TOL * state_scale(r);
            prop_assert!(
                e <= bar,
                "rank {} merged dht off by {:e} > {:e}",
                d.meta.rank,
                e,
                bar
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(96))]

    #[test]
    fn kda_cp_equals_non_cp(
        (layout, plan) in layout_and_plan(),
        h in 1usize..3, g in 1usize..3, k in 1usize..6, v in 1usize..6,
        gate in 0u8..4, l2 in any::<bool>(), beta_sigmoid in any::<bool>(), neg in any::<bool>(), h0 in any::<bool>(),
        chunk in any::<bool>(), cs in prop::sample::select(vec![16usize, 32, 64]), seed in 0u64..1000,
        regime in regimes(),
    ) {
        let (gate, scalar_gate) = gate_of(gate);
        let opts = KdaOptions {
            output_final_state: true, gate, use_qk_l2norm_in_kernel: l2,
            use_beta_sigmoid_in_kernel: beta_sigmoid, allow_neg_eigval: beta_sigmoid && neg,
            ..Default::default()
        };
        let spec = KdaSpec { layout: layout.clone(), h, hv: h * g, k, v, opts, initial_state: h0, scalar_gate, seed };
        let x = inputs::KdaSpec::generate_in(&spec, regime);
        let cpo = CpOptions::default();
        let p = Kda::prepare(&x.inputs, &opts).unwrap();
        let run = |e: &dyn KdaEngineDyn| -> Result<(), TestCaseError> {
            let (o, fwd_diags) = e.cp_fwd(&x.inputs, &opts, &plan, &cpo);
            let full = op::forward(&kda::Naive, &x.inputs, &opts).unwrap();
            close("o", &full.o, &o.o)?;
            close("final_state", full.final_state.as_ref().unwrap(), o.final_state.as_ref().unwrap())?;
            merged_states_are_naive_prefix_states(&layout, &fwd_diags, |seq, a, at, h| {
                let seg = Segment { seq, batch: 0, start: a, end: at };
                Naive.forward(&Kda::head(&p, &seg, h), op::initial_state(&p, seq, h).view()).1
            })?;
            let (gr, diags) = e.cp_bwd(&x.inputs, &opts, &x.d_o, &x.dht, &plan, &cpo);
            let want = op::backward(&kda::Naive, &x.inputs, &opts, &x.d_o, Some(&x.dht)).unwrap();
            close("dq", &want.dq, &gr.dq)?;
            close("dk", &want.dk, &gr.dk)?;
            close("dv", &want.dv, &gr.dv)?;
            close("dg", &want.dg, &gr.dg)?;
            close("dbeta", &want.dbeta, &gr.dbeta)?;
            prop_assert_eq!(want.da_log.is_some(), gr.da_log.is_some());
            prop_assert_eq!(want.dh0.is_some(), gr.dh0.is_some());
            let [da_scale, dbias_scale] = gate_sum_scales(&x.inputs, gate, &want.dg);
            if let (Some(a), Some(b)) = (&want.da_log, &gr.da_log) { close_sum("dA_log", a, b, &da_scale)?; }
            if let (Some(a), Some(b)) = (&want.ddt_bias, &gr.ddt_bias) { close_sum("ddt_bias", a, b, &dbias_scale)?; }
            if let (Some(a), Some(b)) = (&want.dh0, &gr.dh0) { close("dh0", a, b)?; }
            diag_errors_are_small(&diags)
        };
        if chunk { run(&Chunk::new(cs).unwrap())?; } else { run(&Naive)?; }
    }

    #[test]
    fn dplr_cp_equals_non_cp(
        (layout, plan) in layout_and_plan(), h in 1usize..3, k in 1usize..6, v in 1usize..6, h0 in any::<bool>(),
        chunk in any::<bool>(), cs in prop::sample::select(vec![16usize, 32, 64]), seed in 0u64..1000,
        regime in regimes(),
    ) {
        let spec = DplrSpec { layout: layout.clone(), h, k, v, initial_state: h0, seed };
        let x = inputs::DplrSpec::generate_in(&spec, regime);
        let opts = DplrOptions { output_final_state: true, ..Default::default() };
        let cpo = CpOptions::default();
        let engine: Box<dyn DplrCp> = if chunk { Box::new(dplr::Chunk::new(cs).unwrap()) } else { Box::new(dplr::Naive) };
        let (o, fwd_diags) = engine.fwd(&x.inputs, &opts, &plan, &cpo);
        let full = op::forward(&dplr::Naive, &x.inputs, &opts).unwrap();
        close("o", &full.o, &o.o)?;
        close("final_state", full.final_state.as_ref().unwrap(), o.final_state.as_ref().unwrap())?;
        let p = Dplr::prepare(&x.inputs, &opts).unwrap();
        merged_states_are_naive_prefix_states(&layout, &fwd_diags, |seq, a, at, h| {
            let seg = Segment { seq, batch: 0, start: a, end: at };
            dplr::Naive.forward(&Dplr::head(&p, &seg, h), op::initial_state(&p, seq, h).view()).1
        })?;
        let (gr, diags) = engine.bwd(&x.inputs, &opts, &x.d_o, &x.dht, &plan, &cpo);
        let want = op::backward(&dplr::Naive, &x.inputs, &opts, &x.d_o, Some(&x.dht)).unwrap();
        for (n, a, b) in [("dq", &want.dq, &gr.dq), ("dk", &want.dk, &gr.dk), ("dv", &want.dv, &gr.dv), ("da", &want.da, &gr.da), ("db", &want.db, &gr.db), ("dgk", &want.dgk, &gr.dgk)] {
            close(n, a, b)?;
        }
        prop_assert_eq!(want.dh0.is_some(), gr.dh0.is_some());
        if let (Some(a), Some(b)) = (&want.dh0, &gr.dh0) { close("dh0", a, b)?; }
        diag_errors_are_small(&diags)?;
    }

    #[test]
    fn token_shift_cp_equals_non_cp((layout, plan) in layout_and_plan(), dim in 1usize..5, cache in any::<bool>(), seed in 0u64..1000, regime in regimes()) {
        let x = inputs::TokenShiftSpec::generate_in(&TokenShiftSpec { layout, d: dim, cache, seed }, regime);
        let full = op::forward(&token_shift::Shift, &x.inputs, &()).unwrap();
        let got = cp::forward(&Shift, &x.inputs, &(), &plan, &CpOptions::default())
            .unwrap()
            .0;
        prop_assert_eq!(&full.y, &got.y);
        prop_assert_eq!(&full.final_cache, &got.final_cache);
        let want = op::backward(&token_shift::Shift, &x.inputs, &(), &x.d_o, Some(&x.dht)).unwrap();
        let got = cp::backward(
            &Shift,
            &x.inputs,
            &(),
            &x.d_o,
            Some(&x.dht),
            &plan,
            &CpOptions::default(),
        )
        .unwrap()
        .0;
        close("dx", &want.dx, &got.dx)?;
        prop_assert_eq!(want.dcache.is_some(), got.dcache.is_some());
        if let (Some(a), Some(b)) = (&want.dcache, &got.dcache) { close("dcache", a, b)?; }
    }

    /// The rank metadata of an equal split against an independent
    /// transcription of FLA's `get_cp_cu_seqlens` (searchsorted on the
    /// sequence ends and starts, clamp, unique_consecutive).
    #[test]
    fn equal_split_metadata_is_flas(
        (lengths, world) in lengths().prop_flat_map(|l| {
            let w = prop::sample::select(divisors(l.iter().sum()));
            (Just(l), w)
        }),
    ) {
        let t: usize = lengths.iter().sum();
        let cu = Layout::varlen(&lengths).cu_seqlens().unwrap();
        let plan = PlanSpec::World(world).build(1, t, Some(&cu)).unwrap();
        for (r, m) in plan.ranks.iter().enumerate() {
            let want = fla_context(&cu, world, r);
            prop_assert_eq!(
                (&m.cu_seqlens, m.pre_num_ranks, m.post_num_ranks, m.is_first_rank, m.is_last_rank, m.pre_num_conv_tokens),
                (&want.0, want.1, want.2, want.3, want.4, want.5),
                "rank {}", r
            );
        }
    }
}

proptest! {
    #![proptest_config(common::proptest_config(96))]

    /// Zigzag: every part's metadata and each rank's concatenated local
    /// `cu_seqlens` against an independent transcription of FLA's
    /// `get_cp_cu_seqlens(..., layout='zigzag')`.
    #[test]
    fn zigzag_metadata_is_flas(
        (lengths, world) in lengths().prop_filter("2W | T for some W", |l| !zigzag_worlds(l.iter().sum()).is_empty())
            .prop_flat_map(|l| {
                let w = prop::sample::select(zigzag_worlds(l.iter().sum()));
                (Just(l), w)
            }),
    ) {
        let t: usize = lengths.iter().sum();
        let cu = Layout::varlen(&lengths).cu_seqlens().unwrap();
        let plan = PlanSpec::Zigzag(world).build(1, t, Some(&cu)).unwrap();
        prop_assert_eq!(plan.devices(), world);
        for r in 0..world {
            let (front, back) = (fla_context(&cu, 2 * world, r), fla_context(&cu, 2 * world, 2 * world - 1 - r));
            let dev = plan.device_rank(r);
            for (i, want) in dev.intervals.iter().zip([&front, &back]) {
                let m = &plan.ranks[*i];
                prop_assert_eq!(m.device, r);
                prop_assert_eq!(
                    (&m.cu_seqlens, m.pre_num_ranks, m.post_num_ranks, m.is_first_rank, m.is_last_rank, m.pre_num_conv_tokens),
                    (&want.0, want.1, want.2, want.3, want.4, want.5),
                    "rank {} interval {}", r, i
                );
            }
            let part = (t / (2 * world)) as i64;
            let local: Vec<i64> = front.0.iter().copied().chain(back.0[1..].iter().map(|c| c + part)).collect();
            prop_assert_eq!(&dev.cu_seqlens, &local);
            prop_assert_eq!(dev.front_num_seqs, front.0.len() - 1);
        }
    }
}

/// FLA's `get_cp_cu_seqlens(cu_seqlens, world_size, rank)` for `parts` equal
/// intervals (the world size when contiguous, twice it when zigzag; `rank`
/// is then the chain position): `(local cu_seqlens, pre_num_ranks,
/// post_num_ranks, is_first_rank, is_last_rank, pre_num_conv_tokens)`.
fn fla_context(
    cu: &[i64],
    parts: usize,
    rank: usize,
) -> (Vec<i64>, usize, usize, bool, bool, usize) {
    let total = *cu.last().unwrap();
    let part = total / parts as i64;
    let (rs, re) = (part * rank as i64, part * (rank as i64 + 1));
    // searchsorted(ends, rs, right) and searchsorted(starts, re, left).
    let first = cu[1..].iter().filter(|&&e| e <= rs).count();
    let last = cu[..cu.len() - 1].iter().filter(|&&s| s < re).count();
    let mut local: Vec<i64> = cu[first..=last]
        .iter()
        .map(|&c| c.clamp(rs, re) - rs)
        .collect();
    local.dedup();
    let (head, tail) = (cu[first], cu[last]);
    let first_rank = (head / part) as usize;
    let last_rank = ((tail - 1) / part) as usize;
    (
        local,
        rank - first_rank,
        last_rank - rank,
        rank == first_rank,
        rank == last_rank,
        (rs - head).max(0) as usize,
    )
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

impl<E: Engine<f64, Op = Dplr>> DplrCp for E {
    fn fwd(
        &self,
        x: &dplr::DplrInputs<f64>,
        o: &DplrOptions,
        p: &PlanSpec,
        c: &CpOptions,
    ) -> (dplr::DplrOutputs<f64>, Vec<cp::RankDiag<f64>>) {
        cp::forward(self, x, o, p, c).expect("valid")
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
        cp::backward(self, x, o, d_o, Some(dht), p, c).expect("valid")
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

impl<E: Engine<f64, Op = Kda>> KdaEngineDyn for E {
    fn cp_fwd(
        &self,
        x: &kda::KdaInputs<f64>,
        o: &KdaOptions,
        p: &PlanSpec,
        c: &CpOptions,
    ) -> (kda::KdaOutputs<f64>, Vec<cp::RankDiag<f64>>) {
        cp::forward(self, x, o, p, c).expect("valid")
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
        cp::backward(self, x, o, d_o, Some(dht), p, c).expect("valid")
    }
}

/// FLA's debugging-guide layouts, one engine: CP equals non-CP for `o` and
/// every gradient; returns the diagnostics of the backward.
fn debug_guide_run(
    e: &dyn KdaEngineDyn,
    lengths: &[usize],
    world: usize,
) -> (kda::KdaInputs<f64>, KdaOptions, Vec<cp::RankDiag<f64>>) {
    let opts = KdaOptions {
        output_final_state: true,
        gate: Gate::LowerBound { lower_bound: -5.0 },
        use_qk_l2norm_in_kernel: true,
        ..Default::default()
    };
    let spec = KdaSpec {
        layout: Layout::varlen(lengths),
        h: 2,
        hv: 2,
        k: 16,
        v: 16,
        opts,
        initial_state: false,
        scalar_gate: false,
        seed: 7,
    };
    let x = inputs::KdaSpec::generate(&spec);
    let plan = PlanSpec::World(world);
    let cpo = CpOptions::default();
    let (o, _) = e.cp_fwd(&x.inputs, &opts, &plan, &cpo);
    let full = op::forward(&kda::Naive, &x.inputs, &opts).unwrap();
    assert!(ratio(&full.o, &o.o) <= TOL);
    let (gr, diags) = e.cp_bwd(&x.inputs, &opts, &x.d_o, &x.dht, &plan, &cpo);
    let want = op::backward(&kda::Naive, &x.inputs, &opts, &x.d_o, Some(&x.dht)).unwrap();
    for (n, a, b) in [
        ("dq", &want.dq, &gr.dq),
        ("dk", &want.dk, &gr.dk),
        ("dv", &want.dv, &gr.dv),
        ("dg", &want.dg, &gr.dg),
        ("dbeta", &want.dbeta, &gr.dbeta),
    ] {
        assert!(ratio(a, b) <= TOL, "{n}: {:e}", ratio(a, b));
    }
    (x.inputs, opts, diags)
}

fn max_diff(a: &ndarray::Array2<f64>, b: &ndarray::Array2<f64>) -> f64 {
    (a - b).iter().fold(0.0f64, |m, v| m.max(v.abs()))
}

#[test]
fn fla_debug_guide_example() {
    // lengths [400, 624], world 2: rank 1's merged state is the non-CP state
    // at global token 512; rank 0's merged dht is the non-CP state gradient there.
    for (name, e) in [
        ("naive", &Naive as &dyn KdaEngineDyn),
        ("chunk 64", &Chunk::new(64).unwrap()),
    ] {
        let (x, opts, diags) = debug_guide_run(e, &[400, 624], 2);
        let (r0, r1) = (&diags[0].meta, &diags[1].meta);
        assert_eq!(r0.cu_seqlens, vec![0, 400, 512]);
        assert_eq!(r1.cu_seqlens, vec![0, 512]);
        assert_eq!((r0.post_num_ranks, r1.pre_num_ranks), (1, 1));
        // Independent references: naive prefix and suffix runs of sequence 1.
        let p = Kda::prepare(&x, &opts).unwrap();
        let g = inputs::KdaSpec::generate(&KdaSpec {
            layout: Layout::varlen(&[400, 624]),
            h: 2,
            hv: 2,
            k: 16,
            v: 16,
            opts,
            initial_state: false,
            scalar_gate: false,
            seed: 7,
        });
        let d_o = g.d_o.view().into_dimensionality::<ndarray::Ix4>().unwrap();
        let dht = g.dht.view().into_dimensionality::<ndarray::Ix4>().unwrap();
        let (head, tail) = (
            Segment {
                seq: 1,
                batch: 0,
                start: 400,
                end: 512,
            },
            Segment {
                seq: 1,
                batch: 0,
                start: 512,
                end: 1024,
            },
        );
        for h in 0..2 {
            let state = Naive
                .forward(&Kda::head(&p, &head, h), op::initial_state(&p, 1, h).view())
                .1;
            let d = max_diff(&diags[1].merged_h0.as_ref().unwrap()[h], &state);
            assert!(d <= 1e-12, "{name} head {h}: merged h0 off by {d:e}");
            let dh = Naive
                .backward(
                    &Kda::head(&p, &tail, h),
                    state.view(),
                    d_o.slice(ndarray::s![tail.batch, tail.start..tail.end, h, ..]),
                    dht.slice(ndarray::s![1, h, .., ..]),
                )
                .dh0;
            let d = max_diff(&diags[0].merged_dht.as_ref().unwrap()[h], &dh);
            assert!(d <= 1e-12, "{name} head {h}: merged dht off by {d:e}");
        }
        let table = cp::table(&diags, deltaref::cp::Carry::State);
        assert!(
            table.contains("0..512") && table.contains("512..1024"),
            "{table}"
        );
    }
}

#[test]
fn debug_guide_rank_with_a_tail_and_a_head() {
    // lengths [700, 324], CP4 (pitfall 4): rank 2 holds the tail of sequence 0
    // and the head of sequence 1, so its forward pre-process (last piece) and
    // backward pre-process (first piece) are different sequences.
    for e in [&Naive as &dyn KdaEngineDyn, &Chunk::new(64).unwrap()] {
        let (_, _, diags) = debug_guide_run(e, &[700, 324], 4);
        let r2 = &diags[2].meta;
        assert_eq!(r2.cu_seqlens, vec![0, 188, 256]);
        assert_eq!((r2.pre_num_ranks, r2.post_num_ranks), (2, 1));
        assert_eq!((r2.pieces[0].seq, r2.pieces[1].seq), (0, 1));
        assert!(diags[3].meta.is_last_rank && !diags[3].meta.is_first_rank);
        for d in &diags {
            assert!(d.h0_error().is_none_or(|e| e <= 1e-12));
            assert!(d.dht_error().is_none_or(|e| e <= 1e-12));
        }
    }
}

#[test]
fn bad_cp_plans_are_rejected() {
    let x = inputs::KdaSpec::generate(&KdaSpec {
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
    let e = cp::forward(
        &Naive,
        &x.inputs,
        &KdaOptions::default(),
        &PlanSpec::World(2),
        &CpOptions::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("B must be 1"), "{e}");
    let y = inputs::KdaSpec::generate(&KdaSpec {
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
            cp::forward(
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
    let x = inputs::KdaSpec::generate(&spec);
    let plan = deltaref::cp::plan_spec(&[0, 300, 310, 510], &q).unwrap();
    let (o, _) = cp::forward(
        &Chunk::new(64).unwrap(),
        &x.inputs,
        &opts,
        &plan,
        &CpOptions::default(),
    )
    .unwrap();
    let full = op::forward(&kda::Naive, &x.inputs, &opts).unwrap();
    assert!(ratio(&full.o, &o.o) <= TOL);
    assert!(
        ratio(
            full.final_state.as_ref().unwrap(),
            o.final_state.as_ref().unwrap()
        ) <= TOL
    );
}

/// FLA's `prepare_subseq_cu_seqlens`, transcribed: the boundaries of all
/// sub-sequences (sequence ends included, FLA's empty trailing pieces as
/// repeated ends).
fn fla_subseq_boundaries(
    cu: &[i64],
    subseq_len: usize,
    cs: usize,
    max_splits: usize,
) -> Vec<usize> {
    let subseq_chunks = subseq_len.div_ceil(cs);
    let mut out = vec![0];
    for w in cu.windows(2) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        let chunks = (b - a).div_ceil(cs);
        if b - a >= 3 * subseq_len {
            let n = max_splits.min(chunks.div_ceil(subseq_chunks));
            let piece = chunks.div_ceil(n) * cs;
            out.extend((1..=n).map(|j| (a + j * piece).min(b)));
        } else {
            out.push(b);
        }
    }
    out
}

proptest! {
    #![proptest_config(common::proptest_config(32))]

    /// Intra-card splitting: the cuts are FLA's sub-sequence boundaries that
    /// are not sequence ends, and the split forward equals the non-CP one.
    #[test]
    fn intra_card_split_is_flas_and_matches_non_cp(
        lengths in prop::collection::vec(0usize..400, 1..4).prop_filter("tokens", |l| l.iter().sum::<usize>() >= 1),
        subseq_len in 1usize..100, cs in prop::sample::select(vec![16usize, 32, 64]), max_splits in 1usize..6,
        chunk in any::<bool>(), seed in 0u64..1000,
    ) {
        let cu = Layout::varlen(&lengths).cu_seqlens().unwrap();
        let p = IntraParams { num_sms: 132, num_heads: 1, chunk_size: cs, max_splits, subseq_len: Some(subseq_len) };
        let cuts = split_points(&cu, &p).unwrap();
        let mut want: Vec<usize> = fla_subseq_boundaries(&cu, subseq_len, cs, max_splits)
            .into_iter()
            .filter(|b| !cu.contains(&(*b as i64)))
            .collect();
        want.dedup();
        prop_assert_eq!(&cuts, &want);
        let opts = KdaOptions { output_final_state: true, ..Default::default() };
        let spec = KdaSpec { layout: Layout::varlen(&lengths), h: 1, hv: 1, k: 3, v: 2, opts, initial_state: true, scalar_gate: false, seed };
        let x = inputs::KdaSpec::generate(&spec);
        let plan = deltaref::cp::plan_spec(&cu, &p).unwrap();
        let (o, _) = if chunk {
            cp::forward(&Chunk::new(cs).unwrap(), &x.inputs, &opts, &plan, &CpOptions::default())
        } else {
            cp::forward(&Naive, &x.inputs, &opts, &plan, &CpOptions::default())
        }
        .unwrap();
        let full = op::forward(&kda::Naive, &x.inputs, &opts).unwrap();
        close("o", &full.o, &o.o)?;
        close("final_state", full.final_state.as_ref().unwrap(), o.final_state.as_ref().unwrap())?;
    }
}

#[test]
fn bad_intra_card_parameters_are_rejected() {
    let cu = [0i64, 500];
    let p = IntraParams::default();
    for (bad, needle) in [
        (IntraParams { chunk_size: 0, ..p }, "chunk_size"),
        (IntraParams { max_splits: 0, ..p }, "max_splits"),
        (
            IntraParams {
                subseq_len: Some(0),
                ..p
            },
            "subseq_len",
        ),
    ] {
        let e = split_points(&cu, &bad).unwrap_err();
        assert!(e.to_string().contains(needle), "{bad:?}: {e}");
    }
}
