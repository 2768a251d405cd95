//! Token-shift under CP: a rank whose first sequence continues from the
//! previous rank takes that rank's last token as `cache`; in backward the
//! gradient of that cache is added to the previous rank's last-token `dx`.

use ndarray::{s, Array1, Array2, Array3, ArrayD, Ix2, Ix3};

use super::plan::PlanSpec;
use crate::error::Result;
use crate::scalar::Scalar;
use crate::token_shift::{
    shift_segment, shift_segment_backward, validate, validate_upstream, TokenShiftGrads,
    TokenShiftInputs, TokenShiftOutputs,
};

/// CP forward: the same `y` and `final_cache` as `token_shift::forward`.
pub fn forward<T: Scalar>(
    x: &TokenShiftInputs<T>,
    plan: &PlanSpec,
) -> Result<TokenShiftOutputs<T>> {
    let (d, _) = validate(x)?;
    let plan = plan.build(d.b, d.t, x.cu_seqlens.as_deref())?;
    let xx = x.x.view().into_dimensionality::<Ix3>().expect("validated");
    let cache = x.cache.as_ref().map(|c| {
        c.view()
            .into_dimensionality::<Ix2>()
            .expect("validated")
            .to_owned()
    });
    let mut y = Array3::zeros((d.b, d.t, d.d));
    let mut final_cache = cache.clone().unwrap_or_else(|| Array2::zeros((d.n, d.d)));
    for rm in &plan.ranks {
        for (i, seg) in rm.pieces.iter().enumerate() {
            let prev = if i == 0 && rm.continues() {
                // Received from the previous rank.
                xx.slice(s![0, rm.start - 1, ..]).to_owned()
            } else {
                cache
                    .as_ref()
                    .map_or_else(|| Array1::zeros(d.d), |c| c.row(seg.seq).to_owned())
            };
            let last = shift_segment(xx, &mut y, seg, prev);
            if seg.end == plan.cu_seqlens[seg.seq + 1] as usize {
                final_cache.row_mut(seg.seq).assign(&last);
            }
        }
    }
    Ok(TokenShiftOutputs {
        y: y.into_dyn(),
        final_cache: final_cache.into_dyn(),
    })
}

/// CP backward: the same `dx` and `dcache` as `token_shift::backward`.
pub fn backward<T: Scalar>(
    x: &TokenShiftInputs<T>,
    dy: &ArrayD<T>,
    dfinal_cache: Option<&ArrayD<T>>,
    plan: &PlanSpec,
) -> Result<TokenShiftGrads<T>> {
    let (d, _) = validate(x)?;
    validate_upstream(&d, dy, dfinal_cache)?;
    let plan = plan.build(d.b, d.t, x.cu_seqlens.as_deref())?;
    let dyv = dy.view().into_dimensionality::<Ix3>().expect("validated");
    let dfc = dfinal_cache.map(|c| {
        c.view()
            .into_dimensionality::<Ix2>()
            .expect("validated")
            .to_owned()
    });
    let mut dx = Array3::zeros((d.b, d.t, d.d));
    // Zero-length sequences pass dfinal_cache straight to dcache.
    let mut dcache = dfc.clone().unwrap_or_else(|| Array2::zeros((d.n, d.d)));
    let mut sent_back: Vec<(usize, Array1<T>)> = vec![];
    for rm in &plan.ranks {
        for (i, seg) in rm.pieces.iter().enumerate() {
            let ends_seq = seg.end == plan.cu_seqlens[seg.seq + 1] as usize;
            let carry = match (&dfc, ends_seq) {
                (Some(f), true) => f.row(seg.seq).to_owned(),
                _ => Array1::zeros(d.d),
            };
            let d_prev = shift_segment_backward(dyv, &mut dx, seg, carry);
            if i == 0 && rm.continues() {
                sent_back.push((rm.start - 1, d_prev));
            } else {
                dcache.row_mut(seg.seq).assign(&d_prev);
            }
        }
    }
    for (t, g) in sent_back {
        let mut row = dx.slice_mut(s![0, t, ..]);
        row += &g;
    }
    Ok(TokenShiftGrads {
        dx: dx.into_dyn(),
        dcache: x.cache.as_ref().map(|_| dcache.into_dyn()),
    })
}
