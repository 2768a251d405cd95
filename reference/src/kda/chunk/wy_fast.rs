//! The WY representation, FLA's `kda/wy_fast.py`: forward
//! (`recompute_w_u_fwd`) `w = Akk (exp(Γ) ⊙ K)`, `u = Akk V` and the gated
//! `qg`, `kg` of one chunk from its stored inverse; backward
//! (`prepare_wy_repr_bwd`) what `dw`, `du` send to `Akk`, `k`, `v`, `β` and
//! through `(I + L)^{-1}` to `L`.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis};

use super::chunk_intra::Intra;
use super::decays::Decays;
use super::Chunk;
use crate::fast::fused;
use crate::fast::tri;
use crate::precision::Stage;
use crate::scalar::Scalar;

/// What one chunk's WY backward sends on, rows the chunk's tokens.
pub(super) struct WyGrads<T> {
    /// `exp(Γ) ⊙ K` as the backward's operand, `[c, K]`.
    pub kd: Array2<T>,
    /// `∂/∂(exp(Γ) ⊙ K) = Akkᵀ dw`, `[c, K]`.
    pub dkd: Array2<T>,
    /// `∂/∂V = Akkᵀ du`, `[c, V]`.
    pub dv: Array2<T>,
    /// `∂/∂β` (through `Akk = N Diag(β)` and `L = Diag(β) p`), `[c]`.
    pub dbeta: Array1<T>,
    /// `∂/∂p` (`p` the β-free `L`, strictly lower), `[c, c]`.
    pub dp: Array2<T>,
    /// `∂/∂Akk`, its lower triangle with the diagonal, zeros above, `[c, c]`.
    pub dakk: Array2<T>,
}

impl Chunk {
    /// FLA's `recompute_w_u_fwd` for one chunk (`q`, `k` `[c, K]`, `v`
    /// `[c, V]`, `β` `[c]`; `n_inv = (I + L)^{-1}` and `akk = n_inv Diag(β)`
    /// `[c, c]`): `[w, u, qg, kg]` = `Akk (exp(Γ) ⊙ K)` `[c, K]`, `Akk V`
    /// `[c, V]`, `Q ⊙ exp(Γ)` and `K ⊙ exp(Γ_last − Γ)` `[c, K]`, each
    /// rounded to its stage.
    pub(super) fn recompute_w_u<T: Scalar>(
        &self,
        decays: &Decays<T>,
        (n_inv, akk): (&Array2<T>, &Array2<T>),
        beta: ArrayView1<T>,
        [q, k, v]: [ArrayView2<T>; 3],
    ) -> [Array2<T>; 4] {
        let [eg, tl] = decays.exps();
        let [mut qg, mut kg] = fused::products([(q, eg.view()), (k, tl.view())]);
        let (mut w, mut u) = if [Stage::W, Stage::U, Stage::KBeta]
            .into_iter()
            .any(|s| self.policy.storage(s).is_some())
        {
            // FLA (`recompute_w_u_fwd`) multiplies the stored inverse by
            // `(β k ⊙ 2^g).to(bf16)` and `(β v).to(bf16)`: the operands are
            // rounded like the stage they form, `β k` once more before
            // the decay when β is bf16 (`Stage::KBeta`).
            let bcol = beta.insert_axis(Axis(1));
            let mut kb = &k * &bcol;
            self.policy.round(Stage::KBeta, &mut kb);
            kb *= &eg;
            let mut vb = &v * &bcol;
            self.policy.round(Stage::W, &mut kb);
            self.policy.round(Stage::U, &mut vb);
            (
                tri::lower_dot(n_inv.view(), kb.view()),
                tri::lower_dot(n_inv.view(), vb.view()),
            )
        } else {
            (
                tri::lower_dot(
                    akk.view(),
                    fused::zip_map(eg.view(), k, |e, k| e * k).view(),
                ),
                tri::lower_dot(akk.view(), v),
            )
        };
        self.policy.round(Stage::W, &mut w);
        self.policy.round(Stage::U, &mut u);
        self.policy.round(Stage::Gated, &mut qg);
        self.policy.round(Stage::Gated, &mut kg);
        [w, u, qg, kg]
    }

    /// FLA's `prepare_wy_repr_bwd` for chunk `ch`: with `w = Akk (e^Γ ⊙ K)`,
    /// `u = Akk V`, `Akk = N Diag(β)`, `N = (I + L)^{-1}`, `L = Diag(β) p`,
    /// what `dw` `[c, K]` (as the backward's operand) and `du` `[c, V]`
    /// send on; `eg = exp(Γ)` and `k` `[c, K]`, `v` `[c, V]`, `β` `[c]` the
    /// chunk's rows.
    pub(super) fn prepare_wy_repr_bwd<T: Scalar>(
        &self,
        ch: &Intra<T>,
        [eg, k, v]: [ArrayView2<T>; 3],
        beta: ArrayView1<T>,
        dw: ArrayView2<T>,
        du: ArrayView2<T>,
    ) -> WyGrads<T> {
        let kd = self.operand(fused::zip_map(eg, k, |e, k| e * k));
        // Only the lower triangle of dAkk reaches an input (Akk is lower triangular).
        let mut dakk = tri::dot_t_lower(dw, kd.view(), false);
        tri::dot_t_lower_add(du, v, false, dakk.view_mut());
        tri::mask_lower(&mut dakk, true);
        let dkd = tri::lower_t_dot(ch.akk.view(), dw);
        let dv = tri::lower_t_dot(ch.akk.view(), du);
        let beta_v = beta.to_vec();
        let mut dbeta: Array1<T> =
            fused::zip_map(dakk.view(), ch.n_inv.view(), |a, n| a * n).sum_axis(Axis(0));
        let dn = self.operand(fused::scale_columns(&dakk, &beta_v));
        // FLA casts the masked product to the operand dtype between the two
        // multiplications by the stored inverse.
        let mut dlow = -tri::dot_t_lower(
            self.operand(tri::lower_t_dot(ch.n_inv.view(), dn.view()))
                .view(),
            ch.n_inv.view(),
            true,
        );
        tri::mask_lower(&mut dlow, false);
        dbeta += &fused::zip_map(dlow.view(), ch.p.view(), |a, p| a * p).sum_axis(Axis(1));
        let dp = fused::scale_rows(dlow.view(), &beta_v);
        WyGrads {
            kd,
            dkd,
            dv,
            dbeta,
            dp,
            dakk,
        }
    }
}
