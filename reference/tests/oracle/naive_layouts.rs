//! Heads reach the engines in several layouts: a head's rows of the
//! `[B, T, H, D]` tensors (strided by the other heads, `q` still to be
//! scaled), a row-major copy with `q` scaled (the head's `standard()`), and
//! column-major arrays. Every engine gives the same bits for each.

use deltaref::dplr::{self, Dplr, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, Kda, KdaOptions};
use deltaref::op::{self, Engine, Operator};
use ndarray::{Array2, ArrayBase, Data, Ix2, ShapeBuilder};

fn column_major<S: Data<Elem = f64>>(a: &ArrayBase<S, Ix2>) -> Array2<f64> {
    let mut f = Array2::zeros(a.raw_dim().f());
    f.assign(a);
    f
}

fn bits<'a>(xs: impl IntoIterator<Item = &'a Array2<f64>>) -> Vec<u64> {
    xs.into_iter()
        .flat_map(|a| a.iter().map(|v| v.to_bits()))
        .collect()
}

fn upstream(l: usize, kd: usize, vd: usize) -> (Array2<f64>, Array2<f64>) {
    let d_o = Array2::from_shape_fn((l, vd), |(t, j)| ((t * vd + j) as f64 * 0.37).sin());
    let dht = Array2::from_shape_fn((kd, vd), |(i, j)| ((i * vd + j) as f64 * 0.11).cos());
    (d_o, dht)
}

/// Forward and backward bits of `engine` on each head in `heads`, all
/// equal; `do` column-major for the column-major head.
fn same_bits<E: Engine<f64>>(
    engine: &E,
    heads: &[<E::Op as Operator<f64>>::Head<'_>],
    h0: &Array2<f64>,
    d_o: &Array2<f64>,
    dht: &Array2<f64>,
    grads: impl Fn(&<E::Op as Operator<f64>>::HeadGrads) -> Vec<u64>,
) {
    let runs: Vec<_> = heads
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let d_o = if i == 2 {
                column_major(d_o)
            } else {
                d_o.clone()
            };
            let (o, s) = engine.forward(x, h0.view());
            let gr = engine.backward(x, h0.view(), d_o.view(), dht.view());
            (bits([&o, &s]), grads(&gr))
        })
        .collect();
    for (i, r) in runs.iter().enumerate().skip(1) {
        assert!(
            *r == runs[0],
            "head form {i} differs from the borrowed head"
        );
    }
}

#[test]
fn kda_engines_do_not_depend_on_memory_layout() {
    let opts = KdaOptions::default();
    let g = inputs::KdaSpec::generate(&KdaSpec {
        layout: Layout::batch(1, 37),
        h: 3,
        hv: 3,
        k: 6,
        v: 5,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 4,
    });
    let p = Kda::prepare(&g.inputs, &opts).unwrap();
    let x = Kda::head(&p, &p.segments[0], 1);
    assert!(x.q.is_view() && !x.q.is_standard_layout(), "a strided view");
    let xs = x.standard();
    assert_eq!(xs.scale, 1.0);
    let mut xf = x.clone();
    xf.q = column_major(&x.q).into();
    xf.k = column_major(&x.k).into();
    xf.v = column_major(&x.v).into();
    xf.g = column_major(&x.g).into();
    let heads = [x.clone(), xs, xf];
    let h0 = op::initial_state(&p, 0, 1);
    let (d_o, dht) = upstream(37, 6, 5);
    let grads = |g: &<Kda as Operator<f64>>::HeadGrads| {
        let mut b = bits([&g.dq, &g.dk, &g.dv, &g.dg, &g.dh0]);
        b.extend(g.dbeta.iter().map(|v| v.to_bits()));
        b
    };
    same_bits(&kda::Naive, &heads, &h0, &d_o, &dht, grads);
    let chunk = kda::Chunk::new(16).unwrap();
    same_bits(&chunk, &heads, &h0, &d_o, &dht, grads);
}

#[test]
fn dplr_engines_do_not_depend_on_memory_layout() {
    let g = inputs::DplrSpec::generate(&DplrSpec {
        layout: Layout::batch(1, 37),
        h: 3,
        k: 6,
        v: 5,
        initial_state: true,
        seed: 4,
    });
    let p = Dplr::prepare(&g.inputs, &DplrOptions::default()).unwrap();
    let x = Dplr::head(&p, &p.segments[0], 2);
    assert!(x.q.is_view() && !x.q.is_standard_layout(), "a strided view");
    let xs = x.standard();
    let mut xf = x.clone();
    xf.q = column_major(&x.q).into();
    xf.k = column_major(&x.k).into();
    xf.a = column_major(&x.a).into();
    xf.b = column_major(&x.b).into();
    xf.gk = column_major(&x.gk).into();
    xf.v = column_major(&x.v).into();
    xf.heads_gk = None;
    let heads = [x.clone(), xs, xf];
    let h0 = op::initial_state(&p, 0, 2);
    let (d_o, dht) = upstream(37, 6, 5);
    let grads = |g: &<Dplr as Operator<f64>>::HeadGrads| {
        bits([&g.dq, &g.dk, &g.dv, &g.da, &g.db, &g.dgk, &g.dh0])
    };
    same_bits(&dplr::Naive, &heads, &h0, &d_o, &dht, grads);
    let chunk = dplr::Chunk::new(16).unwrap();
    same_bits(&chunk, &heads, &h0, &d_o, &dht, grads);
}
