//! Token-shift's truth (SPEC §5): per sequence `y_t = x_{t−1} − x_t`, where
//! `x_{−1}` is `cache[n]` (or 0); `final_cache[n]` is the sequence's last
//! token, or `x_{−1}` itself when the sequence has none.

use ndarray::{s, Array1, Array2, Array3, ArrayD};

use super::{sequences, view2, view3, Real, Truth};
use crate::token_shift::{TokenShift, TokenShiftInputs, TokenShiftOutputs};

/// Token-shift forward. `x`: `x [B, T, D]`, `cache [N, D]`, `cu_seqlens
/// [N + 1]`. Returns `y [B, T, D]` and `final_cache [N, D]`.
pub fn forward<R: Real>(x: &TokenShiftInputs<R>) -> TokenShiftOutputs<R> {
    let xs = view3(&x.x);
    let (b, t, d) = xs.dim();
    let seqs = sequences(b, t, x.cu_seqlens.as_deref());
    let mut y = Array3::zeros((b, t, d));
    let mut final_cache = Array2::zeros((seqs.len(), d));
    for seq in &seqs {
        let mut prev = x
            .cache
            .as_ref()
            .map_or(Array1::zeros(d), |c| view2(c).row(seq.n).to_owned());
        for ti in seq.tokens.clone() {
            let cur = xs.slice(s![seq.batch, ti, ..]);
            y.slice_mut(s![seq.batch, ti, ..]).assign(&(&prev - &cur));
            prev = cur.to_owned();
        }
        final_cache.row_mut(seq.n).assign(&prev);
    }
    TokenShiftOutputs {
        y: y.into_dyn(),
        final_cache: final_cache.into_dyn(),
    }
}

impl Truth for TokenShift {
    type Inputs<R: Real> = TokenShiftInputs<R>;
    type Outputs<R: Real> = TokenShiftOutputs<R>;

    fn forward<R: Real>(x: &TokenShiftInputs<R>, _: &()) -> TokenShiftOutputs<R> {
        forward(x)
    }

    fn tensors<R: Real>(x: &TokenShiftInputs<R>) -> Vec<Option<&ArrayD<R>>> {
        vec![Some(&x.x), x.cache.as_ref()]
    }

    fn map_tensors<R: Real, S: Real>(
        x: &TokenShiftInputs<R>,
        mut f: impl FnMut(usize, &ArrayD<R>) -> ArrayD<S>,
    ) -> TokenShiftInputs<S> {
        TokenShiftInputs {
            x: f(0, &x.x),
            cache: x.cache.as_ref().map(|c| f(1, c)),
            cu_seqlens: x.cu_seqlens.clone(),
        }
    }

    fn outputs<R: Real>(y: &TokenShiftOutputs<R>) -> Vec<Option<&ArrayD<R>>> {
        vec![Some(&y.y), Some(&y.final_cache)]
    }
}
