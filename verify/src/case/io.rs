//! Case files on disk: safetensors framing, decoding and encoding, the
//! checks that run before the parser sizes anything, candidates.

use std::fmt;
use std::io::Write;
use std::path::Path;

use half::{bf16, f16};
use ndarray::{ArrayD, IxDyn};
use safetensors::tensor::{Dtype as StDtype, Metadata, SafeTensors, TensorInfo, TensorView};
use safetensors::View;
use serde_json::{Map, Value};

use super::dtype::{encode, st};
use super::{Case, CaseError, CaseMeta, Dtype, Op};

/// A case tensor as safetensors writes it, encoded when its bytes are asked for.
enum Encoded<'a> {
    Float(&'a ArrayD<f64>, Dtype, StDtype),
    Int(&'a [i64], Vec<usize>),
}

/// A tensor of a case file drawn only when its bytes are written
/// ([`Case::write_filled`]), stored in `dtype`.
pub struct Drawn {
    pub draw: deltaref::inputs::Draw,
    pub dtype: Dtype,
}

/// A tensor's dtype and shape without its bytes (to build the header alone).
#[derive(Clone)]
struct HeaderOnly {
    dtype: StDtype,
    shape: Vec<usize>,
    len: usize,
}

impl HeaderOnly {
    /// A tensor `name` of `shape` stored in `dtype`, not yet formed.
    fn planned(name: &str, dtype: Dtype, shape: Vec<usize>) -> Result<HeaderOnly, String> {
        let dtype = st(name, dtype)?;
        let len = super::memory::elements(&shape)
            .and_then(|n| usize::try_from(n.checked_mul(dtype.bitsize() as u64 / 8)?).ok())
            .ok_or_else(|| format!("tensor `{name}` of shape {shape:?} overflows"))?;
        Ok(HeaderOnly { dtype, shape, len })
    }

    fn of(v: &impl View) -> HeaderOnly {
        HeaderOnly {
            dtype: v.dtype(),
            shape: v.shape().to_vec(),
            len: v.data_len(),
        }
    }
}

impl safetensors::View for HeaderOnly {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

/// safetensors' order of the tensors' bytes in a file: dtype alignment
/// down, then name.
fn data_order<V: View>(a: &(String, V), b: &(String, V)) -> std::cmp::Ordering {
    b.1.dtype().cmp(&a.1.dtype()).then(a.0.cmp(&b.0))
}

impl safetensors::View for Encoded<'_> {
    fn dtype(&self) -> StDtype {
        match self {
            Encoded::Float(_, _, d) => *d,
            Encoded::Int(..) => StDtype::I64,
        }
    }
    fn shape(&self) -> &[usize] {
        match self {
            Encoded::Float(x, ..) => x.shape(),
            Encoded::Int(_, s) => s,
        }
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        match self {
            Encoded::Float(x, dt, _) => encode(*dt, x).into(),
            Encoded::Int(cu, _) => cu
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>()
                .into(),
        }
    }
    fn data_len(&self) -> usize {
        match self {
            Encoded::Float(x, _, d) => x.len() * d.bitsize() / 8,
            Encoded::Int(cu, _) => cu.len() * 8,
        }
    }
}

impl Case {
    /// The safetensors bytes of the case (deterministic).
    pub fn to_bytes(&self) -> Result<Vec<u8>, CaseError> {
        let format = |why: String| CaseError::Format {
            path: "(in memory)".into(),
            why,
        };
        let views = self.views().map_err(format)?;
        safetensors::tensor::serialize(views, Some(self.meta_map()))
            .map_err(|e| format(e.to_string()))
    }

    /// [`Case::to_bytes`] with more metadata entries beside `case` (a case
    /// written in a kernel's convention records it under `convention`).
    pub fn to_bytes_with_metadata(&self, extra: &[(&str, String)]) -> Result<Vec<u8>, CaseError> {
        let format = |why: String| CaseError::Format {
            path: "(in memory)".into(),
            why,
        };
        let views = self.views().map_err(format)?;
        let mut meta = self.meta_map();
        meta.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        safetensors::tensor::serialize(views, Some(meta)).map_err(|e| format(e.to_string()))
    }

    /// Writes the case atomically: a temporary file next to `path`, then
    /// rename. The bytes are [`Case::to_bytes`]'s, each tensor encoded only
    /// as it is written (a long case is never in memory twice).
    pub fn write(&self, path: &Path) -> Result<(), CaseError> {
        let mut views = self.views().map_err(|why| CaseError::Format {
            path: path.display().to_string(),
            why,
        })?;
        let header: Vec<(String, HeaderOnly)> = views
            .iter()
            .map(|(n, v)| (n.clone(), HeaderOnly::of(v)))
            .collect();
        let head = self.head(path, header)?;
        views.sort_by(data_order);
        super::files::write_atomic_with(path, |tmp| {
            // `create_new` never follows a link planted at the temporary name.
            let f = std::fs::File::options()
                .write(true)
                .create_new(true)
                .open(tmp)?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            w.write_all(&head)?;
            for (_, v) in &views {
                w.write_all(&v.data())?;
            }
            w.flush()
        })
    }

    /// The length prefix and the header of safetensors' serialisation of
    /// `header`'s tensors, formed as `safetensors::serialize` forms them
    /// (tensors in [`data_order`], offsets in that order, the JSON padded
    /// with spaces to 8 bytes), without its buffer for the whole file.
    fn head(
        &self,
        path: &Path,
        mut header: Vec<(String, HeaderOnly)>,
    ) -> Result<Vec<u8>, CaseError> {
        let format = |why: String| CaseError::Format {
            path: path.display().to_string(),
            why,
        };
        header.sort_by(data_order);
        let mut offset = 0;
        let infos = header
            .into_iter()
            .map(|(name, h)| {
                let start = offset;
                offset += h.len;
                let data_offsets = (start, offset);
                (
                    name,
                    TensorInfo {
                        dtype: h.dtype,
                        shape: h.shape,
                        data_offsets,
                    },
                )
            })
            .collect();
        let metadata =
            Metadata::new(Some(self.meta_map()), infos).map_err(|e| format(e.to_string()))?;
        let mut json = serde_json::to_vec(&metadata).map_err(|e| format(e.to_string()))?;
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut head = (json.len() as u64).to_le_bytes().to_vec();
        head.extend(json);
        Ok(head)
    }

    /// Writes the case atomically as [`Case::write`] does, plus the `drawn`
    /// tensors and room for `results` (float64, `(name, shape)`) that `fill`
    /// writes in place: the header, then the case's tensors and the drawn
    /// ones (a drawn tensor is drawn, rounded to its dtype as
    /// [`Case::insert`] rounds, written and freed in its turn: one alive at a
    /// time; the case is consumed the same way), then `fill` runs on the
    /// temporary file, whose result bytes are zero until it writes them.
    /// With every result filled, the bytes are those of [`Case::write`] of
    /// the case holding the drawn tensors and the results. Returns the
    /// number of tensors written.
    pub fn write_filled(
        mut self,
        path: &Path,
        drawn: Vec<Drawn>,
        results: &[(String, Vec<usize>)],
        fill: impl FnOnce(&Path) -> Result<(), CaseError>,
    ) -> Result<usize, CaseError> {
        let format = |why: String| CaseError::Format {
            path: path.display().to_string(),
            why,
        };
        let mut header: Vec<(String, HeaderOnly)> = self
            .views()
            .map_err(format)?
            .iter()
            .map(|(n, v)| (n.clone(), HeaderOnly::of(v)))
            .collect();
        let planned = drawn
            .iter()
            .map(|d| {
                let (name, shape) = (d.draw.name, d.draw.shape.clone());
                Ok((name.to_string(), HeaderOnly::planned(name, d.dtype, shape)?))
            })
            .chain(results.iter().map(|(name, shape)| {
                Ok((
                    name.clone(),
                    HeaderOnly::planned(name, Dtype::F64, shape.clone())?,
                ))
            }))
            .collect::<Result<Vec<_>, String>>()
            .map_err(format)?;
        for (name, h) in planned {
            if header.iter().any(|(n, _)| *n == name) {
                return Err(format(format!(
                    "`{name}` is planned twice (a tensor of the case, a drawn tensor or a result)"
                )));
            }
            header.push((name, h));
        }
        let head = self.head(path, header.clone())?;
        header.sort_by(data_order);
        let count = header.len();
        let mut drawn: std::collections::HashMap<&str, Drawn> =
            drawn.into_iter().map(|d| (d.draw.name, d)).collect();
        let mut failed = None;
        super::files::write_atomic_with(path, |tmp| {
            use std::os::unix::fs::FileExt;
            // `create_new` never follows a link planted at the temporary name.
            let f = std::fs::File::options()
                .write(true)
                .create_new(true)
                .open(tmp)?;
            let end = header.iter().fold(head.len(), |at, (_, h)| at + h.len);
            f.set_len(end as u64)?;
            f.write_all_at(&head, 0)?;
            let mut at = head.len() as u64;
            for (name, h) in &header {
                if let Some(x) = self.tensors.remove(name) {
                    let dt = self.dtypes.get(name).copied().unwrap_or(Dtype::F64);
                    f.write_all_at(&encode(dt, &x), at)?;
                } else if let Some(d) = drawn.remove(name.as_str()) {
                    let x = d.draw.draw();
                    if x.shape() != h.shape.as_slice() {
                        failed = Some(format(format!(
                            "tensor `{name}` was drawn with shape {:?}, planned as {:?}",
                            x.shape(),
                            h.shape
                        )));
                        return Err(std::io::Error::other("a drawn tensor's shape"));
                    }
                    f.write_all_at(&encode(d.dtype, &super::stored(x, d.dtype)), at)?;
                } else if name == "cu_seqlens" {
                    let cu = self.cu_seqlens.take().unwrap_or_default();
                    let bytes: Vec<u8> = cu.iter().flat_map(|v| v.to_le_bytes()).collect();
                    f.write_all_at(&bytes, at)?;
                }
                at += h.len as u64;
            }
            drop(f);
            fill(tmp).map_err(|e| {
                failed = Some(e);
                std::io::Error::other("filling the results failed")
            })
        })
        .map_err(|e| failed.take().unwrap_or(e))?;
        Ok(count)
    }

    /// The `case` metadata entry of the file.
    fn meta_map(&self) -> std::collections::HashMap<String, String> {
        std::collections::HashMap::from([("case".to_string(), self.meta.to_json().to_string())])
    }

    /// The file's tensors, encoded on demand; an error for a tensor whose
    /// dtype a case file cannot hold.
    fn views(&self) -> Result<Vec<(String, Encoded<'_>)>, String> {
        let mut views: Vec<(String, Encoded)> = self
            .tensors
            .iter()
            .map(|(n, x)| {
                let dt = self.dtypes.get(n).copied().unwrap_or(Dtype::F64);
                Ok((n.clone(), Encoded::Float(x, dt, st(n, dt)?)))
            })
            .collect::<Result<_, String>>()?;
        if let Some(cu) = &self.cu_seqlens {
            views.push(("cu_seqlens".into(), Encoded::Int(cu, vec![cu.len()])));
        }
        Ok(views)
    }

    /// Reads and validates a case file.
    pub fn read(path: &Path) -> Result<Case, CaseError> {
        let bytes = super::files::read_bounded(path, READ_WIDEN)?;
        Case::from_bytes(&bytes, &path.display().to_string())
    }

    /// Parses a case from the bytes of a safetensors file (`what` names it
    /// in errors). A case written in a kernel's convention (metadata
    /// `convention`, `gen --convention`) is mapped back to FLA's layout.
    pub fn from_bytes(bytes: &[u8], what: &str) -> Result<Case, CaseError> {
        let case = Case::parse(bytes, what, None)?;
        let case = in_fla_layout(bytes, what, case)?;
        case.validate().map_err(|e| CaseError::Invalid {
            path: what.to_string(),
            source: e,
        })?;
        Ok(case)
    }

    /// Reads a candidate: the outputs and gradients a port produced for a
    /// case of op `op`. See [`Case::candidate_from_bytes`].
    pub fn read_candidate(path: &Path, op: Op) -> Result<Case, CaseError> {
        let bytes = super::files::read_bounded(path, READ_WIDEN)?;
        Case::candidate_from_bytes(&bytes, &path.display().to_string(), op)
    }

    /// Reads a candidate for `case`: as [`Case::read_candidate`], and when
    /// the candidate states `case` metadata, every option it states that
    /// changes the math (scale, l2norm, gate, lower bound, beta sigmoid,
    /// negative eigenvalues; `op` is checked by the parser) must agree with
    /// the case's: else an error naming the differing keys (CP layout, chunk
    /// size, seed and dtype may differ).
    pub fn read_candidate_for(path: &Path, case: &Case) -> Result<Case, CaseError> {
        let bytes = super::files::read_bounded(path, READ_WIDEN)?;
        Case::candidate_for_bytes(&bytes, &path.display().to_string(), case)
    }

    /// [`Case::read_candidate_for`] of a candidate's bytes (`what` names
    /// them in errors).
    pub fn candidate_for_bytes(bytes: &[u8], what: &str, case: &Case) -> Result<Case, CaseError> {
        let cand = Case::candidate_from_bytes(bytes, what, case.meta.op)?;
        let stated: Vec<String> = SafeTensors::read_metadata(bytes)
            .ok()
            .and_then(|(_, m)| m.metadata().as_ref()?.get("case").cloned())
            .and_then(|text| serde_json::from_str::<Map<String, Value>>(&text).ok())
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        let differ = case.math_options_differing(&cand.meta, &stated);
        if !differ.is_empty() {
            return Err(CaseError::Metadata {
                path: what.to_string(),
                why: format!(
                    "the candidate's `case` states other options than the case: {}",
                    differ.join(", ")
                ),
            });
        }
        // A candidate written in another convention carries its inputs in
        // that layout: compare them in FLA's (one that does not map back
        // cannot be compared, and its results meet `--convention` later).
        if let Ok(in_fla) = in_fla_layout(bytes, what, cand.clone()) {
            case.check_candidate_inputs(&in_fla, what)?;
        }
        Ok(cand)
    }

    /// `key (case X, candidate Y)` for every option of the op `stated` by
    /// the candidate that differs from the case's (a port may state only
    /// some); an absent `scale` is its default `K^-0.5`.
    fn math_options_differing(&self, other: &CaseMeta, stated: &[String]) -> Vec<String> {
        let math = self.meta.op.entry().option_keys();
        let k = self
            .tensors
            .get(self.meta.op.first_input())
            .and_then(|q| q.shape().last().copied());
        let with_scale = |m: &CaseMeta| {
            let mut j = m.to_json();
            if let (Some(k), Value::Object(o)) = (k, &mut j) {
                if math.contains(&"scale") && !o.contains_key("scale") {
                    o.insert("scale".into(), (k as f64).powf(-0.5).into());
                }
            }
            j
        };
        let (a, b) = (with_scale(&self.meta), with_scale(other));
        math.iter()
            .filter(|key| stated.iter().any(|s| s == *key) && a.get(**key) != b.get(**key))
            .map(|key| {
                let show = |v: Option<&Value>| v.map_or("absent".to_string(), Value::to_string);
                format!(
                    "{key} (case {}, candidate {})",
                    show(a.get(*key)),
                    show(b.get(*key))
                )
            })
            .collect()
    }

    /// Parses a candidate. Unlike a case it needs no inputs (a port saves
    /// only what it computed), its `case` metadata is optional (when present
    /// its `op` must be `op`), and non-finite values are kept: a NaN in a
    /// port's output is a failed comparison, not an unreadable file. Framing,
    /// tensor names and dtypes are checked as for a case; shapes are checked
    /// by the comparison, tensor by tensor.
    pub fn candidate_from_bytes(bytes: &[u8], what: &str, op: Op) -> Result<Case, CaseError> {
        Case::parse(bytes, what, Some(op))
    }

    /// Framing, metadata, names and dtypes, without the cross-tensor
    /// validation. `candidate_of`: a candidate for a case of this op (its
    /// metadata is then optional but must name this op).
    fn parse(bytes: &[u8], what: &str, candidate_of: Option<Op>) -> Result<Case, CaseError> {
        let fmt_err = |why: String| CaseError::Format {
            path: what.to_string(),
            why,
        };
        check_header_length(bytes).map_err(fmt_err)?;
        reject_duplicate_names(bytes).map_err(fmt_err)?;
        let st = SafeTensors::deserialize(bytes).map_err(|e| fmt_err(describe(&e)))?;
        let (_, md) = SafeTensors::read_metadata(bytes).map_err(|e| fmt_err(describe(&e)))?;
        let meta_err = |why: String| CaseError::Metadata {
            path: what.to_string(),
            why,
        };
        let text = md.metadata().as_ref().and_then(|m| m.get("case"));
        let meta = match (text, candidate_of) {
            (Some(text), _) => CaseMeta::from_json(text).map_err(meta_err)?,
            (None, Some(op)) => CaseMeta::new(op),
            (None, None) => {
                return Err(meta_err(
                    "no `case` entry in the metadata (expected {\"op\": ...})".into(),
                ))
            }
        };
        if let Some(op) = candidate_of.filter(|&op| op != meta.op) {
            return Err(meta_err(format!(
                "candidate op `{}` differs from the case's `{}`",
                meta.op.name(),
                op.name()
            )));
        }
        let mut case = Case::new(meta);
        let mut names: Vec<(String, TensorView)> = st.tensors();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, view) in names {
            let terr = |why: String| CaseError::Tensor {
                path: what.to_string(),
                tensor: name.clone(),
                why,
            };
            if !case.meta.op.knows(&name) {
                return Err(terr(format!(
                    "not a tensor of op {} (valid names: {})",
                    case.meta.op.name(),
                    case.meta.op.known_names().join(", ")
                )));
            }
            if name == "cu_seqlens" {
                case.cu_seqlens = Some(decode_cu_seqlens(&view).map_err(terr)?);
                continue;
            }
            let (values, dt) = decode(&view).map_err(terr)?;
            let arr = ArrayD::from_shape_vec(IxDyn(view.shape()), values)
                .map_err(|e| terr(e.to_string()))?;
            case.tensors.insert(name.clone(), arr);
            case.dtypes.insert(name, dt);
        }
        Ok(case)
    }
}

pub use super::files::write_atomic;

/// `case` (parsed from `bytes`) in FLA's layout: mapped back when its
/// metadata names a convention other than `fla`.
fn in_fla_layout(bytes: &[u8], what: &str, case: Case) -> Result<Case, CaseError> {
    let meta_err = |why: String| CaseError::Metadata {
        path: what.to_string(),
        why,
    };
    let (_, md) = SafeTensors::read_metadata(bytes).map_err(|e| meta_err(describe(&e)))?;
    let entry = md.metadata().as_ref().and_then(|m| m.get("convention"));
    match crate::convention::written_in(entry.map(String::as_str)).map_err(meta_err)? {
        None => Ok(case),
        Some(conv) => conv.case_to_fla(case).map_err(|e| {
            meta_err(format!(
                "the case is written in convention {} but does not map back: {e}",
                conv.name
            ))
        }),
    }
}

/// What reading a case costs per stored byte: the bytes, the f64 tensors
/// and a validation copy for an f64 file (a bf16 file widens more; the
/// command's compute estimate, from the shapes, covers that).
const READ_WIDEN: u64 = 4;

/// `cu_seqlens`: a 1-D int64 or int32 tensor (FLA's kernels take int32;
/// many callers hold that), widened to i64.
fn decode_cu_seqlens(view: &TensorView) -> Result<Vec<i64>, String> {
    if view.shape().len() != 1 {
        return Err(format!(
            "must be a 1-D int64 or int32 tensor, got shape {:?}",
            view.shape()
        ));
    }
    match view.dtype() {
        StDtype::I64 => Ok(view
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect()),
        StDtype::I32 => Ok(view
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
            .collect()),
        other => Err(format!(
            "must be a 1-D int64 or int32 tensor, got {other:?} {:?}",
            view.shape()
        )),
    }
}

/// Float tensors only; integer dtypes are refused by name.
fn decode(view: &TensorView) -> Result<(Vec<f64>, Dtype), String> {
    let d = view.data();
    Ok(match view.dtype() {
        StDtype::F64 => (
            d.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8")))
                .collect(),
            Dtype::F64,
        ),
        StDtype::F32 => (
            d.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4")) as f64)
                .collect(),
            Dtype::F32,
        ),
        StDtype::BF16 => (
            d.chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
                .collect(),
            Dtype::Bf16,
        ),
        StDtype::F16 => (
            d.chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
                .collect(),
            Dtype::F16,
        ),
        other => {
            return Err(format!(
                "dtype {other:?} is not a supported float type (F64, F32, BF16 or F16)"
            ))
        }
    })
}

fn describe(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => "file too short for the 8-byte header length (truncated?)".into(),
        E::InvalidHeaderLength => "header length is larger than the file (truncated?)".into(),
        E::HeaderTooLarge => "header length is implausibly large".into(),
        E::InvalidHeaderDeserialization(j) => format!("header is not valid JSON: {j}"),
        E::MetadataIncompleteBuffer => {
            "tensor data is shorter than the header says (truncated?)".into()
        }
        E::TensorInvalidInfo => "a tensor's dtype and shape do not match its byte length".into(),
        other => other.to_string(),
    }
}

/// The 8-byte header length must fit in the file (checked before the
/// parser sizes anything by it).
fn check_header_length(bytes: &[u8]) -> Result<(), String> {
    let Some(n) = bytes.get(..8) else {
        return Err(format!(
            "file too short for the 8-byte header length ({} bytes; truncated?)",
            bytes.len()
        ));
    };
    let n = u64::from_le_bytes(n.try_into().expect("8 bytes"));
    let room = bytes.len() as u64 - 8;
    // The safetensors parser's own bound on a header.
    const MAX_HEADER: u64 = 100_000_000;
    if n > MAX_HEADER {
        return Err(format!(
            "header length {n} is implausibly large (at most {MAX_HEADER} bytes)"
        ));
    }
    if n > room {
        return Err(format!(
            "header length {n} is larger than the file ({room} bytes after it; truncated?)"
        ));
    }
    Ok(())
}

/// JSON objects silently keep the last of duplicate keys; a case must not.
fn reject_duplicate_names(bytes: &[u8]) -> Result<(), String> {
    struct Keys(Vec<String>);
    impl<'de> serde::Deserialize<'de> for Keys {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Keys;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut m: A,
                ) -> Result<Keys, A::Error> {
                    let mut keys = Vec::new();
                    while let Some((k, _)) = m.next_entry::<String, serde::de::IgnoredAny>()? {
                        keys.push(k);
                    }
                    Ok(Keys(keys))
                }
            }
            d.deserialize_map(V)
        }
    }
    // Framing errors are reported by the safetensors parser itself.
    let Some(n) = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8")) as usize)
    else {
        return Ok(());
    };
    let Some(header) = bytes.get(8..8usize.saturating_add(n)) else {
        return Ok(());
    };
    let Ok(Keys(mut keys)) = serde_json::from_slice::<Keys>(header) else {
        return Ok(());
    };
    keys.sort();
    match keys.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(format!("duplicate tensor name `{}` in the header", w[0])),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Room for a result the case already holds is refused by name, before
    /// anything is written.
    #[test]
    fn room_for_a_tensor_the_case_holds_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.safetensors");
        let mut case = Case::new(CaseMeta::new(Op::TokenShift));
        case.insert("x", ArrayD::zeros(IxDyn(&[1, 2, 3])), Dtype::F64);
        let e = case
            .clone()
            .write_filled(&path, vec![], &[("x".into(), vec![1, 2, 3])], |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`x` is planned twice"), "{e}");
        let e = case
            .write_filled(&path, vec![], &[("y".into(), vec![usize::MAX, 2])], |_| {
                Ok(())
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tensor `y` of shape") && e.contains("overflows"),
            "{e}"
        );
        assert!(!path.exists());
    }

    /// An int32 `cu_seqlens` (what FLA's kernels and many callers hold)
    /// reads as the int64 one; another integer type, or 2-D, is refused
    /// naming the tensor.
    #[test]
    fn int32_cu_seqlens_is_accepted() {
        let mut spec = crate::generate::GenSpec::new(Op::TokenShift);
        spec.lengths = Some(vec![2, 3]);
        spec.shape = Some(vec![1, 5, 3]);
        let case = crate::generate::generate(&spec).unwrap();
        assert_eq!(case.cu_seqlens, Some(vec![0, 2, 5]));
        // The case's own file, its cu_seqlens rewritten as `dtype`, `shape`.
        let bytes = |dtype: StDtype, data: Vec<u8>, shape: Vec<usize>| {
            let own = case.to_bytes().unwrap();
            let st = SafeTensors::deserialize(&own).unwrap();
            let (_, md) = SafeTensors::read_metadata(&own).unwrap();
            let mut views: Vec<(String, TensorView)> = st
                .tensors()
                .into_iter()
                .filter(|(n, _)| n != "cu_seqlens")
                .collect();
            views.push((
                "cu_seqlens".into(),
                TensorView::new(dtype, shape, &data).unwrap(),
            ));
            safetensors::serialize(views, md.metadata().clone()).unwrap()
        };
        let i32s: Vec<u8> = [0i32, 2, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
        let read = Case::from_bytes(&bytes(StDtype::I32, i32s.clone(), vec![3]), "c").unwrap();
        assert_eq!(read, case);
        let e = Case::from_bytes(&bytes(StDtype::I32, i32s, vec![1, 3]), "c")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cu_seqlens") && e.contains("1-D int64 or int32"),
            "{e}"
        );
        let e = Case::from_bytes(&bytes(StDtype::U8, vec![0u8, 2, 5], vec![3]), "c")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cu_seqlens") && e.contains("U8"), "{e}");
    }

    /// A tensor under a name the op does not know (FLA's `ht` for the
    /// final state) is refused with the list of the names it does know.
    #[test]
    fn a_wrong_tensor_name_is_refused_with_the_valid_names() {
        let mut case = Case::new(CaseMeta::new(Op::Kda));
        case.insert("ht", ArrayD::zeros(IxDyn(&[1, 1, 2, 2])), Dtype::F64);
        let e = Case::from_bytes(&case.to_bytes().unwrap(), "c")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`ht`") || e.contains("ht"), "{e}");
        for name in ["valid names", "final_state", "dht", "initial_state", "q"] {
            assert!(e.contains(name), "{name}: {e}");
        }
    }

    /// `write` forms the header itself; its file is safetensors' own
    /// serialisation (`to_bytes`) byte for byte: every stored dtype, an
    /// integer `cu_seqlens`, names out of order.
    #[test]
    fn written_files_are_safetensors_own_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.safetensors");
        let mut case = Case::new(CaseMeta::new(Op::Kda));
        let x = |n: usize| ArrayD::from_shape_fn(IxDyn(&[1, n, 3]), |i| i[1] as f64 / 3.0);
        case.insert("v", x(5), Dtype::F64);
        case.insert("q", x(4), Dtype::Bf16);
        case.insert("k", x(3), Dtype::F16);
        case.insert("beta", x(2), Dtype::F32);
        case.cu_seqlens = Some(vec![0, 2, 5]);
        case.write(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), case.to_bytes().unwrap());
    }

    /// A drawn tensor is written as the case holding it writes it (rounded
    /// to its dtype, in data order among the case's own); one drawn with
    /// another shape than planned is refused by name, and no file is left.
    #[test]
    fn drawn_tensors_are_written_as_held_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.safetensors");
        let x = |n: usize| ArrayD::from_shape_fn(IxDyn(&[1, n, 3]), |i| i[1] as f64 / 3.0);
        let draw = |name, n: usize, wrong: bool| Drawn {
            draw: deltaref::inputs::Draw::new(name, vec![1, n, 3], move |_| {
                x(n + usize::from(wrong))
            }),
            dtype: Dtype::Bf16,
        };
        let mut case = Case::new(CaseMeta::new(Op::Kda));
        case.insert("v", x(5), Dtype::F64);
        case.cu_seqlens = Some(vec![0, 2, 5]);
        let mut whole = case.clone();
        whole.insert("q", x(4), Dtype::Bf16);
        whole.insert("beta", x(2), Dtype::Bf16);
        let drawn = vec![draw("q", 4, false), draw("beta", 2, false)];
        case.clone()
            .write_filled(&path, drawn, &[], |_| Ok(()))
            .unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), whole.to_bytes().unwrap());
        std::fs::remove_file(&path).unwrap();
        let e = case
            .write_filled(&path, vec![draw("q", 4, true)], &[], |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tensor `q` was drawn with shape [1, 5, 3], planned as [1, 4, 3]"),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    /// What `fill` refuses is the write's error, and no file is left.
    #[test]
    fn a_failed_fill_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.safetensors");
        let mut case = Case::new(CaseMeta::new(Op::TokenShift));
        case.insert("x", ArrayD::zeros(IxDyn(&[1, 2, 3])), Dtype::Bf16);
        let e = case
            .write_filled(&path, vec![], &[("y".into(), vec![1, 2, 3])], |_| {
                Err(CaseError::Usage("no truth".into()))
            })
            .unwrap_err()
            .to_string();
        assert_eq!(e, "no truth");
        assert!(!path.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
