//! Sequence pieces as the kernels index them: token ranges over the `B·T`
//! flattened tokens, and for the chunked kernels the global chunk list.

use cudarc::driver::CudaSlice;
use deltaref::varlen::Segment;

use crate::device::Gpu;
use crate::error::Result;

/// `{start, end}` per piece, flattened over `[B, T]` (`t` tokens per row).
pub(crate) fn ranges(pieces: &[Segment], t: usize) -> Vec<i32> {
    pieces
        .iter()
        .flat_map(|s| {
            let base = s.batch * t;
            [(base + s.start) as i32, (base + s.end) as i32]
        })
        .collect()
}

/// Uploads [`ranges`].
pub(crate) fn upload_ranges(gpu: &Gpu, pieces: &[Segment], t: usize) -> Result<CudaSlice<i32>> {
    gpu.upload("piece ranges", &ranges(pieces, t))
}

/// The chunk list of `pieces`: `chunk[c] = {first token, length, piece}` and
/// `segc[s] = {first chunk, number of chunks}`.
pub(crate) struct Chunks {
    pub chunk: Vec<i32>,
    pub segc: Vec<i32>,
}

impl Chunks {
    pub fn new(pieces: &[Segment], t: usize, size: usize) -> Chunks {
        let (mut chunk, mut segc) = (vec![], vec![]);
        for (s, p) in pieces.iter().enumerate() {
            let first = chunk.len() / 3;
            let base = p.batch * t;
            for start in (p.start..p.end).step_by(size) {
                let len = size.min(p.end - start);
                chunk.extend([(base + start) as i32, len as i32, s as i32]);
            }
            segc.extend([first as i32, (chunk.len() / 3 - first) as i32]);
        }
        Chunks { chunk, segc }
    }

    pub fn count(&self) -> usize {
        self.chunk.len() / 3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(seq: usize, batch: usize, start: usize, end: usize) -> Segment {
        Segment {
            seq,
            batch,
            start,
            end,
        }
    }

    #[test]
    fn ranges_flatten_batch_rows() {
        let p = [seg(0, 0, 0, 5), seg(1, 1, 0, 5)];
        assert_eq!(ranges(&p, 5), vec![0, 5, 5, 10]);
    }

    #[test]
    fn chunks_split_each_piece_and_keep_short_tails() {
        // Pieces of 5, 0 and 3 tokens with chunk size 2.
        let p = [seg(0, 0, 0, 5), seg(1, 0, 5, 5), seg(2, 0, 5, 8)];
        let c = Chunks::new(&p, 8, 2);
        assert_eq!(c.chunk, vec![0, 2, 0, 2, 2, 0, 4, 1, 0, 5, 2, 2, 7, 1, 2]);
        assert_eq!(c.segc, vec![0, 3, 3, 0, 3, 2]);
        assert_eq!(c.count(), 5);
    }
}
