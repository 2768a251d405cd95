//! The up-front memory check: every command estimates what it will allocate
//! before allocating it and refuses (exit 2, estimate in the message) when
//! the estimate exceeds the budget: `MemAvailable` from `/proc/meminfo`, or
//! the global `--max-memory` when given.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Case, CaseError, Op};

/// `--max-memory` in bytes; 0 = not given (use `MemAvailable`).
static LIMIT: AtomicU64 = AtomicU64::new(0);

/// Sets the budget to `bytes` (the `--max-memory` override) or, with
/// `None`, back to the machine's available memory.
pub fn set_limit(bytes: Option<u64>) {
    LIMIT.store(bytes.unwrap_or(0), Ordering::Relaxed);
}

/// Parses a size: bytes, or a number with K, M, G or T (powers of 1024,
/// optionally followed by `iB` or `B`), e.g. `512M`, `8GiB`, `1.5G`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("--max-memory: unknown unit in `{s}` (K, M, G, T)")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("--max-memory: expected a size such as 8G or 512M, got `{s}`"))?;
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
        return Err(format!(
            "--max-memory: expected a positive size below 16 EiB, got `{s}`"
        ));
    }
    Ok(bytes as u64)
}

/// `MemAvailable` of `/proc/meminfo` in bytes (`None` where unreadable).
pub fn available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// A byte count for people: `1.5 GiB`.
pub fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// Refuses `what` when its estimate `bytes` exceeds the budget.
pub fn check(what: &str, bytes: u64) -> Result<(), CaseError> {
    let explicit = LIMIT.load(Ordering::Relaxed);
    let (budget, source) = if explicit > 0 {
        (explicit, "allowed by --max-memory")
    } else {
        match available() {
            Some(a) => (a, "available (MemAvailable in /proc/meminfo)"),
            None => return Ok(()),
        }
    };
    if bytes > budget {
        return Err(CaseError::Usage(format!(
            "{what} needs about {} of memory, more than the {} {source}; \
             use smaller shapes, or pass --max-memory SIZE to override",
            human(bytes),
            human(budget)
        )));
    }
    Ok(())
}

/// `Π dims` without overflow (`None` when it overflows).
pub fn elements(dims: &[usize]) -> Option<u64> {
    dims.iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(u64::try_from(d).ok()?))
}

/// The sizes that set a problem's memory: B, T, N sequences; H, HV heads;
/// K, V dims (token-shift: D as V, with H = HV = K = 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Problem {
    pub op: Op,
    pub b: usize,
    pub t: usize,
    pub n: usize,
    pub h: usize,
    pub hv: usize,
    pub k: usize,
    pub v: usize,
}

/// `Σ_i Π_j terms[i][j]`, saturating at `u64::MAX` (an overflowing size is
/// simply too big).
fn sum_of_products(terms: &[&[usize]]) -> u64 {
    terms
        .iter()
        .map(|t| elements(t).unwrap_or(u64::MAX))
        .fold(0u64, u64::saturating_add)
}

/// Work-space factor: the inputs are held as read, as the engine's
/// scalar, in the (rounded) copy an implementation works on, and as
/// gradients, plus the outputs and a stored truth (peak RSS of `verify` on
/// a KDA case of 10.5 M input elements: 880 MiB ≈ 10.5 M × 8 B × 10.5).
const COMPUTE_COPIES: u64 = 9;

impl Problem {
    /// Elements of the inputs and upstream gradients.
    pub fn input_elements(&self) -> u64 {
        let Problem {
            b,
            t,
            n,
            h,
            hv,
            k,
            v,
            ..
        } = *self;
        match self.op {
            // GDN: the scalar gate is broadcast over K inside (KDA's pieces).
            Op::Kda | Op::Gdn => sum_of_products(&[
                &[2, b, t, h, k],
                &[2, b, t, hv, v],
                &[b, t, hv, k],
                &[b, t, hv],
                &[hv, k + 1],
                &[2, n, hv, k, v],
            ]),
            Op::Dplr => sum_of_products(&[&[5, b, t, h, k], &[2, b, t, h, v], &[2, n, h, k, v]]),
            Op::TokenShift => sum_of_products(&[&[2, b, t, v], &[2, n, v]]),
            // x, dy; weight [D, W] and bias; initial_state, dht [N, D, W] (k = W, v = D).
            Op::CausalConv1d => sum_of_products(&[&[2, b, t, v], &[v, k + 1], &[2, n, k, v]]),
        }
    }

    /// Bytes `gen` holds: the f64 draws, their rounded copies and the
    /// serialised file.
    pub fn gen_bytes(&self) -> u64 {
        self.input_elements().saturating_mul(8 * 4)
    }

    /// Bytes an implementation on the CPU holds: copies of the inputs, the
    /// outputs and gradients, and the engine's states (`chunk`: the chunk
    /// size of the chunked engine, whose per-chunk states `h` and `dh` are
    /// kept; `None`: the naive engine's checkpoints and block of replayed
    /// states per running task, `deltaref::sweep::held_states`).
    pub fn compute_bytes(&self, chunk: Option<usize>) -> u64 {
        let state = sum_of_products(&[&[self.hv.max(self.h), self.k, self.v]]);
        let states = match (self.op, chunk) {
            (Op::TokenShift, _) => 0,
            (_, Some(c)) => {
                let chunks = sum_of_products(&[&[self.b, self.t.div_ceil(c.max(1)) + self.n]]);
                state.saturating_mul(chunks).saturating_mul(2)
            }
            (_, None) => {
                let per_head = state / self.hv.max(self.h).max(1) as u64;
                let per_task = deltaref::sweep::held_states(
                    self.t,
                    usize::try_from(per_head.saturating_mul(8)).unwrap_or(usize::MAX),
                ) as u64;
                let tasks = rayon::current_num_threads() as u64;
                per_head.saturating_mul(per_task).saturating_mul(tasks)
            }
        };
        self.input_elements()
            .saturating_mul(COMPUTE_COPIES)
            .saturating_add(states)
            .saturating_mul(8)
    }

    /// The problem a case holds (from its validated input shapes).
    pub fn of_case(case: &Case) -> Problem {
        let shape = |n: &str| case.tensors.get(n).map(|t| t.shape().to_vec());
        let op = case.meta.op;
        let (first, value) = match op {
            Op::TokenShift | Op::CausalConv1d => ("x", "x"),
            _ => ("q", "v"),
        };
        let q = shape(first).unwrap_or_default();
        let v = shape(value).unwrap_or_default();
        let at = |s: &[usize], i: usize| s.get(i).copied().unwrap_or(1);
        let b = at(&q, 0);
        let n = case
            .cu_seqlens
            .as_ref()
            .map_or(b, |c| c.len().saturating_sub(1));
        match op {
            Op::TokenShift => Problem {
                op,
                b,
                t: at(&q, 1),
                n,
                h: 1,
                hv: 1,
                k: 1,
                v: at(&q, 2),
            },
            Op::CausalConv1d => Problem {
                op,
                b,
                t: at(&q, 1),
                n,
                h: 1,
                hv: 1,
                k: shape("weight").map_or(1, |w| at(&w, 1)),
                v: at(&q, 2),
            },
            _ => Problem {
                op,
                b,
                t: at(&q, 1),
                n,
                h: at(&q, 2),
                hv: at(&v, 2),
                k: at(&q, 3),
                v: at(&v, 3),
            },
        }
    }
}
