//! Partition plans: how a packed batch of T tokens is cut into chain
//! intervals, which device rank holds each, and each interval's metadata
//! exactly as FLA's `FLACPContext` has it.
//!
//! The state chain always runs over intervals in global token order. In the
//! contiguous layout interval `i` is rank `i`'s whole slice. In FLA's zigzag
//! layout (`build_cp_context(..., layout='zigzag')`) the T tokens are cut into
//! `2W` equal intervals and rank `r` holds intervals `r` and `2W−1−r`, its
//! local buffer being `[front; back]`; each part is pre-processed and merged
//! on its own, with `pre_num_ranks` counting earlier *intervals* (FLA's
//! `pre_num_ranks_by_part`). So zigzag CP is the contiguous algorithm over
//! `2W` intervals, with two intervals per device.

use crate::error::{Error, Result};
use crate::varlen::{validate_cu_seqlens, Segment};

/// How chain intervals are laid out over device ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// Rank `r` holds interval `r` (FLA's default).
    #[default]
    Contiguous,
    /// `2W` equal intervals; rank `r` holds intervals `r` and `2W−1−r`.
    Zigzag,
}

impl Layout {
    /// FLA's name (`layout=` of `build_cp_context`).
    pub fn name(self) -> &'static str {
        match self {
            Layout::Contiguous => "contiguous",
            Layout::Zigzag => "zigzag",
        }
    }

    /// Parses FLA's name.
    pub fn parse(s: &str) -> Result<Layout> {
        match s {
            "contiguous" => Ok(Layout::Contiguous),
            "zigzag" => Ok(Layout::Zigzag),
            other => Err(Error::Partition(format!(
                "unknown CP layout `{other}` (contiguous, zigzag)"
            ))),
        }
    }
}

/// One chain interval's view of the plan (FLA `FLACPContext` fields, per
/// part under zigzag, plus the pieces).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankMeta {
    /// Position in the state chain (FLA's `chain_pos`): the rank in a
    /// contiguous layout, the interval (slot) in a zigzag one.
    pub rank: usize,
    /// The device rank that holds this interval (`== rank` when contiguous).
    pub device: usize,
    /// Zigzag: this interval is the back half of its device's local buffer.
    pub back: bool,
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
    /// This rank is the first of its first sequence's chain (FLA: `rank ==
    /// first_rank_of_first_seq`, i.e. `pre_num_ranks == 0`): it receives no state.
    /// Not "rank 0": a rank starting on a sequence boundary is also first.
    pub is_first_rank: bool,
    /// This rank is the last of its last sequence's chain (`post_num_ranks ==
    /// 0`): it hands no state on. Not "rank R−1".
    pub is_last_rank: bool,
    /// Tokens of the first sequence held by earlier ranks (FLA
    /// `pre_num_conv_tokens`: `rank_start − first_seq_global_start`).
    pub pre_num_conv_tokens: usize,
    /// The non-empty pieces of global sequences on this rank, in order
    /// (global token coordinates; `seq` is the global sequence index).
    pub pieces: Vec<Segment>,
}

impl RankMeta {
    /// `"r"` in a contiguous layout, `"r.front"` / `"r.back"` in a zigzag one.
    pub fn label(&self, layout: Layout) -> String {
        match (layout, self.back) {
            (Layout::Contiguous, _) => self.rank.to_string(),
            (Layout::Zigzag, false) => format!("{}.front", self.device),
            (Layout::Zigzag, true) => format!("{}.back", self.device),
        }
    }

    /// The first piece continues a sequence from the previous rank.
    pub fn continues(&self) -> bool {
        self.pre_num_ranks > 0
    }

    /// The last piece goes on into the next rank.
    pub fn continued(&self) -> bool {
        self.post_num_ranks > 0
    }
}

/// A validated partition of `[0, T)` into chain intervals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub t: usize,
    /// Global `cu_seqlens` (`[0, T]` for one unpacked sequence).
    pub cu_seqlens: Vec<i64>,
    /// Interval bounds `[0, c_1, …, c_{R−1}, T]`.
    pub bounds: Vec<usize>,
    /// The chain intervals in global token order (one per rank when
    /// contiguous, two per rank when zigzag).
    pub ranks: Vec<RankMeta>,
    pub layout: Layout,
}

/// One device rank's local buffer under a plan: its intervals in buffer
/// order and FLA's local `cu_seqlens` over the concatenated buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceRank {
    pub rank: usize,
    /// Indices into [`Plan::ranks`], in local-buffer order (`[front, back]`).
    pub intervals: Vec<usize>,
    /// Local `cu_seqlens` of the buffer: the parts' local boundaries
    /// concatenated, the back part's shifted by the front's length (FLA).
    pub cu_seqlens: Vec<i64>,
    /// Sequences of the front part (FLA `front_num_seqs`).
    pub front_num_seqs: usize,
}

impl Plan {
    /// FLA's equal split: `world` ranks of `T / world` tokens.
    pub fn equal(cu_seqlens: &[i64], t: usize, world: usize) -> Result<Plan> {
        if world == 0 {
            return Err(Error::Partition("world size must be at least 1".into()));
        }
        if t < world {
            return Err(Error::Partition(format!(
                "T = {t} tokens must be at least the world size {world} (a rank would be empty)"
            )));
        }
        if !t.is_multiple_of(world) {
            return Err(Error::Partition(format!(
                "FLA's equal split needs T divisible by the world size: T = {t}, world = {world} (give explicit cuts instead)"
            )));
        }
        let cuts: Vec<usize> = (1..world).map(|r| r * t / world).collect();
        Plan::from_cuts(cu_seqlens, t, &cuts)
    }

    /// FLA's zigzag split: `2·world` intervals of `T / (2·world)` tokens, rank
    /// `r` holding intervals `r` (front) and `2·world−1−r` (back).
    pub fn zigzag(cu_seqlens: &[i64], t: usize, world: usize) -> Result<Plan> {
        if world == 0 {
            return Err(Error::Partition("world size must be at least 1".into()));
        }
        let parts = world
            .checked_mul(2)
            .ok_or_else(|| Error::Partition(format!("world size {world} is too large")))?;
        if t < parts || !t.is_multiple_of(parts) {
            return Err(Error::Partition(format!(
                "FLA's zigzag layout needs T divisible by 2·world (and at least it): T = {t}, world = {world}, 2·world = {parts}"
            )));
        }
        let mut plan = Plan::equal(cu_seqlens, t, parts)?;
        plan.layout = Layout::Zigzag;
        for m in &mut plan.ranks {
            m.back = m.rank >= world;
            m.device = if m.back { parts - 1 - m.rank } else { m.rank };
        }
        Ok(plan)
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
                let pre_num_ranks = r - rank_of(head_start);
                let post_num_ranks = rank_of(tail_end - 1) - r;
                RankMeta {
                    rank: r,
                    device: r,
                    back: false,
                    start,
                    end,
                    cu_seqlens: cu,
                    pre_num_ranks,
                    post_num_ranks,
                    is_first_rank: pre_num_ranks == 0,
                    is_last_rank: post_num_ranks == 0,
                    pre_num_conv_tokens: start - head_start,
                    pieces,
                }
            })
            .collect();
        Ok(Plan {
            t,
            cu_seqlens: cu_seqlens.to_vec(),
            bounds,
            ranks,
            layout: Layout::Contiguous,
        })
    }

    /// Number of chain intervals (the ranks of a contiguous layout).
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// Number of device ranks.
    pub fn devices(&self) -> usize {
        match self.layout {
            Layout::Contiguous => self.ranks.len(),
            Layout::Zigzag => self.ranks.len() / 2,
        }
    }

    /// Device rank `r`'s local buffer.
    pub fn device_rank(&self, r: usize) -> DeviceRank {
        let intervals: Vec<usize> = match self.layout {
            Layout::Contiguous => vec![r],
            Layout::Zigzag => vec![r, self.ranks.len() - 1 - r],
        };
        let front = &self.ranks[intervals[0]];
        let mut cu = front.cu_seqlens.clone();
        let front_len = (front.end - front.start) as i64;
        if let Some(&b) = intervals.get(1) {
            cu.extend(self.ranks[b].cu_seqlens[1..].iter().map(|c| c + front_len));
        }
        DeviceRank {
            rank: r,
            intervals,
            cu_seqlens: cu,
            front_num_seqs: front.cu_seqlens.len() - 1,
        }
    }

    /// Interior cut points.
    pub fn cuts(&self) -> &[usize] {
        &self.bounds[1..self.bounds.len() - 1]
    }
}

/// How to cut: FLA's equal split (contiguous or zigzag) or explicit interior cuts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanSpec {
    World(usize),
    /// FLA's zigzag layout over this many ranks (`2·world` intervals).
    Zigzag(usize),
    Cuts(Vec<usize>),
}

impl std::fmt::Display for PlanSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanSpec::World(w) => write!(f, "world={w}"),
            PlanSpec::Zigzag(w) => write!(f, "world={w}, zigzag"),
            PlanSpec::Cuts(c) => write!(f, "cuts={c:?}"),
        }
    }
}

impl PlanSpec {
    /// The plan for a `[B, T, …]` input. CP works on one packed row, as FLA's
    /// does (`[1, T, …]`): `B = 1` with `cu_seqlens` (varlen), or `B = 1`
    /// without (one sequence of T tokens). `B > 1` is an `Error::Partition`:
    /// pack the batch into varlen instead.
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
            PlanSpec::Zigzag(w) => Plan::zigzag(cu, t, *w),
            PlanSpec::Cuts(c) => Plan::from_cuts(cu, t, c),
        }
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
        assert!(r0.is_first_rank && !r0.is_last_rank);
        assert!(!r1.is_first_rank && r1.is_last_rank);
        assert_eq!((r0.pre_num_conv_tokens, r1.pre_num_conv_tokens), (0, 112));
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
    fn fla_context_test_case() {
        // FLA tests/context_parallel/test_cp_context.py: [0, 5, 12], world 3, rank 1.
        let p = Plan::equal(&[0, 5, 12], 12, 3).unwrap();
        let r1 = &p.ranks[1];
        assert_eq!(r1.cu_seqlens, vec![0, 1, 4]);
        assert_eq!(r1.pre_num_conv_tokens, 4);
        assert_eq!((r1.pre_num_ranks, r1.post_num_ranks), (1, 1));
        assert!(!r1.is_first_rank && !r1.is_last_rank);
    }

    #[test]
    fn first_and_last_rank_are_per_chain_not_per_world() {
        // [0, 4, 12], world 3: rank 0 ends on a boundary (last of its chain),
        // rank 1 starts on it (first of its chain), rank 2 continues rank 1.
        let p = Plan::equal(&[0, 4, 12], 12, 3).unwrap();
        let flags: Vec<(bool, bool)> = p
            .ranks
            .iter()
            .map(|r| (r.is_first_rank, r.is_last_rank))
            .collect();
        assert_eq!(flags, vec![(true, true), (true, false), (false, true)]);
    }

    #[test]
    fn zigzag_layout_of_the_debug_guide_lengths() {
        // [400, 624], world 2 zigzag: 4 intervals of 256 tokens; rank 0 holds
        // 0..256 and 768..1024, rank 1 holds 256..512 and 512..768.
        let p = Plan::zigzag(&[0, 400, 1024], 1024, 2).unwrap();
        assert_eq!((p.world(), p.devices()), (4, 2));
        let owners: Vec<(usize, bool)> = p.ranks.iter().map(|m| (m.device, m.back)).collect();
        assert_eq!(owners, vec![(0, false), (1, false), (1, true), (0, true)]);
        let chain: Vec<(usize, usize)> = p
            .ranks
            .iter()
            .map(|m| (m.pre_num_ranks, m.post_num_ranks))
            .collect();
        // Sequence 0 spans intervals 0–1, sequence 1 spans intervals 1–3.
        assert_eq!(chain, vec![(0, 1), (1, 2), (1, 1), (2, 0)]);
        assert_eq!(p.ranks[1].cu_seqlens, vec![0, 144, 256]);
        let r0: Vec<(usize, usize)> = p
            .device_rank(0)
            .intervals
            .iter()
            .map(|&i| (p.ranks[i].start, p.ranks[i].end))
            .collect();
        assert_eq!(r0, vec![(0, 256), (768, 1024)]);
        let r1 = p.device_rank(1);
        assert_eq!(r1.intervals, vec![1, 2]);
        assert_eq!(r1.cu_seqlens, vec![0, 144, 256, 512]);
        assert_eq!(r1.front_num_seqs, 2);
        assert_eq!(p.device_rank(0).cu_seqlens, vec![0, 256, 512]);
        assert_eq!(p.ranks[3].label(p.layout), "0.back");
    }

    #[test]
    fn zigzag_needs_two_world_equal_intervals() {
        for (t, w) in [(6, 2), (3, 2), (10, 0)] {
            let e = Plan::zigzag(&[0, t as i64], t, w).unwrap_err();
            assert!(matches!(e, Error::Partition(_)), "{t} {w}: {e}");
        }
        assert!(Plan::zigzag(&[0, 4], 4, usize::MAX).is_err());
        assert_eq!(Layout::parse("zigzag").unwrap(), Layout::Zigzag);
        assert!(Layout::parse("ring")
            .unwrap_err()
            .to_string()
            .contains("contiguous, zigzag"));
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
        assert!(Plan::equal(&[0, 2], 2, 3)
            .unwrap_err()
            .to_string()
            .contains("at least the world size"));
        assert!(Plan::from_cuts(&[0, 0], 0, &[])
            .unwrap_err()
            .to_string()
            .contains("T = 0"));
        assert!(matches!(
            Plan::from_cuts(&[0, 5], 9, &[3]),
            Err(Error::CuSeqlens(_))
        ));
    }
}
