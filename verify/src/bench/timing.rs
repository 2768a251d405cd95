//! Interleaved timing: every job once per round, the rounds repeated.
//!
//! On a shared machine a neighbour's load comes and goes over seconds. Timed
//! one after the other (all runs of one job, then all of the next), two jobs
//! can land in different spells and their ratio says more about the
//! machine than about the jobs. Run in rounds, a spell falls on every job of
//! the round alike, and the ratio of two jobs is taken within each round
//! ([`Rounds::ratio`]) before the rounds are summarised.

use std::time::Instant;

/// Wall seconds of each job in each round run so far.
#[derive(Clone, Debug)]
pub struct Rounds {
    /// `times[job][round]`
    times: Vec<Vec<f64>>,
}

/// Quartiles of a set of samples (nearest rank): `low` the first, `median`
/// the second, `high` the third.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Quartiles {
    pub low: f64,
    pub median: f64,
    pub high: f64,
}

impl Quartiles {
    /// `None` for no samples; NaN samples sort last.
    pub fn of(samples: &[f64]) -> Option<Self> {
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        let at = |q: usize| s[(q * (s.len() - 1) + 2) / 4];
        (!s.is_empty()).then(|| Quartiles {
            low: at(1),
            median: at(2),
            high: at(3),
        })
    }
}

/// Wall seconds `f` takes.
pub fn seconds(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

impl Rounds {
    /// No rounds yet, for `jobs` jobs.
    pub fn new(jobs: usize) -> Self {
        Rounds {
            times: vec![vec![]; jobs],
        }
    }

    /// Rounds run so far.
    pub fn len(&self) -> usize {
        self.times.first().map_or(0, Vec::len)
    }

    /// No round run yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs one more round, `job(i)` for every job `i` once, starting one
    /// job later than the previous round (so no job always follows the same
    /// one). `job(i)` runs job `i` and returns the seconds it took (what the
    /// caller times: see [`seconds`]). Stops at the first job that fails,
    /// leaving the round unrecorded.
    pub fn run<E>(&mut self, mut job: impl FnMut(usize) -> Result<f64, E>) -> Result<(), E> {
        let n = self.times.len();
        let mut round = vec![0.0; n];
        for i in (0..n).map(|i| (i + self.len()) % n) {
            round[i] = job(i)?;
        }
        for (job, t) in self.times.iter_mut().zip(round) {
            job.push(t);
        }
        Ok(())
    }

    /// The fastest round of `job`: on a shared machine the one least
    /// disturbed, which is what a peak (itself the best of its samples) is
    /// compared with. `None` before the first round.
    pub fn best(&self, job: usize) -> Option<f64> {
        self.times[job].iter().copied().reduce(f64::min)
    }

    /// Quartiles of `job`'s times.
    pub fn quartiles(&self, job: usize) -> Option<Quartiles> {
        Quartiles::of(&self.times[job])
    }

    /// Quartiles over the rounds of `job`'s time over `base`'s in the same
    /// round.
    pub fn ratio(&self, job: usize, base: usize) -> Option<Quartiles> {
        let r: Vec<f64> = self.times[job]
            .iter()
            .zip(&self.times[base])
            .map(|(a, b)| a / b)
            .collect();
        Quartiles::of(&r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quartiles_take_the_nearest_rank() {
        assert_eq!(Quartiles::of(&[]), None);
        let one = Quartiles::of(&[3.0]).unwrap();
        assert_eq!((one.low, one.median, one.high), (3.0, 3.0, 3.0));
        // Ranks 0..=4 of five samples: 1, 2, 3.
        let five = Quartiles::of(&[5.0, 1.0, 4.0, 2.0, 3.0]).unwrap();
        assert_eq!((five.low, five.median, five.high), (2.0, 3.0, 4.0));
        // Eight samples: ranks (7+2)/4 = 2, 16/4 = 4, 23/4 = 5.
        let eight: Vec<f64> = (0..8).rev().map(f64::from).collect();
        let q = Quartiles::of(&eight).unwrap();
        assert_eq!((q.low, q.median, q.high), (2.0, 4.0, 5.0));
    }

    #[test]
    fn rounds_rotate() {
        let mut order = vec![];
        let mut rounds = Rounds::new(3);
        assert!(rounds.is_empty() && rounds.best(0).is_none());
        for _ in 0..3 {
            rounds
                .run(|j| {
                    order.push(j);
                    Ok::<_, ()>(seconds(|| {
                        std::thread::sleep(std::time::Duration::from_millis(1 + j as u64))
                    }))
                })
                .unwrap();
        }
        assert_eq!(order, [0, 1, 2, 1, 2, 0, 2, 0, 1]);
        assert_eq!(rounds.len(), 3);
        // Each job's own times: sleeps only overshoot.
        for j in 0..3 {
            assert!(rounds.best(j).unwrap() >= 1e-3 * (1 + j) as f64);
        }
    }

    #[test]
    fn ratios_are_taken_within_a_round() {
        // Job 1 takes twice job 0's time in every round but the last, in
        // which a slow spell hit job 0: the ratio's median is 2, while the
        // ratio of the medians would be 3 / 2.
        let rounds = Rounds {
            times: vec![vec![1.0, 2.0, 10.0], vec![2.0, 4.0, 3.0]],
        };
        let r = rounds.ratio(1, 0).unwrap();
        assert_eq!((r.low, r.median, r.high), (2.0, 2.0, 2.0));
        assert_eq!(rounds.quartiles(0).unwrap().median, 2.0);
        assert_eq!(rounds.quartiles(1).unwrap().median, 3.0);
        let r = rounds.ratio(0, 1).unwrap();
        assert_eq!((r.low, r.median), (0.5, 0.5));
        assert!((r.high - 10.0 / 3.0).abs() < 1e-15);
        assert_eq!(rounds.best(0), Some(1.0));
        assert_eq!(rounds.best(1), Some(2.0));
    }

    #[test]
    fn a_failing_job_ends_the_round_unrecorded() {
        let mut rounds = Rounds::new(2);
        let mut ran = vec![];
        let job = |j: usize| {
            ran.push(j);
            if j == 0 {
                Ok(1.0)
            } else {
                Err("no")
            }
        };
        assert_eq!(rounds.run(job), Err("no"));
        assert_eq!(ran, [0, 1]);
        assert!(rounds.is_empty());
    }
}
