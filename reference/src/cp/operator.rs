//! One template for the operator-specific half of CP (KDA and DPLR differ
//! only in their types): a [`super::Local`] over the pre-processed tensors,
//! and forward/backward that assemble full tensors from the pieces.

/// `cp_operator!(module, LocalName, Engine, Inputs, Options, Outputs, Grads, HeadGrads)`.
macro_rules! cp_operator {
    ($m:ident, $Local:ident, $Engine:ident, $Inputs:ident, $Options:ident, $Outputs:ident, $Grads:ident, $HeadGrads:ident) => {
        use ndarray::{s, Array2, Array4, ArrayD, ArrayView2};

        use super::plan::PlanSpec;
        use super::{CpOptions, Local, RankDiag};
        use crate::error::Result;
        use crate::scalar::Scalar;
        use crate::tensor;
        use crate::varlen::Segment;

        /// One problem seen piece by piece.
        pub struct $Local<'a, T, E> {
            pub p: &'a crate::$m::Prepared<'a, T>,
            pub engine: &'a E,
            /// `[B, T, heads, V]`
            pub d_o: Option<Array4<T>>,
            /// `[N, heads, K, V]`
            pub dht: Option<Array4<T>>,
        }

        impl<T: Scalar, E: crate::$m::$Engine<T>> Local<T> for $Local<'_, T, E> {
            type Grads = crate::$m::$HeadGrads<T>;

            fn heads(&self) -> usize {
                self.p.dims.heads()
            }

            fn state_dims(&self) -> (usize, usize) {
                (self.p.dims.k, self.p.dims.v)
            }

            fn initial_state(&self, seq: usize, h: usize) -> Option<Array2<T>> {
                self.p
                    .h0
                    .as_ref()
                    .map(|a| a.slice(s![seq, h, .., ..]).to_owned())
            }

            fn dht(&self, seq: usize, h: usize) -> Option<Array2<T>> {
                self.dht
                    .as_ref()
                    .map(|a| a.slice(s![seq, h, .., ..]).to_owned())
            }

            fn forward(
                &self,
                seg: &Segment,
                h: usize,
                h0: ArrayView2<T>,
            ) -> (Array2<T>, Array2<T>) {
                self.engine.forward(&self.p.head(seg, h), h0)
            }

            fn backward(
                &self,
                seg: &Segment,
                h: usize,
                h0: ArrayView2<T>,
                dht: ArrayView2<T>,
            ) -> (crate::$m::$HeadGrads<T>, Array2<T>) {
                let d_o = self.d_o.as_ref().expect("backward needs do");
                let g = self.engine.backward(
                    &self.p.head(seg, h),
                    h0,
                    tensor::gather(d_o, seg, h).view(),
                    dht,
                );
                let dh0 = g.dh0.clone();
                (g, dh0)
            }

            fn transition(&self, seg: &Segment, h: usize) -> Array2<T> {
                self.engine.transition(&self.p.head(seg, h))
            }
        }

        /// CP forward: the same outputs as the non-CP forward, computed rank by rank.
        pub fn forward<T: Scalar, E: crate::$m::$Engine<T>>(
            engine: &E,
            x: &crate::$m::$Inputs<T>,
            opt: &crate::$m::$Options,
            plan: &PlanSpec,
            cp: &CpOptions,
        ) -> Result<(crate::$m::$Outputs<T>, Vec<RankDiag<T>>)> {
            let p = engine.stored(crate::$m::Prepared::new(x, opt)?);
            let d = p.dims;
            let plan = plan.build(d.b, d.t, x.cu_seqlens.as_deref())?;
            let local = $Local {
                p: &p,
                engine,
                d_o: None,
                dht: None,
            };
            let f = super::forward(&local, &plan, cp);
            let mut o = Array4::zeros((d.b, d.t, d.heads(), d.v));
            for (seg, h, oh) in &f.o {
                tensor::scatter(&mut o, seg, *h, oh.view());
            }
            // Sequences without tokens keep their initial state.
            let mut ht =
                p.h0.map(|h0| h0.to_owned())
                    .unwrap_or_else(|| Array4::zeros((d.n, d.heads(), d.k, d.v)));
            for (seq, h, st) in &f.final_states {
                ht.slice_mut(s![*seq, *h, .., ..]).assign(st);
            }
            Ok((
                crate::$m::$Outputs {
                    o: o.into_dyn(),
                    final_state: opt.output_final_state.then(|| ht.into_dyn()),
                },
                f.diags,
            ))
        }

        /// CP backward: the same gradients as the non-CP backward, computed rank by rank.
        pub fn backward<T: Scalar, E: crate::$m::$Engine<T>>(
            engine: &E,
            x: &crate::$m::$Inputs<T>,
            opt: &crate::$m::$Options,
            d_o: &ArrayD<T>,
            dht: Option<&ArrayD<T>>,
            plan: &PlanSpec,
            cp: &CpOptions,
        ) -> Result<(crate::$m::$Grads<T>, Vec<RankDiag<T>>)> {
            let p = engine.stored(crate::$m::Prepared::new(x, opt)?);
            let d = p.dims;
            crate::$m::validate_upstream(&d, d_o, dht)?;
            let plan = plan.build(d.b, d.t, x.cu_seqlens.as_deref())?;
            let local = $Local {
                p: &p,
                engine,
                d_o: Some(tensor::to4(d_o)),
                dht: dht.map(tensor::to4),
            };
            let b = super::backward(&local, &plan, cp);
            let pieces: Vec<_> = b.grads.iter().map(|(seg, h, g)| (*seg, *h, g)).collect();
            let mut pg = crate::$m::PreparedGrads::from_pieces(&d, &pieces);
            // A sequence without tokens passes its final-state gradient straight to h0.
            if let Some(dht) = &local.dht {
                pg.dh0.assign(dht);
            }
            for (seq, h, dh0) in &b.dh0 {
                pg.dh0.slice_mut(s![*seq, *h, .., ..]).assign(dh0);
            }
            Ok((pg.chain(x, opt, &p), b.diags))
        }
    };
}
