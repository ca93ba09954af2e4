// pipeline.cpp: trains the reference model through four pipeline stages, as
// four swarm nodes would, with every activation and gradient compressed to
// blockwise int8 between stages (what goes on the wire), from C++17.
#include "gwtf.hpp"

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

using StagePtr = std::unique_ptr<gwtf_stage, decltype(&gwtf_stage_free)>;

// int8 round trip of a buffer: what the next node would receive.
std::vector<float> over_the_wire(const std::vector<float> &x, uint32_t block) {
    size_t nb = (x.size() + block - 1) / block;
    std::vector<int8_t> codes(x.size());
    std::vector<float> scales(nb), back(x.size());
    gwtf_error *err = nullptr;
    gwtf::check(gwtf_quantize_int8_host(x.data(), codes.data(), scales.data(), nb, x.size(), block, &err), &err);
    gwtf::check(gwtf_dequantize_int8_host(codes.data(), scales.data(), nb, back.data(), x.size(), block, &err), &err);
    return back;
}

}  // namespace

int main() {
    const uint32_t S = 4, B = 4, T = 16, BLOCK = 64;
    std::vector<StagePtr> stages;
    gwtf_error *err = nullptr;
    for (uint32_t s = 0; s < S; ++s) {
        gwtf_stage *raw = nullptr;
        gwtf::check(gwtf_stage_new("llama-tiny", S, s, 1, &raw, &err), &err);
        stages.emplace_back(raw, gwtf_stage_free);
    }
    gwtf_stage_info info;
    gwtf_stage_info_init(&info);
    gwtf::check(gwtf_stage_get_info(stages[0].get(), &info, &err), &err);
    const size_t width = size_t(B) * T * info.d_model;

    // A toy task: predict the next token of a fixed cyclic sequence.
    std::vector<uint32_t> tokens(B * T), targets(B * T);
    for (size_t i = 0; i < tokens.size(); ++i) {
        tokens[i] = uint32_t((i * 5) % 64);
        targets[i] = uint32_t(((i + 1) * 5) % 64);
    }
    gwtf_adamw_options opt;
    gwtf_adamw_options_init(&opt);
    opt.lr = 1e-2f;
    float first = 0, loss = 0;
    for (uint64_t step = 0; step < 30; ++step) {
        std::vector<float> act(width), next(width);
        gwtf::check(gwtf_stage_forward(stages[0].get(), step, B, T, tokens.data(), nullptr, tokens.size(),
                                       nullptr, 0, act.data(), width, nullptr, nullptr, &err), &err);
        for (uint32_t s = 1; s + 1 < S; ++s) {
            act = over_the_wire(act, BLOCK);
            gwtf::check(gwtf_stage_forward(stages[s].get(), step, B, T, nullptr, act.data(), width, nullptr, 0,
                                           next.data(), width, nullptr, nullptr, &err), &err);
            act.swap(next);
        }
        act = over_the_wire(act, BLOCK);
        gwtf::check(gwtf_stage_forward(stages[S - 1].get(), step, B, T, nullptr, act.data(), width,
                                       targets.data(), targets.size(), nullptr, 0, nullptr, &loss, &err), &err);
        std::vector<float> grad(width), prev(width);
        gwtf::check(gwtf_stage_backward(stages[S - 1].get(), step, nullptr, 0, grad.data(), width, nullptr, &err), &err);
        for (uint32_t s = S - 2; s >= 1; --s) {
            grad = over_the_wire(grad, BLOCK);
            gwtf::check(gwtf_stage_backward(stages[s].get(), step, grad.data(), width, prev.data(), width, nullptr, &err), &err);
            grad.swap(prev);
        }
        grad = over_the_wire(grad, BLOCK);
        gwtf::check(gwtf_stage_backward(stages[0].get(), step, grad.data(), width, nullptr, 0, nullptr, &err), &err);
        for (auto &st : stages) gwtf::check(gwtf_stage_step(st.get(), &opt, &err), &err);
        if (step == 0) first = loss;
        if (step % 10 == 0 || step == 29) std::printf("step %2llu  loss %.4f\n", (unsigned long long)step, loss);
    }
    if (!(std::isfinite(loss) && loss < 0.5f * first)) {
        std::fprintf(stderr, "loss did not drop: %f -> %f\n", first, loss);
        return 1;
    }
    std::printf("pipeline_cpp: ok (loss %.4f -> %.4f with int8 activations)\n", first, loss);
    return 0;
}
