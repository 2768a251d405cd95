//! Runtime dispatch to wider vector instructions, without changing a bit.
//!
//! The binaries run on other machines, so the crate is built for the baseline
//! CPU; [`dispatch`] recompiles a hot closure for AVX-512 or AVX2 and picks
//! the widest the CPU has. The results are bit-identical: LLVM never fuses
//! `a * b + c` into an FMA or reorders a floating-point sum without
//! fast-math flags (which Rust never sets), so wider vectors only change how
//! many independent lanes one instruction handles. A fused multiply-add is
//! only where the code asks for one (`mul_add`, in [`crate::fast::gemm`]): one
//! rounding, by the FMA instruction here (both widths require FMA) and by
//! libm's `fma` in the baseline code, so the same bits there too.
//!
//! Only code inlined into the closure is recompiled, so the closure and the
//! hot loops it calls are `#[inline(always)]`.
//!
//! Setting the environment variable `DELTAREF_NO_SIMD` (to anything) keeps
//! the baseline code and `DELTAREF_NO_AVX512` stops at AVX2, e.g. to check
//! that every path gives the same bits.

use std::sync::OnceLock;

/// The vector instructions [`dispatch`] compiles for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Width {
    Baseline,
    Avx2,
    Avx512,
}

impl Width {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Width::Baseline => "baseline",
            Width::Avx2 => "AVX2",
            Width::Avx512 => "AVX-512",
        }
    }
}

/// The widest vectors the CPU has, capped by the environment (decided once
/// per process).
pub(crate) fn width() -> Width {
    static WIDTH: OnceLock<Width> = OnceLock::new();
    *WIDTH.get_or_init(|| {
        let set = |name| std::env::var_os(name).is_some();
        if set("DELTAREF_NO_SIMD") {
            return Width::Baseline;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let fma = std::arch::is_x86_feature_detected!("fma");
            // DQ (64-bit integer multiplies and conversions on vectors) is on
            // every AVX-512 CPU but the Xeon Phi; the random draws need it.
            let avx512 = std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512dq");
            if !set("DELTAREF_NO_AVX512") && fma && avx512 {
                return Width::Avx512;
            }
            if fma && std::arch::is_x86_feature_detected!("avx2") {
                return Width::Avx2;
            }
        }
        Width::Baseline
    })
}

/// Runs `f`, compiled for the [`width`] the CPU has.
#[inline(always)]
pub(crate) fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    match width() {
        Width::Avx512 => {
            #[target_feature(enable = "avx512f,avx512dq,fma")]
            unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: the CPU supports AVX-512F, AVX-512DQ and FMA (checked by
            // `width`).
            return unsafe { avx512(f) };
        }
        Width::Avx2 => {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: the CPU supports AVX2 and FMA (checked by `width`).
            return unsafe { avx2(f) };
        }
        Width::Baseline => {}
    }
    f()
}
