//! Partition plans: how a packed batch of T tokens is cut into rank slices,
//! and each rank's metadata exactly as FLA's `FLACPContext` has it.

use crate::error::{Error, Result};
use crate::varlen::{validate_cu_seqlens, Segment};

/// One rank's view of the plan (FLA `FLACPContext` fields plus the pieces).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankMeta {
    pub rank: usize,
    /// Global token range `[start, end)`.
    pub start: usize,
    pub end: usize,
    /// Local `cu_seqlens`: global boundaries clamped to the slice, relative
    /// to `start`, duplicates removed (FLA's rule).
    pub cu_seqlens: Vec<i64>,
    /// Earlier ranks holding the head of this rank's first sequence.
    pub pre_num_ranks: usize,
    /// Later ranks holding the tail of this rank's last sequence.
    pub post_num_ranks: usize,
    pub is_first_rank: bool,
    pub is_last_rank: bool,
    /// The non-empty pieces of global sequences on this rank, in order
    /// (global token coordinates; `seq` is the global sequence index).
    pub pieces: Vec<Segment>,
}

impl RankMeta {
    /// The first piece continues a sequence from the previous rank.
    pub fn continues(&self) -> bool {
        self.pre_num_ranks > 0
    }

    /// The last piece goes on into the next rank.
    pub fn continued(&self) -> bool {
        self.post_num_ranks > 0
    }
}

/// A validated partition of `[0, T)` into ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub t: usize,
    /// Global `cu_seqlens` (`[0, T]` for one unpacked sequence).
    pub cu_seqlens: Vec<i64>,
    /// `[0, c_1, …, c_{R−1}, T]`.
    pub bounds: Vec<usize>,
    pub ranks: Vec<RankMeta>,
}

impl Plan {
    /// FLA's equal split: `world` ranks of `T / world` tokens.
    pub fn equal(cu_seqlens: &[i64], t: usize, world: usize) -> Result<Plan> {
        if world == 0 {
            return Err(Error::Partition("world size must be at least 1".into()));
        }
        if !t.is_multiple_of(world) {
            return Err(Error::Partition(format!(
                "FLA's equal split needs T divisible by the world size: T = {t}, world = {world} (give explicit cuts instead)"
            )));
        }
        let cuts: Vec<usize> = (1..world).map(|r| r * t / world).collect();
        Plan::from_cuts(cu_seqlens, t, &cuts)
    }

    /// Arbitrary interior cut points `0 < c_1 < … < c_{R−1} < T`.
    pub fn from_cuts(cu_seqlens: &[i64], t: usize, cuts: &[usize]) -> Result<Plan> {
        validate_cu_seqlens(cu_seqlens, t)?;
        if t == 0 {
            return Err(Error::Partition("cannot partition T = 0 tokens".into()));
        }
        if let Some(&c) = cuts.iter().find(|&&c| c == 0 || c >= t) {
            return Err(Error::Partition(format!(
                "cut {c} is out of range: interior cuts must lie in 1..{t} (0 and T = {t} are implied)"
            )));
        }
        if let Some(w) = cuts.windows(2).find(|w| w[1] <= w[0]) {
            return Err(Error::Partition(format!(
                "cuts must be strictly increasing (an empty rank is not allowed): {} then {} in {cuts:?}",
                w[0], w[1]
            )));
        }
        let bounds: Vec<usize> = std::iter::once(0)
            .chain(cuts.iter().copied())
            .chain(std::iter::once(t))
            .collect();
        let seqs: Vec<(usize, usize)> = cu_seqlens
            .windows(2)
            .map(|w| (w[0] as usize, w[1] as usize))
            .collect();
        let rank_of = |tok: usize| {
            bounds
                .windows(2)
                .position(|w| w[0] <= tok && tok < w[1])
                .expect("token in range")
        };
        let world = bounds.len() - 1;
        let ranks = (0..world)
            .map(|r| {
                let (start, end) = (bounds[r], bounds[r + 1]);
                let pieces: Vec<Segment> = seqs
                    .iter()
                    .enumerate()
                    .filter_map(|(n, &(a, b))| {
                        let (s, e) = (a.max(start), b.min(end));
                        (s < e).then_some(Segment {
                            seq: n,
                            batch: 0,
                            start: s,
                            end: e,
                        })
                    })
                    .collect();
                let first = pieces.first().expect("a rank has at least one token");
                let last = pieces.last().expect("a rank has at least one token");
                let (head_start, tail_end) = (seqs[first.seq].0, seqs[last.seq].1);
                let mut cu: Vec<i64> = std::iter::once(start)
                    .chain(cu_seqlens.iter().map(|&c| (c as usize).clamp(start, end)))
                    .chain(std::iter::once(end))
                    .map(|c| (c - start) as i64)
                    .collect();
                cu.dedup();
                RankMeta {
                    rank: r,
                    start,
                    end,
                    cu_seqlens: cu,
                    pre_num_ranks: if head_start < start {
                        r - rank_of(head_start)
                    } else {
                        0
                    },
                    post_num_ranks: if tail_end > end {
                        rank_of(tail_end - 1) - r
                    } else {
                        0
                    },
                    is_first_rank: r == 0,
                    is_last_rank: r + 1 == world,
                    pieces,
                }
            })
            .collect();
        Ok(Plan {
            t,
            cu_seqlens: cu_seqlens.to_vec(),
            bounds,
            ranks,
        })
    }

    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// Interior cut points.
    pub fn cuts(&self) -> &[usize] {
        &self.bounds[1..self.bounds.len() - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fla_debug_guide_layout() {
        // lengths [400, 624], world 2: rank 1 continues sequence 0 from rank 0.
        let p = Plan::equal(&[0, 400, 1024], 1024, 2).unwrap();
        let (r0, r1) = (&p.ranks[0], &p.ranks[1]);
        assert_eq!(r0.cu_seqlens, vec![0, 400, 512]);
        assert_eq!(r1.cu_seqlens, vec![0, 512]);
        assert_eq!((r0.pre_num_ranks, r0.post_num_ranks), (0, 1));
        assert_eq!((r1.pre_num_ranks, r1.post_num_ranks), (1, 0));
        assert!(r0.is_first_rank && !r0.is_last_rank && r1.is_last_rank);
        assert_eq!(
            r1.pieces,
            vec![Segment {
                seq: 1,
                batch: 0,
                start: 512,
                end: 1024
            }]
        );
    }

    #[test]
    fn one_sequence_over_many_ranks_and_many_sequences_on_one_rank() {
        let p = Plan::from_cuts(&[0, 2, 3, 3, 40], 40, &[10, 20, 30]).unwrap();
        assert_eq!(p.ranks[0].cu_seqlens, vec![0, 2, 3, 10]);
        assert_eq!(p.ranks[0].pieces.len(), 3);
        assert_eq!(
            (p.ranks[0].pre_num_ranks, p.ranks[0].post_num_ranks),
            (0, 3)
        );
        assert_eq!(
            (p.ranks[2].pre_num_ranks, p.ranks[2].post_num_ranks),
            (2, 1)
        );
        assert_eq!(
            (p.ranks[3].pre_num_ranks, p.ranks[3].post_num_ranks),
            (3, 0)
        );
        // A cut exactly on a sequence boundary: nothing continues across it.
        let q = Plan::from_cuts(&[0, 5, 9], 9, &[5]).unwrap();
        assert_eq!(
            (q.ranks[0].post_num_ranks, q.ranks[1].pre_num_ranks),
            (0, 0)
        );
    }

    #[test]
    fn bad_plans_are_rejected() {
        let cu = [0i64, 5, 9];
        for (cuts, needle) in [
            (vec![0, 4], "out of range"),
            (vec![9], "out of range"),
            (vec![12], "out of range"),
            (vec![5, 5], "strictly increasing"),
            (vec![6, 3], "strictly increasing"),
        ] {
            let e = Plan::from_cuts(&cu, 9, &cuts).unwrap_err();
            assert!(e.to_string().contains(needle), "{cuts:?}: {e}");
        }
        assert!(Plan::equal(&cu, 9, 2)
            .unwrap_err()
            .to_string()
            .contains("divisible"));
        assert!(Plan::equal(&cu, 9, 0).is_err());
        assert!(matches!(
            Plan::from_cuts(&[0, 5], 9, &[3]),
            Err(Error::CuSeqlens(_))
        ));
    }
}

/// How to cut: FLA's equal split or explicit interior cuts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanSpec {
    World(usize),
    Cuts(Vec<usize>),
}

impl PlanSpec {
    /// The plan for a `[B, T, …]` input: CP works on one packed row (`B = 1`,
    /// with `cu_seqlens` or as one sequence).
    pub fn build(&self, b: usize, t: usize, cu_seqlens: Option<&[i64]>) -> Result<Plan> {
        if b != 1 {
            return Err(Error::Partition(format!(
                "context parallel splits one packed sequence batch: B must be 1 (varlen), got B = {b}"
            )));
        }
        let whole = [0, t as i64];
        let cu = cu_seqlens.unwrap_or(&whole);
        match self {
            PlanSpec::World(w) => Plan::equal(cu, t, *w),
            PlanSpec::Cuts(c) => Plan::from_cuts(cu, t, c),
        }
    }
}
