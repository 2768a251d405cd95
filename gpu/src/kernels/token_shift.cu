// Token-shift, SPEC §5: y_t = x_{t−1} − x_t per sequence piece.
// One block per piece, threads over the feature dim D, tokens in order.
// seg[s] = {start, end, seq, link}: token range (flattened [B·T]), sequence,
// and in forward the token before the piece when it comes from another rank
// (−1: cache[seq] or 0); in backward 1 when dfinal_cache flows into the
// piece's last token.

extern "C" __global__ void ts_fwd(const in_t* __restrict__ x, const in_t* __restrict__ cache,
                                  float* __restrict__ y, float* __restrict__ last,
                                  const int* __restrict__ seg, int D) {
    const int s = blockIdx.x;
    const int start = seg[4 * s], end = seg[4 * s + 1], seq = seg[4 * s + 2], link = seg[4 * s + 3];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float prev = link >= 0 ? ld_in(x, (i64)link * D + d)
                               : (cache ? ld_in(cache, (i64)seq * D + d) : 0.f);
        for (int t = start; t < end; ++t) {
            const float xt = ld_in(x, (i64)t * D + d);
            y[(i64)t * D + d] = prev - xt;
            prev = xt;
        }
        last[(i64)s * D + d] = prev;
    }
}

// dx_t = dy_{t+1} − dy_t; `dprev` receives the gradient of the token before
// the piece (dcache, or the previous rank's last token under CP).
extern "C" __global__ void ts_bwd(const in_t* __restrict__ dy, const float* __restrict__ dfinal,
                                  float* __restrict__ dx, float* __restrict__ dprev,
                                  const int* __restrict__ seg, int D) {
    const int s = blockIdx.x;
    const int start = seg[4 * s], end = seg[4 * s + 1], seq = seg[4 * s + 2], link = seg[4 * s + 3];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float carry = (link && dfinal) ? dfinal[(i64)seq * D + d] : 0.f;
        for (int t = end - 1; t >= start; --t) {
            const float g = ld_in(dy, (i64)t * D + d);
            dx[(i64)t * D + d] = carry - g;
            carry = g;
        }
        dprev[(i64)s * D + d] = carry;
    }
}

// CP backward: a continuing piece hands d(prev) to the previous rank's last
// token (to[s] ≥ 0); run after every ts_bwd of the step.
extern "C" __global__ void ts_send_back(float* __restrict__ dx, const float* __restrict__ dprev,
                                        const int* __restrict__ to, int S, int D) {
    for (i64 i = grid_index(); i < (i64)S * D; i += grid_stride()) {
        const int s = (int)(i / D), d = (int)(i % D);
        if (to[s] >= 0) dx[(i64)to[s] * D + d] += dprev[i];
    }
}
