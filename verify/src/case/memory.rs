//! The up-front memory check: every command estimates what it will allocate
//! before allocating it and refuses (exit 2, estimate in the message) when
//! the estimate exceeds the budget: `MemAvailable` from `/proc/meminfo`, or
//! the global `--max-memory` when given.

use std::sync::atomic::{AtomicU64, Ordering};

use deltaref::registry::{MemoryModel, Options};

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

/// Bytes every run holds whatever its size: [`PROCESS_BYTES`] and the
/// naive engines' buffers kept per thread for reuse
/// ([`MemoryModel::KEPT`] of [`MemoryModel::MAX_KEPT`] bytes at
/// most).
pub fn fixed_bytes() -> u64 {
    let kept = (MemoryModel::KEPT * MemoryModel::MAX_KEPT) as u64;
    PROCESS_BYTES.saturating_add(kept.saturating_mul(rayon::current_num_threads() as u64))
}

/// Refuses `what` when its estimate `bytes` (plus [`fixed_bytes`])
/// exceeds the budget.
pub fn check(what: &str, bytes: u64) -> Result<(), CaseError> {
    let bytes = bytes.saturating_add(fixed_bytes());
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
/// K, V dims (token-shift: D as V, with H = HV = K = 1; the convolution: D
/// as V and W as K), and the op's memory coefficients for its options.
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
    pub model: MemoryModel,
}

/// `Σ_i Π_j terms[i][j]`, saturating at `u64::MAX` (an overflowing size is
/// simply too big).
fn sum_of_products(terms: &[&[usize]]) -> u64 {
    terms
        .iter()
        .map(|t| elements(t).unwrap_or(u64::MAX))
        .fold(0u64, u64::saturating_add)
}

/// Bytes of the process itself (code, thread stacks, the allocator's
/// arenas), part of [`fixed_bytes`].
pub const PROCESS_BYTES: u64 = 32 << 20;

/// How a computation runs on the CPU, for [`Problem::compute_bytes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Run {
    /// The naive engine (and the host side of a GPU run).
    Naive,
    /// The chunked engine with chunks of `chunk_size`, over pieces of at
    /// most `piece` tokens per (sequence, head), `pieces` of them per pair
    /// (CP: the ranks' intervals, which run side by side).
    Chunk {
        chunk_size: usize,
        piece: usize,
        pieces: usize,
    },
}

impl Problem {
    /// The problem of `op` with options `o`, `[B, T, N]` and `[H, HV, K, V]`.
    pub fn new(op: Op, o: &Options, [b, t, n]: [usize; 3], [h, hv, k, v]: [usize; 4]) -> Problem {
        Problem {
            op,
            b,
            t,
            n,
            h,
            hv,
            k,
            v,
            model: op.entry().memory(o),
        }
    }

    /// The size an axis label of the op's declarations stands for.
    fn size(&self, label: &str) -> Option<usize> {
        Some(match label {
            "B" => self.b,
            "T" => self.t,
            "N" => self.n,
            "H" => self.h,
            "HV" => self.hv,
            "K" | "W" => self.k,
            "V" | "D" => self.v,
            "HV*K" => self.hv.saturating_mul(self.k),
            "H*K" => self.h.saturating_mul(self.k),
            _ => return None,
        })
    }

    /// Elements of each input and upstream gradient the op declares
    /// (`cu_seqlens`, an integer tensor, aside).
    fn tensor_elements(&self) -> impl Iterator<Item = u64> + '_ {
        self.op.info().axes.iter().filter_map(|(_, axes)| {
            let dims: Option<Vec<usize>> = axes.split(',').map(|a| self.size(a)).collect();
            Some(elements(&dims?).unwrap_or(u64::MAX))
        })
    }

    /// Elements of the inputs and upstream gradients.
    pub fn input_elements(&self) -> u64 {
        self.tensor_elements().fold(0u64, u64::saturating_add)
    }

    /// Bytes `gen` holds without the truth: the f64 draws, then the drawn
    /// case and one tensor encoded for the file (measured: KDA, GDN and
    /// DPLR 1.2 inputs, token-shift's and conv's one large tensor 1.5).
    pub fn draw_bytes(&self) -> u64 {
        self.input_elements()
            .saturating_mul(self.model.draw_eighths)
    }

    /// Bytes `gen --expected` holds on the whole-case path: the drawn case
    /// while the naive engine computes its truth from a copy.
    pub fn gen_bytes(&self) -> u64 {
        self.input_elements()
            .saturating_mul(8)
            .saturating_add(self.compute_bytes(Run::Naive))
    }

    /// Bytes `gen` holds head block by head block, `heads` query/key heads
    /// at a time, storing `width` bytes per element: the largest draw
    /// ([`Problem::streamed_draw_bytes`]), one block's inputs read back
    /// (their stored bytes and f64 values) and (`expected`) the engine run
    /// they move into.
    pub fn gen_streamed_bytes(&self, heads: usize, expected: bool, width: usize) -> u64 {
        let draw = self.streamed_draw_bytes(width);
        let block = self.heads_block(heads);
        let read = block.input_elements().saturating_mul(8);
        let fill = if expected {
            read.saturating_mul(2).max(block.compute_bytes(Run::Naive))
        } else {
            read.saturating_mul(9) / 4
        };
        draw.max(fill)
    }

    /// Bytes of a KDA or DPLR case's inputs drawn and written one at a
    /// time, stored in `width` bytes per element: the largest input in f64
    /// and its stored bytes (DPLR's `a` with the `kk` it keeps for `b`
    /// beside it: see `DplrSpec`'s draws), and 64 KiB for the
    /// file's header and the plan of its tensors.
    pub fn streamed_draw_bytes(&self, width: usize) -> u64 {
        let per_element = self.model.streamed_draw_bytes + width as u64;
        self.largest_input()
            .saturating_mul(per_element)
            .saturating_add(64 << 10)
    }

    /// Elements of the largest input or upstream gradient.
    fn largest_input(&self) -> u64 {
        self.tensor_elements().max().unwrap_or(u64::MAX)
    }

    /// The same problem cut to `heads` query/key heads (GVA value heads
    /// with them), as a head block of it is.
    pub fn heads_block(&self, heads: usize) -> Problem {
        let heads = heads.clamp(1, self.h.max(1));
        Problem {
            h: heads,
            hv: heads * (self.hv / self.h.max(1)).max(1),
            ..*self
        }
    }

    /// Bytes a CPU run holds at its peak, its own copy of the inputs
    /// included (an owned case moves in as that copy): the inputs, the
    /// outputs and gradients, the prepared inputs (`copy_elements`)
    /// and the engine's own: the naive engine's checkpoints and block of
    /// replayed states per pair in flight ([`MemoryModel::held_states`]),
    /// the chunked engine's intermediates of one span
    /// ([`MemoryModel::SPAN_LEN`] tokens at most) per piece in flight,
    /// [`Problem::chunk_elements`] per token. `verify/tests/memory_estimate.rs`
    /// checks it against the peak heap of the runs, measured by a counting
    /// allocator: never below, at most twice above.
    pub fn compute_bytes(&self, run: Run) -> u64 {
        self.copy_elements()
            .saturating_add(self.engine_elements(run))
            .saturating_mul(8)
    }

    /// Elements of the inputs, the results and the prepared inputs,
    /// measured in input sizes: about 2 for KDA and DPLR, 2.2 for GDN, 3
    /// for token-shift and 4.5 for conv (the factors here: 2.25, 2.5,
    /// 3.25, 4.75), plus 1.5 copies of `q` and `k` when they are l2-normed
    /// in the kernel and 4.5 of KDA's gate when it is activated there.
    fn copy_elements(&self) -> u64 {
        let m = self.model;
        let (b, t, h, hv, k) = (self.b, self.t, self.h, self.hv, self.k);
        let qk = sum_of_products(&[&[2, b, t, h, k]]);
        let gate = sum_of_products(&[&[b, t, hv, k]]);
        (self.input_elements().saturating_mul(m.copy_quarters) / 4)
            .saturating_add(qk.saturating_mul(m.qk_halves) / 2)
            .saturating_add(gate.saturating_mul(m.gate_halves) / 2)
    }

    /// Elements the engine itself holds at its peak (see [`Problem::compute_bytes`]).
    fn engine_elements(&self, run: Run) -> u64 {
        let heads = self.hv.max(self.h);
        let state = sum_of_products(&[&[self.k, self.v]]);
        let tasks = rayon::current_num_threads() as u64;
        match (self.op.is_delta_rule(), run) {
            (false, _) => 0,
            (true, Run::Naive) => {
                let per_task = MemoryModel::held_states(
                    self.t,
                    usize::try_from(state.saturating_mul(8)).unwrap_or(usize::MAX),
                ) as u64;
                let pairs = sum_of_products(&[&[self.n, heads]]);
                state
                    .saturating_mul(per_task)
                    .saturating_mul(tasks.min(pairs))
            }
            (
                true,
                Run::Chunk {
                    chunk_size,
                    piece,
                    pieces,
                },
            ) => {
                // One span per piece in flight, never more tokens than all
                // the pairs hold; half as much again where fewer pairs than
                // threads split their chunks over the threads (measured:
                // 1.3 to 1.5 times, the chunks' pieces collected before
                // they are assembled).
                let span = piece.min(self.t).min(MemoryModel::SPAN_LEN) as u64;
                let pairs = sum_of_products(&[&[self.n, heads, pieces]]);
                let tokens = span
                    .saturating_mul(tasks.min(pairs))
                    .min(sum_of_products(&[&[self.b, self.t, heads]]));
                let tokens = if pairs < tasks {
                    tokens.saturating_mul(3) / 2
                } else {
                    tokens
                };
                tokens.saturating_mul(self.chunk_elements(chunk_size))
            }
        }
    }

    /// The chunked engine's intermediates per token of a pair (chunks of
    /// `c`): KDA's `[c, K]` rows (Γ, `w`, `qg`, `kg`, the decay factors),
    /// `[c, V]` rows (`u`, `v_new`, `o`, `dv_new`) and `[c, c]` factors
    /// (the inverse, `Akk`, `Aqk`, the key products), with `h` and `dh`
    /// per chunk; DPLR's and GDN's more of each.
    pub fn chunk_elements(&self, c: usize) -> u64 {
        let (k, v, c) = (self.k as u64, self.v as u64, c.max(1) as u64);
        let [rk, rv, rc] = self.model.chunk_rows;
        let rows = rk * k + rv * v + rc * c;
        rows.saturating_add(k.saturating_mul(v).saturating_mul(2) / c)
    }

    /// The problem a case holds (from its input shapes, read by the axis
    /// labels its op declares; 1 where a size is absent).
    pub fn of_case(case: &Case) -> Problem {
        let info = case.meta.op.info();
        let size = |label: &str| {
            info.axes.iter().find_map(|(name, axes)| {
                let i = axes.split(',').position(|a| a == label)?;
                case.tensors.get(*name)?.shape().get(i).copied()
            })
        };
        let b = size("B").unwrap_or(1);
        let n = case
            .cu_seqlens
            .as_ref()
            .map_or(b, |c| c.len().saturating_sub(1));
        let h = size("H").unwrap_or(1);
        Problem::new(
            case.meta.op,
            &case.meta.options,
            [b, size("T").unwrap_or(1), n],
            [
                h,
                size("HV").unwrap_or(h),
                size("K").or(size("W")).unwrap_or(1),
                size("V").or(size("D")).unwrap_or(1),
            ],
        )
    }
}
