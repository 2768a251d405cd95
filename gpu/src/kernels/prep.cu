// Pre-processing FLA fuses into its kernels (l2norm, scale, gates, beta
// sigmoid) and the backward through it (GVA group sums, l2norm, gates,
// A_log/dt_bias reductions, beta sigmoid). SPEC §3 "Options".

#define L2NORM_EPS 1e-6f

// Rows of D elements: y = x / sqrt(Σx² + eps) (when l2norm) times `scale`.
// Under bf16 inputs the normalised row is stored in bf16 first, as FLA does.
extern "C" __global__ void prep_rows(const in_t* __restrict__ x, float* __restrict__ y,
                                     i64 rows, int D, int l2norm, float scale) {
    for (i64 row = grid_index(); row < rows; row += grid_stride()) {
        const i64 base = row * D;
        float r = 1.f;
        if (l2norm) {
            float ss = 0.f;
            for (int d = 0; d < D; ++d) { float v = ld_in(x, base + d); ss += v * v; }
            r = 1.f / sqrtf(ss + L2NORM_EPS);
        }
        for (int d = 0; d < D; ++d) {
            float v = ld_in(x, base + d);
            if (l2norm) v = store_round(v * r);
            y[base + d] = v * scale;
        }
    }
}

// gate_kind: 0 none (g is the decay), 1 kda (−exp(A_log)·softplus(g + dt_bias)),
// 2 lower bound (lower_bound·sigmoid(exp(A_log)·(g + dt_bias))).
// Returns the decay and, through the pointers, ∂g/∂x and ∂g/∂A_log.
__device__ __forceinline__ float gate_eval(int kind, float x, const float* a_log, int hv,
                                           float lower_bound, float* dx, float* da) {
    if (kind == 1) {
        float a = expf(a_log[hv]);
        float g = -a * softplus_f(x);
        *dx = -a * sigmoid_f(x);
        *da = g;
        return g;
    }
    if (kind == 2) {
        float scale = a_log ? expf(a_log[hv]) : 1.f;
        float z = scale * x;
        float s = sigmoid_f(z);
        float dg_dz = lower_bound * s * (1.f - s);
        *dx = dg_dz * scale;
        *da = a_log ? dg_dz * z : 0.f;
        return lower_bound * s;
    }
    *dx = 1.f;
    *da = 0.f;
    return x;
}

// g [BT, HV, K] (or [BT, HV] for a scalar gate) → decay [BT, HV, K].
// dt_bias is [HV, K], or [HV] with a scalar gate (GDN's per-head gate).
extern "C" __global__ void prep_gate(const in_t* __restrict__ g, const float* __restrict__ a_log,
                                     const float* __restrict__ dt_bias, float* __restrict__ out,
                                     i64 n, int HV, int K, int scalar_gate, int kind,
                                     float lower_bound) {
    for (i64 i = grid_index(); i < n; i += grid_stride()) {
        const int k = (int)(i % K), hv = (int)((i / K) % HV);
        const i64 bt = i / ((i64)K * HV);
        float x = scalar_gate ? ld_in(g, bt * HV + hv) : ld_in(g, i);
        if (dt_bias) x += scalar_gate ? dt_bias[hv] : dt_bias[hv * K + k];
        float dx, da;
        out[i] = gate_eval(kind, x, a_log, hv, lower_bound, &dx, &da);
    }
}

// β = c·sigmoid(beta) with c = 2 under allow_neg_eigval, or beta itself.
extern "C" __global__ void prep_beta(const in_t* __restrict__ b, float* __restrict__ out, i64 n,
                                     int use_sigmoid, float c) {
    for (i64 i = grid_index(); i < n; i += grid_stride()) {
        float x = ld_in(b, i);
        out[i] = use_sigmoid ? c * sigmoid_f(x) : x;
    }
}

// dq/dk per value head [BT, HV, K] → per q/k head [BT, H, K]: sum each GVA
// group in head order, times `factor` (scale for q), then back through l2norm
// (given the raw input row x).
extern "C" __global__ void group_l2norm_bwd(const float* __restrict__ dv_heads,
                                            const in_t* __restrict__ x, float* __restrict__ dx,
                                            i64 rows, int H, int G, int K, int l2norm,
                                            float factor) {
    for (i64 row = grid_index(); row < rows; row += grid_stride()) {
        const i64 bt = row / H;
        const int h = (int)(row % H);
        const i64 base = row * K;
        float r = 1.f, ydy = 0.f;
        if (l2norm) {
            float ss = 0.f;
            for (int d = 0; d < K; ++d) { float v = ld_in(x, base + d); ss += v * v; }
            r = 1.f / sqrtf(ss + L2NORM_EPS);
        }
        for (int d = 0; d < K; ++d) {
            float s = 0.f;
            for (int j = 0; j < G; ++j) s += dv_heads[(bt * H * G + (i64)h * G + j) * K + d];
            s *= factor;
            dx[base + d] = s;
            if (l2norm) ydy += ld_in(x, base + d) * r * s;
        }
        if (l2norm)
            for (int d = 0; d < K; ++d)
                dx[base + d] = r * (dx[base + d] - ld_in(x, base + d) * r * ydy);
    }
}

// Through the in-kernel gate, element-wise: dgate [BT, HV, K] → d(raw g) and
// the A_log contribution of each element (summed by gate_param_grads).
extern "C" __global__ void gate_bwd(const float* __restrict__ dgate, const in_t* __restrict__ g,
                                    const float* __restrict__ a_log,
                                    const float* __restrict__ dt_bias, float* __restrict__ dg,
                                    float* __restrict__ da_elem, i64 n, int HV, int K, int kind,
                                    float lower_bound) {
    for (i64 i = grid_index(); i < n; i += grid_stride()) {
        const int k = (int)(i % K), hv = (int)((i / K) % HV);
        float x = ld_in(g, i);
        if (dt_bias) x += dt_bias[hv * K + k];
        float dx, da;
        gate_eval(kind, x, a_log, hv, lower_bound, &dx, &da);
        dg[i] = dgate[i] * dx;
        da_elem[i] = dgate[i] * da;
    }
}

// One block per value head, one thread per key dim: ddt_bias[hv, k] = Σ_bt dg,
// dA_log[hv] = Σ_bt,k da_elem, each summed serially in index order (the
// result does not depend on the launch shape). The terms cancel heavily, so
// they are summed in double (torch's tree-ordered sum, which FLA uses, is
// likewise far more accurate than a serial f32 sum).
extern "C" __global__ void gate_param_grads(const float* __restrict__ dg,
                                            const float* __restrict__ da_elem,
                                            float* __restrict__ ddt_bias,
                                            float* __restrict__ da_log, i64 BT, int HV, int K) {
    extern __shared__ double part[];
    const int hv = blockIdx.x;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        double sb = 0.0, sa = 0.0;
        for (i64 t = 0; t < BT; ++t) {
            const i64 i = (t * HV + hv) * K + k;
            sb += dg[i];
            sa += da_elem[i];
        }
        if (ddt_bias) ddt_bias[hv * K + k] = (float)sb;
        part[k] = sa;
    }
    __syncthreads();
    if (threadIdx.x == 0 && da_log) {
        double s = 0.0;
        for (int k = 0; k < K; ++k) s += part[k];
        da_log[hv] = (float)s;
    }
}

// GDN: the scalar gate's gradient is the sum over the key dims.
extern "C" __global__ void scalar_gate_bwd(const float* __restrict__ dgate, float* __restrict__ dg,
                                           i64 n, int K) {
    for (i64 i = grid_index(); i < n; i += grid_stride()) {
        float s = 0.f;
        for (int k = 0; k < K; ++k) s += dgate[i * K + k];
        dg[i] = s;
    }
}

extern "C" __global__ void beta_bwd(const float* __restrict__ dbeta, const in_t* __restrict__ b,
                                    float* __restrict__ out, i64 n, float c) {
    for (i64 i = grid_index(); i < n; i += grid_stride()) {
        float s = sigmoid_f(ld_in(b, i));
        out[i] = dbeta[i] * c * s * (1.f - s);
    }
}
