// Residual adds and the bias of the linear layers, as add_inplace, bias_forward
// and bias_backward in src/model/ops.rs. One add per element, or a column sum in
// the CPU's row order: the results match the CPU bit for bit.

// dst[i] += src[i]
extern "C" __global__ void gwtf_add_inplace(float *dst, const float *src, gwtf_size n) {
    GWTF_FOR(i, n) { dst[i] += src[i]; }
}

// out[r, j] += bias[j] for every row r of `oc` columns.
extern "C" __global__ void gwtf_bias_forward(float *out, const float *bias, gwtf_size rows,
                                             unsigned int oc) {
    GWTF_FOR(k, rows * oc) { out[k] += bias[k % oc]; }
}

// dbias[j] += dout[0, j] + dout[1, j] + ... (rows in order), one thread per column.
extern "C" __global__ void gwtf_bias_backward(float *dbias, const float *dout, gwtf_size rows,
                                              unsigned int oc) {
    GWTF_FOR(j, (gwtf_size)oc) {
        float acc = dbias[j];
        for (gwtf_size r = 0; r < rows; ++r) acc += dout[r * oc + j];
        dbias[j] = acc;
    }
}
