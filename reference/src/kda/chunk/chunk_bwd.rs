//! The backward over a head's chunks, FLA's `chunk_kda_bwd`
//! (`kda/chunk_bwd.py`): the `dh` recurrence ([`super::chunk_delta_h`]),
//! then per chunk the fused pass of `chunk_kda_bwd_wy_dqkg_fused` (output,
//! state, WY ([`super::wy_fast`]) and gate gradients), the intra backward
//! ([`super::chunk_intra`]) and the reverse cumsum of `dΓ`.

use ndarray::{s, Array1, Array2, Array3, ArrayView2, Axis};

use super::chunk_intra::Intra;
use super::{qk_rows, Chunk, ChunkBackward, ChunkForward};
use crate::fast::columns::{backward_chunks, StateGradColumns};
use crate::fast::fused;
use crate::fast::gemm;
use crate::fast::tri;
use crate::fast::views;
use crate::kda::{KdaHead, KdaHeadGrads, KdaHeadGradsMut};
use crate::precision::Stage;
use crate::scalar::Scalar;

impl Chunk {
    /// `Σ_v h[k,v]·dh[k,v]` per key dim (`h`, `dh` `[K, V]`; returns `[K]`)
    /// as FLA's decay gradient forms it: products of the bf16 operands, and
    /// with a [`Stage::HdhSum`] storage each block of `BV` = 64 values
    /// reduced in it by 8 lanes of 8 values (`Dtype::lane_sum`; this
    /// order matched FLA's `dg` error best on an H100) before the blocks add
    /// in the compute scalar. A short last block is zero-padded, as the
    /// masked load is, which changes no sum.
    fn decay_sums<T: Scalar>(&self, h: ArrayView2<T>, dh: ArrayView2<T>) -> Array1<T> {
        const BV: usize = 64;
        const PER_LANE: usize = 8;
        let prods = self.operand(fused::zip_map(h, dh, |h, d| h * d));
        let Some(st) = self.policy.store(Stage::HdhSum) else {
            return prods.sum_axis(Axis(1));
        };
        prods
            .rows()
            .into_iter()
            .map(|row| {
                let row = row.to_vec();
                row.chunks(BV).fold(T::zero(), |acc, block| {
                    let mut padded = block.to_vec();
                    padded.resize(BV, T::zero());
                    acc + st.lane_sum(&padded, PER_LANE)
                })
            })
            .collect()
    }

    /// The backward pass with every intermediate.
    pub fn backward_intermediates<T: Scalar>(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> ChunkBackward<T> {
        self.backward_from(x, &self.forward_pass(x, h0, false), d_o, dht, true)
    }

    /// The backward pass given the forward's intermediates `fwd`; `dh`,
    /// `dv_new` and the per-chunk A-block gradients are kept only with
    /// `keep_blocks` (else left empty: only the intermediates need them).
    pub(super) fn backward_from<T: Scalar>(
        &self,
        x: &KdaHead<T>,
        fwd: &ChunkForward<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        keep_blocks: bool,
    ) -> ChunkBackward<T> {
        let mut grads = KdaHeadGrads::zeros(x.len(), x.k_dim(), x.v_dim());
        let (dh, dv_new, daqk, dakk) =
            self.backward_into(x, fwd, d_o, dht, keep_blocks, grads.view_mut());
        ChunkBackward {
            dh,
            dv_new,
            daqk,
            dakk,
            grads,
        }
    }

    /// [`Chunk::backward_from`] writing the gradients into `gr`, each
    /// chunk's rows as they are computed; returns `(dh, dv_new, dAqk,
    /// dAkk)`, all empty without `keep_blocks`.
    #[allow(clippy::type_complexity)]
    pub(super) fn backward_into<T: Scalar>(
        &self,
        x: &KdaHead<T>,
        fwd: &ChunkForward<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        keep_blocks: bool,
        mut gr: KdaHeadGradsMut<T>,
    ) -> (Array3<T>, Array2<T>, Vec<Array2<T>>, Vec<Array2<T>>) {
        let chunks: Vec<_> = fwd
            .intra
            .iter()
            .map(|ch| ch.start..ch.start + ch.len())
            .collect();
        let (mut daqk, mut dakk) = (vec![], vec![]);
        let StateGradColumns { dh, dv_new, dh0 } = backward_chunks(
            d_o,
            dht,
            &chunks,
            keep_blocks,
            |dh| self.policy.round(Stage::Dh, dh),
            |n, d_o, ds_used, ds| self.state_backward(&fwd.intra[n], d_o, ds_used, ds),
            |n, ds, dvn| self.chunk_backward(x, &fwd.intra[n], fwd, n, d_o, ds, dvn),
            |n, step: ChunkStep<T>| {
                let rows = s![chunks[n].clone(), ..];
                for (dst, src) in [
                    (&mut gr.dq, &step.dq),
                    (&mut gr.dk, &step.dk),
                    (&mut gr.dv, &step.dv),
                    (&mut gr.dg, &step.dg),
                ] {
                    views::copy_into(dst.slice_mut(rows), src.view());
                }
                gr.dbeta
                    .slice_mut(s![chunks[n].clone()])
                    .assign(&step.dbeta);
                if keep_blocks {
                    daqk.push(step.daqk);
                    dakk.push(step.dakk);
                }
            },
        );
        views::copy_into(gr.dh0.view_mut(), dh0.view());
        (dh, dv_new, daqk, dakk)
    }

    /// Backward through chunk `n` given the state gradient at its end as
    /// stored, `ds [K, V]`, and its rows of `dv_new`, `[c, V]` (from the
    /// state pass): the chunk's token gradients.
    #[allow(clippy::too_many_arguments)]
    fn chunk_backward<T: Scalar>(
        &self,
        x: &KdaHead<T>,
        ch: &Intra<T>,
        fwd: &ChunkForward<T>,
        n: usize,
        d_o: ArrayView2<T>,
        ds: ArrayView2<T>,
        dvn: ArrayView2<T>,
    ) -> ChunkStep<T> {
        let c = ch.len();
        let rows = s![ch.start..ch.start + c, ..];
        let h = fwd.h.index_axis(Axis(0), n);
        let vn = fwd.v_new.slice(rows);
        let dout = d_o.slice(rows);
        let decay_last = ch.decay_last();
        // Output: O = qg h + Aqk v_new; v_new = u − w h. One product gives
        // dqg = dO hᵀ and −dw = dv_new hᵀ.
        let dqg_dw = tri::stacked_dot(&[dout, dvn], h.t());
        let dqg = dqg_dw.slice(s![..c, ..]);
        let daqk = Self::d_aqk(dout, vn);
        // State pass: S' = Diag(e^Γlast) h + kgᵀ v_new, v_new = u − w h.
        let dkg = gemm::dot(vn.view(), ds.t());
        let mut dgamma_last: Array1<T> = self.decay_sums(h, ds) * decay_last;
        let dw = self.operand(dqg_dw.slice(s![c.., ..]).mapv(|x| -x));
        // WY: w = Akk (e^Γ ⊙ K), u = Akk V ([`Chunk::prepare_wy_repr_bwd`]).
        let [q, k] = qk_rows(x, ch.start..ch.start + c);
        let k = k.view();
        let [eg, tl] = ch.decays.exps();
        let beta = x.beta.slice(s![ch.start..ch.start + c]);
        let wy =
            self.prepare_wy_repr_bwd(ch, [eg.view(), k, x.v.slice(rows)], beta, dw.view(), dvn);
        let (kd_, dkd) = (&wy.kd, &wy.dkd);
        // With qg = Q ⊙ e^Γ, kg = K ⊙ e^(Γlast − Γ), kd = e^Γ ⊙ K, one pass:
        // dq = dqg e^Γ, dk = dkd e^Γ + dkg e^(Γlast − Γ),
        // dΓ = dkd kd + dqg qg − dkg kg and dΓlast += Σ_rows dkg kg.
        let q = q.view();
        let kd = x.k_dim();
        let (mut dq, mut dk, mut dgamma) = (
            crate::fast::stagger::zeros((c, kd)),
            crate::fast::stagger::zeros((c, kd)),
            crate::fast::stagger::zeros((c, kd)),
        );
        let mut dkg_kg_sum = vec![T::zero(); kd];
        let flats = [
            dqg.view(),
            eg.view(),
            dkd.view(),
            kd_.view(),
            ch.qg.view(),
            dkg.view(),
            tl.view(),
            ch.kg.view(),
        ]
        .map(fused::flat);
        let (dq_, dk_, dgamma_) = (
            fused::flat_mut(&mut dq),
            fused::flat_mut(&mut dk),
            fused::flat_mut(&mut dgamma),
        );
        let sum = &mut dkg_kg_sum[..kd];
        crate::fast::simd::dispatch(
            #[inline(always)]
            || {
                for r in 0..c {
                    // Slices of length `kd` exactly: no bounds checks in the
                    // loop, which then vectorises.
                    let [dqg_, eg_, dkd_, kdd_, qg_, dkg_, tl_, kg_] =
                        flats.each_ref().map(|x| &x[r * kd..][..kd]);
                    let (dq_, dk_, dgamma_) = (
                        &mut dq_[r * kd..][..kd],
                        &mut dk_[r * kd..][..kd],
                        &mut dgamma_[r * kd..][..kd],
                    );
                    for d in 0..kd {
                        let t = dkg_[d] * kg_[d];
                        dq_[d] = dqg_[d] * eg_[d];
                        dk_[d] = dkd_[d] * eg_[d] + dkg_[d] * tl_[d];
                        dgamma_[d] = dkd_[d] * kdd_[d] + dqg_[d] * qg_[d] - t;
                        sum[d] += t;
                    }
                }
            },
        );
        dgamma_last += &ndarray::aview1(&dkg_kg_sum);
        let k_col = self.k_beta_col(k, beta);
        self.intra_backward(
            ch,
            q,
            k,
            k_col.view(),
            &daqk,
            &wy.dp,
            &mut dq,
            &mut dk,
            &mut dgamma,
        );
        // Γlast is the last row of Γ; Γ_r = Σ_{i≤r} g_i ⇒ dg = reverse cumsum of dΓ.
        let mut last = dgamma.row_mut(c - 1);
        last += &dgamma_last;
        fused::reverse_cumsum_rows(&mut dgamma);
        ChunkStep {
            dq,
            dk,
            dv: wy.dv,
            dg: dgamma,
            dbeta: wy.dbeta,
            daqk,
            dakk: wy.dakk,
        }
    }
}

/// One chunk's token gradients (rows of `dq`, `dk`, `dv`, `dg`, `dbeta`)
/// and its A-block gradients, `[c, c]` each.
struct ChunkStep<T> {
    dq: Array2<T>,
    dk: Array2<T>,
    dv: Array2<T>,
    dg: Array2<T>,
    dbeta: Array1<T>,
    daqk: Array2<T>,
    dakk: Array2<T>,
}
