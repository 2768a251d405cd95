//! The chunked DPLR form against the naive recurrence: f64 agreement ≤ 1e-10
//! for outputs, final state and every gradient; `h` equal to the naive state
//! at every chunk start; the chunk transition equal to the per-token
//! product; no overflow under strong decay; f32 within FLA's band.

use deltaref::dplr::Chunk;
use deltaref::dplr::Naive;
use deltaref::dplr::{Dplr, DplrOptions};
use deltaref::inputs::{self, DplrSpec, Layout};
use deltaref::op::{self, Engine, Operator};
use deltaref_tests::{assert_maps_close, assert_split_chunks_agree, ratio, steep_decays, Run};
use deltaref_verify::outputs::{self, Tensors};
use ndarray::{s, Array2, ArrayD, CowArray, Ix2, IxDyn};

fn spec(layout: Layout, seed: u64) -> DplrSpec {
    DplrSpec {
        layout,
        h: 2,
        k: 8,
        v: 6,
        initial_state: true,
        seed,
    }
}

fn all(engine: &impl Engine<f64, Op = Dplr>, s: &DplrSpec) -> Tensors {
    let g = inputs::DplrSpec::generate(s);
    outputs::all::<f64, _>(
        engine,
        &g.inputs,
        &DplrOptions::default(),
        &g.d_o,
        Some(&g.dht),
    )
    .expect("valid")
}

#[test]
fn chunk_matches_naive_for_every_chunk_size_and_layout() {
    for (i, layout) in [Layout::varlen(&[37, 0, 1, 70, 16]), Layout::batch(2, 45)]
        .into_iter()
        .enumerate()
    {
        let s = spec(layout, 30 + i as u64);
        let reference = all(&Naive, &s);
        for c in [16, 32, 64] {
            assert_maps_close(
                &format!("C={c}"),
                &reference,
                &all(&Chunk::new(c).unwrap(), &s),
                1e-10,
            );
        }
    }
}

/// One piece of one head, as the engines see it (the operator contract's
/// associated type: the oracle does not name it).
type Head = <Dplr as Operator<f64>>::Head<'static>;

fn head(s: &DplrSpec) -> (Head, Array2<f64>) {
    let g = inputs::DplrSpec::generate(s);
    let p = Dplr::prepare(&g.inputs, &DplrOptions::default()).unwrap();
    (
        Dplr::head(&p, &p.segments[0], 1).into_owned(),
        op::initial_state(&p, 0, 1),
    )
}

/// The first `n` tokens of `x` (every per-token field cut, `scale` kept,
/// no cached per-head gates).
fn prefix(x: &Head, n: usize) -> Head {
    let cut = |a: &CowArray<f64, Ix2>| CowArray::from(a.slice(s![..n, ..]).to_owned());
    let mut y = x.clone();
    y.q = cut(&x.q);
    y.k = cut(&x.k);
    y.a = cut(&x.a);
    y.b = cut(&x.b);
    y.gk = cut(&x.gk);
    y.v = cut(&x.v);
    y.heads_gk = None;
    y
}

fn max_diff(a: &Array2<f64>, b: &Array2<f64>) -> f64 {
    (a - b).iter().fold(0.0, |m, v| m.max(v.abs()))
}

#[test]
fn h_is_the_naive_state_at_every_chunk_start_and_transitions_agree() {
    let (x, h0) = head(&spec(Layout::varlen(&[150]), 3));
    let per_token = Naive.transition(&x);
    for c in [16, 32, 64] {
        let chunk = Chunk::new(c).unwrap();
        let f = chunk.forward_intermediates(&x, h0.view());
        for n in 0..f.h.shape()[0] {
            let naive = Naive.forward(&prefix(&x, n * c), h0.view()).1;
            let d = max_diff(&f.h.index_axis(ndarray::Axis(0), n).to_owned(), &naive);
            assert!(d <= 1e-12, "C={c} chunk {n}: {d:e}");
        }
        let d = max_diff(&chunk.transition(&x), &per_token);
        assert!(d <= 1e-12, "C={c} transition: {d:e}");
    }
}

#[test]
fn chunks_too_wide_for_one_pair_of_factors_split_into_blocks() {
    // As in the KDA test of the same name ([`steep_decays`]: dims from
    // −0.8 to −50 a token, one token −800): the chunks split into blocks,
    // down to single rows around the −800 token, where Γx's factor
    // (exp(−gk) = e^800) is never formed. f64 to 1e-10 against the naive
    // recurrence; f32 within 1e-4 (measured: at most 8.1e-6, up to 70
    // times the naive form's f32 error, the same as when these chunks
    // formed each pair's decay from its difference).
    let s = spec(Layout::varlen(&[150, 70]), 12);
    let mut g = inputs::DplrSpec::generate(&s);
    steep_decays(&mut g.inputs.gk, 100);
    let run = Run {
        x: &g.inputs,
        opts: &DplrOptions::default(),
        d_o: &g.d_o,
        dht: &g.dht,
    };
    assert_split_chunks_agree(&Naive, |c| Chunk::new(c).unwrap(), &g.inputs.gk, run);
}

#[test]
fn strong_decay_does_not_overflow() {
    let s = spec(Layout::varlen(&[130, 64]), 5);
    let mut g = inputs::DplrSpec::generate(&s);
    g.inputs.gk = ArrayD::from_elem(IxDyn(g.inputs.gk.shape()), -5.0);
    // −20 per token puts Γ's range past what a product of two exponentials
    // survives in f64: the chunks split into blocks must agree too.
    let mut steep = g.clone();
    steep.inputs.gk = ArrayD::from_elem(IxDyn(g.inputs.gk.shape()), -20.0);
    let opts20 = DplrOptions::default();
    let want = outputs::all::<f64, _>(&Naive, &steep.inputs, &opts20, &steep.d_o, Some(&steep.dht))
        .unwrap();
    let got20 = outputs::all::<f64, _>(
        &Chunk::new(64).unwrap(),
        &steep.inputs,
        &opts20,
        &steep.d_o,
        Some(&steep.dht),
    )
    .unwrap();
    assert_maps_close("decay -20", &want, &got20, 1e-10);
    let opts = DplrOptions::default();
    let reference = outputs::all::<f64, _>(&Naive, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap();
    let chunk = Chunk::new(64).unwrap();
    let got = outputs::all::<f64, _>(&chunk, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap();
    assert_maps_close("gk = -5", &reference, &got, 1e-10);
    let single = outputs::all::<f32, _>(&chunk, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap();
    for (name, t) in &single {
        assert!(t.iter().all(|v| v.is_finite()), "f32 {name} has Inf/NaN");
    }
}

#[test]
fn f32_chunk_is_within_flas_band_of_f64_naive() {
    let s = DplrSpec {
        k: 32,
        v: 32,
        ..spec(Layout::varlen(&[200, 56]), 6)
    };
    let g = inputs::DplrSpec::generate(&s);
    let opts = DplrOptions::default();
    let reference = outputs::all::<f64, _>(&Naive, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap();
    let single = outputs::all::<f32, _>(
        &Chunk::new(64).unwrap(),
        &g.inputs,
        &opts,
        &g.d_o,
        Some(&g.dht),
    )
    .unwrap();
    for (name, r) in &reference {
        let v = ratio(r, &single[name]);
        println!("f32 chunk vs f64 naive (dplr) {name:<12} {v:.3e}");
        assert!(v <= 5e-3, "{name}: {v:e}");
    }
}

/// FLA's `gate_bound_is_safe`: `(C/2 + 1)·|lb|·log2 e ≤ 124`, so at chunk 16
/// (9 rows) the largest safe |lb| is 124 / (9·log2 e) ≈ 9.55, at chunk 64
/// (33 rows) ≈ 2.60; a non-negative bound is never safe.
#[test]
fn fla_picks_the_safe_gate_scheme_from_the_bound() {
    use deltaref::gates::gate_bound_is_safe;
    assert!(gate_bound_is_safe(-9.5, 16) && !gate_bound_is_safe(-9.6, 16));
    assert!(gate_bound_is_safe(-2.6, 64) && !gate_bound_is_safe(-2.7, 64));
    assert!(!gate_bound_is_safe(0.0, 16) && !gate_bound_is_safe(1.0, 16));
    let bounded = |lb| DplrOptions {
        lower_bound: Some(lb),
        ..Default::default()
    };
    assert!(bounded(-5.0).uses_safe_gate(16) && !bounded(-5.0).uses_safe_gate(64));
    let forced = DplrOptions {
        safe_gate: true,
        ..Default::default()
    };
    assert!(forced.uses_safe_gate(64) && !DplrOptions::default().uses_safe_gate(16));
}

/// `gen --op dplr --lower-bound X` records FLA's `lower_bound` and draws
/// `gk` in `[X, 0)`, reaching below RWKV-7's `−e^{−1/2}`; a `gk` below the
/// recorded bound is refused, naming the element and the bound.
#[test]
fn a_dplr_lower_bound_draws_gk_within_it_and_is_checked() {
    use deltaref::gates::Gate;
    use deltaref_verify::case::Op;
    use deltaref_verify::generate::{generate, GenSpec};
    use deltaref_verify::impls::{Compute, Impl};
    let case = generate(&GenSpec {
        shape: Some(vec![1, 40, 2, 8, 8]),
        gate: Gate::LowerBound { lower_bound: -3.0 },
        seed: 4,
        ..GenSpec::new(Op::Dplr)
    })
    .expect("generates");
    assert_eq!(case.meta.options["lower_bound"], serde_json::json!(-3.0));
    let gk = &case.tensors["gk"];
    let (lo, hi) = gk
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &g| (l.min(g), h.max(g)));
    assert!(lo >= -3.0 && hi < 0.0 && lo < -0.61, "gk in [{lo}, {hi}]");
    let mut broken = case.clone();
    broken.tensors.get_mut("gk").unwrap()[[0, 3, 1, 2]] = -3.5;
    let e = Impl::NAIVE
        .compute(&broken, Compute::F64)
        .expect_err("gk below the bound")
        .to_string();
    assert!(
        e.contains("lower_bound") && e.contains("[0, 3, 1, 2]") && e.contains("-3.5"),
        "{e}"
    );
}
