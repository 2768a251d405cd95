// Shared by every kernel source. The host prepends the compile-time sizes:
//   IN_BF16  1 when the stored inputs are bfloat16 (read as raw 16-bit words)
//   KD       key dimension (a state column lives in KD registers)
//   CHUNK    chunk size (chunked kernels only)
// Index arithmetic is done in 64 bits: T·H·K can pass 2^31.

typedef long long i64;
typedef unsigned short bf16_t;

__device__ __forceinline__ float bf16_to_f32(bf16_t x) {
    return __uint_as_float(((unsigned)x) << 16);
}

// Round to the nearest bfloat16, ties to even (what a bf16 store does).
__device__ __forceinline__ float round_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0x7f800000u) return f;
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}

#if IN_BF16
typedef bf16_t in_t;
__device__ __forceinline__ float ld_in(const in_t* p, i64 i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ float store_round(float x) { return round_bf16(x); }
#else
typedef float in_t;
__device__ __forceinline__ float ld_in(const in_t* p, i64 i) { return p[i]; }
__device__ __forceinline__ float store_round(float x) { return x; }
#endif

__device__ __forceinline__ float sigmoid_f(float x) {
    // Split by sign so neither branch overflows.
    if (x >= 0.f) return 1.f / (1.f + expf(-x));
    float e = expf(x);
    return e / (1.f + e);
}

__device__ __forceinline__ float softplus_f(float x) {
    return x > 0.f ? x + log1pf(expf(-x)) : log1pf(expf(x));
}

// Sum over the 32 lanes of a warp, the same order in every lane.
__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ i64 grid_index() {
    return (i64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ i64 grid_stride() {
    return (i64)gridDim.x * blockDim.x;
}

// Reduces one value per thread over the block (columns of a state), in a
// fixed order: lanes by warp_sum, then warps in index order. `part` holds one
// float per warp. Every thread gets the sum. Call from all threads.
__device__ __forceinline__ float block_sum(float x, float* part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    x = warp_sum(x);
    __syncthreads();
    if (lane == 0) part[warp] = x;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < nw; ++w) s += part[w];
    return s;
}

// Element-wise conversions at the edges of a run.
extern "C" __global__ void to_f32(const in_t* __restrict__ x, float* __restrict__ y, i64 n) {
    for (i64 i = grid_index(); i < n; i += grid_stride()) y[i] = ld_in(x, i);
}

// Results rounded to bfloat16 and packed (half the bytes to copy back); a
// NaN stays a NaN (dropping its low mantissa bits could make it ±Inf).
extern "C" __global__ void pack_bf16(const float* __restrict__ x, bf16_t* __restrict__ y, i64 n) {
    for (i64 i = grid_index(); i < n; i += grid_stride()) {
        const float f = x[i];
        y[i] = f != f ? (bf16_t)0x7fc0u : (bf16_t)(__float_as_uint(round_bf16(f)) >> 16);
    }
}
