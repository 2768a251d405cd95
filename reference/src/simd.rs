//! Runtime dispatch to wider vector instructions, without changing a bit.
//!
//! The binaries run on other machines, so the crate is built for the baseline
//! CPU; [`dispatch`] recompiles a hot closure for AVX2 and picks it when the
//! CPU has it. The results are bit-identical: LLVM never fuses `a * b + c`
//! into an FMA or reorders a floating-point sum without fast-math flags
//! (which Rust never sets), so wider vectors only change how many
//! independent lanes one instruction handles.
//!
//! Only code inlined into the closure is recompiled, so the closure and the
//! hot loops it calls are `#[inline(always)]`.
//!
//! Setting the environment variable `DELTAREF_NO_SIMD` (to anything) keeps
//! the baseline code, e.g. to check that both give the same bits.

use std::sync::OnceLock;

/// Whether [`dispatch`] uses AVX2 (decided once per process).
pub fn avx2_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if std::env::var_os("DELTAREF_NO_SIMD").is_none() {
            return std::arch::is_x86_feature_detected!("avx2");
        }
        false
    })
}

/// Runs `f`, compiled for AVX2 when the CPU has it.
#[inline(always)]
pub fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if avx2_enabled() {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        // SAFETY: the CPU supports AVX2 (checked by `avx2_enabled`).
        return unsafe { avx2(f) };
    }
    f()
}
