//! FLA's safe-gate A stage for DPLR (`safe_gate=True`, or a `lower_bound`
//! that `gate_bound_is_safe` accepts): `chunk_dplr_fwd_A_kernel_intra_tensorcore`
//! forms a whole chunk's four A blocks at once through one anchor row,
//! `off = Γ[mid]` with `mid = valid_len // 2` of the same head, as tensor-core
//! products of fp32 operands:
//!
//! ```text
//! q_ops = (q·scale)·exp(Γ − off)     k_ops = k·exp(off − Γ)
//! a_ops = a·exp(Γx − off)            b_ops = b·exp(off − Γ)
//! Aqk = tril_incl(q_ops k_opsᵀ)      Aqb = tril_incl(q_ops b_opsᵀ)
//! Aak = tril_strict(a_ops k_opsᵀ)    Aab = tril_strict(a_ops b_opsᵀ)
//! ```
//!
//! `Aqk`, `Aqb` are stored in the token dtype, `Aab`, `Aak` in fp32 (the
//! non-safe kernel rounds those two to the token dtype first); the gated
//! tensors are rebuilt from the operands (`qg = q_ops·exp(off)`, `kg =
//! k_ops·exp(Γ_last − off)`, …). Nothing guards the exponents: a gate
//! outside what the anchor keeps in range overflows, as on the GPU. The
//! backward A stage (`chunk_dplr_bwd_kernel_intra_tensorcore`) goes
//! through the same anchor: the chunk's factors carry it.
//!
//! Under [`crate::precision::Policy::midpoint_stride_fault`] the anchor is
//! read as FLA #1085 read it: with a token stride of `K` instead of `H·K`.

use ndarray::{s, Array2, ArrayView2, Axis};

use super::{Chunk, Decays, Factors};
use crate::dplr::DplrHead;
use crate::fast::tri;
use crate::precision::Stage;
use crate::scalar::Scalar;

impl Chunk {
    /// The safe-gate A stage of the chunk at `start` (`c` rows) of head `x`
    /// (standard layout, `scale` applied): the four A blocks `(Aqk, Aqb,
    /// Aab, Aak)`, `[c, c]` each, masked and stored as FLA stores them, and
    /// the chunk's decays through the anchor, from Γ, Γx `[c, K]` and the
    /// chunk's `q` (as read), `k`, `a`, `b` `[c, K]`.
    pub(super) fn safe_gate_a_stage<T: Scalar>(
        &self,
        x: &DplrHead<T>,
        start: usize,
        g: &Array2<T>,
        gx: &Array2<T>,
        [q, k, a, b]: [ArrayView2<T>; 4],
    ) -> (Decays<T>, [Array2<T>; 4]) {
        let off = self.midpoint_offset(x, start, g);
        let f = self.anchored_factors(g, gx, &off);
        let e = |v: T| self.policy.exp(v);
        let last = g.row(g.nrows() - 1);
        let mid = (
            off.iter().map(|&o| e(o)).collect(),
            last.iter().zip(&off).map(|(&l, &o)| e(l - o)).collect(),
        );
        // The products' fp32 operands, as Triton's default input precision
        // reads them (tf32 under FLA's bf16 kernels).
        let operand = |x: ArrayView2<T>, f: &Array2<T>| {
            let mut o = crate::fast::fused::zip_map(x, f.view(), |x, f| x * f);
            self.policy.round(Stage::FwdDots, &mut o);
            o
        };
        let (q_ops, a_ops) = (operand(q, &f.ep), operand(a, &f.exp_));
        let (k_ops, b_ops) = (operand(k, &f.em), operand(b, &f.em));
        let [mut aqk, mut aak] =
            tri::dot_t_lower_each([q_ops.view(), a_ops.view()], k_ops.view(), false);
        let [mut aqb, mut aab] =
            tri::dot_t_lower_each([q_ops.view(), a_ops.view()], b_ops.view(), false);
        tri::mask_lower(&mut aqk, true);
        tri::mask_lower(&mut aqb, true);
        tri::mask_lower(&mut aab, false);
        tri::mask_lower(&mut aak, false);
        // `Aqk`, `Aqb` go to the token dtype; `Aab`, `Aak` are stored
        // straight into their fp32 tensors (the compute scalar here).
        let (aqk, aqb) = (
            self.as_stored(Stage::Aqk, aqk),
            self.as_stored(Stage::Aqk, aqb),
        );
        (Decays::Mid { f, mid }, [aqk, aqb, aab, aak])
    }

    /// `exp(Γ − off)`, `exp(Γx − off)`, `exp(off − Γ)`, `[c, K]` each, each
    /// its own exponential (FLA's `exp_gi`, `exp_ge`, `inv_exp_gi`), unguarded.
    fn anchored_factors<T: Scalar>(&self, g: &Array2<T>, gx: &Array2<T>, off: &[T]) -> Factors<T> {
        let shifted = |x: &Array2<T>, sign: T| {
            let mut o = x.clone();
            for mut row in o.axis_iter_mut(Axis(0)) {
                for (v, &m) in row.iter_mut().zip(off) {
                    *v = self.policy.exp(sign * (*v - m));
                }
            }
            o
        };
        Factors {
            ep: shifted(g, T::one()),
            exp_: shifted(gx, T::one()),
            em: shifted(g, -T::one()),
        }
    }

    /// The anchor `off [K]` of the chunk at `start` (`c` rows, Γ `g`): the
    /// chunk's own Γ at row `mid = c / 2` (FLA 0.6.0), or under the #1085
    /// fault what FLA's `(i_t·BT + mid)·K` read reached: row `i_h + i_t·BT +
    /// mid` of the `[T·H, K]` flattened gate cumsum, i.e. token `(i_h +
    /// start + mid) / H`, head `(i_h + start + mid) % H` of the same
    /// sequence, its in-chunk cumsum (for H = 1, the right row). A head
    /// without its batch's gates ([`DplrHead::heads_gk`]) reads as H = 1.
    fn midpoint_offset<T: Scalar>(&self, x: &DplrHead<T>, start: usize, g: &Array2<T>) -> Vec<T> {
        let mid = g.nrows() / 2;
        let own = || g.row(mid).to_vec();
        let Some(heads) = x
            .heads_gk
            .as_ref()
            .filter(|_| self.policy.midpoint_stride_fault)
        else {
            return own();
        };
        let h = heads.gk.shape()[1];
        let row = heads.head + start + mid;
        let (token, head) = (row / h, row % h);
        let chunk_start = token - token % self.chunk_size;
        let mut cum = heads.gk.slice(s![chunk_start..=token, head, ..]).to_owned();
        self.policy.cumsum_rows(&mut cum);
        cum.row(cum.nrows() - 1).to_vec()
    }
}
