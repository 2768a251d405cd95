//! Sequences of a batch: `B` independent rows, or `B == 1` with sequences
//! packed along T by `cu_seqlens` (FlashAttention/FLA convention).

use crate::error::{Error, Result};

/// One sequence, or one contiguous piece of one (CP), inside a `[B, T, …]` tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index of the sequence (row of `initial_state` / `final_state`).
    pub seq: usize,
    /// Batch row holding it (always 0 in varlen mode).
    pub batch: usize,
    /// First token (inclusive) along T.
    pub start: usize,
    /// Last token (exclusive) along T.
    pub end: usize,
}

impl Segment {
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// Validates `cu_seqlens` against a `[B, T, …]` input and lists its sequences.
///
/// Without `cu_seqlens` there is one sequence per batch row (`N = B`); with it,
/// `B` must be 1 and `cu_seqlens` must be `[0, …, T]`, non-decreasing
/// (zero-length sequences are legal).
pub fn sequences(b: usize, t: usize, cu_seqlens: Option<&[i64]>) -> Result<Vec<Segment>> {
    let Some(cu) = cu_seqlens else {
        return Ok((0..b)
            .map(|i| Segment {
                seq: i,
                batch: i,
                start: 0,
                end: t,
            })
            .collect());
    };
    if b != 1 {
        return Err(Error::CuSeqlens(format!(
            "varlen mode needs batch size B = 1 (sequences packed along T), got B = {b}"
        )));
    }
    validate_cu_seqlens(cu, t)?;
    Ok(cu
        .windows(2)
        .enumerate()
        .map(|(n, w)| Segment {
            seq: n,
            batch: 0,
            start: w[0] as usize,
            end: w[1] as usize,
        })
        .collect())
}

/// `cu_seqlens` must have N + 1 ≥ 2 entries, start at 0, never decrease and end at `t`.
pub(crate) fn validate_cu_seqlens(cu: &[i64], t: usize) -> Result<()> {
    if cu.len() < 2 {
        return Err(Error::CuSeqlens(format!(
            "needs at least 2 entries [0, …, T], got {cu:?}"
        )));
    }
    if cu[0] != 0 {
        return Err(Error::CuSeqlens(format!("must start at 0, got {cu:?}")));
    }
    if let Some(i) = (1..cu.len()).find(|&i| cu[i] < cu[i - 1]) {
        return Err(Error::CuSeqlens(format!(
            "must be non-decreasing, but entry {i} ({}) < entry {} ({})",
            cu[i],
            i - 1,
            cu[i - 1]
        )));
    }
    let last = *cu.last().expect("length checked");
    if last != t as i64 {
        return Err(Error::CuSeqlens(format!(
            "must end at T = {t} (the packed length), got {last}"
        )));
    }
    Ok(())
}
