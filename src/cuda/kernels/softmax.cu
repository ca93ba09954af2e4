// Softmax + cross-entropy over rows of `v` logits, one thread block per row,
// as src/model/ops.rs: probs = softmax(logits); loss[r] = -(l[t] - max - ln sum).
extern "C" __global__ void gwtf_crossentropy_forward(float *probs, float *losses,
                                                     const float *logits,
                                                     const unsigned int *targets, gwtf_size rows,
                                                     unsigned int v) {
    __shared__ float shared[32];
    for (gwtf_size r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *l = logits + r * v;
        float m = -__int_as_float(0x7f800000);
        for (unsigned int i = threadIdx.x; i < v; i += blockDim.x) m = fmaxf(m, l[i]);
        float maxv = gwtf_block_max(m, shared, -__int_as_float(0x7f800000));
        float s = 0.0f;
        for (unsigned int i = threadIdx.x; i < v; i += blockDim.x) {
            float e = expf(l[i] - maxv);
            probs[r * v + i] = e;
            s += e;
        }
        float sum = gwtf_block_sum(s, shared);
        float inv = 1.0f / sum;
        for (unsigned int i = threadIdx.x; i < v; i += blockDim.x) probs[r * v + i] *= inv;
        if (threadIdx.x == 0) losses[r] = -((l[targets[r]] - maxv) - logf(sum));
    }
}

// dlogits += (probs - onehot(target)) * scale, scale = dloss / rows.
extern "C" __global__ void gwtf_crossentropy_backward(float *dlogits, const float *probs,
                                                      const unsigned int *targets,
                                                      gwtf_size rows, unsigned int v,
                                                      float scale) {
    GWTF_FOR(k, rows * v) {
        gwtf_size r = k / v;
        unsigned int i = (unsigned int)(k % v);
        float ind = (i == targets[r]) ? 1.0f : 0.0f;
        dlogits[k] += (probs[k] - ind) * scale;
    }
}
