//! Long cases in bounded memory: KDA and DPLR heads never mix (every engine,
//! naive, chunk or CP, runs each (sequence, head) pair on its own), so a
//! large case file is verified one block of query/key heads at a time. Each
//! block is read straight from the file (only its slice of every tensor,
//! still in the stored dtype), widened to f64, computed and compared, and
//! the metrics accumulate per tensor ([`Accum`]); the whole case is never
//! in memory. With GVA a block holds its q/k heads' value heads (HV/H each).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ndarray::{ArrayD, Axis, IxDyn, Slice};
use safetensors::tensor::Dtype as StDtype;
use serde_json::{Map, Value};

use crate::case::{Case, CaseError, Op};
use crate::metrics::Accum;
use crate::outputs::Tensors;
use crate::report::VerifyRow;

/// Files smaller than this are read whole (the usual path, same bits).
pub const STREAM_MIN_BYTES: u64 = 64 << 20;
/// Stored bytes one head block aims at (at least one head per block).
const BLOCK_BYTES: u64 = 256 << 20;
/// Bytes read from the file per system call when gathering a slice.
const READ_BYTES: usize = 8 << 20;

/// One tensor of the file.
struct Entry {
    name: String,
    dtype: StDtype,
    size: usize,
    shape: Vec<usize>,
    /// Absolute file offset of its first byte.
    begin: u64,
}

/// A case file opened for reading head block by head block.
pub struct HeadFile {
    path: PathBuf,
    file: File,
    op: Op,
    metadata: HashMap<String, String>,
    tensors: Vec<Entry>,
    /// Query/key heads H.
    heads: usize,
    per_block: usize,
}

impl HeadFile {
    /// Opens `path` for head-block reading when that pays and is safe: a KDA
    /// or DPLR case of at least `min_bytes` whose tensors all have a head
    /// axis. A single head is one block, still read tensor by tensor and
    /// compared one result at a time, never the whole file at once. `None`
    /// means "read it whole", which also reports every framing or shape
    /// error in the usual words.
    pub fn open(path: &Path, min_bytes: u64) -> Result<Option<HeadFile>, CaseError> {
        Ok(read_header(path, min_bytes).and_then(|h| HeadFile::of_case(path, h)))
    }

    /// A KDA or DPLR case's head-block view, with blocks of
    /// [`heads_per_block`]; `None` for other ops, no query/key head, or
    /// tensors that do not split by heads.
    fn of_case(path: &Path, header: Header) -> Option<HeadFile> {
        let Header {
            file,
            metadata,
            tensors,
            data_bytes,
        } = header;
        // Only KDA's and DPLR's tensor layouts are known here (GDN's gate is
        // [B, T, H], the conv has channels, not heads): the rest load whole.
        let op = case_op(&metadata).filter(|op| op.info().streams_by_head)?;
        // A case in a kernel's convention is mapped back whole (its heads
        // may be tiled, its state transposed): no head blocks.
        if metadata.contains_key("convention") {
            return None;
        }
        let heads = tensors
            .iter()
            .find(|e| e.name == "q")
            .and_then(|q| q.shape.get(2).copied())
            .filter(|&h| h >= 1)?;
        let file = HeadFile {
            path: path.to_path_buf(),
            file,
            op,
            metadata,
            tensors,
            heads,
            per_block: heads_per_block(data_bytes, heads),
        };
        file.splits().then_some(file)
    }

    /// A candidate file (a port's outputs and gradients) for this case,
    /// opened for reading in this case's head blocks; `None` (read it whole)
    /// when a tensor has no head axis (an intermediate, a name no op knows)
    /// or its head axis is not a multiple of H, so that the whole-case path
    /// reports those in its own words.
    pub fn candidate(&self, path: &Path) -> Result<Option<HeadFile>, CaseError> {
        let Some(Header {
            file,
            metadata,
            tensors,
            ..
        }) = read_header(path, 0)
        else {
            return Ok(None);
        };
        let file = HeadFile {
            path: path.to_path_buf(),
            file,
            op: self.op,
            metadata,
            tensors,
            heads: self.heads,
            per_block: self.per_block,
        };
        Ok(file.splits().then_some(file))
    }

    /// A case file this process is writing (see [`crate::case::Case::write_filled`]),
    /// opened for reading its inputs and writing its results head block by
    /// head block: at most `per_block` query/key heads at a time, fewer
    /// where the blocks [`HeadFile::open`] reads would be smaller (a
    /// block's engine run holds several times its stored bytes). `None`
    /// where its tensors do not split by heads (not KDA or DPLR, a tensor
    /// without a head axis).
    pub fn for_filling(path: &Path, per_block: usize) -> Result<Option<HeadFile>, CaseError> {
        let file = File::options()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| CaseError::Io {
                path: path.display().to_string(),
                source,
            })?;
        Ok(read_header_of(file, 0)
            .and_then(|h| HeadFile::of_case(path, h))
            .map(|f| {
                let n = per_block.min(f.per_block);
                f.with_heads_per_block(n)
            }))
    }

    /// Writes result `name` (stored as float64) of heads `heads`: `x` is
    /// shaped as the whole result with its head axis cut to those heads.
    pub fn write_result(
        &self,
        heads: &Range<usize>,
        name: &str,
        x: &ArrayD<f64>,
    ) -> Result<(), CaseError> {
        let what = self.block_name(heads);
        let fail = |why: String| CaseError::Write {
            path: what.clone(),
            why: format!("result `{name}`: {why}"),
        };
        let e = self
            .tensors
            .iter()
            .find(|e| e.name == name && self.is_result(name))
            .ok_or_else(|| fail("the file has no room for it".into()))?;
        if e.dtype != StDtype::F64 {
            return Err(fail(format!("stored as {:?}, not F64", e.dtype)));
        }
        let a = self
            .op
            .info()
            .head_axis(name)
            .ok_or_else(|| fail("it has no head axis".into()))?;
        let per = e.shape[a] / self.heads;
        let units = heads.start * per..heads.end * per;
        let mut want = e.shape.clone();
        want[a] = units.len();
        if x.shape() != want.as_slice() || heads.end > self.heads {
            return Err(fail(format!(
                "expected shape {want:?} for heads {}..{} of {:?}, got {:?}",
                heads.start,
                heads.end,
                e.shape,
                x.shape()
            )));
        }
        self.scatter(e, a, units, x.iter().copied())
            .map_err(|err| fail(err.to_string()))
    }

    /// Writes `values` (f64, in order) as `units` along axis `a` of tensor
    /// `e`: the mirror of [`HeadFile::gather`]. Rows of one block are apart
    /// in the file unless the block is every head, when they are written
    /// together.
    fn scatter(
        &self,
        e: &Entry,
        a: usize,
        units: Range<usize>,
        mut values: impl Iterator<Item = f64>,
    ) -> std::io::Result<()> {
        let inner: usize = e.shape.iter().skip(a + 1).product::<usize>() * e.size;
        let outer: usize = e.shape.iter().take(a).product();
        let row = e.shape[a] * inner;
        let (skip, take) = (units.start * inner, units.len() * inner);
        let rows_per_write = if take == row {
            (READ_BYTES / row.max(1)).max(1)
        } else {
            1
        };
        let mut buf = Vec::with_capacity(rows_per_write * take);
        for first in (0..outer).step_by(rows_per_write) {
            let n = rows_per_write.min(outer - first);
            buf.clear();
            for v in values.by_ref().take(n * take / e.size) {
                buf.extend_from_slice(&v.to_le_bytes());
            }
            self.file
                .write_all_at(&buf, e.begin + (first * row + skip) as u64)?;
        }
        Ok(())
    }

    /// Whether every tensor has a head axis whose length is a multiple of H.
    fn splits(&self) -> bool {
        self.tensors
            .iter()
            .all(|e| match self.op.info().head_axis(&e.name) {
                Some(a) => e
                    .shape
                    .get(a)
                    .is_some_and(|&l| l > 0 && l % self.heads == 0),
                None => e.name == "cu_seqlens",
            })
    }
}

/// Query/key heads per block of a file of `data_bytes` after its header:
/// about `BLOCK_BYTES` (256 MiB) of stored data, at least one head.
pub fn heads_per_block(data_bytes: u64, heads: usize) -> usize {
    let per_head = data_bytes / heads as u64;
    (BLOCK_BYTES / per_head.max(1)).clamp(1, heads as u64) as usize
}

/// The op a file's `case` metadata names.
fn case_op(metadata: &HashMap<String, String>) -> Option<Op> {
    let m = serde_json::from_str::<Value>(metadata.get("case")?).ok()?;
    Op::parse(m.get("op")?.as_str()?)
}

/// A safetensors file opened and its header parsed.
struct Header {
    file: File,
    metadata: HashMap<String, String>,
    tensors: Vec<Entry>,
    /// Bytes after the header.
    data_bytes: u64,
}

/// The parsed header of a safetensors file of at least `min_bytes`; `None`
/// for anything unreadable or malformed (the whole-file path reports it).
fn read_header(path: &Path, min_bytes: u64) -> Option<Header> {
    read_header_of(File::open(path).ok()?, min_bytes)
}

/// [`read_header`] of a file already open.
fn read_header_of(file: File, min_bytes: u64) -> Option<Header> {
    let len = file.metadata().ok()?.len();
    if len < min_bytes.max(8) {
        return None;
    }
    let mut n = [0u8; 8];
    file.read_exact_at(&mut n, 0).ok()?;
    let n = u64::from_le_bytes(n);
    if n > 100_000_000 || n > len - 8 {
        return None;
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact_at(&mut header, 8).ok()?;
    let (metadata, tensors) = entries(&header, 8 + n, len)?;
    Some(Header {
        file,
        metadata,
        tensors,
        data_bytes: len - 8 - n,
    })
}

/// The metadata and the tensors (with absolute offsets, each inside the
/// file) of a safetensors header.
#[allow(clippy::type_complexity)]
fn entries(
    header: &[u8],
    data_start: u64,
    len: u64,
) -> Option<(HashMap<String, String>, Vec<Entry>)> {
    let map: Map<String, Value> = serde_json::from_slice(header).ok()?;
    let mut metadata = HashMap::new();
    let mut tensors = vec![];
    for (name, v) in &map {
        if name == "__metadata__" {
            for (k, x) in v.as_object()? {
                metadata.insert(k.clone(), x.as_str()?.to_string());
            }
            continue;
        }
        let dtype: StDtype = serde_json::from_value(v.get("dtype")?.clone()).ok()?;
        let shape: Vec<usize> = serde_json::from_value(v.get("shape")?.clone()).ok()?;
        let off: [u64; 2] = serde_json::from_value(v.get("data_offsets")?.clone()).ok()?;
        if !dtype.bitsize().is_multiple_of(8) {
            return None;
        }
        let size = dtype.bitsize() / 8;
        let bytes = shape
            .iter()
            .try_fold(size as u64, |a, &d| a.checked_mul(d as u64))?;
        let begin = data_start.checked_add(off[0])?;
        if off[1].checked_sub(off[0])? != bytes || begin.checked_add(bytes)? > len {
            return None;
        }
        tensors.push(Entry {
            name: name.clone(),
            dtype,
            size,
            shape,
            begin,
        });
    }
    Some((metadata, tensors))
}

impl HeadFile {
    /// The same file read `n` query/key heads per block (at least one, at
    /// most H) instead of about 256 MiB of stored data per block.
    pub fn with_heads_per_block(self, n: usize) -> HeadFile {
        HeadFile {
            per_block: n.clamp(1, self.heads),
            ..self
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Query/key heads H of the case.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// The head blocks, in order, covering `0..H`.
    pub fn blocks(&self) -> Vec<Range<usize>> {
        (0..self.heads)
            .step_by(self.per_block)
            .map(|h| h..(h + self.per_block).min(self.heads))
            .collect()
    }

    /// The case restricted to query/key heads `heads` (and their value
    /// heads) without its stored results: parsed and validated as a case
    /// file of its own.
    pub fn read_inputs(&self, heads: &Range<usize>) -> Result<Case, CaseError> {
        let (bytes, what) = self.block_file(heads, |n| !self.is_result(n))?;
        Case::from_bytes(&bytes, &what)
    }

    /// Whether the file stores any result (output or gradient).
    pub fn has_results(&self) -> bool {
        !self.result_names().is_empty()
    }

    /// The names of the results (outputs and gradients) the file stores, in name order.
    pub fn result_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .tensors
            .iter()
            .filter(|e| self.is_result(&e.name))
            .map(|e| e.name.clone())
            .collect();
        names.sort();
        names
    }

    /// The stored result `name` (an output or gradient, one of
    /// [`HeadFile::result_names`]) of heads `heads`, checked as a case's
    /// are: shaped as `shapes` (from the same block's inputs,
    /// [`Case::result_shape`]) says, and finite. Only that tensor's block
    /// is read, so the comparison holds one stored tensor at a time.
    pub fn read_result(
        &self,
        heads: &Range<usize>,
        name: &str,
        shapes: &BTreeMap<String, Vec<usize>>,
    ) -> Result<ArrayD<f64>, CaseError> {
        let (bytes, what) = self.block_file(heads, |n| n == name && self.is_result(n))?;
        let x = Case::candidate_from_bytes(&bytes, &what, self.op)?
            .tensors
            .remove(name)
            .ok_or_else(|| CaseError::Format {
                path: what.clone(),
                why: format!("no stored result `{name}`"),
            })?;
        let invalid = |source| CaseError::Invalid {
            path: what.clone(),
            source,
        };
        if let Some(want) = shapes.get(name) {
            deltaref::tensor::expect_shape(name, "(as its input counterpart)", want, x.shape())
                .map_err(invalid)?;
        }
        deltaref::tensor::check_finite(name, &x).map_err(invalid)?;
        Ok(x)
    }

    /// Checks a candidate's `case` metadata against `case`, the inputs of
    /// head block `heads` (as [`Case::read_candidate_for`] does for a whole
    /// candidate): its op, and every math option it states.
    pub fn check_candidate_meta(&self, heads: &Range<usize>, case: &Case) -> Result<(), CaseError> {
        let (bytes, what) = self.block_file(heads, |_| false)?;
        Case::candidate_for_bytes(&bytes, &what, case).map(drop)
    }

    /// A candidate's tensor `name` of heads `heads` (`None`: it has none),
    /// non-finite values kept (see [`Case::candidate_from_bytes`]).
    pub fn read_candidate(
        &self,
        heads: &Range<usize>,
        name: &str,
    ) -> Result<Option<ArrayD<f64>>, CaseError> {
        let (bytes, what) = self.block_file(heads, |n| n == name)?;
        Ok(Case::candidate_from_bytes(&bytes, &what, self.op)?
            .tensors
            .remove(name))
    }

    fn is_result(&self, name: &str) -> bool {
        self.op.results().contains(&name)
    }

    /// The file and head range, for errors about one block.
    fn block_name(&self, heads: &Range<usize>) -> String {
        format!(
            "{} (heads {}..{})",
            self.path.display(),
            heads.start,
            heads.end
        )
    }

    /// A safetensors file (bytes, and its name for errors) holding heads
    /// `heads` of the tensors `keep` accepts; `cu_seqlens` always.
    fn block_file(
        &self,
        heads: &Range<usize>,
        keep: impl Fn(&str) -> bool,
    ) -> Result<(Vec<u8>, String), CaseError> {
        let what = self.block_name(heads);
        let fail = |why: String| CaseError::Format {
            path: what.clone(),
            why,
        };
        // The header first (names, dtypes, block shapes, offsets), then the
        // data gathered straight into place: one buffer, no second copy.
        let mut header = Map::new();
        let meta: Map<String, Value> = self
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        header.insert("__metadata__".into(), Value::Object(meta));
        let mut parts = vec![];
        let mut offset = 0usize;
        for e in self
            .tensors
            .iter()
            .filter(|e| keep(&e.name) || e.name == "cu_seqlens")
        {
            let (a, len, units) = match self.op.info().head_axis(&e.name) {
                None => {
                    let n = e.shape.first().copied().unwrap_or(1);
                    (0, n, 0..n)
                }
                Some(a) => {
                    let per = e.shape[a] / self.heads;
                    (a, e.shape[a], heads.start * per..heads.end * per)
                }
            };
            let mut shape = e.shape.clone();
            if let Some(x) = shape.get_mut(a) {
                *x = units.len();
            }
            let bytes = shape.iter().product::<usize>() * e.size;
            header.insert(
                e.name.clone(),
                serde_json::json!({
                    "dtype": e.dtype,
                    "shape": shape,
                    "data_offsets": [offset, offset + bytes],
                }),
            );
            parts.push((e, a, len, units, offset..offset + bytes));
            offset += bytes;
        }
        let mut text =
            serde_json::to_string(&Value::Object(header)).map_err(|e| fail(e.to_string()))?;
        // safetensors aligns the data to 8 bytes with trailing spaces.
        while (text.len() + 8) % 8 != 0 {
            text.push(' ');
        }
        let start = 8 + text.len();
        let mut out = vec![0u8; start + offset];
        out[..8].copy_from_slice(&(text.len() as u64).to_le_bytes());
        out[8..start].copy_from_slice(text.as_bytes());
        for (e, a, len, units, range) in parts {
            self.gather(
                e,
                a,
                len,
                units,
                &mut out[start + range.start..start + range.end],
            )
            .map_err(|err| fail(format!("reading `{}`: {err}", e.name)))?;
        }
        Ok((out, what))
    }

    /// Gathers `units` along axis `a` (of length `len`) of tensor `e` into `out`.
    fn gather(
        &self,
        e: &Entry,
        a: usize,
        len: usize,
        units: Range<usize>,
        out: &mut [u8],
    ) -> std::io::Result<()> {
        let inner: usize = e.shape.iter().skip(a + 1).product::<usize>() * e.size;
        let outer: usize = e.shape.iter().take(a).product();
        let row = len * inner;
        let (skip, take) = (units.start * inner, units.len() * inner);
        let rows_per_read = (READ_BYTES / row.max(1)).max(1);
        let mut buf = vec![];
        let mut dst = out.chunks_exact_mut(take.max(1));
        for first in (0..outer).step_by(rows_per_read) {
            let n = rows_per_read.min(outer - first);
            buf.resize(n * row, 0);
            self.file
                .read_exact_at(&mut buf, e.begin + (first * row) as u64)?;
            for (r, d) in buf.chunks_exact(row.max(1)).zip(&mut dst) {
                d.copy_from_slice(&r[skip..skip + take]);
            }
        }
        Ok(())
    }

    /// `(full shape, flat index in the full tensor)` of a head block's
    /// tensor `name` of shape `block`: heads `heads` of the whole case.
    pub(crate) fn place(
        &self,
        name: &str,
        block: &[usize],
        heads: &Range<usize>,
    ) -> Option<(Vec<usize>, impl Fn(usize) -> usize)> {
        let a = self.op.info().head_axis(name)?;
        let per = block.get(a)? / heads.len();
        let mut full = block.to_vec();
        full[a] = per * self.heads;
        let inner: usize = block.iter().skip(a + 1).product();
        let (lb, lf, off) = (block[a] * inner, full[a] * inner, heads.start * per * inner);
        Some((full, move |i: usize| {
            (i / lb.max(1)) * lf + off + i % lb.max(1)
        }))
    }
}

/// `f` (a computation of a case's outputs and gradients) run on `case`
/// one block of `per_block` query/key heads at a time, the blocks' results
/// placed into whole tensors: the same values as one run on the whole case,
/// since heads never mix, with one block's buffers live instead of all.
/// KDA and DPLR only (`None` for token-shift or a tensor without a head axis).
pub fn compute_by_blocks<E>(
    case: &Case,
    per_block: usize,
    mut f: impl FnMut(Case) -> Result<Tensors, E>,
) -> Option<Result<Tensors, E>> {
    let info = case.meta.op.info();
    let head_axis = |n: &str| info.head_axis(n);
    let heads = *case.tensors.get(info.first_input())?.shape().get(2)?;
    let all_split = case.tensors.iter().all(|(n, x)| {
        head_axis(n).is_some_and(|a| x.shape().get(a).is_some_and(|&l| l % heads == 0))
    });
    if !info.streams_by_head || !all_split || per_block == 0 {
        return None;
    }
    let mut whole = Tensors::new();
    for h0 in (0..heads).step_by(per_block) {
        let h = h0..(h0 + per_block).min(heads);
        let mut block = Case::new(case.meta.clone());
        block.cu_seqlens = case.cu_seqlens.clone();
        block.dtypes = case.dtypes.clone();
        for (name, x) in &case.tensors {
            let a = head_axis(name).expect("checked");
            let per = x.shape()[a] / heads;
            let part = x.slice_axis(Axis(a), Slice::from(h.start * per..h.end * per));
            block.tensors.insert(name.clone(), part.to_owned());
        }
        let got = match f(block) {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        for (name, part) in got {
            let a = head_axis(&name).expect("results have a head axis");
            let per = part.shape()[a] / h.len();
            let full = whole.entry(name).or_insert_with(|| {
                let mut shape = part.shape().to_vec();
                shape[a] = per * heads;
                ArrayD::zeros(IxDyn(&shape))
            });
            full.slice_axis_mut(Axis(a), Slice::from(h.start * per..h.end * per))
                .assign(&part);
        }
    }
    Some(Ok(whole))
}

/// Per-tensor comparisons accumulated over head blocks.
#[derive(Default)]
pub struct BlockRows {
    rows: BTreeMap<String, (Vec<usize>, Result<Accum, String>)>,
}

impl BlockRows {
    /// Adds tensor `name` of one head block: `expected` against `got`
    /// (`None`: the candidate lacks it).
    pub fn add(
        &mut self,
        file: &HeadFile,
        heads: &Range<usize>,
        name: &str,
        expected: &ArrayD<f64>,
        got: Option<&ArrayD<f64>>,
    ) -> Result<(), CaseError> {
        let (full, at) = file.place(name, expected.shape(), heads).ok_or_else(|| {
            CaseError::Usage(format!(
                "{}: `{name}` has no head axis: verify this case whole",
                file.path.display()
            ))
        })?;
        let entry = self
            .rows
            .entry(name.to_string())
            .or_insert_with(|| (full, Ok(Accum::default())));
        let Ok(acc) = &mut entry.1 else {
            return Ok(());
        };
        match got {
            None => entry.1 = Err("missing from the candidate".into()),
            Some(c) if c.shape() != expected.shape() => {
                entry.1 = Err(format!(
                    "candidate shape {:?} in heads {}..{}",
                    c.shape(),
                    heads.start,
                    heads.end
                ))
            }
            Some(c) => acc.add(expected.iter().copied().zip(c.iter().copied()), at),
        }
        Ok(())
    }

    /// One row per tensor, in name order (as [`crate::report::VerifyReport::new`]).
    pub fn rows(self, max_ratio: f64) -> Vec<VerifyRow> {
        self.rows
            .into_iter()
            .map(|(name, (shape, acc))| match acc {
                Ok(acc) => VerifyRow::from_accum(&name, &shape, &acc, max_ratio),
                Err(problem) => VerifyRow::problem(&name, &shape, problem),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::Dtype;
    use crate::generate::{generate, GenSpec};
    use crate::impls::{Compute, Impl};
    use crate::report::VerifyReport;
    use deltaref::gates::Gate;

    /// A case file with stored truth: KDA with GVA (H = 3, HV = 6), gates,
    /// an initial state and three sequences, so that every head axis occurs.
    fn kda_file(dir: &Path, dtype: Dtype) -> PathBuf {
        let mut spec = GenSpec::new(Op::Kda);
        spec.lengths = Some(vec![5, 40, 19]);
        spec.shape = Some(vec![1, 64, 3, 6, 8, 4]);
        spec.gate = Gate::Kda;
        spec.initial_state = true;
        spec.expected = true;
        spec.dtype = dtype;
        let path = dir.join("kda.safetensors");
        generate(&spec).unwrap().write(&path).unwrap();
        path
    }

    /// The chunked engine against the stored truth, whole and by head blocks of two.
    #[test]
    fn head_blocks_give_the_whole_cases_rows() {
        let dir = tempfile::tempdir().unwrap();
        for dtype in [Dtype::F64, Dtype::Bf16] {
            let path = kda_file(dir.path(), dtype);
            let imp = Impl::chunk(16).unwrap();
            let case = Case::read(&path).unwrap();
            let got = imp.compute(&case, Compute::F64).unwrap();
            let whole = VerifyReport::new("", "", "", &case.results(), &got, 5e-3).rows;

            let file = HeadFile::open(&path, 0)
                .unwrap()
                .unwrap()
                .with_heads_per_block(2);
            assert_eq!(file.blocks(), vec![0..2, 2..3]);
            let mut rows = BlockRows::default();
            for heads in file.blocks() {
                let block = file.read_inputs(&heads).unwrap();
                let shapes = Op::Kda
                    .results()
                    .iter()
                    .filter_map(|&n| Some((n.to_string(), block.result_shape(n)?)))
                    .collect();
                let got = imp.compute_owned(block, Compute::F64).unwrap();
                for name in file.result_names() {
                    let expected = file.read_result(&heads, &name, &shapes).unwrap();
                    rows.add(&file, &heads, &name, &expected, got.get(&name))
                        .unwrap();
                }
            }
            let rows = rows.rows(5e-3);
            assert_eq!(rows.len(), whole.len());
            assert_eq!(rows.len(), 10, "o, final_state and 8 gradients");
            for (r, w) in rows.iter().zip(&whole) {
                assert_eq!(
                    (&r.tensor, &r.shape, &r.argmax),
                    (&w.tensor, &w.shape, &w.argmax)
                );
                assert_eq!((r.max_abs, r.pass), (w.max_abs, w.pass), "{}", r.tensor);
                let (a, b) = (r.norm_ratio.unwrap(), w.norm_ratio.unwrap());
                assert!((a - b).abs() <= 1e-12 * b.abs(), "{}: {a} vs {b}", r.tensor);
            }
        }
    }

    #[test]
    fn small_or_token_shift_files_are_read_whole_single_heads_in_one_block() {
        let dir = tempfile::tempdir().unwrap();
        let path = kda_file(dir.path(), Dtype::F64);
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(HeadFile::open(&path, size + 1).unwrap().is_none());
        assert!(HeadFile::open(&path, size).unwrap().is_some());
        let mut spec = GenSpec::new(Op::TokenShift);
        spec.expected = true;
        let ts = dir.path().join("ts.safetensors");
        generate(&spec).unwrap().write(&ts).unwrap();
        assert!(HeadFile::open(&ts, 0).unwrap().is_none());
        let mut spec = GenSpec::new(Op::Dplr);
        spec.shape = Some(vec![1, 32, 1, 8, 8]);
        let one = dir.path().join("one.safetensors");
        generate(&spec).unwrap().write(&one).unwrap();
        let one = HeadFile::open(&one, 0).unwrap().unwrap();
        let blocks = one.blocks();
        assert_eq!((one.heads(), blocks.len(), &blocks[0]), (1, 1, &(0..1)));
    }

    /// Asking for a result the file does not store names it.
    #[test]
    fn a_result_the_file_lacks_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = GenSpec::new(Op::Kda);
        spec.shape = Some(vec![1, 32, 2, 2, 8, 4]);
        let path = dir.path().join("inputs.safetensors");
        generate(&spec).unwrap().write(&path).unwrap();
        let file = HeadFile::open(&path, 0).unwrap().unwrap();
        assert!(!file.has_results() && file.result_names().is_empty());
        let e = file
            .read_result(&(0..1), "o", &BTreeMap::new())
            .unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("no stored result `o`") && e.contains("heads 0..1"),
            "{e}"
        );
    }

    /// A stored truth that is not finite is refused by name, as for a whole case.
    #[test]
    fn a_non_finite_stored_result_in_a_block_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = kda_file(dir.path(), Dtype::F64);
        let mut case = Case::read(&path).unwrap();
        let mut dq = case.tensors["dq"].clone();
        dq[[0, 50, 2, 3]] = f64::NAN;
        case.tensors.insert("dq".into(), dq);
        case.write(&path).unwrap();
        let file = HeadFile::open(&path, 0)
            .unwrap()
            .unwrap()
            .with_heads_per_block(1);
        let block = file.read_inputs(&(2..3)).unwrap();
        let shapes = [("dq".to_string(), block.result_shape("dq").unwrap())].into();
        let e = file.read_result(&(2..3), "dq", &shapes).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("heads 2..3") && e.contains("dq"), "{e}");
        assert!(file.read_result(&(0..1), "dq", &shapes).is_ok());
        assert!(file.read_result(&(2..3), "dk", &shapes).is_ok());
    }

    /// A result written into a head block's slices lands where the whole
    /// tensor's slice assignment puts it, and nowhere else.
    #[test]
    fn a_written_block_lands_in_its_heads() {
        let dir = tempfile::tempdir().unwrap();
        let path = kda_file(dir.path(), Dtype::Bf16);
        let before = Case::read(&path).unwrap();
        let file = HeadFile::for_filling(&path, 2).unwrap().unwrap();
        assert_eq!(file.blocks(), vec![0..2, 2..3]);
        for (name, axis) in [("dv", 2), ("dh0", 1), ("ddt_bias", 0), ("o", 2)] {
            let whole = &before.tensors[name];
            let per = whole.shape()[axis] / 3;
            let mut block = whole
                .slice_axis(Axis(axis), Slice::from(2 * per..3 * per))
                .to_owned();
            block.mapv_inplace(|v| v + 1.0);
            file.write_result(&(2..3), name, &block).unwrap();
            let mut want = whole.clone();
            want.slice_axis_mut(Axis(axis), Slice::from(2 * per..3 * per))
                .assign(&block);
            let after = Case::read(&path).unwrap();
            assert_eq!(after.tensors[name], want, "{name}");
        }
        let after = Case::read(&path).unwrap();
        for name in ["q", "dq", "final_state"] {
            assert_eq!(after.tensors[name], before.tensors[name], "{name}");
        }
    }

    /// Writing an input, a block of the wrong shape or one past the last
    /// head is refused by name; an op without heads is not opened.
    #[test]
    fn writing_a_block_the_file_has_no_room_for_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = kda_file(dir.path(), Dtype::F64);
        let file = HeadFile::for_filling(&path, 1).unwrap().unwrap();
        // One value head: a query/key head has two (GVA, HV = 2H).
        let o = Case::read(&path).unwrap().tensors["o"]
            .slice_axis(Axis(2), Slice::from(0..1))
            .to_owned();
        let e = file.write_result(&(0..1), "q", &o).unwrap_err().to_string();
        assert!(e.contains("result `q`: the file has no room for it"), "{e}");
        let e = file.write_result(&(0..1), "o", &o).unwrap_err().to_string();
        assert!(
            e.contains("expected shape [1, 64, 2, 4] for heads 0..1"),
            "{e}"
        );
        let two = Case::read(&path).unwrap().tensors["o"]
            .slice_axis(Axis(2), Slice::from(0..2))
            .to_owned();
        let e = file
            .write_result(&(3..4), "o", &two)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("heads 3..4") && e.contains("expected shape"),
            "{e}"
        );
        let mut spec = GenSpec::new(Op::TokenShift);
        spec.expected = true;
        let ts = dir.path().join("ts.safetensors");
        generate(&spec).unwrap().write(&ts).unwrap();
        assert!(HeadFile::for_filling(&ts, 1).unwrap().is_none());
        let e = HeadFile::for_filling(&dir.path().join("none"), 1)
            .err()
            .unwrap();
        assert!(e.to_string().contains("cannot read"), "{e}");
    }

    /// A result stored in another dtype than f64 is not overwritten.
    #[test]
    fn a_result_stored_below_f64_is_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = kda_file(dir.path(), Dtype::F64);
        let mut case = Case::read(&path).unwrap();
        let o = case.tensors["o"].clone();
        case.insert("o", o.clone(), Dtype::F32);
        case.write(&path).unwrap();
        let file = HeadFile::for_filling(&path, 3).unwrap().unwrap();
        let e = file.write_result(&(0..3), "o", &o).unwrap_err().to_string();
        assert!(e.contains("stored as F32, not F64"), "{e}");
    }
}
