// Aggregation: out = sum_j w_j * in_j, with the weights already normalised on
// the host (w_j = weight_j / sum(weights), computed in double, as the CPU twin
// does), summed in the order j = 0..count-1 for every element.
extern "C" __global__ void gwtf_weighted_average(const float *const *inputs, const float *weights,
                                                 unsigned int count, float *out, gwtf_size n) {
    GWTF_FOR(i, n) {
        float acc = __fmul_rn(weights[0], inputs[0][i]);
        for (unsigned int j = 1; j < count; ++j) acc = __fadd_rn(acc, __fmul_rn(weights[j], inputs[j][i]));
        out[i] = acc;
    }
}
