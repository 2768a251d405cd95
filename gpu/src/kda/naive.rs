//! The naive recurrent KDA kernels (`kda_naive.cu`) as a [`Recurrence`].

use cudarc::driver::{CudaSlice, PushKernelArg};
use deltaref::varlen::Segment;

use super::{Grads, Problem};
use crate::cp::Recurrence;
use crate::device::{arg_opt, grid, Gpu};
use crate::error::{GpuError, Result};
use crate::kernels::{Defines, KDA_NAIVE};
use crate::pieces::upload_ranges;

/// Default dynamic shared memory per block.
const SHARED_LIMIT: usize = 48 * 1024;

pub(crate) struct Naive<'a, 'g> {
    pub p: &'a Problem<'g>,
}

/// Checkpoint spacing of the backward: `⌈√L⌉` (at least 16), as the oracle.
pub(crate) fn block_len(max_len: usize) -> usize {
    ((max_len as f64).sqrt().ceil() as usize).max(16)
}

impl Naive<'_, '_> {
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
        let max_len = pieces.iter().map(Segment::len).max().unwrap_or(0);
        let bl = block_len(max_len);
        let nck = max_len.div_ceil(bl).max(1);
        let warps = d.v.div_ceil(32);
        let shared = (warps * 3 * d.k + warps) * 4;
        if shared > SHARED_LIMIT {
            return Err(GpuError::Unsupported(format!(
                "naive KDA backward with K = {}, V = {} needs {shared} bytes of shared memory (limit {SHARED_LIMIT})",
                d.k, d.v
            )));
        }
        let pairs = pieces.len() * d.hv;
        let mut ckpt = gpu.zeros::<f32>("backward checkpoints", pairs * nck * kv)?;
        let mut prev = gpu.zeros::<f32>("backward block states", pairs * bl * kv)?;
        let mut rbuf = gpu.zeros::<f32>("backward residuals", pairs * bl * d.v)?;
        let seg = upload_ranges(gpu, pieces, d.t)?;
        let f = gpu.function(&KDA_NAIVE, self.defines(), "kda_naive_bwd")?;
        let (h, hv, v, bl_, nck_) = (d.h as i32, d.hv as i32, d.v as i32, bl as i32, nck as i32);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&p.q)
            .arg(&p.k)
            .arg(&p.v)
            .arg(&p.g)
            .arg(&p.beta)
            .arg(&seg);
        arg_opt(&mut b, h0);
        b.arg(&p.d_o);
        arg_opt(&mut b, dht);
        b.arg(&mut g.dq)
            .arg(&mut g.dk)
            .arg(&mut g.dv)
            .arg(&mut g.dg)
            .arg(&mut g.dbeta)
            .arg(&mut dh0)
            .arg(&mut ckpt)
            .arg(&mut prev)
            .arg(&mut rbuf)
            .arg(&h)
            .arg(&hv)
            .arg(&v)
            .arg(&bl_)
            .arg(&nck_);
        gpu.launch(b, "kda_naive_bwd", grid(pieces.len(), d.hv, d.v, shared))?;
        Ok(dh0)
    }

    fn scratch_grads(&self) -> Result<Grads> {
        Grads::zeros(self.p)
    }
}
