//! The naive engines read a head's tensors row by row; a head whose arrays
//! (and `do`) are column-major gives the same bits as a row-major one.

use deltaref::dplr::{self, Dplr, DplrHead, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, Kda, KdaHead, KdaOptions};
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

#[test]
fn kda_naive_does_not_depend_on_memory_layout() {
    let opts = KdaOptions::default();
    let g = inputs::kda(&KdaSpec {
        layout: Layout::batch(1, 37),
        h: 1,
        hv: 1,
        k: 6,
        v: 5,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 4,
    });
    let p = kda::Prepared::new(&g.inputs, &opts).unwrap();
    let x = Kda::head(&p, &p.segments[0], 0);
    let xf = KdaHead {
        q: column_major(&x.q).into(),
        k: column_major(&x.k).into(),
        v: column_major(&x.v).into(),
        g: column_major(&x.g).into(),
        beta: x.beta.clone(),
    };
    let h0 = op::initial_state(&p, 0, 0);
    let (d_o, dht) = upstream(37, 6, 5);
    let n = kda::naive::Naive;
    let (o, s) = n.forward(&x, h0.view());
    let (of, sf) = n.forward(&xf, h0.view());
    assert_eq!(bits([&o, &s]), bits([&of, &sf]));
    let gr = n.backward(&x, h0.view(), d_o.view(), dht.view());
    let grf = n.backward(&xf, h0.view(), column_major(&d_o).view(), dht.view());
    assert_eq!(
        bits([&gr.dq, &gr.dk, &gr.dv, &gr.dg, &gr.dh0]),
        bits([&grf.dq, &grf.dk, &grf.dv, &grf.dg, &grf.dh0])
    );
    assert_eq!(gr.dbeta, grf.dbeta);
}

#[test]
fn dplr_naive_does_not_depend_on_memory_layout() {
    let g = inputs::dplr(&DplrSpec {
        layout: Layout::batch(1, 37),
        h: 1,
        k: 6,
        v: 5,
        initial_state: true,
        seed: 4,
    });
    let p = dplr::Prepared::new(&g.inputs, &DplrOptions::default()).unwrap();
    let x = Dplr::head(&p, &p.segments[0], 0);
    let xf = DplrHead {
        q: column_major(&x.q).into(),
        k: column_major(&x.k).into(),
        a: column_major(&x.a).into(),
        b: column_major(&x.b).into(),
        gk: column_major(&x.gk).into(),
        v: column_major(&x.v).into(),
    };
    let h0 = op::initial_state(&p, 0, 0);
    let (d_o, dht) = upstream(37, 6, 5);
    let n = dplr::naive::Naive;
    let (o, s) = n.forward(&x, h0.view());
    let (of, sf) = n.forward(&xf, h0.view());
    assert_eq!(bits([&o, &s]), bits([&of, &sf]));
    let gr = n.backward(&x, h0.view(), d_o.view(), dht.view());
    let grf = n.backward(&xf, h0.view(), column_major(&d_o).view(), dht.view());
    assert_eq!(
        bits([&gr.dq, &gr.dk, &gr.dv, &gr.da, &gr.db, &gr.dgk, &gr.dh0]),
        bits([&grf.dq, &grf.dk, &grf.dv, &grf.da, &grf.db, &grf.dgk, &grf.dh0])
    );
}
