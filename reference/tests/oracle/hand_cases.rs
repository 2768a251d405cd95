//! Tiny cases (T = 1 and T = 2, K = 2, V = 1) whose expected values are
//! written out here from the formulas of SPEC §3–§5, scalar by scalar.

use approx::assert_relative_eq;
use deltaref::dplr::{self, DplrInputs, DplrOptions};
use deltaref::kda::{self, KdaInputs, KdaOptions};
use deltaref::op;
use deltaref::token_shift::{self, TokenShiftInputs};
use ndarray::{ArrayD, IxDyn};

fn t(shape: &[usize], v: &[f64]) -> ArrayD<f64> {
    ArrayD::from_shape_vec(IxDyn(shape), v.to_vec()).expect("shape")
}

/// KDA, B = 1, H = HV = 1, K = 2, V = 1, `scale` given.
struct Kda1 {
    q: [[f64; 2]; 2],
    k: [[f64; 2]; 2],
    v: [f64; 2],
    g: [[f64; 2]; 2],
    beta: [f64; 2],
    s0: [f64; 2],
    scale: f64,
}

impl Kda1 {
    fn inputs(&self, steps: usize) -> KdaInputs<f64> {
        let flat = |a: &[[f64; 2]; 2]| a[..steps].iter().flatten().copied().collect::<Vec<_>>();
        KdaInputs {
            q: t(&[1, steps, 1, 2], &flat(&self.q)),
            k: t(&[1, steps, 1, 2], &flat(&self.k)),
            v: t(&[1, steps, 1, 1], &self.v[..steps]),
            g: t(&[1, steps, 1, 2], &flat(&self.g)),
            beta: t(&[1, steps, 1], &self.beta[..steps]),
            a_log: None,
            dt_bias: None,
            initial_state: Some(t(&[1, 1, 2, 1], &self.s0)),
            cu_seqlens: None,
        }
    }

    /// One token by hand: decay, delta-rule update, read-out.
    fn step(&self, i: usize, s: [f64; 2]) -> ([f64; 2], f64) {
        let (k, g, b) = (self.k[i], self.g[i], self.beta[i]);
        let sp = [g[0].exp() * s[0], g[1].exp() * s[1]];
        let pred = k[0] * sp[0] + k[1] * sp[1];
        let u = b * (self.v[i] - pred);
        let s1 = [sp[0] + k[0] * u, sp[1] + k[1] * u];
        let o = self.scale * (self.q[i][0] * s1[0] + self.q[i][1] * s1[1]);
        (s1, o)
    }
}

fn kda_example() -> Kda1 {
    Kda1 {
        q: [[0.5, -1.0], [0.25, 2.0]],
        k: [[1.0, 0.5], [-0.5, 1.5]],
        v: [2.0, -1.0],
        g: [[-0.1, -0.7], [-0.3, -0.2]],
        beta: [0.6, 0.9],
        s0: [0.3, -0.2],
        scale: 0.8,
    }
}

#[test]
fn kda_one_and_two_tokens() {
    let c = kda_example();
    let opt = KdaOptions {
        scale: Some(c.scale),
        output_final_state: true,
        ..Default::default()
    };
    let (s1, o1) = c.step(0, c.s0);
    let (s2, o2) = c.step(1, s1);
    for (steps, os, fin) in [(1, vec![o1], s1), (2, vec![o1, o2], s2)] {
        let out = op::forward(&kda::Naive, &c.inputs(steps), &opt).expect("valid");
        for (got, want) in out.o.iter().zip(&os) {
            assert_relative_eq!(*got, *want, epsilon = 1e-14);
        }
        let st = out.final_state.expect("asked");
        assert_relative_eq!(st[[0, 0, 0, 0]], fin[0], epsilon = 1e-14);
        assert_relative_eq!(st[[0, 0, 1, 0]], fin[1], epsilon = 1e-14);
    }
}

#[test]
fn kda_one_token_gradients_by_hand() {
    // L = o·do with o = scale qᵀS1, S1 = S' + β k (v − kᵀS')
    let c = kda_example();
    let d_o = 1.7;
    let (s1, _) = c.step(0, c.s0);
    let (q, k, g, b) = (c.q[0], c.k[0], c.g[0], c.beta[0]);
    let sp = [g[0].exp() * c.s0[0], g[1].exp() * c.s0[1]];
    let r = c.v[0] - (k[0] * sp[0] + k[1] * sp[1]);
    let qk = q[0] * k[0] + q[1] * k[1];
    let want_dq = [c.scale * s1[0] * d_o, c.scale * s1[1] * d_o];
    let want_dv = c.scale * d_o * b * qk;
    let want_dbeta = c.scale * d_o * qk * r;
    // dS0_i = e^{g_i} (scale·do) (q_i − β k_i qk)
    let want_dh0 = [0, 1].map(|i| g[i].exp() * c.scale * d_o * (q[i] - b * k[i] * qk));
    let opt = KdaOptions {
        scale: Some(c.scale),
        ..Default::default()
    };
    let gr = op::backward(
        &kda::Naive,
        &c.inputs(1),
        &opt,
        &t(&[1, 1, 1, 1], &[d_o]),
        None,
    )
    .expect("valid");
    assert_relative_eq!(gr.dq[[0, 0, 0, 0]], want_dq[0], epsilon = 1e-14);
    assert_relative_eq!(gr.dq[[0, 0, 0, 1]], want_dq[1], epsilon = 1e-14);
    assert_relative_eq!(gr.dv[[0, 0, 0, 0]], want_dv, epsilon = 1e-14);
    assert_relative_eq!(gr.dbeta[[0, 0, 0]], want_dbeta, epsilon = 1e-14);
    let dh0 = gr.dh0.expect("initial state given");
    assert_relative_eq!(dh0[[0, 0, 0, 0]], want_dh0[0], epsilon = 1e-14);
    assert_relative_eq!(dh0[[0, 0, 1, 0]], want_dh0[1], epsilon = 1e-14);
}

#[test]
fn dplr_one_and_two_tokens() {
    let q = [[0.5, -1.0], [0.25, 2.0]];
    let k = [[1.0, 0.5], [-0.5, 1.5]];
    let a = [[-0.6, 0.8], [0.3, -0.4]];
    let b = [[0.2, 0.1], [-0.3, 0.5]];
    let gk: [[f64; 2]; 2] = [[-0.1, -0.5], [-0.2, -0.05]];
    let v = [2.0, -1.0];
    let s0 = [0.3, -0.2];
    let scale = 0.8;
    let step = |i: usize, s: [f64; 2]| {
        let a_s = a[i][0] * s[0] + a[i][1] * s[1];
        let s1 = [0, 1].map(|d| gk[i][d].exp() * s[d] + b[i][d] * a_s + k[i][d] * v[i]);
        (s1, scale * (q[i][0] * s1[0] + q[i][1] * s1[1]))
    };
    let (s1, o1) = step(0, s0);
    let (s2, o2) = step(1, s1);
    let flat = |x: &[[f64; 2]; 2], n: usize| x[..n].iter().flatten().copied().collect::<Vec<_>>();
    let opt = DplrOptions {
        scale: Some(scale),
        output_final_state: true,
        ..DplrOptions::default()
    };
    for (n, os, fin) in [(1, vec![o1], s1), (2, vec![o1, o2], s2)] {
        let x = DplrInputs {
            q: t(&[1, n, 1, 2], &flat(&q, n)),
            k: t(&[1, n, 1, 2], &flat(&k, n)),
            v: t(&[1, n, 1, 1], &v[..n]),
            a: t(&[1, n, 1, 2], &flat(&a, n)),
            b: t(&[1, n, 1, 2], &flat(&b, n)),
            gk: t(&[1, n, 1, 2], &flat(&gk, n)),
            initial_state: Some(t(&[1, 1, 2, 1], &s0)),
            cu_seqlens: None,
        };
        let out = op::forward(&dplr::Naive, &x, &opt).expect("valid");
        for (got, want) in out.o.iter().zip(&os) {
            assert_relative_eq!(*got, *want, epsilon = 1e-14);
        }
        let st = out.final_state.expect("asked");
        assert_relative_eq!(st[[0, 0, 0, 0]], fin[0], epsilon = 1e-14);
        assert_relative_eq!(st[[0, 0, 1, 0]], fin[1], epsilon = 1e-14);
    }
}

#[test]
fn token_shift_by_hand() {
    // Sequences [x0, x1] and [x2] (D = 1), cache [c0, c1].
    let x = TokenShiftInputs {
        x: t(&[1, 3, 1], &[1.0, 4.0, -2.0]),
        cache: Some(t(&[2, 1], &[0.5, 3.0])),
        cu_seqlens: Some(vec![0, 2, 3]),
    };
    let out = op::forward(&token_shift::Shift, &x, &()).expect("valid");
    assert_eq!(
        out.y.iter().copied().collect::<Vec<_>>(),
        vec![0.5 - 1.0, 1.0 - 4.0, 3.0 + 2.0]
    );
    assert_eq!(
        out.final_cache.iter().copied().collect::<Vec<_>>(),
        vec![4.0, -2.0]
    );
    // dx_t = dy_{t+1} − dy_t (+ dfinal_cache at the last token), dcache = dy_0.
    let dy = t(&[1, 3, 1], &[0.1, 0.2, 0.4]);
    let dfc = t(&[2, 1], &[1.0, 2.0]);
    let gr = op::backward(&token_shift::Shift, &x, &(), &dy, Some(&dfc)).expect("valid");
    let want_dx = [0.2 - 0.1, 1.0 - 0.2, 2.0 - 0.4];
    for (got, want) in gr.dx.iter().zip(want_dx) {
        assert_relative_eq!(*got, want, epsilon = 1e-15);
    }
    assert_eq!(
        gr.dcache
            .expect("cache given")
            .iter()
            .copied()
            .collect::<Vec<_>>(),
        vec![0.1, 0.4]
    );
    // No cache: a length-1 sequence gives y = −x.
    let out = op::forward(
        &token_shift::Shift,
        &TokenShiftInputs { cache: None, ..x },
        &(),
    )
    .expect("valid");
    assert_eq!(out.y[[0, 2, 0]], 2.0);
}
