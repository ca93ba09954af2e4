// RMSNorm and LayerNorm over the last dimension (c), one thread block per row.
// Same formulas as src/model/ops.rs; the reductions are tree-ordered here, so
// results agree with the CPU within a few ulps, not bit for bit.

extern "C" __global__ void gwtf_rmsnorm_forward(float *out, float *rstd, const float *in,
                                                const float *w, gwtf_size rows, unsigned int c,
                                                float eps) {
    __shared__ float shared[32];
    for (gwtf_size r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = in + r * c;
        float ss = 0.0f;
        for (unsigned int i = threadIdx.x; i < c; i += blockDim.x) ss += x[i] * x[i];
        ss = gwtf_block_sum(ss, shared);
        float rs = 1.0f / sqrtf(ss / (float)c + eps);
        for (unsigned int i = threadIdx.x; i < c; i += blockDim.x) out[r * c + i] = x[i] * rs * w[i];
        if (threadIdx.x == 0) rstd[r] = rs;
    }
}

// dinp += d * w * rs - x * (sum(d*w*x) * rs^3 / c);  dw += d * x * rs (atomic over rows).
extern "C" __global__ void gwtf_rmsnorm_backward(float *dinp, float *dw, const float *dout,
                                                 const float *in, const float *w,
                                                 const float *rstd, gwtf_size rows,
                                                 unsigned int c) {
    __shared__ float shared[32];
    for (gwtf_size r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = in + r * c, *d = dout + r * c;
        float rs = rstd[r];
        float dot = 0.0f;
        for (unsigned int i = threadIdx.x; i < c; i += blockDim.x) dot += d[i] * w[i] * x[i];
        dot = gwtf_block_sum(dot, shared);
        float k = dot * rs * rs * rs / (float)c;
        for (unsigned int i = threadIdx.x; i < c; i += blockDim.x) {
            dinp[r * c + i] += d[i] * w[i] * rs - x[i] * k;
            atomicAdd(&dw[i], d[i] * x[i] * rs);
        }
    }
}

extern "C" __global__ void gwtf_layernorm_forward(float *out, float *mean, float *rstd,
                                                  const float *in, const float *w, const float *b,
                                                  gwtf_size rows, unsigned int c, float eps) {
    __shared__ float shared[32];
    for (gwtf_size r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = in + r * c;
        float s = 0.0f;
        for (unsigned int i = threadIdx.x; i < c; i += blockDim.x) s += x[i];
        float mu = gwtf_block_sum(s, shared) / (float)c;
        float var = 0.0f;
        for (unsigned int i = threadIdx.x; i < c; i += blockDim.x) {
            float dlt = x[i] - mu;
            var += dlt * dlt;
        }
        var = gwtf_block_sum(var, shared) / (float)c;
        float rs = 1.0f / sqrtf(var + eps);
        for (unsigned int i = threadIdx.x; i < c; i += blockDim.x)
            out[r * c + i] = (x[i] - mu) * rs * w[i] + b[i];
        if (threadIdx.x == 0) {
            mean[r] = mu;
            rstd[r] = rs;
        }
    }
}

extern "C" __global__ void gwtf_layernorm_backward(float *dinp, float *dw, float *db,
                                                   const float *dout, const float *in,
                                                   const float *w, const float *mean,
                                                   const float *rstd, gwtf_size rows,
                                                   unsigned int c) {
    __shared__ float shared[32];
    for (gwtf_size r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = in + r * c, *d = dout + r * c;
        float mu = mean[r], rs = rstd[r];
        float dm = 0.0f, dnm = 0.0f;
        for (unsigned int i = threadIdx.x; i < c; i += blockDim.x) {
            float norm = (x[i] - mu) * rs;
            float dn = w[i] * d[i];
            dm += dn;
            dnm += dn * norm;
        }
        dm = gwtf_block_sum(dm, shared) / (float)c;
        dnm = gwtf_block_sum(dnm, shared) / (float)c;
        for (unsigned int i = threadIdx.x; i < c; i += blockDim.x) {
            float norm = (x[i] - mu) * rs;
            float dn = w[i] * d[i];
            dinp[r * c + i] += (dn - dm - norm * dnm) * rs;
            atomicAdd(&db[i], d[i]);
            atomicAdd(&dw[i], norm * d[i]);
        }
    }
}
