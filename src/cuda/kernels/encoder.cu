// Token + position embedding, as encoder_forward / encoder_backward in src/model/ops.rs.
// Every output element is one add (forward) or a sum taken in the same order as
// the CPU twin (backward), so the results match the CPU bit for bit. Token ids
// are checked against the vocabulary on the host before they are uploaded.

// out[i, j] = wte[tokens[i], j] + wpe[i % seq, j]; `wpe` is NULL for no positions.
extern "C" __global__ void gwtf_encoder_forward(float *out, const unsigned int *tokens,
                                                const float *wte, const float *wpe,
                                                gwtf_size rows, unsigned int seq,
                                                unsigned int c) {
    GWTF_FOR(k, rows * c) {
        gwtf_size i = k / c;
        unsigned int j = (unsigned int)(k % c);
        float x = wte[(gwtf_size)tokens[i] * c + j];
        if (wpe != 0) x += wpe[(i % seq) * c + j];
        out[k] = x;
    }
}

// dwte[tokens[i], j] += dout[i, j] for i = 0, 1, ..., rows-1 in that order (the
// CPU's order). One thread per column j: a thread owns column j of every row of
// dwte, so repeated tokens need no atomics and the order is fixed.
extern "C" __global__ void gwtf_encoder_backward_wte(float *dwte, const float *dout,
                                                     const unsigned int *tokens,
                                                     gwtf_size rows, unsigned int c) {
    GWTF_FOR(j, (gwtf_size)c) {
        for (gwtf_size i = 0; i < rows; ++i) dwte[(gwtf_size)tokens[i] * c + j] += dout[i * c + j];
    }
}

// dwpe[t, j] += dout[i, j] for the rows i = t, t + seq, t + 2 seq, ... in that
// order. One thread per element of dwpe (seq x c).
extern "C" __global__ void gwtf_encoder_backward_wpe(float *dwpe, const float *dout,
                                                     gwtf_size rows, unsigned int seq,
                                                     unsigned int c) {
    GWTF_FOR(k, (gwtf_size)seq * c) {
        gwtf_size t = k / c, j = k % c;
        float acc = dwpe[k];
        for (gwtf_size i = t; i < rows; i += seq) acc += dout[i * c + j];
        dwpe[k] = acc;
    }
}
