// Naive recurrent KDA, SPEC §3: one block per (sequence piece, value head),
// one thread per state column j (the recurrence never mixes columns), the
// column S[:, j] in KD registers. Inputs are the pre-processed f32 tensors:
// q, k [NTOK, H, KD] (q times scale), v [NTOK, HV, ncol], g [NTOK, HV, KD]
// (log decay), beta [NTOK, HV]; seg[s] = {start, end} over the NTOK = B·T
// flattened tokens.
//
// transition = 1 computes M (S_L = M S_0 + S_L|_{S_0=0}) instead: v = 0,
// S_0 = I, ncol = KD.

struct KdaToken {
    float k[KD], q[KD], e[KD];
};

// Loads token t's k, q, exp(g) into shared memory (all threads).
__device__ __forceinline__ void load_token(KdaToken* sm, const float* q, const float* k,
                                           const float* g, i64 t, int H, int hq, int HV,
                                           int hv) {
    __syncthreads();
    for (int i = threadIdx.x; i < KD; i += blockDim.x) {
        sm->k[i] = k[(t * H + hq) * KD + i];
        sm->q[i] = q[(t * H + hq) * KD + i];
        sm->e[i] = expf(g[(t * HV + hv) * KD + i]);
    }
    __syncthreads();
}

// One token on column S: S ← Diag(e) S, r = v − Sᵀk, S ← S + β k r; returns r.
__device__ __forceinline__ float kda_step(float* S, const KdaToken* sm, float v, float beta) {
    float ks = 0.f;
#pragma unroll
    for (int i = 0; i < KD; ++i) {
        S[i] *= sm->e[i];
        ks += sm->k[i] * S[i];
    }
    const float r = v - ks, u = beta * r;
#pragma unroll
    for (int i = 0; i < KD; ++i) S[i] += sm->k[i] * u;
    return r;
}

__device__ __forceinline__ void load_column(float* S, const float* src, i64 base, int ncol,
                                            int j, bool active) {
#pragma unroll
    for (int i = 0; i < KD; ++i) S[i] = (active && src) ? src[base + (i64)i * ncol + j] : 0.f;
}

extern "C" __global__ void kda_naive_fwd(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, const float* __restrict__ g,
                                         const float* __restrict__ beta,
                                         const int* __restrict__ seg,
                                         const float* __restrict__ h0, float* __restrict__ o,
                                         float* __restrict__ ht, int H, int HV, int ncol,
                                         int transition) {
    __shared__ KdaToken sm;
    const int s = blockIdx.x, hv = blockIdx.y, j = threadIdx.x, hq = hv / (HV / H);
    const bool active = j < ncol;
    const int start = seg[2 * s], end = seg[2 * s + 1];
    const i64 sbase = ((i64)s * HV + hv) * KD * ncol;
    float S[KD];
    load_column(S, h0, sbase, ncol, j, active && !transition);
    if (transition)
#pragma unroll
        for (int i = 0; i < KD; ++i) S[i] = (i == j) ? 1.f : 0.f;
    for (int t = start; t < end; ++t) {
        load_token(&sm, q, k, g, t, H, hq, HV, hv);
        if (!active) continue;
        const float vj = transition ? 0.f : v[((i64)t * HV + hv) * ncol + j];
        kda_step(S, &sm, vj, beta[(i64)t * HV + hv]);
        if (o) {
            float oj = 0.f;
#pragma unroll
            for (int i = 0; i < KD; ++i) oj += sm.q[i] * S[i];
            o[((i64)t * HV + hv) * ncol + j] = oj;
        }
    }
    if (active)
#pragma unroll
        for (int i = 0; i < KD; ++i) ht[sbase + (i64)i * ncol + j] = S[i];
}

// Backward, the reverse-time recurrence of the CPU oracle (kda/naive.rs):
// states are kept at checkpoints every BL tokens (ckpt [NCK, KD, V] per
// pair) and recomputed per block into prev [BL, KD, V] with r into rbuf
// [BL, V], so memory is O((L/BL + BL)·K·V). Per-token sums over columns
// (dq, dk, dg, dbeta) go through warp shuffles and a per-warp table `red`
// (dynamic shared memory, [NW][3][KD] + [NW]) in a fixed order.
extern "C" __global__ void kda_naive_bwd(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, const int* __restrict__ seg,
    const float* __restrict__ h0, const float* __restrict__ d_o, const float* __restrict__ dht,
    float* __restrict__ dq, float* __restrict__ dk, float* __restrict__ dv,
    float* __restrict__ dg, float* __restrict__ dbeta, float* __restrict__ dh0, int H, int HV,
    int V, float* __restrict__ ckpt, float* __restrict__ prev, float* __restrict__ rbuf, int BL,
    int NCK) {
    extern __shared__ float red[];
    __shared__ KdaToken sm;
    const int s = blockIdx.x, hv = blockIdx.y, j = threadIdx.x, hq = hv / (HV / H);
    const int lane = j & 31, warp = j >> 5, nw = (blockDim.x + 31) >> 5;
    const bool active = j < V;
    const int start = seg[2 * s], end = seg[2 * s + 1];
    const i64 pair = (i64)s * HV + hv, kv = (i64)KD * V;
    float* ck = ckpt + pair * NCK * kv;
    float* pv = prev + pair * BL * kv;
    float* rb = rbuf + pair * BL * V;
    float S[KD];
    load_column(S, h0, pair * kv, V, j, active);
    for (int t = start; t < end; ++t) {
        if ((t - start) % BL == 0 && active)
            for (int i = 0; i < KD; ++i) ck[(i64)((t - start) / BL) * kv + (i64)i * V + j] = S[i];
        load_token(&sm, q, k, g, t, H, hq, HV, hv);
        if (active) kda_step(S, &sm, v[((i64)t * HV + hv) * V + j], beta[(i64)t * HV + hv]);
    }
    float dS[KD];
    load_column(dS, dht, pair * kv, V, j, active);
    const int nblocks = (end - start + BL - 1) / BL;
    for (int blk = nblocks - 1; blk >= 0; --blk) {
        const int t0 = start + blk * BL, t1 = min(t0 + BL, end);
        load_column(S, ck, (i64)blk * kv, V, j, active);
        for (int t = t0; t < t1; ++t) {
            if (active)
                for (int i = 0; i < KD; ++i) pv[(i64)(t - t0) * kv + (i64)i * V + j] = S[i];
            load_token(&sm, q, k, g, t, H, hq, HV, hv);
            if (active)
                rb[(i64)(t - t0) * V + j] =
                    kda_step(S, &sm, v[((i64)t * HV + hv) * V + j], beta[(i64)t * HV + hv]);
        }
        for (int t = t1 - 1; t >= t0; --t) {
            load_token(&sm, q, k, g, t, H, hq, HV, hv);
            const float b = beta[(i64)t * HV + hv];
            const float doj = active ? d_o[((i64)t * HV + hv) * V + j] : 0.f;
            const float rj = active ? rb[(i64)(t - t0) * V + j] : 0.f;
            const float* sp = pv + (i64)(t - t0) * kv;
            // dS_t += q doᵀ; du = dS_tᵀ k.
            float du = 0.f;
            for (int i = 0; i < KD; ++i) {
                dS[i] += sm.q[i] * doj;
                du += dS[i] * sm.k[i];
            }
            if (active) dv[((i64)t * HV + hv) * V + j] = b * du;
            const float dr = -b * du;  // d(S'ᵀk)
            for (int i = 0; i < KD; ++i) {
                const float s_dec = active ? sm.e[i] * sp[(i64)i * V + j] : 0.f;  // S'
                const float s_t = s_dec + sm.k[i] * b * rj;
                const float cq = warp_sum(s_t * doj);
                const float ckk = warp_sum(b * dS[i] * rj + s_dec * dr);
                dS[i] += sm.k[i] * dr;  // dS'
                const float cg = warp_sum(dS[i] * s_dec);
                dS[i] *= sm.e[i];  // dS_{t−1}
                if (lane == 0) {
                    red[(warp * 3 + 0) * KD + i] = cq;
                    red[(warp * 3 + 1) * KD + i] = ckk;
                    red[(warp * 3 + 2) * KD + i] = cg;
                }
            }
            const float cb = warp_sum(du * rj);
            if (lane == 0) red[nw * 3 * KD + warp] = cb;
            __syncthreads();
            for (int i = threadIdx.x; i < KD; i += blockDim.x) {
                float a = 0.f, bk = 0.f, c = 0.f;
                for (int w = 0; w < nw; ++w) {
                    a += red[(w * 3 + 0) * KD + i];
                    bk += red[(w * 3 + 1) * KD + i];
                    c += red[(w * 3 + 2) * KD + i];
                }
                const i64 o = ((i64)t * HV + hv) * KD + i;
                dq[o] = a;
                dk[o] = bk;
                dg[o] = c;
            }
            if (threadIdx.x == 0) {
                float sb = 0.f;
                for (int w = 0; w < nw; ++w) sb += red[nw * 3 * KD + w];
                dbeta[(i64)t * HV + hv] = sb;
            }
        }
    }
    if (active)
        for (int i = 0; i < KD; ++i) dh0[pair * kv + (i64)i * V + j] = dS[i];
}
