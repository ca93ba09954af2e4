// swarm_mlp: a trainer with its own model that joins a libgwtf swarm.
//
// The model is this file's, in plain C++ (forward, backward, Adam): a token
// embedding and a softmax head on the data holders (stage 0), and one tanh
// layer per relay stage. Stage boundaries alternate between 32 and 48 wide,
// so the activations between stages have different sizes. libgwtf does
// everything else: membership, routing, transport, crash recovery, the
// all-reduce of the gradients, state transfer to joiners.
//
//   gwtf keygen h1.key    # prints the id (say 4168068179) for the --peer lists
//   swarm_mlp --listen 127.0.0.1:7001 --key-file KEY --node-key h1.key --holder
//             --peer 4168068179/0/127.0.0.1:7001 --peer ID2/1/127.0.0.1:7002 ...
//   swarm_mlp --listen 127.0.0.1:7005 --key-file KEY --join 127.0.0.1:7001
//
// Prints one JSON object per line (listening, iteration, applied, state,
// error, done, left). SIGTERM or SIGINT leaves gracefully; SIGKILL is a
// crash the others survive. Data holders exit after --iterations.
#include "mlp_model.hpp"

#include <cmath>
#include <cstring>
#include <vector>

namespace {

class MlpTrainer : public Trainer {
public:
    using Trainer::Trainer;

protected:
    std::string compute(const gwtf_peer_task &t) override {
        Mb mb = mb_of(t.mb);
        const float *in = reinterpret_cast<const float *>(t.input);
        switch (t.kind) {
        case GWTF_TASK_KIND_EMBED: {
            Kept &k = draw_microbatch(st_, t.mb);
            int d = width(0);
            gwtf::Frame f = peer_.alloc(t.output_bytes);
            float *h = f.data<float>();
            for (int b = 0; b < BATCH; b++)
                std::memcpy(h + b * d, &st_.pieces[0].w[(size_t)k.tokens[b] * d], 4 * d);
            peer_.done(t.id, f);
            return "";
        }
        case GWTF_TASK_KIND_LOSS: {
            auto k = st_.kept.find(mb);
            if (k == st_.kept.end()) return "loss of a microbatch this holder did not embed";
            int d = width(st_.relay_stages);
            const std::vector<float> &W = st_.pieces[1].w, &bias = st_.pieces[2].w;
            std::vector<float> gW(W.size(), 0.0f), gb(VOCAB, 0.0f);
            gwtf::Frame f = peer_.alloc(t.output_bytes);
            float *gh = f.data<float>();
            double loss = 0;
            for (int b = 0; b < BATCH; b++) {
                const float *h = in + b * d;
                float z[VOCAB], mx = -1e30f, s = 0;
                for (int v = 0; v < VOCAB; v++) {
                    z[v] = bias[v];
                    for (int j = 0; j < d; j++) z[v] += h[j] * W[(size_t)j * VOCAB + v];
                    mx = std::max(mx, z[v]);
                }
                for (int v = 0; v < VOCAB; v++) s += (z[v] = std::exp(z[v] - mx));
                int y = k->second.targets[b];
                loss -= std::log(z[y] / s);
                for (int v = 0; v < VOCAB; v++) {
                    float g = (z[v] / s - (v == y ? 1.0f : 0.0f)) / BATCH;
                    gb[v] += g;
                    for (int j = 0; j < d; j++) gW[(size_t)j * VOCAB + v] += h[j] * g;
                    z[v] = g;
                }
                for (int j = 0; j < d; j++) {
                    float acc = 0;
                    for (int v = 0; v < VOCAB; v++) acc += z[v] * W[(size_t)j * VOCAB + v];
                    gh[b * d + j] = acc;
                }
            }
            st_.keep_grad(mb, 1, std::move(gW));
            st_.keep_grad(mb, 2, std::move(gb));
            peer_.done_loss(t.id, (float)(loss / BATCH), f);
            return "";
        }
        case GWTF_TASK_KIND_EMBED_BACKWARD: {
            auto k = st_.kept.find(mb);
            if (k == st_.kept.end()) return "embedding backward of a microbatch not embedded";
            int d = width(0);
            std::vector<float> gE(st_.pieces[0].w.size(), 0.0f);
            for (int b = 0; b < BATCH; b++)
                for (int j = 0; j < d; j++) gE[(size_t)k->second.tokens[b] * d + j] += in[b * d + j];
            st_.keep_grad(mb, 0, std::move(gE));
            st_.kept.erase(k);
            peer_.done(t.id);
            return "";
        }
        case GWTF_TASK_KIND_FORWARD: {
            int din = width(st_.stage - 1), dout = width(st_.stage);
            const std::vector<float> &W = st_.pieces[0].w, &bias = st_.pieces[1].w;
            Kept &k = st_.kept[mb];
            k.in.assign(in, in + (size_t)BATCH * din);
            k.out.resize((size_t)BATCH * dout);
            for (int b = 0; b < BATCH; b++)
                for (int o = 0; o < dout; o++) {
                    float z = bias[o];
                    for (int i = 0; i < din; i++) z += W[(size_t)o * din + i] * in[b * din + i];
                    k.out[(size_t)b * dout + o] = std::tanh(z);
                }
            gwtf::Frame f = peer_.alloc(t.output_bytes);
            std::memcpy(f.data<float>(), k.out.data(), 4 * k.out.size());
            peer_.done(t.id, f);
            return "";
        }
        case GWTF_TASK_KIND_BACKWARD: {
            auto k = st_.kept.find(mb);
            if (k == st_.kept.end()) return "backward of a microbatch whose forward is not kept";
            int din = width(st_.stage - 1), dout = width(st_.stage);
            const std::vector<float> &W = st_.pieces[0].w;
            std::vector<float> gW(W.size(), 0.0f), gb(dout, 0.0f);
            gwtf::Frame f = peer_.alloc(t.output_bytes);
            float *gin = f.data<float>();
            std::fill(gin, gin + (size_t)BATCH * din, 0.0f);
            for (int b = 0; b < BATCH; b++)
                for (int o = 0; o < dout; o++) {
                    float y = k->second.out[(size_t)b * dout + o];
                    float dz = in[b * dout + o] * (1 - y * y);
                    gb[o] += dz;
                    for (int i = 0; i < din; i++) {
                        gW[(size_t)o * din + i] += dz * k->second.in[(size_t)b * din + i];
                        gin[b * din + i] += dz * W[(size_t)o * din + i];
                    }
                }
            st_.keep_grad(mb, 0, std::move(gW));
            st_.keep_grad(mb, 1, std::move(gb));
            st_.kept.erase(k);
            peer_.done(t.id, f);
            return "";
        }
        }
        return "not a compute task";
    }
};

}  // namespace

int main(int argc, char **argv) {
    return swarm::main_guard("swarm_mlp", [&] {
        return serve_model<MlpTrainer>("swarm_mlp", swarm::parse(argc, argv));
    });
}
