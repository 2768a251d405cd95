//! The chunked KDA form against the naive recurrence: f64 agreement ≤ 1e-10
//! for outputs, final state and every gradient; `h` equal to the naive state
//! at every chunk start; the chunk transition equal to the per-token product;
//! no overflow at the gate's lower bound; f32 within FLA's band.

use deltaref::gates::Gate;
use deltaref::inputs::{self, KdaSpec, Layout};
use deltaref::kda::Chunk;
use deltaref::kda::Naive;
use deltaref::kda::{Kda, KdaOptions};
use deltaref::op::{self, Engine, Operator};
use deltaref_tests::{assert_maps_close, assert_split_chunks_agree, ratio, steep_decays, Run};
use deltaref_verify::outputs::{self, Tensors};
use ndarray::{s, Array2, ArrayD, IxDyn};

fn spec(layout: Layout, opts: KdaOptions, seed: u64) -> KdaSpec {
    KdaSpec {
        layout,
        h: 2,
        hv: 4,
        k: 8,
        v: 6,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed,
    }
}

fn all(engine: &impl Engine<f64, Op = Kda>, s: &KdaSpec) -> Tensors {
    let g = inputs::KdaSpec::generate(s);
    outputs::all::<f64, _>(engine, &g.inputs, &s.opts, &g.d_o, Some(&g.dht)).expect("valid")
}

#[test]
fn chunk_matches_naive_for_every_chunk_size_gate_and_layout() {
    let gates = [
        Gate::None,
        Gate::Kda,
        Gate::LowerBound { lower_bound: -5.0 },
    ];
    for (i, gate) in gates.into_iter().enumerate() {
        for l2 in [false, true] {
            let opts = KdaOptions {
                gate,
                use_qk_l2norm_in_kernel: l2,
                use_beta_sigmoid_in_kernel: i == 1,
                ..Default::default()
            };
            for layout in [Layout::varlen(&[37, 0, 1, 70, 16]), Layout::batch(2, 45)] {
                let s = spec(layout, opts, 10 + i as u64);
                let reference = all(&Naive, &s);
                for c in [16, 32, 64] {
                    let got = all(&Chunk::new(c).unwrap(), &s);
                    assert_maps_close(&format!("C={c} {opts:?}"), &reference, &got, 1e-10);
                }
            }
        }
    }
}

/// One piece of one head, as the engines see it (the operator contract's
/// associated type: the oracle does not name it).
type Head = <Kda as Operator<f64>>::Head<'static>;

fn head(s: &KdaSpec, seq: usize, hv: usize) -> (Head, Array2<f64>) {
    let g = inputs::KdaSpec::generate(s);
    let p = Kda::prepare(&g.inputs, &s.opts).unwrap();
    let seg = p.segments[seq];
    (
        Kda::head(&p, &seg, hv).into_owned(),
        op::initial_state(&p, seg.seq, hv),
    )
}

/// The first `n` tokens of `x` (every per-token field cut, `scale` kept).
fn prefix(x: &Head, n: usize) -> Head {
    let mut y = x.clone();
    y.q = x.q.slice(s![..n, ..]).to_owned().into();
    y.k = x.k.slice(s![..n, ..]).to_owned().into();
    y.v = x.v.slice(s![..n, ..]).to_owned().into();
    y.g = x.g.slice(s![..n, ..]).to_owned().into();
    y.beta = x.beta.slice(s![..n]).to_owned().into();
    y
}

fn max_diff(a: &Array2<f64>, b: &Array2<f64>) -> f64 {
    (a - b).iter().fold(0.0, |m, v| m.max(v.abs()))
}

#[test]
fn h_is_the_naive_state_at_every_chunk_start() {
    let s = spec(
        Layout::varlen(&[150, 9]),
        KdaOptions {
            gate: Gate::Kda,
            ..Default::default()
        },
        3,
    );
    let (x, h0) = head(&s, 0, 3);
    for c in [16, 32, 64] {
        let f = Chunk::new(c).unwrap().forward_intermediates(&x, h0.view());
        for n in 0..f.h.shape()[0] {
            let naive = Naive.forward(&prefix(&x, n * c), h0.view()).1;
            let d = max_diff(&f.h.index_axis(ndarray::Axis(0), n).to_owned(), &naive);
            assert!(d <= 1e-12, "C={c} chunk {n}: {d:e}");
        }
    }
}

#[test]
fn chunk_transition_is_the_per_token_product() {
    let s = spec(
        Layout::varlen(&[100]),
        KdaOptions {
            gate: Gate::LowerBound { lower_bound: -2.0 },
            ..Default::default()
        },
        4,
    );
    let (x, _) = head(&s, 0, 1);
    let per_token = Naive.transition(&x);
    for c in [16, 32, 64] {
        let d = max_diff(&Chunk::new(c).unwrap().transition(&x), &per_token);
        assert!(d <= 1e-12, "C={c}: {d:e}");
    }
}

#[test]
fn gates_at_the_lower_bound_do_not_overflow() {
    // g = −5 every token: Γ reaches −320 inside a 64-token chunk, so
    // exp(−Γ_c) alone would overflow f32; differences never do.
    let opts = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    let s = spec(Layout::varlen(&[130, 64]), opts, 5);
    let mut g = inputs::KdaSpec::generate(&s);
    g.inputs.g = ArrayD::from_elem(IxDyn(g.inputs.g.shape()), -5.0);
    // −20 per token puts Γ's range past what a product of two exponentials
    // survives in f64: the chunks split into blocks must agree too.
    let mut steep = g.clone();
    steep.inputs.g = ArrayD::from_elem(IxDyn(g.inputs.g.shape()), -20.0);
    let opts20 = opts;
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
    let reference = outputs::all::<f64, _>(&Naive, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap();
    let chunk = Chunk::new(64).unwrap();
    let got = outputs::all::<f64, _>(&chunk, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap();
    assert_maps_close("g = -5", &reference, &got, 1e-10);
    let single = outputs::all::<f32, _>(&chunk, &g.inputs, &opts, &g.d_o, Some(&g.dht)).unwrap();
    for (name, t) in &single {
        assert!(t.iter().all(|v| v.is_finite()), "f32 {name} has Inf/NaN");
    }
    let x32 = g.inputs.cast::<f32>();
    let p = Kda::prepare(&x32, &opts).unwrap();
    let f = chunk.forward_intermediates(
        &Kda::head(&p, &p.segments[0], 0),
        op::initial_state(&p, 0, 0).view(),
    );
    for ch in &f.intra {
        for a in [&ch.akk, &ch.aqk, &ch.w, &ch.u, &ch.qg, &ch.kg] {
            assert!(a.iter().all(|v| v.is_finite()));
        }
    }
}

#[test]
fn chunks_too_wide_for_one_pair_of_factors_split_into_blocks() {
    // Dim 0 about −0.8 a token, dim 7 about −50, one token −800
    // ([`steep_decays`]). A chunk's factors through its middle row
    // overflow once a span passes 2·exp_bound: 567 in f64 and 71 in f32, so
    // the chunks split, down to single rows around the −800 token, while
    // the gentle dims keep their decays near 1 across the chunk. The split
    // chunks must still agree with the naive recurrence to 1e-10 in f64
    // (outputs, final state, every gradient), and in f32 within 1e-4 (a
    // broken block is off by its whole value; measured: at most 4.3e-6,
    // 1 to 18 times the naive form's f32 error, the same as when these
    // chunks formed each pair's decay from its difference).
    let opts = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    let s = KdaSpec {
        k: 8,
        v: 8,
        ..spec(Layout::varlen(&[150, 70]), opts, 11)
    };
    let mut g = inputs::KdaSpec::generate(&s);
    steep_decays(&mut g.inputs.g, 100);
    let run = Run {
        x: &g.inputs,
        opts: &opts,
        d_o: &g.d_o,
        dht: &g.dht,
    };
    assert_split_chunks_agree(&Naive, |c| Chunk::new(c).unwrap(), &g.inputs.g, run);
}

#[test]
fn f32_chunk_is_within_flas_band_of_f64_naive() {
    let opts = KdaOptions {
        gate: Gate::LowerBound { lower_bound: -5.0 },
        use_qk_l2norm_in_kernel: true,
        ..Default::default()
    };
    let s = KdaSpec {
        k: 32,
        v: 32,
        ..spec(Layout::varlen(&[200, 56]), opts, 6)
    };
    let g = inputs::KdaSpec::generate(&s);
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
        println!("f32 chunk vs f64 naive {name:<12} {v:.3e}");
        assert!(v <= 5e-3, "{name}: {v:e}");
    }
}

#[test]
fn chunk_size_is_validated() {
    for c in [0, 8, 48, 128] {
        let e = Chunk::new(c).expect_err("bad chunk size");
        assert!(e.to_string().contains("chunk_size"), "{e}");
    }
}
