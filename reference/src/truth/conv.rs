//! Causal conv1d's truth (FLA `causal_conv1d`): per sequence of `L` tokens,
//! with `X = [initial_state[n] (W tokens, oldest first), x_0, …, x_{L−1}]`
//! (zeros for the state when absent),
//! ```text
//! y_t[d] = act(Σ_{i<W} weight[d, i] · X[t + 1 + i][d] + bias[d])
//! final_state[n][d, i] = X[L + i][d]            (the last W entries of X)
//! ```
//! `act` the identity or SiLU `z · sigmoid(z)`.

use ndarray::{Array2, Array3, ArrayD};

use super::{sequences, sigmoid, sum, view2, view3, Real, Truth};
use crate::conv::{Activation, CausalConv1d, ConvInputs, ConvOptions, ConvOutputs};

/// Causal conv1d forward. `x`: `x [B, T, D]`, `weight [D, W]`, `bias [D]`,
/// `initial_state [N, D, W]`, `cu_seqlens [N + 1]`. Returns `y [B, T, D]`
/// and, with `output_final_state`, `final_state [N, D, W]`.
pub fn forward<R: Real>(x: &ConvInputs<R>, opt: &ConvOptions) -> ConvOutputs<R> {
    let xs = view3(&x.x);
    let weight = view2(&x.weight);
    let (b, t, d) = xs.dim();
    let w = weight.ncols();
    let act = |z: R| match opt.activation {
        Activation::None => z,
        Activation::Silu => z * sigmoid(z),
    };
    let seqs = sequences(b, t, x.cu_seqlens.as_deref());
    let mut y = Array3::zeros((b, t, d));
    let mut fin = Array3::zeros((seqs.len(), d, w));
    for seq in &seqs {
        let l = seq.tokens.len();
        // Row m of X: the state's column m below W, token m − W above.
        let ext = Array2::from_shape_fn((w + l, d), |(m, c)| match (m < w, &x.initial_state) {
            (true, Some(h0)) => h0[[seq.n, c, m]],
            (true, None) => R::zero(),
            (false, _) => xs[[seq.batch, seq.tokens.start + m - w, c]],
        });
        for ti in 0..l {
            for c in 0..d {
                let bias = x.bias.as_ref().map_or(R::zero(), |bias| bias[[c]]);
                let z = sum(w, |i| weight[[c, i]] * ext[[ti + 1 + i, c]]) + bias;
                y[[seq.batch, seq.tokens.start + ti, c]] = act(z);
            }
        }
        for c in 0..d {
            for i in 0..w {
                fin[[seq.n, c, i]] = ext[[l + i, c]];
            }
        }
    }
    ConvOutputs {
        y: y.into_dyn(),
        final_state: opt.output_final_state.then(|| fin.into_dyn()),
    }
}

impl Truth for CausalConv1d {
    type Inputs<R: Real> = ConvInputs<R>;
    type Outputs<R: Real> = ConvOutputs<R>;

    fn forward<R: Real>(x: &ConvInputs<R>, opt: &ConvOptions) -> ConvOutputs<R> {
        forward(x, opt)
    }

    fn tensors<R: Real>(x: &ConvInputs<R>) -> Vec<Option<&ArrayD<R>>> {
        vec![
            Some(&x.x),
            Some(&x.weight),
            x.bias.as_ref(),
            x.initial_state.as_ref(),
        ]
    }

    fn map_tensors<R: Real, S: Real>(
        x: &ConvInputs<R>,
        mut f: impl FnMut(usize, &ArrayD<R>) -> ArrayD<S>,
    ) -> ConvInputs<S> {
        ConvInputs {
            x: f(0, &x.x),
            weight: f(1, &x.weight),
            bias: x.bias.as_ref().map(|a| f(2, a)),
            initial_state: x.initial_state.as_ref().map(|a| f(3, a)),
            cu_seqlens: x.cu_seqlens.clone(),
        }
    }

    fn outputs<R: Real>(y: &ConvOutputs<R>) -> Vec<Option<&ArrayD<R>>> {
        vec![Some(&y.y), y.final_state.as_ref()]
    }
}
