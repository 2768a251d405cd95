//! Intra-card CP (inference prefill, forward only): one device splits long
//! sequences into sub-sequences, pre-processes each, merges and recomputes —
//! the CP algorithm with cut points inside long sequences. The split rule is
//! FLA's (fla-core 0.6, `fla/ops/common/intracard_cp.py`).

use super::plan::PlanSpec;
use crate::error::{Error, Result};

/// FLA `compute_subseq_len(seq_len, num_sms, num_heads, chunk_size)`.
pub fn compute_subseq_len(
    seq_len: usize,
    num_sms: usize,
    num_heads: usize,
    chunk_size: usize,
) -> usize {
    let seq_chunks = seq_len.div_ceil(chunk_size);
    if seq_chunks < 8 {
        return seq_len;
    }
    // Each sub-sequence feeds 2·num_heads blocks; aim to fill the SMs, at least 4 ways.
    const NUM_V_BLOCKS: usize = 2;
    const MIN_SUBSEQ_CHUNKS: usize = 128;
    let target_splits = 4.max(num_sms / (NUM_V_BLOCKS * num_heads.max(1)));
    let subseq_chunks = seq_chunks.div_ceil(target_splits).max(MIN_SUBSEQ_CHUNKS);
    subseq_chunks.saturating_mul(chunk_size)
}

/// Parameters of the split rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntraParams {
    /// Streaming multiprocessors of the device (H100: 132).
    pub num_sms: usize,
    /// FLA passes the value-head count HV.
    pub num_heads: usize,
    pub chunk_size: usize,
    pub max_splits: usize,
    /// Use this sub-sequence length instead of `compute_subseq_len` of the longest sequence.
    pub subseq_len: Option<usize>,
}

impl Default for IntraParams {
    /// An H100 (132 SMs), FLA's defaults (`max_splits = 32`, chunk 64).
    fn default() -> Self {
        IntraParams {
            num_sms: 132,
            num_heads: 1,
            chunk_size: 64,
            max_splits: 32,
            subseq_len: None,
        }
    }
}

/// The split points (FLA `prepare_subseq_cu_seqlens`): a sequence of at least
/// `3·subseq_len` tokens becomes `min(max_splits, ⌈chunks / subseq_chunks⌉)`
/// pieces of `⌈chunks / pieces⌉·chunk_size` tokens. Returns the interior cut
/// points (global token positions); empty when nothing is split. When
/// `max_splits` caps the count, FLA's last piece can be empty (a boundary
/// clamped to the sequence end); it holds no tokens, so it is no cut here.
pub fn split_points(cu_seqlens: &[i64], p: &IntraParams) -> Result<Vec<usize>> {
    if p.chunk_size == 0 || p.max_splits == 0 {
        return Err(Error::option(
            "intra-card",
            "chunk_size and max_splits must be positive",
        ));
    }
    let lens = cu_seqlens.windows(2).map(|w| (w[1] - w[0]) as usize);
    let longest = lens.clone().max().unwrap_or(0);
    let subseq_len = p
        .subseq_len
        .unwrap_or_else(|| compute_subseq_len(longest, p.num_sms, p.num_heads, p.chunk_size));
    if subseq_len == 0 {
        return Err(Error::option("subseq_len", "must be positive"));
    }
    let subseq_chunks = subseq_len.div_ceil(p.chunk_size);
    let mut cuts = vec![];
    for w in cu_seqlens.windows(2) {
        let (start, end) = (w[0] as usize, w[1] as usize);
        let len = end - start;
        // `3·subseq_len` may exceed usize for a huge explicit subseq_len.
        if subseq_len.checked_mul(3).is_none_or(|min| len < min) {
            continue;
        }
        let chunks = len.div_ceil(p.chunk_size);
        let pieces = p.max_splits.min(chunks.div_ceil(subseq_chunks));
        let piece_len = chunks.div_ceil(pieces) * p.chunk_size;
        cuts.extend(
            (1..pieces)
                .map(|j| start + j * piece_len)
                .filter(|&c| c < end),
        );
    }
    Ok(cuts)
}

/// The CP plan of intra-card splitting (cuts only inside long sequences).
pub fn plan_spec(cu_seqlens: &[i64], p: &IntraParams) -> Result<PlanSpec> {
    Ok(PlanSpec::Cuts(split_points(cu_seqlens, p)?))
}
