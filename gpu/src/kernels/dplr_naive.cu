// Naive recurrent DPLR, SPEC §4: S_t = Diag(exp gk_t) S_{t−1} + b_t (a_tᵀ S_{t−1})
// + k_t v_tᵀ, o_t = S_tᵀ q_t. Same layout as kda_naive.cu: one block per
// (piece, head), one thread per state column (columns never mix), q, k, a, b,
// gk [NTOK, H, KD] f32 (q times scale), v [NTOK, H, ncol].

struct DplrToken {
    float q[KD], k[KD], a[KD], b[KD], e[KD];
};

__device__ __forceinline__ void load_dplr_token(DplrToken* sm, const float* q, const float* k,
                                                const float* a, const float* b,
                                                const float* gk, i64 t, int H, int h) {
    __syncthreads();
    for (int i = threadIdx.x; i < KD; i += blockDim.x) {
        const i64 o = (t * H + h) * KD + i;
        sm->q[i] = q[o];
        sm->k[i] = k[o];
        sm->a[i] = a[o];
        sm->b[i] = b[o];
        sm->e[i] = expf(gk[o]);
    }
    __syncthreads();
}

// One token on column S; returns aᵀ S_{t−1} (needed by backward).
__device__ __forceinline__ float dplr_step(float* S, const DplrToken* sm, float v) {
    float as = 0.f;
#pragma unroll
    for (int i = 0; i < KD; ++i) as += sm->a[i] * S[i];
#pragma unroll
    for (int i = 0; i < KD; ++i) S[i] = sm->e[i] * S[i] + sm->b[i] * as + sm->k[i] * v;
    return as;
}

__device__ __forceinline__ void load_dplr_column(float* S, const float* src, i64 base, int ncol,
                                                 int j, bool active) {
#pragma unroll
    for (int i = 0; i < KD; ++i) S[i] = (active && src) ? src[base + (i64)i * ncol + j] : 0.f;
}

extern "C" __global__ void dplr_naive_fwd(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ gk,
    const int* __restrict__ seg, const float* __restrict__ h0, float* __restrict__ o,
    float* __restrict__ ht, int H, int ncol, int transition) {
    __shared__ DplrToken sm;
    const int s = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const bool active = j < ncol;
    const int start = seg[2 * s], end = seg[2 * s + 1];
    const i64 sbase = ((i64)s * H + h) * KD * ncol;
    float S[KD];
    load_dplr_column(S, h0, sbase, ncol, j, active && !transition);
    if (transition)
#pragma unroll
        for (int i = 0; i < KD; ++i) S[i] = (i == j) ? 1.f : 0.f;
    for (int t = start; t < end; ++t) {
        load_dplr_token(&sm, q, k, a, b, gk, t, H, h);
        if (!active) continue;
        dplr_step(S, &sm, transition ? 0.f : v[((i64)t * H + h) * ncol + j]);
        if (o) {
            float oj = 0.f;
#pragma unroll
            for (int i = 0; i < KD; ++i) oj += sm.q[i] * S[i];
            o[((i64)t * H + h) * ncol + j] = oj;
        }
    }
    if (active)
#pragma unroll
        for (int i = 0; i < KD; ++i) ht[sbase + (i64)i * ncol + j] = S[i];
}

// Backward (dplr/naive.rs): checkpoints every BL tokens, per-block recompute
// into prev [BL, KD, V] and aᵀS into asbuf [BL, V]; five per-token sums over
// columns (dq, dk, db, dgk, da) through `red` ([NW][5][KD] dynamic shared).
extern "C" __global__ void dplr_naive_bwd(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ gk,
    const int* __restrict__ seg, const float* __restrict__ h0, const float* __restrict__ d_o,
    const float* __restrict__ dht, float* __restrict__ dq, float* __restrict__ dk,
    float* __restrict__ dv, float* __restrict__ da, float* __restrict__ db,
    float* __restrict__ dgk, float* __restrict__ dh0, int H, int V, float* __restrict__ ckpt,
    float* __restrict__ prev, float* __restrict__ asbuf, int BL, int NCK) {
    extern __shared__ float red[];
    __shared__ DplrToken sm;
    const int s = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const int lane = j & 31, warp = j >> 5, nw = (blockDim.x + 31) >> 5;
    const bool active = j < V;
    const int start = seg[2 * s], end = seg[2 * s + 1];
    const i64 pair = (i64)s * H + h, kv = (i64)KD * V;
    float* ck = ckpt + pair * NCK * kv;
    float* pv = prev + pair * BL * kv;
    float* ab = asbuf + pair * BL * V;
    float S[KD];
    load_dplr_column(S, h0, pair * kv, V, j, active);
    for (int t = start; t < end; ++t) {
        if ((t - start) % BL == 0 && active)
            for (int i = 0; i < KD; ++i) ck[(i64)((t - start) / BL) * kv + (i64)i * V + j] = S[i];
        load_dplr_token(&sm, q, k, a, b, gk, t, H, h);
        if (active) dplr_step(S, &sm, v[((i64)t * H + h) * V + j]);
    }
    float dS[KD];
    load_dplr_column(dS, dht, pair * kv, V, j, active);
    const int nblocks = (end - start + BL - 1) / BL;
    for (int blk = nblocks - 1; blk >= 0; --blk) {
        const int t0 = start + blk * BL, t1 = min(t0 + BL, end);
        load_dplr_column(S, ck, (i64)blk * kv, V, j, active);
        for (int t = t0; t < t1; ++t) {
            if (active)
                for (int i = 0; i < KD; ++i) pv[(i64)(t - t0) * kv + (i64)i * V + j] = S[i];
            load_dplr_token(&sm, q, k, a, b, gk, t, H, h);
            if (active) ab[(i64)(t - t0) * V + j] = dplr_step(S, &sm, v[((i64)t * H + h) * V + j]);
        }
        for (int t = t1 - 1; t >= t0; --t) {
            load_dplr_token(&sm, q, k, a, b, gk, t, H, h);
            const float doj = active ? d_o[((i64)t * H + h) * V + j] : 0.f;
            const float vj = active ? v[((i64)t * H + h) * V + j] : 0.f;
            const float asj = active ? ab[(i64)(t - t0) * V + j] : 0.f;
            const float* sp = pv + (i64)(t - t0) * kv;
            // Pass A: dq (from S_t), dS_t += q doᵀ, dk, db, dgk; dv and d(aᵀS) per column.
            float dvj = 0.f, das = 0.f;
            for (int i = 0; i < KD; ++i) {
                const float s_prev = active ? sp[(i64)i * V + j] : 0.f;
                const float s_t = sm.e[i] * s_prev + sm.b[i] * asj + sm.k[i] * vj;
                const float cq = warp_sum(s_t * doj);
                dS[i] += sm.q[i] * doj;
                const float ckk = warp_sum(dS[i] * vj);
                const float cb = warp_sum(dS[i] * asj);
                const float cg = warp_sum(sm.e[i] * dS[i] * s_prev);
                dvj += sm.k[i] * dS[i];
                das += sm.b[i] * dS[i];
                if (lane == 0) {
                    red[(warp * 5 + 0) * KD + i] = cq;
                    red[(warp * 5 + 1) * KD + i] = ckk;
                    red[(warp * 5 + 2) * KD + i] = cb;
                    red[(warp * 5 + 3) * KD + i] = cg;
                }
            }
            if (active) dv[((i64)t * H + h) * V + j] = dvj;
            // Pass B: da = S_{t−1} d(aᵀS), dS_{t−1} = Diag(e) dS_t + a d(aᵀS)ᵀ.
            for (int i = 0; i < KD; ++i) {
                const float s_prev = active ? sp[(i64)i * V + j] : 0.f;
                const float ca = warp_sum(s_prev * das);
                dS[i] = sm.e[i] * dS[i] + sm.a[i] * das;
                if (lane == 0) red[(warp * 5 + 4) * KD + i] = ca;
            }
            __syncthreads();
            for (int i = threadIdx.x; i < KD; i += blockDim.x) {
                float acc[5] = {0.f, 0.f, 0.f, 0.f, 0.f};
                for (int w = 0; w < nw; ++w)
                    for (int c = 0; c < 5; ++c) acc[c] += red[(w * 5 + c) * KD + i];
                const i64 o = ((i64)t * H + h) * KD + i;
                dq[o] = acc[0];
                dk[o] = acc[1];
                db[o] = acc[2];
                dgk[o] = acc[3];
                da[o] = acc[4];
            }
        }
    }
    if (active)
        for (int i = 0; i < KD; ++i) dh0[pair * kv + (i64)i * V + j] = dS[i];
}
