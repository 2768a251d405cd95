//! What the naive recurrent backward kernels (KDA, DPLR) share: states kept
//! at checkpoints every `⌈√L⌉` tokens, as the oracle does, each block's states
//! recomputed into a buffer with one value per token and column, and a
//! shared-memory table of per-warp sums over the state columns.

use cudarc::driver::{CudaSlice, LaunchArgs, PushKernelArg};
use deltaref::registry::MemoryModel;
use deltaref::varlen::Segment;

use crate::device::Gpu;
use crate::error::{GpuError, Result};

/// Default dynamic shared memory per block.
const SHARED_LIMIT: usize = 48 * 1024;

/// Buffers of one backward launch over `pieces × heads` states `[K, V]`.
pub(crate) struct BackwardScratch {
    /// Tokens between checkpoints, and checkpoints per state.
    pub block: i32,
    pub checkpoints: i32,
    /// `[pairs, checkpoints, K, V]`
    pub ckpt: CudaSlice<f32>,
    /// `[pairs, block, K, V]`: the state entering each token of a block.
    pub prev: CudaSlice<f32>,
    /// `[pairs, block, V]`: the kernel's per-token, per-column value.
    pub per_token: CudaSlice<f32>,
    /// Dynamic shared memory: `sums` rows of K per warp, plus `scalars` per warp.
    pub shared: usize,
}

impl BackwardScratch {
    pub fn new(
        gpu: &Gpu,
        op: &str,
        pieces: &[Segment],
        heads: usize,
        (k, v): (usize, usize),
        (sums, scalars): (usize, usize),
    ) -> Result<Self> {
        let warps = v.div_ceil(32);
        let shared = warps * (sums * k + scalars) * 4;
        if shared > SHARED_LIMIT {
            return Err(GpuError::Unsupported(format!(
                "naive {op} backward with K = {k}, V = {v} needs {shared} bytes of shared memory (limit {SHARED_LIMIT})"
            )));
        }
        let max_len = pieces.iter().map(Segment::len).max().unwrap_or(0);
        let block = MemoryModel::block_len(max_len);
        let checkpoints = max_len.div_ceil(block).max(1);
        let pairs = pieces.len() * heads;
        Ok(BackwardScratch {
            block: block as i32,
            checkpoints: checkpoints as i32,
            ckpt: gpu.zeros("backward checkpoints", pairs * checkpoints * k * v)?,
            prev: gpu.zeros("backward block states", pairs * block * k * v)?,
            per_token: gpu.zeros("backward per-token values", pairs * block * v)?,
            shared,
        })
    }

    /// Pushes the scratch arguments, which end both kernels' argument lists:
    /// `ckpt, prev, per_token, block, checkpoints`.
    pub fn push<'a>(&'a mut self, b: &mut LaunchArgs<'a>) {
        b.arg(&mut self.ckpt)
            .arg(&mut self.prev)
            .arg(&mut self.per_token)
            .arg(&self.block)
            .arg(&self.checkpoints);
    }
}
