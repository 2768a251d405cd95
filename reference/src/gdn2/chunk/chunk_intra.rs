//! The intra-chunk stage, FLA's `gdn2/chunk_intra.py`: Γ (the in-chunk
//! cumsum of `g`), `Akk = (I + L)^{-1}` and `Aqk` per chunk
//! (`chunk_gdn2_fwd_intra`), and their backward into `q`, `k`, `b` and Γ
//! (`chunk_gdn2_bwd_intra`).

use ndarray::{s, Array1, Array2, ArrayView2, Axis};

use super::Chunk;
use crate::dtype::Dtype;
use crate::gdn2::Gdn2Head;
use crate::precision::{Policy, Stage};
use crate::scalar::Scalar;

/// FLA's sub-chunk of the intra kernels (`BC`): pairs of rows in different
/// sub-chunks go through tf32 `tl.dot`s.
const SUB_CHUNK: usize = 16;

/// FLA's safe-gate anchor shift: `C = Γ_0 − ½(BC − 1)·2` nats below the
/// sub-chunk's first row (`GATE_SHIFT` = 2, `chunk_gdn2` never passes its
/// `lower_bound` to the intra kernels).
const SAFE_GATE_SHIFT: f64 = 0.5 * (SUB_CHUNK as f64 - 1.0) * 2.0;

/// One chunk's state-independent quantities (FLA's `chunk_gdn2_fwd_intra`
/// and `recompute_w_u_fwd_gdn2`), `c` rows.
#[derive(Clone, Debug)]
pub(crate) struct Intra<T> {
    /// First token of the chunk in its piece.
    pub start: usize,
    /// `[c, K]` in-chunk inclusive cumsum of `g` (natural log).
    pub g_cumsum: Array2<T>,
    /// `[c, c]` FLA's `Akk`: the inverse `(I + L)^{-1}` (unit lower triangular).
    pub akk: Array2<T>,
    /// `[c, c]` FLA's `Aqk` (lower triangular, diagonal included; `q` scaled).
    pub aqk: Array2<T>,
    /// `[c, K]` `Akk (b ⊙ k ⊙ exp Γ)`.
    pub w_wy: Array2<T>,
    /// `[c, V]` `Akk (w ⊙ v)`.
    pub u_wy: Array2<T>,
    /// `[c, K]` `q ⊙ exp Γ`.
    pub qg: Array2<T>,
    /// `[c, K]` `k ⊙ exp(Γ_last − Γ)`.
    pub kg: Array2<T>,
}

impl<T: Scalar> Intra<T> {
    /// Rows `c` (tokens of the chunk).
    pub fn len(&self) -> usize {
        self.g_cumsum.nrows()
    }
    /// `Γ_last [K]`, the chunk's total log-decay.
    pub fn g_last(&self) -> Array1<T> {
        self.g_cumsum.row(self.len() - 1).to_owned()
    }
    /// `[K, K]` the chunk's transition `Diag(exp Γ_last) − kgᵀ w_wy`, with
    /// `policy`'s exponential (base 2 or not).
    pub fn transition_with(&self, policy: &Policy) -> Array2<T> {
        Array2::from_diag(&self.g_last().mapv(|x| policy.exp(x))) - self.kg.t().dot(&self.w_wy)
    }
}

/// Where the forward's pairwise products go through FLA's rounded `tl.dot`
/// operands ([`Stage::FwdDots`]): the storage, and whether the diagonal
/// sub-chunks do too (the safe-gate path).
#[derive(Clone, Copy)]
struct DotRounding {
    storage: Dtype,
    safe_gate: bool,
}

impl Chunk {
    /// `Σ_d a_r[d] c_s[d] exp(Γ_r[d] − Γ_s[d])` for the rows `(r, s)` of a
    /// chunk that `keep(r, s)` admits, else 0; `[c, c]`. Under
    /// [`Stage::FwdDots`], a pair in different 16-token sub-chunks (and,
    /// with the safe gate, in the same one) is FLA's product of rounded
    /// factors `(a_r exp(Γ_r − n)) · (c_s exp(n − Γ_s))` through the row
    /// sub-chunk's anchor `n` (its first row; safe gate inside a sub-chunk:
    /// that row minus [`SAFE_GATE_SHIFT`]); other pairs are FLA's fp32
    /// elementwise sums (`chunk_intra_token_parallel`).
    ///
    /// `a_safe` replaces `a` on the safe path's diagonal sub-chunks (FLA's
    /// `bk_dt`, `b k` rounded to the input dtype there only).
    fn decayed_products<T: Scalar>(
        &self,
        a: ArrayView2<T>,
        a_safe: ArrayView2<T>,
        c: ArrayView2<T>,
        g_cumsum: &Array2<T>,
        keep: impl Fn(usize, usize) -> bool,
    ) -> Array2<T> {
        let n = g_cumsum.nrows();
        let dots = self
            .policy
            .storage(Stage::FwdDots)
            .map(|storage| DotRounding {
                storage,
                safe_gate: self.policy.safe_gate_midpoint,
            });
        let e = |x: T| self.policy.exp(x);
        Array2::from_shape_fn((n, n), |(r, s)| {
            if !keep(r, s) {
                return T::zero();
            }
            let (gr, gs) = (g_cumsum.row(r), g_cumsum.row(s));
            let sub = |i: usize| i / SUB_CHUNK;
            match dots {
                Some(d) if sub(r) != sub(s) || d.safe_gate => {
                    let first = g_cumsum.row(sub(r) * SUB_CHUNK);
                    let (shift, a) = if sub(r) == sub(s) {
                        (T::c(SAFE_GATE_SHIFT), a_safe)
                    } else {
                        (T::zero(), a)
                    };
                    (0..gr.len())
                        .map(|k| {
                            let anchor = first[k] - shift;
                            let left = d.storage.round(a[[r, k]] * e(gr[k] - anchor));
                            let right = d.storage.round(c[[s, k]] * e(anchor - gs[k]));
                            left * right
                        })
                        .sum()
                }
                _ => (0..gr.len())
                    .map(|k| a[[r, k]] * c[[s, k]] * e(gr[k] - gs[k]))
                    .sum(),
            }
        })
    }
}

/// `(I + L)^{-1}` of a strictly lower triangular `l [c, c]`, by forward
/// substitution: row `r` is `e_r − Σ_{s<r} L[r,s] · row s`.
fn unit_lower_inverse<T: Scalar>(l: &Array2<T>) -> Array2<T> {
    let n = l.nrows();
    let mut inv = Array2::<T>::eye(n);
    for r in 1..n {
        let (above, mut below) = inv.view_mut().split_at(Axis(0), r);
        let mut row = below.row_mut(0);
        for s in 0..r {
            row.scaled_add(-l[[r, s]], &above.row(s));
        }
    }
    inv
}

impl Chunk {
    /// The state-independent quantities of `x`'s chunk of rows `start ..
    /// start + c` (`c ≥ 1`, `start + c ≤ L`), each stored as the policy says.
    pub(crate) fn intra<T: Scalar>(&self, x: &Gdn2Head<T>, start: usize, c: usize) -> Intra<T> {
        let p = &self.policy;
        let rows = s![start..start + c, ..];
        let (q, k, b) = (x.q.slice(rows), x.k.slice(rows), x.b.slice(rows));
        let mut g_cumsum = x.g.slice(rows).to_owned();
        p.cumsum_rows(&mut g_cumsum);
        let bk = &b * &k;
        // The safe path's diagonal blocks read `b k` rounded to the input
        // dtype (`bk_dt`); the other intra kernels form it in fp32.
        let bk_dt = p.stored(Stage::KBeta, bk.view());
        let l = self.decayed_products(bk.view(), bk_dt.view(), k, &g_cumsum, |r, s| s < r);
        let mut akk = unit_lower_inverse(&l);
        p.round(Stage::Akk, &mut akk);
        let mut aqk = self.decayed_products(q, q, k, &g_cumsum, |r, s| s <= r);
        p.round(Stage::Aqk, &mut aqk);
        let [w_wy, u_wy, qg, kg] = self.recompute_w_u(x, start, &akk, &g_cumsum);
        Intra {
            start,
            w_wy,
            u_wy,
            qg,
            kg,
            g_cumsum,
            akk,
            aqk,
        }
    }

    /// Each chunk's [`Intra`] of a piece.
    pub(crate) fn intras<T: Scalar>(&self, x: &Gdn2Head<T>) -> Vec<Intra<T>> {
        (0..x.len())
            .step_by(self.chunk_size)
            .map(|start| self.intra(x, start, self.chunk_size.min(x.len() - start)))
            .collect()
    }

    /// The intra backward of chunk `it` (FLA's `chunk_gdn2_bwd_intra`):
    /// through `Aqk[r,s] = Σ_d q_r k_s e` (`s ≤ r`) and `L[r,s] = Σ_d b_r k_r
    /// k_s e` (`s < r`), `e = exp(Γ_r − Γ_s)`, the gradients `dAqk`, `dL`
    /// `[c, c]` add to `dq`, `dk`, `db`, `dΓ` `[c, K]` (`q`, `k`, `b` the
    /// chunk's rows, `[c, K]`).
    pub(super) fn intra_backward<T: Scalar>(
        &self,
        it: &Intra<T>,
        [q, k, b]: [ArrayView2<T>; 3],
        daqk: &Array2<T>,
        dl: &Array2<T>,
        [dq, dk, db, dgam]: [&mut Array2<T>; 4],
    ) {
        let e = |x: T| self.policy.exp(x);
        let (c, kd, g) = (it.len(), k.ncols(), &it.g_cumsum);
        for r in 0..c {
            for s in 0..=r {
                let (a_qk, a_l) = (daqk[[r, s]], if s < r { dl[[r, s]] } else { T::zero() });
                for d in 0..kd {
                    let ed = e(g[[r, d]] - g[[s, d]]);
                    let ks = k[[s, d]] * ed;
                    let t_qk = a_qk * q[[r, d]] * ks;
                    let t_l = a_l * b[[r, d]] * k[[r, d]] * ks;
                    dq[[r, d]] += a_qk * ks;
                    dk[[s, d]] += (a_qk * q[[r, d]] + a_l * b[[r, d]] * k[[r, d]]) * ed;
                    dk[[r, d]] += a_l * b[[r, d]] * ks;
                    db[[r, d]] += a_l * k[[r, d]] * ks;
                    dgam[[r, d]] += t_qk + t_l;
                    dgam[[s, d]] -= t_qk + t_l;
                }
            }
        }
    }
}
