//! The CUDA device: the driver and NVRTC loaded at run time (so the workspace
//! builds and its tests run on machines without CUDA), kernels compiled from
//! source by NVRTC for the device's architecture and cached per source and
//! compile-time sizes, and memory whose exhaustion is a clear error.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::sys::CUresult;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr,
    DriverError, LaunchArgs, LaunchConfig, PinnedHostSlice, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};
use ndarray::{ArrayD, IxDyn};
use rayon::prelude::*;

use deltaref::Dtype;

use crate::error::{GpuError, Result};
use crate::kernels::{prep_defines, Defines, Source, PREP};

/// One CUDA device with its stream and compiled kernels.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    name: String,
    modules: Mutex<HashMap<(&'static str, Defines), Arc<CudaModule>>>,
    /// Nanoseconds spent in [`Gpu::load`] (compiling or loading modules).
    compile_ns: AtomicU64,
    /// The page-locked buffers tensors cross the bus through (allocated on
    /// first use, kept for the device's life).
    staging: Mutex<Vec<Stage>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({}, {})", self.name, self.arch)
    }
}

/// Bytes of one staging buffer: a part's conversion on every core takes a
/// few milliseconds, long enough to hide the previous part's copy.
const STAGE_BYTES: usize = 32 << 20;

/// Elements of a conversion a core takes at a time.
const PAR_MIN: usize = 1 << 15;

/// A page-locked host buffer and the event recorded after the last copy
/// that uses it. Copies from pageable memory go through the driver's own
/// bounce buffer, one at a time, at a fraction of the bus speed; from here
/// the copy engine reads directly while the cores fill the other buffer.
struct Stage {
    mem: PinnedHostSlice<u8>,
    copied: CudaEvent,
}

impl Stage {
    /// The first `len` elements of the buffer as `T`, once the last copy
    /// that used it has finished.
    fn part<T: DeviceRepr + ValidAsZeroBits + Copy>(&mut self, len: usize) -> Result<&mut [T]> {
        assert!(len * std::mem::size_of::<T>() <= self.mem.num_bytes());
        self.copied
            .synchronize()
            .map_err(|e| driver("waiting for a staged copy", e))?;
        let ptr = self
            .mem
            .as_mut_ptr()
            .map_err(|e| driver("reaching a staging buffer", e))?;
        // SAFETY: the allocation is page-aligned and holds `len` elements;
        // no copy reads or writes it any more (`copied` has completed); any
        // bit pattern is a valid `T` (`ValidAsZeroBits` plain data).
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<T>(), len) })
    }
}

/// `v` as bfloat16 bits, rounded as `half` rounds (the case's own
/// `Dtype::round`, so the device reads what the oracle is given). A bf16
/// case's values are bf16 already: their bits are read off the f32 without
/// `half`'s per-value special cases.
fn bf16_bits(v: f64) -> u16 {
    let f = v as f32;
    let u = f.to_bits();
    if u & 0xffff == 0 && f64::from(f) == v {
        (u >> 16) as u16
    } else {
        deltaref::dtype::to_bf16(v).to_bits()
    }
}

/// `n` zeros whose pages are mapped: the first write to a fresh page is a
/// page fault, which costs more than the copy that lands there. Mapping a
/// result's memory on every core while the device computes takes it off
/// the path from the last kernel to the f64 results.
pub(crate) fn mapped_zeros(n: usize) -> Vec<f64> {
    // Not `vec![0.0; n]`: reused memory would be zeroed on one core first.
    let mut v: Vec<f64> = Vec::with_capacity(n);
    advise_huge_pages(v.spare_capacity_mut());
    v.spare_capacity_mut()
        .par_chunks_mut(1 << 18)
        .for_each(|c| c.fill(std::mem::MaybeUninit::new(0.0)));
    // SAFETY: the loop above wrote all `n` elements.
    unsafe { v.set_len(n) };
    v
}

/// Asks Linux to back the whole 2 MiB pages of `buf` with transparent huge
/// pages. That matters where they are enabled for `madvise` only, as on
/// the GPU hosts lent: an 800 MB result then maps in about 400 faults
/// instead of 200,000, and the host's download time stops swinging with
/// the faulting (KDA, T = 8192, H = 96, K = V = 128 on an H100 host: the
/// download took 120–163 ms against 230–402 ms). Advice only: on an error
/// the pages stay 4 KiB.
#[cfg(target_os = "linux")]
fn advise_huge_pages<T>(buf: &mut [T]) {
    const HUGE: usize = 2 << 20;
    let start = buf.as_mut_ptr() as usize;
    let end = start + std::mem::size_of_val(buf);
    let (lo, hi) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
    if lo < hi {
        // SAFETY: `lo..hi` lies inside `buf`, which this process owns; the
        // advice changes no contents.
        unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages<T>(_: &mut [T]) {}

/// Null for an optional pointer argument.
static NULL: u64 = 0;

impl Gpu {
    /// Opens device `ordinal`: loads the driver and NVRTC first, so a machine
    /// without them gets [`GpuError::NoDriver`] / [`GpuError::NoNvrtc`], not a panic.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        ensure_driver()?;
        let count = CudaContext::device_count().map_err(|e| driver("cuDeviceGetCount", e))?;
        if count <= 0 {
            return Err(GpuError::NoDevice(
                "the CUDA driver is installed but sees no GPU".into(),
            ));
        }
        if ordinal >= count as usize {
            return Err(GpuError::NoDevice(format!(
                "device {ordinal} requested, the driver sees {count}"
            )));
        }
        ensure_nvrtc()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("creating the context", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver("reading the compute capability", e))?;
        let name = ctx
            .name()
            .map_err(|e| driver("reading the device name", e))?;
        let stream = ctx.default_stream();
        Ok(Gpu {
            ctx,
            stream,
            arch: format!("compute_{major}{minor}"),
            name,
            modules: Mutex::new(HashMap::new()),
            compile_ns: AtomicU64::new(0),
            staging: Mutex::new(Vec::new()),
        })
    }

    /// Device 0, or why there is none (the message GPU tests print when they skip).
    pub fn probe() -> Result<Gpu> {
        Gpu::open(0)
    }

    /// E.g. `"NVIDIA H100 80GB HBM3 (compute_90)"`.
    pub fn describe(&self) -> String {
        format!("{} ({})", self.name, self.arch)
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Kernel `function` of `source` compiled with `defines` (compiled once).
    pub(crate) fn function(
        &self,
        source: &Source,
        defines: Defines,
        function: &'static str,
    ) -> Result<CudaFunction> {
        let key = (source.name, defines);
        let module = {
            let mut cache = self.modules.lock().expect("module cache poisoned");
            match cache.get(&key) {
                Some(m) => m.clone(),
                None => {
                    let m = self.load(source, defines)?;
                    cache.insert(key, m.clone());
                    m
                }
            }
        };
        module
            .load_function(function)
            .map_err(|e| driver(&format!("finding kernel `{function}`"), e))
    }

    /// Loads a module from the PTX disk cache, or compiles it (and caches
    /// it); a cached file the driver rejects is replaced by a fresh build.
    fn load(&self, source: &Source, defines: Defines) -> Result<Arc<CudaModule>> {
        let t = Instant::now();
        let m = self.load_untimed(source, defines);
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.compile_ns.fetch_add(ns, Ordering::Relaxed);
        m
    }

    /// Seconds spent loading or compiling modules since the device was opened.
    pub fn compile_seconds(&self) -> f64 {
        self.compile_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    fn load_untimed(&self, source: &Source, defines: Defines) -> Result<Arc<CudaModule>> {
        let what = || format!("loading module `{}`", source.name);
        let cache = PtxCache::open();
        if let Some(ptx) = cache
            .as_ref()
            .and_then(|c| c.get(source, defines, &self.arch))
        {
            if let Ok(m) = self.ctx.load_module(ptx) {
                return Ok(m);
            }
        }
        let ptx = compile(source, defines, &self.arch)?;
        if let Some(c) = &cache {
            c.put(source, defines, &self.arch, &ptx.to_src());
        }
        self.ctx.load_module(ptx).map_err(|e| driver(&what(), e))
    }

    /// Launches a built kernel call.
    pub(crate) fn launch(
        &self,
        mut args: LaunchArgs<'_>,
        what: &str,
        cfg: LaunchConfig,
    ) -> Result<()> {
        unsafe { args.launch(cfg) }
            .map(|_| ())
            .map_err(|e| driver(&format!("launching {what}"), e))
    }

    /// Waits for the stream; kernel faults surface here.
    pub(crate) fn sync(&self, what: &str) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver(&format!("running {what}"), e))
    }

    /// Seconds `f` takes with the stream drained before and after.
    pub(crate) fn timed<R>(&self, what: &str, f: impl FnOnce() -> Result<R>) -> Result<(R, f64)> {
        self.sync(what)?;
        let t = Instant::now();
        let r = f()?;
        self.sync(what)?;
        Ok((r, t.elapsed().as_secs_f64()))
    }

    /// `n` zeros on the device (at least one element, so empty problems need
    /// no special case); running out of memory is [`GpuError::OutOfMemory`].
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        what: &str,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        let n = n.max(1);
        self.stream
            .alloc_zeros::<T>(n)
            .map_err(|e| self.memory_error(what, n * std::mem::size_of::<T>(), e))
    }

    /// Copies `host` to the device.
    pub(crate) fn upload<T: DeviceRepr + ValidAsZeroBits + Copy>(
        &self,
        what: &str,
        host: &[T],
    ) -> Result<CudaSlice<T>> {
        let mut d = self.zeros::<T>(what, host.len())?;
        if !host.is_empty() {
            self.stream
                .memcpy_htod(host, &mut d)
                .map_err(|e| driver(&format!("copying {what} to the device"), e))?;
        }
        Ok(d)
    }

    /// Copies `len` floats from `src[src_at..]` to `dst[dst_at..]` on the device.
    pub(crate) fn copy(
        &self,
        src: &CudaSlice<f32>,
        src_at: usize,
        dst: &mut CudaSlice<f32>,
        dst_at: usize,
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let from = src.slice(src_at..src_at + len);
        let mut to = dst.slice_mut(dst_at..dst_at + len);
        self.stream
            .memcpy_dtod(&from, &mut to)
            .map_err(|e| driver("a device-to-device copy", e))
    }

    /// Uploads an input tensor in the chosen storage dtype ([`Dtype::GPU`]:
    /// f32 or bf16, as FLA's runs store them; results are then rounded to it
    /// too, while states, `A_log`, `dt_bias` and their gradients stay f32).
    pub(crate) fn upload_input(&self, what: &str, x: &ArrayD<f64>, s: Dtype) -> Result<Input> {
        match s.require(&format!("GPU input `{what}`"), &Dtype::GPU) {
            Ok(Dtype::Bf16) => Ok(Input::Bf16(self.upload_as(what, x, bf16_bits)?)),
            Ok(_) => Ok(Input::F32(self.upload_f32(what, x)?)),
            Err(why) => Err(GpuError::Unsupported(why)),
        }
    }

    /// Uploads a tensor as f32 (states, gate parameters, upstream state gradients).
    pub(crate) fn upload_f32(&self, what: &str, x: &ArrayD<f64>) -> Result<CudaSlice<f32>> {
        self.upload_as(what, x, |v| v as f32)
    }

    /// The two staging buffers (allocated on first use).
    fn staging(&self) -> Result<std::sync::MutexGuard<'_, Vec<Stage>>> {
        let mut stages = self.staging.lock().expect("staging buffers poisoned");
        while stages.len() < 2 {
            // SAFETY: the memory is only read after a copy or a conversion wrote it.
            let mem = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(STAGE_BYTES, 0) }
                .map_err(|e| self.memory_error("a page-locked staging buffer", STAGE_BYTES, e))?;
            let copied = self
                .ctx
                .new_event(None)
                .map_err(|e| driver("creating a copy event", e))?;
            stages.push(Stage { mem, copied });
        }
        Ok(stages)
    }

    /// Copies `x` (row-major) to the device as `T`, element by element
    /// through `f`: part by part, each converted on every core into one
    /// staging buffer while the part before it crosses the bus from the other.
    fn upload_as<T: DeviceRepr + ValidAsZeroBits + Copy + Send + Sync>(
        &self,
        what: &str,
        x: &ArrayD<f64>,
        f: impl Fn(f64) -> T + Sync,
    ) -> Result<CudaSlice<T>> {
        let x = x.as_standard_layout();
        let host = x.as_slice().expect("standard layout");
        let mut d = self.zeros::<T>(what, host.len())?;
        let per = STAGE_BYTES / std::mem::size_of::<T>();
        let mut stages = self.staging()?;
        for (i, part) in host.chunks(per).enumerate() {
            let stage = &mut stages[i % 2];
            let buf = stage.part::<T>(part.len())?;
            buf.par_iter_mut()
                .zip(part)
                .with_min_len(PAR_MIN)
                .for_each(|(o, &v)| *o = f(v));
            let mut to = d.slice_mut(i * per..i * per + part.len());
            self.stream
                .memcpy_htod(&*buf, &mut to)
                .map_err(|e| driver(&format!("copying {what} to the device"), e))?;
            stage
                .copied
                .record(&self.stream)
                .map_err(|e| driver("recording a copy event", e))?;
        }
        Ok(d)
    }

    /// The first `n` elements of `x` as f64 through `f`: part by part, each
    /// widened on every core from one staging buffer while the part after it
    /// crosses the bus into the other.
    fn download_as<T: DeviceRepr + ValidAsZeroBits + Copy + Send + Sync>(
        &self,
        what: &str,
        x: &CudaSlice<T>,
        f: impl Fn(T) -> f64 + Sync,
        out: &mut [f64],
    ) -> Result<()> {
        let n = out.len();
        let per = STAGE_BYTES / std::mem::size_of::<T>();
        let parts = n.div_ceil(per);
        let mut stages = self.staging()?;
        let fetch = |i: usize, stage: &mut Stage| -> Result<()> {
            let len = per.min(n - i * per);
            let buf = stage.part::<T>(len)?;
            self.stream
                .memcpy_dtoh(&x.slice(i * per..i * per + len), buf)
                .map_err(|e| driver(&format!("copying {what} from the device"), e))?;
            stage
                .copied
                .record(&self.stream)
                .map_err(|e| driver("recording a copy event", e))
        };
        for i in 0..parts.min(2) {
            fetch(i, &mut stages[i])?;
        }
        for (i, wide) in out.chunks_mut(per).enumerate() {
            let stage = &mut stages[i % 2];
            let buf = stage.part::<T>(wide.len())?;
            wide.par_iter_mut()
                .zip(&*buf)
                .with_min_len(PAR_MIN)
                .for_each(|(o, &v)| *o = f(v));
            if i + 2 < parts {
                fetch(i + 2, stage)?;
            }
        }
        Ok(())
    }

    /// Copies a result `[shape]` back as f64, rounded to `round_to`'s dtype
    /// first (FLA returns outputs and gradients in the input dtype); bf16
    /// results cross the bus packed, half the bytes of f32.
    pub(crate) fn fetch(
        &self,
        what: &str,
        t: CudaSlice<f32>,
        shape: &[usize],
        round_to: Option<Dtype>,
    ) -> Result<ArrayD<f64>> {
        let n = shape.iter().product();
        self.fetch_into(what, t, shape, round_to, vec![0.0; n])
    }

    /// [`Gpu::fetch`] into `out` (`shape`'s element count, e.g. from
    /// [`mapped_zeros`]).
    pub(crate) fn fetch_into(
        &self,
        what: &str,
        t: CudaSlice<f32>,
        shape: &[usize],
        round_to: Option<Dtype>,
        mut out: Vec<f64>,
    ) -> Result<ArrayD<f64>> {
        let n = out.len();
        if round_to == Some(Dtype::Bf16) && n > 0 {
            let mut packed = self.zeros::<u16>(what, n)?;
            let f = self.function(&PREP, prep_defines(Dtype::Bf16), "pack_bf16")?;
            let nn = n as i64;
            let mut b = self.stream.launch_builder(&f);
            b.arg(&t).arg(&mut packed).arg(&nn);
            self.launch(b, "pack_bf16", elementwise(n))?;
            // A bf16 is an f32 with the low 16 bits zero: exact, and
            // branch-free (half's bf16 → f64 checks each special case).
            let wide = |b: u16| f64::from(f32::from_bits(u32::from(b) << 16));
            self.download_as(what, &packed, wide, &mut out)?;
        } else {
            self.download_as(what, &t, f64::from, &mut out)?;
        }
        Ok(ArrayD::from_shape_vec(IxDyn(shape), out).expect("shape matches the buffer"))
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| driver("reading free memory", e))
    }

    fn memory_error(&self, what: &str, bytes: usize, e: DriverError) -> GpuError {
        if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            let (free, total) = self.memory().unwrap_or((0, 0));
            GpuError::OutOfMemory {
                what: what.to_string(),
                bytes,
                free,
                total,
            }
        } else {
            driver(&format!("allocating {what}"), e)
        }
    }
}

/// A stored input: f32 or raw bfloat16 words (kernels compiled with `IN_BF16`).
pub(crate) enum Input {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

/// Pushes a stored input as a kernel argument.
pub(crate) fn arg_in<'a>(b: &mut LaunchArgs<'a>, x: &'a Input) {
    match x {
        Input::F32(s) => b.arg(s),
        Input::Bf16(s) => b.arg(s),
    };
}

/// Pushes an optional input (null when absent).
pub(crate) fn arg_in_opt<'a>(b: &mut LaunchArgs<'a>, x: Option<&'a Input>) {
    match x {
        Some(x) => arg_in(b, x),
        None => {
            b.arg(&NULL);
        }
    }
}

/// Pushes an optional f32 buffer (null when absent).
pub(crate) fn arg_opt<'a, T>(b: &mut LaunchArgs<'a>, x: Option<&'a CudaSlice<T>>) {
    match x {
        Some(s) => {
            b.arg(s);
        }
        None => {
            b.arg(&NULL);
        }
    }
}

/// A grid-stride launch over `n` elements.
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 8192) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A `(x, y)` grid of blocks of `threads` (rounded up to whole warps).
pub(crate) fn grid(x: usize, y: usize, threads: usize, shared_bytes: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x.max(1) as u32, y.max(1) as u32, 1),
        block_dim: (threads.div_ceil(32).max(1) as u32 * 32, 1, 1),
        shared_mem_bytes: shared_bytes as u32,
    }
}

pub(crate) fn driver(what: &str, e: DriverError) -> GpuError {
    GpuError::Driver {
        what: what.to_string(),
        source: e,
    }
}

/// NVRTC-compiles `source` with `defines` for `arch` (e.g. `compute_90`);
/// needs NVRTC but no GPU (see `ptx` for the text).
pub fn compile(source: &Source, defines: Defines, arch: &str) -> Result<Ptx> {
    ensure_nvrtc()?;
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some(format!("{}.cu", source.name)),
        ..Default::default()
    };
    compile_ptx_with_opts(source.text(defines), opts).map_err(|e| match e {
        CompileError::CompileError { options, log, .. } => GpuError::Compile {
            source_name: source.name.to_string(),
            options: options.join(" "),
            log: log.to_string_lossy().into_owned(),
        },
        other => GpuError::Compile {
            source_name: source.name.to_string(),
            options: String::new(),
            log: format!("{other:?}"),
        },
    })
}

/// The PTX of `source` built with `defines` for `arch`, for inspection.
pub fn ptx(source: &Source, defines: Defines, arch: &str) -> Result<String> {
    Ok(compile(source, defines, arch)?.to_src())
}

/// Compiled PTX on disk, keyed by a hash of the full source text, the
/// architecture and the NVRTC version, so a process reuses what an earlier one
/// compiled. The folder is `DELTAREF_CACHE`, else `$XDG_CACHE_HOME/deltaref`
/// or `~/.cache/deltaref`; `DELTAREF_CACHE=off` disables it. Best effort: a
/// cache that cannot be read or written only costs a compile.
pub struct PtxCache {
    dir: PathBuf,
}

impl PtxCache {
    pub fn open() -> Option<PtxCache> {
        let dir = match std::env::var_os("DELTAREF_CACHE") {
            Some(d) if d == "off" => return None,
            Some(d) => PathBuf::from(d),
            None => std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?
                .join("deltaref"),
        };
        PtxCache::at(dir.join("ptx"))
    }

    /// A cache in `dir` (created if needed).
    pub fn at(dir: PathBuf) -> Option<PtxCache> {
        std::fs::create_dir_all(&dir).ok()?;
        Some(PtxCache { dir })
    }

    /// The file an identical build is stored in.
    pub fn path(&self, source: &Source, defines: Defines, arch: &str) -> PathBuf {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(source.text(defines).as_bytes());
        h.update(arch.as_bytes());
        h.update(nvrtc_version().as_bytes());
        let key: String = h.finalize()[..12]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        self.dir.join(format!("{}-{key}.ptx", source.name))
    }

    pub fn get(&self, source: &Source, defines: Defines, arch: &str) -> Option<Ptx> {
        std::fs::read_to_string(self.path(source, defines, arch))
            .ok()
            .map(Ptx::from_src)
    }

    /// Writes through a temporary file and a rename, so a reader never sees
    /// half a file.
    pub fn put(&self, source: &Source, defines: Defines, arch: &str, ptx: &str) {
        let path = self.path(source, defines, arch);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, ptx).is_ok() && std::fs::rename(&tmp, &path).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

/// `"major.minor"` of the loaded NVRTC (empty when it is not loaded).
fn nvrtc_version() -> String {
    if ensure_nvrtc().is_err() {
        return String::new();
    }
    let (mut major, mut minor) = (0, 0);
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        format!("{major}.{minor}")
    } else {
        String::new()
    }
}

fn ensure_driver() -> Result<()> {
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError::NoDriver {
            why: "libcuda.so.1 is not on the library path (ldconfig, LD_LIBRARY_PATH)".into(),
        })
    }
}

/// Makes NVRTC loadable: the dynamic library path first, else a copy found
/// through `DELTAREF_NVRTC`, `CUDA_HOME`, `CUDA_PATH` or `/usr/local/cuda`,
/// opened by full path and kept loaded so cudarc's later load by name finds it.
pub fn ensure_nvrtc() -> Result<()> {
    static FOUND: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Ok(());
            }
            let candidates = nvrtc_candidates();
            for path in &candidates {
                if let Ok(lib) = unsafe { libloading::Library::new(path) } {
                    // Kept for the life of the process: cudarc resolves NVRTC
                    // by name, and NVRTC its builtins (from the same folder).
                    std::mem::forget(lib);
                    preload_builtins(path);
                    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                        return Ok(());
                    }
                }
            }
            Err(candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "))
        })
        .clone()
        .map_err(|tried| GpuError::NoNvrtc {
            tried: if tried.is_empty() {
                "no DELTAREF_NVRTC/CUDA_HOME/CUDA_PATH and no /usr/local/cuda".into()
            } else {
                tried
            },
        })
}

/// Loads `libnvrtc-builtins.so*` beside `nvrtc` (not on the library path either).
fn preload_builtins(nvrtc: &std::path::Path) {
    let Some(Ok(entries)) = nvrtc.parent().map(std::fs::read_dir) else {
        return;
    };
    for p in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("libnvrtc-builtins.so") {
            if let Ok(lib) = unsafe { libloading::Library::new(&p) } {
                std::mem::forget(lib);
            }
        }
    }
}

fn nvrtc_candidates() -> Vec<PathBuf> {
    let mut out = vec![];
    if let Some(f) = std::env::var_os("DELTAREF_NVRTC") {
        out.push(PathBuf::from(f));
    }
    let roots = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .chain(std::iter::once(PathBuf::from("/usr/local/cuda")));
    for root in roots {
        for sub in ["lib64", "lib", "targets/x86_64-linux/lib"] {
            let Ok(entries) = std::fs::read_dir(root.join(sub)) else {
                continue;
            };
            let mut libs: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("libnvrtc.so"))
                })
                .collect();
            libs.sort();
            out.extend(libs);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{bf16_bits, mapped_zeros};

    /// Every element is zero, whether the buffer covers whole huge pages,
    /// part of one or none.
    #[test]
    fn mapped_zeros_are_zeros() {
        for n in [0, 1, 1000, (4 << 20) / 8 + 3, (6 << 20) / 8] {
            // Freed memory of the same size, likely handed out again.
            drop(vec![f64::NAN; n]);
            let v = mapped_zeros(n);
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|x| x.to_bits() == 0), "n = {n}");
        }
    }

    /// The fast path gives `half`'s bits: on every bf16 value, their
    /// neighbours and midpoints, f32 values, f64 values no f32 holds, the
    /// overflow edge, infinities and signed zeros.
    #[test]
    fn bf16_rounding_matches_half() {
        let mut values = vec![0.0, -0.0, f64::INFINITY, f64::NEG_INFINITY, f64::MAX, 1e-45];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..200_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let f = f32::from_bits(state as u32);
            if f.is_finite() {
                values.push(f64::from(f));
            }
            values.push(f64::from_bits(state) % 1e6);
        }
        for b in 0..=u16::MAX {
            let x = f32::from_bits(u32::from(b) << 16);
            for d in [0u32, 1, 0x7fff, 0x8000, 0x8001] {
                values.push(f64::from(f32::from_bits(x.to_bits().wrapping_add(d))));
            }
        }
        for v in values.into_iter().filter(|v| !v.is_nan()) {
            assert_eq!(
                bf16_bits(v),
                deltaref::dtype::to_bf16(v).to_bits(),
                "{v:e} ({:#x})",
                v.to_bits()
            );
        }
    }
}
