//! The naive recurrent KDA kernels (`kda_naive.cu`) as a `Recurrence`
//! (`crate::cp`).

use cudarc::driver::{CudaSlice, LaunchArgs, PushKernelArg};
use deltaref::varlen::Segment;

use super::{Grads, Problem};
use crate::cp::Recurrence;
use crate::device::{arg_opt, grid, Gpu};
use crate::error::Result;
use crate::kernels::{Defines, KDA_NAIVE};
use crate::pieces::upload_ranges;
use crate::recurrent::BackwardScratch;

pub(crate) struct Naive<'a, 'g> {
    pub p: &'a Problem<'g>,
}

impl<'a> Naive<'a, '_> {
    /// Pushes the pre-processed inputs and the piece ranges.
    fn push_inputs(&self, b: &mut LaunchArgs<'a>, seg: &'a CudaSlice<i32>) {
        let p = self.p;
        b.arg(&p.q)
            .arg(&p.k)
            .arg(&p.v)
            .arg(&p.g)
            .arg(&p.beta)
            .arg(seg);
    }

    /// The recurrence reads the pre-processed f32 tensors.
    fn defines(&self) -> Defines {
        Defines {
            in_bf16: false,
            kd: self.p.d.k,
            chunk: 0,
        }
    }

    /// The forward kernel over `pieces` with `ncol` columns (`V`, or `K` for M).
    fn run_fwd(
        &self,
        pieces: &[Segment],
        h0: Option<&CudaSlice<f32>>,
        o: Option<&mut CudaSlice<f32>>,
        transition: bool,
    ) -> Result<CudaSlice<f32>> {
        let (gpu, d) = (self.p.gpu, self.p.d);
        let ncol = if transition { d.k } else { d.v };
        let mut ht = gpu.zeros::<f32>("final states", pieces.len() * d.hv * d.k * ncol)?;
        if pieces.is_empty() {
            return Ok(ht);
        }
        let seg = upload_ranges(gpu, pieces, d.t)?;
        let f = gpu.function(&KDA_NAIVE, self.defines(), "kda_naive_fwd")?;
        let (h, hv, nc, tr) = (d.h as i32, d.hv as i32, ncol as i32, i32::from(transition));
        let p = self.p;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&p.q)
            .arg(&p.k)
            .arg(&p.v)
            .arg(&p.g)
            .arg(&p.beta)
            .arg(&seg);
        arg_opt(&mut b, h0);
        arg_opt(&mut b, o.map(|o| &*o));
        b.arg(&mut ht).arg(&h).arg(&hv).arg(&nc).arg(&tr);
        gpu.launch(b, "kda_naive_fwd", grid(pieces.len(), d.hv, ncol, 0))?;
        Ok(ht)
    }
}

impl Recurrence for Naive<'_, '_> {
    type Grads = Grads;

    fn gpu(&self) -> &Gpu {
        self.p.gpu
    }

    fn shape(&self) -> (usize, usize, usize) {
        (self.p.d.hv, self.p.d.k, self.p.d.v)
    }

    fn forward(
        &self,
        pieces: &[Segment],
        h0: Option<&CudaSlice<f32>>,
        o: Option<&mut CudaSlice<f32>>,
    ) -> Result<CudaSlice<f32>> {
        self.run_fwd(pieces, h0, o, false)
    }

    fn transition(&self, pieces: &[Segment]) -> Result<CudaSlice<f32>> {
        self.run_fwd(pieces, None, None, true)
    }

    fn backward(
        &self,
        pieces: &[Segment],
        h0: Option<&CudaSlice<f32>>,
        dht: Option<&CudaSlice<f32>>,
        g: &mut Grads,
    ) -> Result<CudaSlice<f32>> {
        let (gpu, d, p) = (self.p.gpu, self.p.d, self.p);
        let kv = d.k * d.v;
        let mut dh0 = gpu.zeros::<f32>("dh0", pieces.len() * d.hv * kv)?;
        if pieces.is_empty() {
            return Ok(dh0);
        }
        let mut sc = BackwardScratch::new(gpu, "KDA", pieces, d.hv, (d.k, d.v), (3, 1))?;
        let seg = upload_ranges(gpu, pieces, d.t)?;
        let f = gpu.function(&KDA_NAIVE, self.defines(), "kda_naive_bwd")?;
        let (h, hv, v) = (d.h as i32, d.hv as i32, d.v as i32);
        let mut b = gpu.stream().launch_builder(&f);
        self.push_inputs(&mut b, &seg);
        arg_opt(&mut b, h0);
        b.arg(&p.d_o);
        arg_opt(&mut b, dht);
        b.arg(&mut g.dq)
            .arg(&mut g.dk)
            .arg(&mut g.dv)
            .arg(&mut g.dg)
            .arg(&mut g.dbeta)
            .arg(&mut dh0)
            .arg(&h)
            .arg(&hv)
            .arg(&v);
        let shared = sc.shared;
        sc.push(&mut b);
        gpu.launch(b, "kda_naive_bwd", grid(pieces.len(), d.hv, d.v, shared))?;
        Ok(dh0)
    }

    fn scratch_grads(&self) -> Result<Grads> {
        Grads::zeros(self.p)
    }
}
