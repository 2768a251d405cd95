//! Every engine against the truth ([`super`], the definition),
//! and the truth against itself: its dual-number gradients against central
//! finite differences of its own forward, and its forward against tiny cases
//! computed by hand.
//!
//! Bars, as `max |engine − truth| / max |truth|` per tensor (NaN fails):
//! - f64 outputs ≤ [`OUT_BAR`] = 1e-12. The engines compute the same
//!   products as the truth in another order (chunked sums, the WY inverse,
//!   CP merges); on these cases (≤ 100 tokens, O(1) states) that costs at
//!   most 2.3e-15 (measured), so the bar leaves a factor ~400 for other
//!   seeds and still fails an engine off by 1e-11 in one element
//!   ([`a_wrong_engine_fails`]).
//! - f64 gradients ≤ [`GRAD_BAR`] = 1e-10 (measured at most 1.7e-14): the
//!   engines' hand-written backward passes run longer chains (recompute,
//!   reverse sweeps, the CP `dM` chain) than the truth's forward-mode duals.
//! - f32 engines ≤ [`F32_BAR`] = 1e-4 (measured at most 1.1e-5, GDN-2's
//!   `ddt_bias`, a sum over every token): the inputs are narrowed to f32
//!   and every step rounds to f32 (1 ulp = 6e-8).

use std::sync::OnceLock;

use crate::conv::{Activation, CausalConv1d, ConvInputs, ConvOptions, Direct};
use crate::cp::{self, CpOptions, PlanSpec};
use crate::dplr::{self, Dplr, DplrInputs, DplrOptions};
use crate::gates::Gate;
use crate::gdn::{Gdn, GdnInputs, GdnOptions, OnKda};
use crate::gdn2::{self, Gdn2, Gdn2Inputs, Gdn2Options};
use crate::inputs::{self, ConvSpec, DplrSpec, GdnSpec, KdaSpec, Layout, Regime, TokenShiftSpec};
use crate::kda::{self, Kda, KdaHead, KdaHeadGrads, KdaInputs, KdaOptions};
use crate::op::{self, Engine, OpSpec, Operator};
use crate::rng::Stream;
use crate::tensor::cast;
use crate::token_shift::{Shift, TokenShift, TokenShiftInputs};
use crate::truth::{self, Truth, LANES};
use crate::Scalar;
use ndarray::{Array2, ArrayD, ArrayView2, IxDyn};

const OUT_BAR: f64 = 1e-12;
const GRAD_BAR: f64 = 1e-10;
const F32_BAR: f64 = 1e-4;

/// Named tensors, in [`op::named`]'s order (outputs, then gradients).
type Named = Vec<(&'static str, ArrayD<f64>)>;

/// One problem: inputs, options, upstream gradients.
struct Case<O: Subject> {
    what: &'static str,
    x: <O as Operator<f64>>::Inputs,
    opt: O::Options,
    d_o: ArrayD<f64>,
    dht: ArrayD<f64>,
}

/// An operator under test: its truth, its engines' contract, its problems.
trait Subject:
    Truth + Operator<f64, Inputs = <Self as Truth>::Inputs<f64>> + Operator<f32> + Sized
{
    /// Small random problems covering the operator's options.
    fn cases() -> Vec<Case<Self>>;
    /// Tiny problems, for finite differences of every input element.
    fn tiny() -> Vec<Case<Self>>;
}

/// A case with the truth's outputs and gradients.
struct Judged<O: Subject> {
    case: Case<O>,
    truth: Named,
}

fn judge<O: Subject>(case: Case<O>) -> Judged<O> {
    let mut truth = truth::named_outputs::<O>(&case.x, &O::all_outputs(&case.opt));
    truth.extend(truth::grads::<O>(
        &case.x,
        &case.opt,
        &case.d_o,
        Some(&case.dht),
    ));
    Judged { case, truth }
}

/// `max |a − b| / max |b|`.
fn rel_err(a: &ArrayD<f64>, b: &ArrayD<f64>) -> f64 {
    let scale = b.iter().fold(0.0_f64, |m, v| m.max(v.abs())).max(1e-300);
    let err = a
        .iter()
        .zip(b)
        .fold(0.0_f64, |m, (p, q)| m.max((p - q).abs()));
    // NaN anywhere is a failure, never a pass.
    if a.iter().chain(b).any(|v| v.is_nan()) {
        f64::INFINITY
    } else {
        err / scale
    }
}

/// Checks `got` against the truth `want`, tensor by tensor (outputs within
/// `out_bar`, gradients within `grad_bar`); `Err` names the first tensor
/// over its bar.
fn compare<O: Subject>(
    got: &Named,
    want: &Named,
    out_bar: f64,
    grad_bar: f64,
) -> Result<(), String> {
    let names = |m: &Named| m.iter().map(|(n, _)| *n).collect::<Vec<_>>();
    if names(got) != names(want) {
        return Err(format!(
            "tensors {:?}, truth has {:?}",
            names(got),
            names(want)
        ));
    }
    for ((name, a), (_, b)) in got.iter().zip(want) {
        if a.shape() != b.shape() {
            return Err(format!(
                "{name}: shape {:?}, truth {:?}",
                a.shape(),
                b.shape()
            ));
        }
        let bar = if O::OUTPUTS.contains(name) {
            out_bar
        } else {
            grad_bar
        };
        let e = rel_err(a, b);
        if e.is_nan() || e > bar {
            return Err(format!("{name}: relative error {e:.3e} > {bar:.0e}"));
        }
    }
    Ok(())
}

fn assert_matches<O: Subject>(what: &str, got: &Named, want: &Named, out_bar: f64, grad_bar: f64) {
    if let Err(e) = compare::<O>(got, want, out_bar, grad_bar) {
        panic!("{} {what}: {e}", O::NAME);
    }
}

/// Every output and gradient of `engine` in `T` (inputs narrowed from f64),
/// widened to f64: one [`op::forward_backward`] run, or a CP one over `plan`.
fn run<T: Scalar, O: Subject + Operator<T>, E: Engine<T, Op = O>>(
    engine: &E,
    c: &Case<O>,
    plan: Option<&PlanSpec>,
) -> Named {
    let x = <O as Operator<T>>::narrow(&c.x);
    let opt = O::all_outputs(&c.opt);
    let (d_o, dht) = (cast::<f64, T>(&c.d_o), cast::<f64, T>(&c.dht));
    let (out, gr) = match plan {
        None => op::forward_backward(engine, &x, &opt, &d_o, Some(&dht)).expect("valid"),
        Some(plan) => {
            let (o, g, _) =
                cp::forward_backward(engine, &x, &opt, &d_o, Some(&dht), plan, &cp_options())
                    .expect("valid");
            (o, g)
        }
    };
    widen::<T>(op::named::<T, O>(&out, Some(&gr)))
}

fn widen<T: Scalar>(named: Vec<(&'static str, &ArrayD<T>)>) -> Named {
    named.into_iter().map(|(n, t)| (n, cast(t))).collect()
}

fn cp_options() -> CpOptions {
    CpOptions {
        skip_reference_runs: true,
        ..Default::default()
    }
}

/// `(B, T)` of a case (the first output is `[B, T, …]`).
fn batch_tokens<O: Subject>(j: &Judged<O>) -> (usize, usize) {
    let o = &j.truth[0].1;
    (o.shape()[0], o.shape()[1])
}

/// CP plans for `T` tokens: random interior cuts (3 and 6 ranks), one-token
/// ranks at both ends, FLA's equal split and zigzag where `T` divides.
fn plans(t: usize, seed: u64) -> Vec<PlanSpec> {
    let random = |ranks: u64, name: &str| {
        let s = Stream::new(seed, name);
        let mut cuts: Vec<usize> = (1..ranks)
            .map(|i| 1 + (s.uniform(i, 0) * (t - 1) as f64) as usize)
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        PlanSpec::Cuts(cuts)
    };
    let mut p = vec![
        random(3, "cuts3"),
        random(6, "cuts6"),
        PlanSpec::Cuts(vec![1, t - 1]),
    ];
    p.extend(
        [2, 3, 4]
            .into_iter()
            .filter(|&w| t.is_multiple_of(w))
            .map(PlanSpec::World),
    );
    p.extend(
        [2, 3]
            .into_iter()
            .filter(|&w| t.is_multiple_of(2 * w))
            .map(PlanSpec::Zigzag),
    );
    p
}

/// The engine on every case, f64, no CP.
fn plain<O: Subject, E: Engine<f64, Op = O>>(engine: &E, judged: &[Judged<O>]) {
    for j in judged {
        let got = run::<f64, O, E>(engine, &j.case, None);
        assert_matches::<O>(j.case.what, &got, &j.truth, OUT_BAR, GRAD_BAR);
    }
}

/// The engine under CP ([`cp::forward_backward`]) on every one-row case,
/// over every plan of [`plans`].
fn context_parallel<O: Subject, E: Engine<f64, Op = O>>(engine: &E, judged: &[Judged<O>]) {
    let mut ran = 0;
    for (i, j) in judged.iter().enumerate() {
        let (b, t) = batch_tokens(j);
        if b != 1 {
            continue;
        }
        for plan in plans(t, i as u64) {
            let got = run::<f64, O, E>(engine, &j.case, Some(&plan));
            let what = format!("{} CP {plan}", j.case.what);
            assert_matches::<O>(&what, &got, &j.truth, OUT_BAR, GRAD_BAR);
            ran += 1;
        }
    }
    assert!(ran > 0, "{}: no case CP can cut", O::NAME);
}

/// Intra-card CP (forward only): FLA's split rule for chunks of `chunk`
/// tokens with sub-sequences of 12 tokens, so that every sequence of 36
/// tokens or more is cut at the chunk boundaries the rule picks.
fn intra_card<O: Subject, E: Engine<f64, Op = O>>(engine: &E, chunk: usize, judged: &[Judged<O>]) {
    let mut cut = 0;
    for j in judged {
        let (b, t) = batch_tokens(j);
        let Some(cu) = <O as Operator<f64>>::cu_seqlens(&j.case.x)
            .map(<[i64]>::to_vec)
            .or((b == 1).then(|| vec![0, t as i64]))
        else {
            continue;
        };
        let params = cp::IntraParams {
            chunk_size: chunk,
            subseq_len: Some(12),
            ..Default::default()
        };
        let spec = cp::plan_spec(&cu, &params).expect("valid");
        cut += matches!(&spec, PlanSpec::Cuts(c) if !c.is_empty()) as usize;
        let opt = O::all_outputs(&j.case.opt);
        let (out, _) = cp::forward(engine, &j.case.x, &opt, &spec, &cp_options()).expect("valid");
        let got = widen::<f64>(op::named::<f64, O>(&out, None));
        let want: Named = j.truth[..got.len()].to_vec();
        assert_matches::<O>(
            &format!("{} intra-card {spec}", j.case.what),
            &got,
            &want,
            OUT_BAR,
            0.0,
        );
    }
    assert!(cut > 0, "{}: intra-card split no sequence", O::NAME);
}

/// The engine in f32 on every case, against the f64 truth.
fn single<O: Subject, E: Engine<f32, Op = O>>(engine: &E, judged: &[Judged<O>]) {
    for j in judged {
        let got = run::<f32, O, E>(engine, &j.case, None);
        assert_matches::<O>(
            &format!("{} f32", j.case.what),
            &got,
            &j.truth,
            F32_BAR,
            F32_BAR,
        );
    }
}

/// The truth's gradients against central differences (step 1e-5) of its own
/// f64 loss, element by element: `max |fd − grad| ≤ 1e-7 · max |fd|` per
/// input. The differences' own error is ~1e-10 relative here (≤ 5e-9 with
/// l2norm), so a dual-number rule wrong by 1e-6 relative fails.
fn finite_differences<O: Subject>() {
    for c in O::tiny() {
        let grads = truth::grads::<O>(&c.x, &c.opt, &c.d_o, Some(&c.dht));
        let loss =
            |x: &<O as Truth>::Inputs<f64>| truth::loss::<O, f64>(x, &c.opt, &c.d_o, Some(&c.dht));
        let present: Vec<(usize, usize)> = O::tensors(&c.x)
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.map(|t| (i, t.len())))
            .collect();
        assert_eq!(
            present.len(),
            grads.len(),
            "{} {}: one gradient per input",
            O::NAME,
            c.what
        );
        let h = 1e-5;
        for ((i, n), (name, g)) in present.into_iter().zip(&grads) {
            let fd: Vec<f64> = (0..n)
                .map(|e| {
                    let shifted = |by: f64| {
                        O::map_tensors(&c.x, |k, t| {
                            let mut t = t.clone();
                            if k == i {
                                *t.iter_mut().nth(e).expect("element") += by;
                            }
                            t
                        })
                    };
                    (loss(&shifted(h)) - loss(&shifted(-h))) / (2.0 * h)
                })
                .collect();
            let fd = ArrayD::from_shape_vec(g.raw_dim(), fd).expect("shape");
            assert!(
                g.iter().any(|v| v.abs() > 1e-6),
                "{} {}: {name} is zero",
                O::NAME,
                c.what
            );
            let e = rel_err(g, &fd);
            assert!(
                e <= 1e-7,
                "{} {}: {name} vs finite differences: {e:.3e}",
                O::NAME,
                c.what
            );
        }
    }
}

/// [`truth::jvp`] along random tangents (more than one pass of [`LANES`])
/// equals `Σ grads · tangent`.
fn jvp_is_gradient_along_tangent<O: Subject>() {
    let c = &O::tiny()[0];
    let grads = truth::grads::<O>(&c.x, &c.opt, &c.d_o, Some(&c.dht));
    let tangents: Vec<_> = (0..LANES + 3)
        .map(|l| {
            O::map_tensors(&c.x, |i, t| {
                let s = Stream::new(l as u64, &format!("tangent {i}"));
                ArrayD::from_shape_vec(t.raw_dim(), s.normals(t.len())).expect("shape")
            })
        })
        .collect();
    let jvps = truth::jvp::<O>(&c.x, &c.opt, &c.d_o, Some(&c.dht), &tangents);
    assert_eq!(jvps.len(), tangents.len());
    for (t, jvp) in tangents.iter().zip(jvps) {
        let present = O::tensors(t).into_iter().flatten();
        let dot: f64 = present.zip(&grads).map(|(t, (_, g))| dot(t, g)).sum();
        assert!(
            (jvp - dot).abs() <= 1e-12 * dot.abs().max(1.0),
            "{}: jvp {jvp} vs Σ grad·tangent {dot}",
            O::NAME
        );
    }
}

fn dot(a: &ArrayD<f64>, b: &ArrayD<f64>) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `Case` from a generated problem.
fn case<O: Subject>(
    what: &'static str,
    g: inputs::Generated<<O as Operator<f64>>::Inputs>,
    opt: O::Options,
) -> Case<O> {
    Case {
        what,
        x: g.inputs,
        opt,
        d_o: g.d_o,
        dht: g.dht,
    }
}

/// Varlen with an empty and a one-token sequence, and sequences spanning
/// several chunks of 16.
const LENGTHS: [usize; 4] = [37, 0, 1, 26];
/// Varlen with a sequence spanning two chunks of 64, three of 32.
const LONG: [usize; 4] = [70, 1, 0, 29];

fn kda_spec(layout: Layout, h: usize, hv: usize, opts: KdaOptions, seed: u64) -> KdaSpec {
    KdaSpec {
        layout,
        h,
        hv,
        k: 4,
        v: 3,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed,
    }
}

impl Subject for Kda {
    fn cases() -> Vec<Case<Kda>> {
        let all = KdaOptions {
            use_qk_l2norm_in_kernel: true,
            gate: Gate::Kda,
            use_beta_sigmoid_in_kernel: true,
            ..Default::default()
        };
        let bounded = KdaOptions {
            scale: Some(0.7),
            gate: Gate::LowerBound { lower_bound: -5.0 },
            use_beta_sigmoid_in_kernel: true,
            allow_neg_eigval: true,
            ..Default::default()
        };
        let mut no_dt_bias = inputs::KdaSpec::generate(&KdaSpec {
            initial_state: false,
            ..kda_spec(Layout::batch(2, 19), 1, 2, bounded, 21)
        });
        no_dt_bias.inputs.dt_bias = None;
        let unbounded_rate = KdaOptions {
            gate: Gate::LowerBound { lower_bound: -3.0 },
            ..Default::default()
        };
        let mut no_a_log = inputs::KdaSpec::generate_in(
            &kda_spec(Layout::varlen(&LONG), 1, 3, unbounded_rate, 22),
            Regime::Mixed,
        );
        no_a_log.inputs.a_log = None;
        let scalar = KdaSpec {
            scalar_gate: true,
            ..kda_spec(Layout::batch(1, 40), 2, 2, KdaOptions::default(), 23)
        };
        vec![
            case(
                "varlen, GVA, kda gate, l2norm, beta sigmoid, h0",
                inputs::KdaSpec::generate(&kda_spec(Layout::varlen(&LENGTHS), 2, 4, all, 20)),
                all,
            ),
            case(
                "batch, lower-bound gate without dt_bias, 2·sigmoid, scale",
                no_dt_bias,
                bounded,
            ),
            case(
                "long varlen, G = 3, lower-bound gate without A_log, mixed",
                no_a_log,
                unbounded_rate,
            ),
            case(
                "scalar gate, one row",
                inputs::KdaSpec::generate(&scalar),
                KdaOptions::default(),
            ),
        ]
    }

    fn tiny() -> Vec<Case<Kda>> {
        let all = KdaOptions {
            use_qk_l2norm_in_kernel: true,
            gate: Gate::Kda,
            use_beta_sigmoid_in_kernel: true,
            ..Default::default()
        };
        let bounded = KdaOptions {
            gate: Gate::LowerBound { lower_bound: -4.0 },
            use_beta_sigmoid_in_kernel: true,
            allow_neg_eigval: true,
            ..Default::default()
        };
        let tiny = |opts, seed| KdaSpec {
            k: 2,
            v: 2,
            ..kda_spec(Layout::varlen(&[3, 0, 2]), 1, 2, opts, seed)
        };
        vec![
            case(
                "tiny, kda gate",
                inputs::KdaSpec::generate(&tiny(all, 30)),
                all,
            ),
            case(
                "tiny, lower-bound gate",
                inputs::KdaSpec::generate(&tiny(bounded, 31)),
                bounded,
            ),
        ]
    }
}

fn gdn_spec(layout: Layout, opts: GdnOptions, seed: u64) -> GdnSpec {
    GdnSpec {
        layout,
        h: 1,
        hv: 2,
        k: 4,
        v: 3,
        opts,
        initial_state: true,
        seed,
    }
}

impl Subject for Gdn {
    fn cases() -> Vec<Case<Gdn>> {
        let all = GdnOptions {
            use_qk_l2norm_in_kernel: true,
            use_gate_in_kernel: true,
            use_beta_sigmoid_in_kernel: true,
            state_v_first: true,
            ..Default::default()
        };
        let plain = GdnOptions {
            scale: Some(1.3),
            use_beta_sigmoid_in_kernel: true,
            allow_neg_eigval: true,
            ..Default::default()
        };
        let gate = GdnOptions {
            use_gate_in_kernel: true,
            ..Default::default()
        };
        let mut no_dt_bias = inputs::GdnSpec::generate_in(
            &gdn_spec(Layout::varlen(&LONG), gate, 42),
            Regime::LongMemory,
        );
        no_dt_bias.inputs.dt_bias = None;
        vec![
            case(
                "varlen, GVA, in-kernel gate, l2norm, sigmoid, V-first",
                inputs::GdnSpec::generate(&gdn_spec(Layout::varlen(&LENGTHS), all, 40)),
                all,
            ),
            case(
                "batch, 2·sigmoid, scale",
                inputs::GdnSpec::generate(&gdn_spec(Layout::batch(2, 18), plain, 41)),
                plain,
            ),
            case(
                "long varlen, in-kernel gate without dt_bias",
                no_dt_bias,
                gate,
            ),
        ]
    }

    fn tiny() -> Vec<Case<Gdn>> {
        let all = GdnOptions {
            use_qk_l2norm_in_kernel: true,
            use_gate_in_kernel: true,
            use_beta_sigmoid_in_kernel: true,
            state_v_first: true,
            ..Default::default()
        };
        let spec = GdnSpec {
            k: 2,
            v: 2,
            ..gdn_spec(Layout::varlen(&[3, 0, 2]), all, 43)
        };
        vec![case(
            "tiny, in-kernel gate, V-first",
            inputs::GdnSpec::generate(&spec),
            all,
        )]
    }
}

/// A GDN-2 problem (`H = 2`, `K = 4`, `V = 3` unless `kv` says): KDA's draws
/// for `q, k, v, g, A_log, dt_bias [H·K]`, the initial state and the upstream
/// gradients (with `gate`, KDA's form of the in-kernel gate `opt` picks),
/// and `b`, `w` sigmoids of their own normal streams; the states transposed
/// with `state_v_first`.
fn gdn2_case(
    what: &'static str,
    layout: Layout,
    kv: (usize, usize),
    opt: Gdn2Options,
    regime: Regime,
    seed: u64,
) -> Case<Gdn2> {
    let gate = match (opt.use_gate_in_kernel, opt.lower_bound) {
        (false, _) => Gate::None,
        (true, None) => Gate::Kda,
        (true, Some(lower_bound)) => Gate::LowerBound { lower_bound },
    };
    let (k, v) = kv;
    let spec = KdaSpec {
        k,
        v,
        opts: KdaOptions {
            gate,
            ..Default::default()
        },
        ..kda_spec(layout.clone(), 2, 2, KdaOptions::default(), seed)
    };
    let g = inputs::KdaSpec::generate_in(&spec, regime);
    let sig = |name: &str, last: usize| {
        inputs::normal(seed, name, &[layout.b, layout.t, 2, last])
            .mapv(|x| 1.0 / (1.0 + (-x).exp()))
    };
    let state = |a: ArrayD<f64>| match opt.state_v_first {
        true => crate::gdn2::swap_state(&a),
        false => a,
    };
    let x = g.inputs;
    Case {
        what,
        x: Gdn2Inputs {
            q: x.q,
            k: x.k,
            v: x.v,
            g: x.g,
            b: sig("b", k),
            w: sig("w", v),
            a_log: x.a_log,
            dt_bias: x.dt_bias,
            initial_state: x.initial_state.map(state),
            cu_seqlens: x.cu_seqlens,
        },
        opt,
        d_o: g.d_o,
        dht: state(g.dht),
    }
}

impl Subject for Gdn2 {
    fn cases() -> Vec<Case<Gdn2>> {
        let softplus = Gdn2Options {
            use_qk_l2norm_in_kernel: true,
            use_gate_in_kernel: true,
            state_v_first: true,
            ..Default::default()
        };
        let safe = Gdn2Options {
            scale: Some(0.7),
            use_gate_in_kernel: true,
            safe_gate: true,
            lower_bound: Some(-5.0),
            ..Default::default()
        };
        let mut no_a_log = gdn2_case(
            "batch, bounded gate under safe_gate without A_log, scale",
            Layout::batch(2, 18),
            (4, 3),
            safe,
            Regime::Mixed,
            81,
        );
        no_a_log.x.a_log = None;
        vec![
            gdn2_case(
                "varlen, softplus in-kernel gate, l2norm, V-first",
                Layout::varlen(&LENGTHS),
                (4, 3),
                softplus,
                Regime::FlaTest,
                80,
            ),
            no_a_log,
            gdn2_case(
                "long varlen, g the decay",
                Layout::varlen(&LONG),
                (4, 3),
                Gdn2Options::default(),
                Regime::LongMemory,
                82,
            ),
        ]
    }

    fn tiny() -> Vec<Case<Gdn2>> {
        let all = Gdn2Options {
            use_qk_l2norm_in_kernel: true,
            use_gate_in_kernel: true,
            state_v_first: true,
            ..Default::default()
        };
        vec![gdn2_case(
            "tiny, softplus in-kernel gate, l2norm, V-first",
            Layout::varlen(&[3, 0, 2]),
            (2, 2),
            all,
            Regime::FlaTest,
            83,
        )]
    }
}

fn dplr_spec(layout: Layout, h: usize, initial_state: bool, seed: u64) -> DplrSpec {
    DplrSpec {
        layout,
        h,
        k: 4,
        v: 3,
        initial_state,
        seed,
    }
}

impl Subject for Dplr {
    fn cases() -> Vec<Case<Dplr>> {
        let scaled = DplrOptions {
            scale: Some(0.9),
            ..Default::default()
        };
        vec![
            case(
                "varlen, h0",
                inputs::DplrSpec::generate(&dplr_spec(Layout::varlen(&LENGTHS), 2, true, 50)),
                DplrOptions::default(),
            ),
            case(
                "one row of 21, no h0, scale",
                inputs::DplrSpec::generate(&dplr_spec(Layout::batch(1, 21), 1, false, 51)),
                scaled,
            ),
            case(
                "batch of 2",
                inputs::DplrSpec::generate(&dplr_spec(Layout::batch(2, 9), 2, true, 52)),
                DplrOptions::default(),
            ),
            case(
                "long varlen, mixed",
                inputs::DplrSpec::generate_in(
                    &dplr_spec(Layout::varlen(&LONG), 1, true, 53),
                    Regime::Mixed,
                ),
                DplrOptions::default(),
            ),
        ]
    }

    fn tiny() -> Vec<Case<Dplr>> {
        let spec = DplrSpec {
            k: 2,
            v: 2,
            ..dplr_spec(Layout::varlen(&[3, 0, 2]), 1, true, 54)
        };
        vec![case(
            "tiny",
            inputs::DplrSpec::generate(&spec),
            DplrOptions::default(),
        )]
    }
}

fn shift_spec(layout: Layout, cache: bool, seed: u64) -> TokenShiftSpec {
    TokenShiftSpec {
        layout,
        d: 3,
        cache,
        seed,
    }
}

impl Subject for TokenShift {
    fn cases() -> Vec<Case<TokenShift>> {
        vec![
            case(
                "varlen, cache",
                inputs::TokenShiftSpec::generate(&shift_spec(Layout::varlen(&LENGTHS), true, 60)),
                (),
            ),
            case(
                "batch, no cache",
                inputs::TokenShiftSpec::generate(&shift_spec(Layout::batch(3, 5), false, 61)),
                (),
            ),
            case(
                "empty sequences first, cache",
                inputs::TokenShiftSpec::generate(&shift_spec(
                    Layout::varlen(&[0, 0, 3, 1]),
                    true,
                    62,
                )),
                (),
            ),
        ]
    }

    fn tiny() -> Vec<Case<TokenShift>> {
        vec![case(
            "tiny",
            inputs::TokenShiftSpec::generate(&shift_spec(Layout::varlen(&[2, 0, 1]), true, 63)),
            (),
        )]
    }
}

fn conv_spec(layout: Layout, w: usize, bias: bool, initial_state: bool, seed: u64) -> ConvSpec {
    ConvSpec {
        layout,
        d: 3,
        w,
        bias,
        initial_state,
        seed,
    }
}

impl Subject for CausalConv1d {
    fn cases() -> Vec<Case<CausalConv1d>> {
        let silu = ConvOptions {
            activation: Activation::Silu,
            output_final_state: true,
        };
        vec![
            case(
                "varlen, W = 4, bias, h0, silu",
                inputs::ConvSpec::generate(&conv_spec(Layout::varlen(&LENGTHS), 4, true, true, 70)),
                silu,
            ),
            case(
                "batch, W = 3, plain",
                inputs::ConvSpec::generate(&conv_spec(Layout::batch(2, 7), 3, false, false, 71)),
                ConvOptions::default(),
            ),
            case(
                "sequences shorter than W, h0, silu",
                inputs::ConvSpec::generate(&conv_spec(
                    Layout::varlen(&[2, 0, 1, 9]),
                    4,
                    false,
                    true,
                    72,
                )),
                silu,
            ),
        ]
    }

    fn tiny() -> Vec<Case<CausalConv1d>> {
        let silu = ConvOptions {
            activation: Activation::Silu,
            output_final_state: true,
        };
        vec![case(
            "tiny",
            inputs::ConvSpec::generate(&conv_spec(Layout::varlen(&[3, 0, 2]), 3, true, true, 73)),
            silu,
        )]
    }
}

/// `op: Operator => { engine: expr, chunk size for intra-card CP; … }` → a
/// module per operator (its cases judged once) with, per engine, the plain,
/// CP, intra-card and f32 runs against the truth; and the truth's own
/// finite-difference and jvp checks.
macro_rules! against_truth {
    ($($m:ident: $op:ty => { $($engine:ident: $e:expr, $chunk:expr;)+ })+) => {$(
        mod $m {
            use super::*;

            fn judged() -> &'static [Judged<$op>] {
                static J: OnceLock<Vec<Judged<$op>>> = OnceLock::new();
                J.get_or_init(|| <$op as Subject>::cases().into_iter().map(judge).collect())
            }

            #[test]
            fn truth_grads_match_finite_differences() {
                finite_differences::<$op>();
            }

            #[test]
            fn truth_jvp_is_gradient_along_tangent() {
                jvp_is_gradient_along_tangent::<$op>();
            }

            $(
                mod $engine {
                    use super::*;

                    #[test]
                    fn plain_f64() {
                        plain(&$e, judged());
                    }

                    #[test]
                    fn context_parallel() {
                        super::super::context_parallel(&$e, judged());
                    }

                    #[test]
                    fn intra_card() {
                        super::super::intra_card(&$e, $chunk, judged());
                    }

                    #[test]
                    fn f32() {
                        single(&$e, judged());
                    }
                }
            )+
        }
    )+};
}

fn kda_chunk(c: usize) -> kda::Chunk {
    kda::Chunk::new(c).expect("valid")
}

fn dplr_chunk(c: usize) -> dplr::Chunk {
    dplr::Chunk::new(c).expect("valid")
}

against_truth! {
    kda_vs_truth: Kda => {
        naive: kda::Naive, 16;
        chunk16: kda_chunk(16), 16;
        chunk32: kda_chunk(32), 32;
        chunk64: kda_chunk(64), 64;
        chunk16_spans32: kda_chunk(16).with_span_len(32).expect("valid"), 16;
    }
    gdn_vs_truth: Gdn => {
        naive: OnKda(kda::Naive), 16;
        chunk16: OnKda(kda_chunk(16)), 16;
        chunk32: OnKda(kda_chunk(32)), 32;
        chunk64: OnKda(kda_chunk(64)), 64;
    }
    gdn2_vs_truth: Gdn2 => {
        naive: gdn2::Naive, 16;
        chunk16: gdn2::Chunk::new(16).expect("valid"), 16;
        chunk32: gdn2::Chunk::new(32).expect("valid"), 32;
        chunk64: gdn2::Chunk::new(64).expect("valid"), 64;
    }
    dplr_vs_truth: Dplr => {
        naive: dplr::Naive, 16;
        chunk16: dplr_chunk(16), 16;
        chunk32: dplr_chunk(32), 32;
        chunk64: dplr_chunk(64), 64;
        chunk16_spans32: dplr_chunk(16).with_span_len(32).expect("valid"), 16;
    }
    token_shift_vs_truth: TokenShift => {
        shift: Shift, 1;
    }
    conv_vs_truth: CausalConv1d => {
        direct: Direct, 2;
    }
}

/// KDA's naive engine with its first element of `o` scaled by `1 + o` and
/// its first element of `dk` by `1 + dk`, in every piece.
struct Skewed {
    o: f64,
    dk: f64,
}

impl Engine<f64> for Skewed {
    type Op = Kda;

    fn forward(&self, x: &KdaHead<f64>, h0: ArrayView2<f64>) -> (Array2<f64>, Array2<f64>) {
        let (mut o, s) = kda::Naive.forward(x, h0);
        o.iter_mut().take(1).for_each(|v| *v *= 1.0 + self.o);
        (o, s)
    }

    fn backward(
        &self,
        x: &KdaHead<f64>,
        h0: ArrayView2<f64>,
        d_o: ArrayView2<f64>,
        dht: ArrayView2<f64>,
    ) -> KdaHeadGrads<f64> {
        let mut g = kda::Naive.backward(x, h0, d_o, dht);
        g.dk.iter_mut().take(1).for_each(|v| *v *= 1.0 + self.dk);
        g
    }
}

/// The comparison catches an engine wrong in one element: `o` by 1e-11
/// relative, `dk` by 1e-9 (a few times each bar, the tensors' largest
/// elements being a few times the first).
#[test]
fn a_wrong_engine_fails() {
    let j = judge(Kda::cases().swap_remove(0));
    let check = |e: &Skewed| {
        compare::<Kda>(
            &run::<f64, Kda, _>(e, &j.case, None),
            &j.truth,
            OUT_BAR,
            GRAD_BAR,
        )
    };
    check(&Skewed { o: 0.0, dk: 0.0 }).expect("the unskewed engine passes");
    let o = check(&Skewed { o: 1e-11, dk: 0.0 }).expect_err("a skewed o fails");
    assert!(o.starts_with(&format!("{}:", Kda::OUTPUTS[0])), "{o}");
    let dk = check(&Skewed { o: 0.0, dk: 1e-9 }).expect_err("a skewed dk fails");
    assert!(dk.starts_with(&format!("{}:", Kda::GRADS[1])), "{dk}");
}

/// CP with each of FLA's historical faults (SPEC §9, 4–6) injected fails
/// against the truth.
#[test]
fn cp_faults_fail() {
    let j = judge(Kda::cases().swap_remove(0));
    let faults = [
        cp::Faults {
            drop_merged_state_in_backward: true,
            ..Default::default()
        },
        cp::Faults {
            merge_v_limit: Some(1),
            ..Default::default()
        },
        cp::Faults {
            preprocess_first_piece: true,
            ..Default::default()
        },
    ];
    let (x, opt) = (&j.case.x, &Kda::all_outputs(&j.case.opt));
    // Rank 1 holds the end of sequence 0, sequence 2 and the head of
    // sequence 3 ([`LENGTHS`]), which rank 2 continues.
    let plan = PlanSpec::Cuts(vec![30, 45, 55]);
    for faults in faults {
        let cpo = CpOptions {
            faults,
            ..cp_options()
        };
        let engine = kda::Naive;
        let (d_o, dht) = (&j.case.d_o, Some(&j.case.dht));
        let (out, gr, _) =
            cp::forward_backward(&engine, x, opt, d_o, dht, &plan, &cpo).expect("valid");
        let got = widen::<f64>(op::named::<f64, Kda>(&out, Some(&gr)));
        let res = compare::<Kda>(&got, &j.truth, OUT_BAR, GRAD_BAR);
        assert!(res.is_err(), "{faults:?} passed");
    }
}

fn t(shape: &[usize], v: &[f64]) -> ArrayD<f64> {
    ArrayD::from_shape_vec(IxDyn(shape), v.to_vec()).expect("shape")
}

fn assert_near(what: &str, got: &ArrayD<f64>, want: &[f64]) {
    let got: Vec<f64> = got.iter().copied().collect();
    assert_eq!(got.len(), want.len(), "{what}: size");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= 1e-14 * w.abs().max(1.0),
            "{what}: {got:?} vs {want:?}"
        );
    }
}

/// B = T = H = K = V = 1 inputs of KDA (one token, one head).
fn kda_token(q: f64, k: f64, v: f64, g: f64, beta: f64, h0: f64) -> KdaInputs<f64> {
    KdaInputs {
        q: t(&[1, 1, 1, 1], &[q]),
        k: t(&[1, 1, 1, 1], &[k]),
        v: t(&[1, 1, 1, 1], &[v]),
        g: t(&[1, 1, 1, 1], &[g]),
        beta: t(&[1, 1, 1], &[beta]),
        a_log: None,
        dt_bias: None,
        initial_state: Some(t(&[1, 1, 1, 1], &[h0])),
        cu_seqlens: None,
    }
}

#[test]
fn kda_by_hand() {
    let opt = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    // K = V = 1 (scale 1), two tokens, S_0 = 4.
    // t = 0: decay e^0 = 1, S = 4; v − Sk = 2 − 4 = −2; S = 4 + ½·1·(−2) = 3; o = 1·3 = 3.
    // t = 1: decay e^{ln ½}, S = 1.5; v − Sk = 4 − 1.5 = 2.5; S = 1.5 + 1·1·2.5 = 4; o = 2·4 = 8.
    let x = KdaInputs {
        q: t(&[1, 2, 1, 1], &[1.0, 2.0]),
        k: t(&[1, 2, 1, 1], &[1.0, 1.0]),
        v: t(&[1, 2, 1, 1], &[2.0, 4.0]),
        g: t(&[1, 2, 1, 1], &[0.0, 0.5f64.ln()]),
        beta: t(&[1, 2, 1], &[0.5, 1.0]),
        ..kda_token(0.0, 0.0, 0.0, 0.0, 0.0, 4.0)
    };
    let y = <Kda as Truth>::forward(&x, &opt);
    assert_near("o", &y.o, &[3.0, 8.0]);
    assert_near(
        "final_state",
        y.final_state.as_ref().expect("asked"),
        &[4.0],
    );

    // K = 2, V = 1 (scale 1/√2), one token, S_0 = [2, 4]:
    // decay [½, ¼] → S = [1, 1]; Sᵀk = 2 with k = [1, 1]; v − Sᵀk = 4 − 2 = 2;
    // S = [1, 1] + ½·[1, 1]·2 = [2, 2]; o = (1·2 + 3·2)/√2 = 4√2.
    let x = KdaInputs {
        q: t(&[1, 1, 1, 2], &[1.0, 3.0]),
        k: t(&[1, 1, 1, 2], &[1.0, 1.0]),
        g: t(&[1, 1, 1, 2], &[0.5f64.ln(), 0.25f64.ln()]),
        initial_state: Some(t(&[1, 1, 2, 1], &[2.0, 4.0])),
        ..kda_token(0.0, 0.0, 4.0, 0.0, 0.5, 0.0)
    };
    let y = <Kda as Truth>::forward(&x, &opt);
    assert_near("o", &y.o, &[4.0 * 2f64.sqrt()]);
    assert_near(
        "final_state",
        y.final_state.as_ref().expect("asked"),
        &[2.0, 2.0],
    );
}

#[test]
fn kda_gates_by_hand() {
    // The kda gate, l2norm and 2·sigmoid on one token (K = V = 1, scale 1):
    // z = g + dt_bias = 1 − 1 = 0, g = −exp(ln 2)·softplus(0) = −2 ln 2, decay ¼:
    // S = ¼·8 = 2. β = 2·sigmoid(0) = 1. l2norm: k̂ = 2/√(4 + 1e-6) (≈ 1 − 1.25e-7),
    // q̂ = 3/√(9 + 1e-6). S = 2 + 1·k̂·(5 − 2k̂) (≈ 5); o = q̂·S.
    let opt = KdaOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        gate: Gate::Kda,
        use_beta_sigmoid_in_kernel: true,
        allow_neg_eigval: true,
        ..Default::default()
    };
    let x = KdaInputs {
        a_log: Some(t(&[1], &[2f64.ln()])),
        dt_bias: Some(t(&[1], &[-1.0])),
        ..kda_token(3.0, 2.0, 5.0, 1.0, 0.0, 8.0)
    };
    let (kh, qh) = (2.0 / (4.0f64 + 1e-6).sqrt(), 3.0 / (9.0f64 + 1e-6).sqrt());
    let s = 2.0 + kh * (5.0 - 2.0 * kh);
    let y = <Kda as Truth>::forward(&x, &opt);
    assert_near("o", &y.o, &[qh * s]);
    assert_near("final_state", y.final_state.as_ref().expect("asked"), &[s]);

    // The lower-bound gate, lower_bound = −(4/3) ln 2, β = 0 (S only decays):
    // with A_log = ln 2, g = ln3/2: z = 2·ln3/2 = ln 3, sigmoid(ln 3) = ¾,
    // g = −(4/3) ln 2 · ¾ = −ln 2, decay ½: S = ½·6 = 3, o = 1·3.
    // Without A_log, g = ln 3: z = ln 3, the same.
    let opt = KdaOptions {
        output_final_state: true,
        gate: Gate::LowerBound {
            lower_bound: -4.0 / 3.0 * 2f64.ln(),
        },
        ..Default::default()
    };
    let with_rate = KdaInputs {
        a_log: Some(t(&[1], &[2f64.ln()])),
        ..kda_token(1.0, 1.0, 7.0, 3f64.ln() / 2.0, 0.0, 6.0)
    };
    let without = kda_token(1.0, 1.0, 7.0, 3f64.ln(), 0.0, 6.0);
    for x in [with_rate, without] {
        let y = <Kda as Truth>::forward(&x, &opt);
        assert_near("o", &y.o, &[3.0]);
        assert_near(
            "final_state",
            y.final_state.as_ref().expect("asked"),
            &[3.0],
        );
    }
}

#[test]
fn gdn2_by_hand() {
    // K = 2, V = 1, one token, scale ½, S₀ = [4, 8], q = [1, 1], k = [1, 2],
    // b = [½, 1], w = 2, v = 3, g + dt_bias = 1 − 1 = 0 on both key dims.
    // Softplus gate: −exp(ln 2)·softplus(0) = −2 ln 2, a decay of ¼:
    // S̃ = [1, 2]; read at b ⊙ k = [½, 2]: S̃ᵀ(b ⊙ k) = ½ + 4 = 4.5;
    // w ⊙ v − 4.5 = 1.5; written at k: S = [1 + 1.5, 2 + 3] = [2.5, 5];
    // o = ½·(2.5 + 5) = 3.75.
    // Bounded gate without A_log, lower_bound = −2 ln 2: (−2 ln 2)·sigmoid(0)
    // = −ln 2, a decay of ½: S̃ = [2, 4]; S̃ᵀ(b ⊙ k) = 1 + 8 = 9;
    // 6 − 9 = −3; S = [2 − 3, 4 − 6] = [−1, −2]; o = ½·(−3) = −1.5.
    let opt = Gdn2Options {
        scale: Some(0.5),
        output_final_state: true,
        use_gate_in_kernel: true,
        ..Default::default()
    };
    let x = Gdn2Inputs {
        q: t(&[1, 1, 1, 2], &[1.0, 1.0]),
        k: t(&[1, 1, 1, 2], &[1.0, 2.0]),
        v: t(&[1, 1, 1, 1], &[3.0]),
        g: t(&[1, 1, 1, 2], &[1.0, 1.0]),
        b: t(&[1, 1, 1, 2], &[0.5, 1.0]),
        w: t(&[1, 1, 1, 1], &[2.0]),
        a_log: Some(t(&[1], &[2f64.ln()])),
        dt_bias: Some(t(&[2], &[-1.0, -1.0])),
        initial_state: Some(t(&[1, 1, 2, 1], &[4.0, 8.0])),
        cu_seqlens: None,
    };
    let y = <Gdn2 as Truth>::forward(&x, &opt);
    assert_near("o", &y.o, &[3.75]);
    assert_near("final_state", &y.final_state.expect("asked"), &[2.5, 5.0]);
    let bounded = Gdn2Options {
        lower_bound: Some(-2.0 * 2f64.ln()),
        ..opt
    };
    let x = Gdn2Inputs { a_log: None, ..x };
    let y = <Gdn2 as Truth>::forward(&x, &bounded);
    assert_near("o", &y.o, &[-1.5]);
    assert_near("final_state", &y.final_state.expect("asked"), &[-1.0, -2.0]);
}

/// `b = w = β` (broadcast over K and over V) is KDA's recurrence: GDN-2's
/// truth agrees with KDA's, which writes the update as `β k (v − Sᵀk)ᵀ`.
#[test]
fn gdn2_truth_with_b_and_w_beta_is_kda_truth() {
    let opt = Gdn2Options {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        use_gate_in_kernel: true,
        ..Default::default()
    };
    let c = gdn2_case(
        "",
        Layout::varlen(&LENGTHS),
        (4, 3),
        opt,
        Regime::FlaTest,
        84,
    );
    let (b, t) = (c.x.q.shape()[0], c.x.q.shape()[1]);
    let beta = inputs::normal(84, "beta", &[b, t, 2]).mapv(|x| 1.0 / (1.0 + (-x).exp()));
    let over = |n: usize| {
        let wide = beta.clone().insert_axis(ndarray::Axis(3));
        wide.broadcast(IxDyn(&[b, t, 2, n]))
            .expect("broadcast")
            .to_owned()
    };
    let x = Gdn2Inputs {
        b: over(4),
        w: over(3),
        ..c.x
    };
    let gdn2 = <Gdn2 as Truth>::forward(&x, &opt);
    let as_kda = KdaInputs {
        q: x.q,
        k: x.k,
        v: x.v,
        g: x.g,
        beta,
        a_log: x.a_log,
        dt_bias: x.dt_bias,
        initial_state: x.initial_state,
        cu_seqlens: x.cu_seqlens,
    };
    let kda_opt = KdaOptions {
        output_final_state: true,
        use_qk_l2norm_in_kernel: true,
        gate: Gate::Kda,
        ..Default::default()
    };
    let kda = <Kda as Truth>::forward(&as_kda, &kda_opt);
    for (name, a, b) in [
        ("o", &gdn2.o, &kda.o),
        (
            "final_state",
            gdn2.final_state.as_ref().expect("asked"),
            kda.final_state.as_ref().expect("asked"),
        ),
    ] {
        let e = rel_err(a, b);
        assert!(e <= 1e-13, "{name}: GDN-2 with b = w = β vs KDA: {e:.3e}");
    }
}

#[test]
fn gdn_by_hand() {
    // K = 2, V = 1, one token, states [N, HV, V, K], scale ½.
    // Decay: −exp(ln 2)·softplus(1 + (−1)) = −2 ln 2 on both key dims, ¼:
    // S = ¼·[4, 8] = [1, 2]; k = [1, 0]: Sᵀk = 1, v − Sᵀk = 3 − 1 = 2;
    // S = [1, 2] + 1·[1, 0]·2 = [3, 2]; o = ½·(1·3 + 1·2) = 2.5.
    let opt = GdnOptions {
        scale: Some(0.5),
        output_final_state: true,
        use_gate_in_kernel: true,
        state_v_first: true,
        ..Default::default()
    };
    let x = GdnInputs {
        q: t(&[1, 1, 1, 2], &[1.0, 1.0]),
        k: t(&[1, 1, 1, 2], &[1.0, 0.0]),
        v: t(&[1, 1, 1, 1], &[3.0]),
        g: t(&[1, 1, 1], &[1.0]),
        beta: t(&[1, 1, 1], &[1.0]),
        a_log: Some(t(&[1], &[2f64.ln()])),
        dt_bias: Some(t(&[1], &[-1.0])),
        initial_state: Some(t(&[1, 1, 1, 2], &[4.0, 8.0])),
        cu_seqlens: None,
    };
    let y = <Gdn as Truth>::forward(&x, &opt);
    assert_near("o", &y.o, &[2.5]);
    let fin = y.final_state.expect("asked");
    assert_eq!(fin.shape(), &[1, 1, 1, 2]);
    assert_near("final_state", &fin, &[3.0, 2.0]);
}

#[test]
fn dplr_by_hand() {
    let opt = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    // K = V = 1 (scale 1), two tokens, S_0 = 2.
    // t = 0: e^{ln ½}·2 + b·(a·S) + k·v = 1 + ½·(1·2) + 1·3 = 5; o = 1·5.
    // t = 1: e^0·5 + 1·(−1·5) + 2·1 = 2; o = 3·2 = 6.
    let x = DplrInputs {
        q: t(&[1, 2, 1, 1], &[1.0, 3.0]),
        k: t(&[1, 2, 1, 1], &[1.0, 2.0]),
        v: t(&[1, 2, 1, 1], &[3.0, 1.0]),
        a: t(&[1, 2, 1, 1], &[1.0, -1.0]),
        b: t(&[1, 2, 1, 1], &[0.5, 1.0]),
        gk: t(&[1, 2, 1, 1], &[0.5f64.ln(), 0.0]),
        initial_state: Some(t(&[1, 1, 1, 1], &[2.0])),
        cu_seqlens: None,
    };
    let y = <Dplr as Truth>::forward(&x, &opt);
    assert_near("o", &y.o, &[5.0, 6.0]);
    assert_near(
        "final_state",
        y.final_state.as_ref().expect("asked"),
        &[2.0],
    );

    // K = 2, V = 1 (scale 1/√2), one token, S_0 = [2, 4]: aᵀS_0 = 2 + 4 = 6
    // (undecayed); decay [½, ¼] → [1, 1]; + b·6 = [1 + 6, 1]; + k·v = [7, 1 + 1];
    // o = (7 + 2)/√2.
    let x = DplrInputs {
        q: t(&[1, 1, 1, 2], &[1.0, 1.0]),
        k: t(&[1, 1, 1, 2], &[0.0, 1.0]),
        v: t(&[1, 1, 1, 1], &[1.0]),
        a: t(&[1, 1, 1, 2], &[1.0, 1.0]),
        b: t(&[1, 1, 1, 2], &[1.0, 0.0]),
        gk: t(&[1, 1, 1, 2], &[0.5f64.ln(), 0.25f64.ln()]),
        initial_state: Some(t(&[1, 1, 2, 1], &[2.0, 4.0])),
        cu_seqlens: None,
    };
    let y = <Dplr as Truth>::forward(&x, &opt);
    assert_near("o", &y.o, &[9.0 / 2f64.sqrt()]);
    assert_near(
        "final_state",
        y.final_state.as_ref().expect("asked"),
        &[7.0, 2.0],
    );
}

#[test]
fn token_shift_by_hand() {
    // Sequences [2, 0, 1] tokens, D = 2.
    // seq 0: y = [cache₀ − x₀, x₀ − x₁] = [[9, 18], [−2, −3]], final x₁ = [3, 5];
    // seq 1 (empty): final = cache₁ = [30, 40];
    // seq 2: y = cache₂ − x₂ = [43, 49], final x₂ = [7, 11].
    let x = TokenShiftInputs {
        x: t(&[1, 3, 2], &[1.0, 2.0, 3.0, 5.0, 7.0, 11.0]),
        cache: Some(t(&[3, 2], &[10.0, 20.0, 30.0, 40.0, 50.0, 60.0])),
        cu_seqlens: Some(vec![0, 2, 2, 3]),
    };
    let y = <TokenShift as Truth>::forward(&x, &());
    assert_near("y", &y.y, &[9.0, 18.0, -2.0, -3.0, 43.0, 49.0]);
    assert_near(
        "final_cache",
        &y.final_cache,
        &[3.0, 5.0, 30.0, 40.0, 7.0, 11.0],
    );
    // Without a cache the token before is 0: y₀ = −x₀, the empty sequence's final cache 0.
    let y = <TokenShift as Truth>::forward(&TokenShiftInputs { cache: None, ..x }, &());
    assert_near("y", &y.y, &[-1.0, -2.0, -2.0, -3.0, -7.0, -11.0]);
    assert_near(
        "final_cache",
        &y.final_cache,
        &[3.0, 5.0, 0.0, 0.0, 7.0, 11.0],
    );
}

#[test]
fn conv_by_hand() {
    let plain = ConvOptions {
        activation: Activation::None,
        output_final_state: true,
    };
    // D = 1, W = 2, weight [1, 2], bias ½, state [3, 4], x = [5, 6]: X = [3, 4, 5, 6].
    // y₀ = 1·X₁ + 2·X₂ + ½ = 4 + 10 + ½ = 14.5; y₁ = 1·5 + 2·6 + ½ = 17.5;
    // final = [X₂, X₃] = [5, 6].
    let x = ConvInputs {
        x: t(&[1, 2, 1], &[5.0, 6.0]),
        weight: t(&[1, 2], &[1.0, 2.0]),
        bias: Some(t(&[1], &[0.5])),
        initial_state: Some(t(&[1, 1, 2], &[3.0, 4.0])),
        cu_seqlens: None,
    };
    let y = <CausalConv1d as Truth>::forward(&x, &plain);
    assert_near("y", &y.y, &[14.5, 17.5]);
    assert_near(
        "final_state",
        y.final_state.as_ref().expect("asked"),
        &[5.0, 6.0],
    );

    // One token shorter than W = 3 keeps part of its state: X = [1, 2, 3, 5],
    // y₀ = X₁ + X₂ + X₃ = 10, final = [2, 3, 5].
    let x = ConvInputs {
        x: t(&[1, 1, 1], &[5.0]),
        weight: t(&[1, 3], &[1.0, 1.0, 1.0]),
        bias: None,
        initial_state: Some(t(&[1, 1, 3], &[1.0, 2.0, 3.0])),
        cu_seqlens: None,
    };
    let y = <CausalConv1d as Truth>::forward(&x, &plain);
    assert_near("y", &y.y, &[10.0]);
    assert_near(
        "final_state",
        y.final_state.as_ref().expect("asked"),
        &[2.0, 3.0, 5.0],
    );

    // SiLU: weight [0, 1], no state, x = [ln 3]: z = ln 3, y = ln 3 · sigmoid(ln 3) = ¾ ln 3.
    let silu = ConvOptions {
        activation: Activation::Silu,
        output_final_state: false,
    };
    let x = ConvInputs {
        x: t(&[1, 1, 1], &[3f64.ln()]),
        weight: t(&[1, 2], &[0.0, 1.0]),
        bias: None,
        initial_state: None,
        cu_seqlens: None,
    };
    let y = <CausalConv1d as Truth>::forward(&x, &silu);
    assert_near("y", &y.y, &[0.75 * 3f64.ln()]);
    assert!(y.final_state.is_none());
}
