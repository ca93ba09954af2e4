// Multi-head causal self-attention, as attention_forward / attention_backward in
// src/model/ops.rs. Layouts: qkv is [B*T, 3C] (q | k | v, heads contiguous inside
// each), out and dout are [B*T, C], att (and the backward's dpre scratch) is
// [B, NH, T, T] with row (b, h, ti) at ((b*NH + h)*T + ti)*T. hs = C / NH.
//
// Dot products over hs and the sums over positions run in the CPU's order, so
// they round the same; the softmax's max and sum are block reductions (tree
// order) and expf differs from the CPU's exp by an ulp or two, so the results
// agree within a small tolerance, not bit for bit.

// One thread block per query row (b, h, ti): scores over t2 <= ti, softmax into
// att (zeros above the diagonal), then out[b, ti, h] = sum_t2 att * v[t2].
extern "C" __global__ void gwtf_attention_forward(float *out, float *att, const float *qkv,
                                                  unsigned int B, unsigned int T, unsigned int C,
                                                  unsigned int NH, float scale) {
    __shared__ float shared[32];
    const float neg_inf = -__int_as_float(0x7f800000);
    unsigned int hs = C / NH;
    gwtf_size C3 = 3 * (gwtf_size)C;
    gwtf_size rows = (gwtf_size)B * NH * T;
    for (gwtf_size r = blockIdx.x; r < rows; r += gridDim.x) {
        unsigned int ti = (unsigned int)(r % T);
        gwtf_size bh = r / T; // b * NH + h
        unsigned int h = (unsigned int)(bh % NH);
        gwtf_size b = bh / NH;
        const float *q = qkv + (b * T + ti) * C3 + h * hs;
        float *row = att + r * T; // == att + bh*T*T + ti*T
        float m = neg_inf;
        for (unsigned int t2 = threadIdx.x; t2 <= ti; t2 += blockDim.x) {
            const float *k = qkv + (b * T + t2) * C3 + C + h * hs;
            float s = 0.0f;
            for (unsigned int i = 0; i < hs; ++i) s += q[i] * k[i];
            s *= scale;
            row[t2] = s;
            m = fmaxf(m, s);
        }
        float maxv = gwtf_block_max(m, shared, neg_inf);
        float sum = 0.0f;
        for (unsigned int t2 = threadIdx.x; t2 <= ti; t2 += blockDim.x) {
            float e = expf(row[t2] - maxv);
            row[t2] = e;
            sum += e;
        }
        sum = gwtf_block_sum(sum, shared);
        float inv = 1.0f / sum;
        for (unsigned int t2 = threadIdx.x; t2 < T; t2 += blockDim.x)
            row[t2] = t2 <= ti ? row[t2] * inv : 0.0f;
        __syncthreads(); // the whole row is written before any thread reads it
        float *o = out + (b * T + ti) * C + h * hs;
        for (unsigned int i = threadIdx.x; i < hs; i += blockDim.x) {
            float acc = 0.0f;
            for (unsigned int t2 = 0; t2 <= ti; ++t2)
                acc += row[t2] * qkv[(b * T + t2) * C3 + 2 * C + h * hs + i];
            o[i] = acc;
        }
        __syncthreads(); // done reading this row before the block moves on
    }
}

// Backward, first half: one thread block per query row (b, h, ti).
//   datt[t2] = v[t2] . dout[ti]                  (t2 <= ti)
//   dpre[t2] = att[t2] * (datt[t2] - sum_t2 att[t2] * datt[t2]) * scale
//   dq[ti]  += sum_t2 dpre[t2] * k[t2]
// dpre (the gradient of the pre-softmax scores) is kept in the scratch buffer
// for the second half; only its entries t2 <= ti are written.
extern "C" __global__ void gwtf_attention_backward_query(float *dqkv, float *dpre,
                                                        const float *dout, const float *qkv,
                                                        const float *att, unsigned int B,
                                                        unsigned int T, unsigned int C,
                                                        unsigned int NH, float scale) {
    __shared__ float shared[32];
    unsigned int hs = C / NH;
    gwtf_size C3 = 3 * (gwtf_size)C;
    gwtf_size rows = (gwtf_size)B * NH * T;
    for (gwtf_size r = blockIdx.x; r < rows; r += gridDim.x) {
        unsigned int ti = (unsigned int)(r % T);
        gwtf_size bh = r / T;
        unsigned int h = (unsigned int)(bh % NH);
        gwtf_size b = bh / NH;
        const float *arow = att + r * T;
        float *prow = dpre + r * T;
        const float *d = dout + (b * T + ti) * C + h * hs;
        float dot = 0.0f;
        for (unsigned int t2 = threadIdx.x; t2 <= ti; t2 += blockDim.x) {
            const float *v = qkv + (b * T + t2) * C3 + 2 * C + h * hs;
            float s = 0.0f;
            for (unsigned int i = 0; i < hs; ++i) s += v[i] * d[i];
            prow[t2] = s; // datt, turned into dpre below by the same thread
            dot += arow[t2] * s;
        }
        dot = gwtf_block_sum(dot, shared);
        for (unsigned int t2 = threadIdx.x; t2 <= ti; t2 += blockDim.x)
            prow[t2] = arow[t2] * (prow[t2] - dot) * scale;
        __syncthreads(); // the whole dpre row is written before any thread reads it
        for (unsigned int i = threadIdx.x; i < hs; i += blockDim.x) {
            float acc = 0.0f;
            for (unsigned int t2 = 0; t2 <= ti; ++t2)
                acc += prow[t2] * qkv[(b * T + t2) * C3 + C + h * hs + i];
            dqkv[(b * T + ti) * C3 + h * hs + i] += acc;
        }
        __syncthreads();
    }
}

// Backward, second half: one thread block per key/value position (b, h, t2),
// summing over the queries ti >= t2 in increasing order:
//   dk[t2] += sum_ti dpre[ti, t2] * q[ti]
//   dv[t2] += sum_ti att[ti, t2] * dout[ti]
// Runs after gwtf_attention_backward_query (same stream), which wrote dpre.
extern "C" __global__ void gwtf_attention_backward_key_value(float *dqkv, const float *dpre,
                                                            const float *dout, const float *qkv,
                                                            const float *att, unsigned int B,
                                                            unsigned int T, unsigned int C,
                                                            unsigned int NH) {
    unsigned int hs = C / NH;
    gwtf_size C3 = 3 * (gwtf_size)C;
    gwtf_size rows = (gwtf_size)B * NH * T;
    for (gwtf_size r = blockIdx.x; r < rows; r += gridDim.x) {
        unsigned int t2 = (unsigned int)(r % T);
        gwtf_size bh = r / T;
        unsigned int h = (unsigned int)(bh % NH);
        gwtf_size b = bh / NH;
        for (unsigned int i = threadIdx.x; i < hs; i += blockDim.x) {
            float dk = 0.0f, dv = 0.0f;
            for (unsigned int ti = t2; ti < T; ++ti) {
                gwtf_size at = (bh * T + ti) * T + t2;
                dv += att[at] * dout[(b * T + ti) * C + h * hs + i];
                dk += dpre[at] * qkv[(b * T + ti) * C3 + h * hs + i];
            }
            dqkv[(b * T + t2) * C3 + C + h * hs + i] += dk;
            dqkv[(b * T + t2) * C3 + 2 * C + h * hs + i] += dv;
        }
    }
}
