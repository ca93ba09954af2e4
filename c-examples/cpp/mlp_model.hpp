// The model of swarm_mlp and swarm_torch, and everything of their trainers
// but the compute: a token embedding and a softmax head on the data holders
// (stage 0), one tanh layer per relay stage, boundaries alternating between
// 32 and 48 wide; the stage's parameters, Adam state, the gradients kept per
// microbatch until aggregated, the exported state, the digest, and the
// dispatch of the library's tasks. A trainer supplies `compute`: the
// forward and backward of one microbatch (plain loops in swarm_mlp.cpp,
// libtorch's autograd in swarm_torch.cpp), over the same parameters.
#pragma once
#include "swarm_common.hpp"
#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace {

constexpr int VOCAB = 16;   // tokens
constexpr int BATCH = 16;   // examples per microbatch
constexpr float LR = 0.02f; // Adam

// Width of stage boundary b: the activation stage b sends to stage b + 1.
int width(int b) { return b % 2 == 0 ? 32 : 48; }

// ---- deterministic randomness

uint64_t splitmix(uint64_t &s) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
uint64_t mix(std::initializer_list<uint64_t> xs) {
    uint64_t s = 0x5357'4d4c'5000'0001ull;
    for (uint64_t x : xs) {
        s ^= x;
        s = splitmix(s);
    }
    return s;
}
float uniform(uint64_t &s) { return (float)((splitmix(s) >> 40) / (double)(1ull << 24)); }

// ---- the model of one stage: pieces of parameters with Adam state

struct Piece {
    std::vector<float> w, m, v;
};

struct Kept {
    std::vector<float> in, out;  // relay: its input and tanh output
    std::vector<int> tokens;     // holder: the microbatch's tokens
    std::vector<int> targets;    // holder: and targets
};

using Mb = std::tuple<uint32_t, uint32_t, uint32_t>;  // holder, iteration, index
Mb mb_of(const gwtf_microbatch &m) { return {m.holder, m.iteration, m.index}; }

struct Stage {
    int relay_stages = 0;
    int stage = -1;  // -1: not known yet (a joiner before its state)
    uint64_t seed = 1;
    std::vector<Piece> pieces;  // holder: [embedding, head W, head b]; relay: [W, b]
    uint64_t step = 0;
    std::map<Mb, Kept> kept;
    std::map<Mb, std::vector<std::vector<float>>> grads;  // per piece, until aggregated
    std::optional<uint32_t> applied;                     // last update applied or imported
    std::optional<std::vector<Piece>> before;             // parameters before it

    void init(int s) {
        stage = s;
        pieces.clear();
        kept.clear();
        grads.clear();
        step = 0;
        applied.reset();
        before.reset();
        auto piece = [&](size_t n, int fan_in, uint64_t tag) {
            Piece p;
            p.w.resize(n);
            p.m.assign(n, 0.0f);
            p.v.assign(n, 0.0f);
            uint64_t r = mix({seed, (uint64_t)s, tag});
            float scale = fan_in > 0 ? 1.0f / std::sqrt((float)fan_in) : 0.0f;
            for (float &x : p.w) x = (2.0f * uniform(r) - 1.0f) * scale;
            pieces.push_back(std::move(p));
        };
        if (s == 0) {
            int d = width(0), dl = width(relay_stages);
            piece((size_t)VOCAB * d, 1, 1);   // embedding
            piece((size_t)dl * VOCAB, dl, 2); // head weights
            piece(VOCAB, 0, 3);               // head bias (zeros)
        } else {
            int din = width(s - 1), dout = width(s);
            piece((size_t)dout * din, din, 1);
            piece(dout, 0, 2);
        }
    }

    size_t num_params() const {
        size_t n = 0;
        for (auto &p : pieces) n += p.w.size();
        return n;
    }
    // Parameters, Adam moments and step; then, when known, the parameters
    // from before the last update (a joiner may have to run a microbatch
    // of that update's iteration): at most this many bytes.
    size_t core_bytes() const { return 12 * num_params() + 8; }
    size_t state_bytes() const { return core_bytes() + 4 * num_params(); }

    // A 256-bit digest of parameters, Adam moments and step (four FNV-1a
    // lanes: not cryptographic; replicas only compare it).
    void digest(uint8_t out[32]) const {
        uint64_t h[4] = {0xcbf29ce484222325ull, 0x84222325cbf29ce4ull, 0x1234567890abcdefull,
                         0xfedcba0987654321ull};
        auto eat = [&](const void *data, size_t n) {
            const uint8_t *b = static_cast<const uint8_t *>(data);
            for (size_t i = 0; i < n; i++) h[i % 4] = (h[i % 4] ^ b[i]) * 0x100000001b3ull;
        };
        for (auto &p : pieces) {
            eat(p.w.data(), 4 * p.w.size());
            eat(p.m.data(), 4 * p.m.size());
            eat(p.v.data(), 4 * p.v.size());
        }
        eat(&step, 8);
        for (int i = 0; i < 4; i++) std::memcpy(out + 8 * i, &h[i], 8);
    }

    std::vector<uint8_t> export_state() const {
        std::vector<uint8_t> b;
        b.reserve(state_bytes());
        auto put = [&](const std::vector<float> &v) {
            const uint8_t *p = reinterpret_cast<const uint8_t *>(v.data());
            b.insert(b.end(), p, p + 4 * v.size());
        };
        for (auto &p : pieces) put(p.w);
        for (auto &p : pieces) put(p.m);
        for (auto &p : pieces) put(p.v);
        const uint8_t *s = reinterpret_cast<const uint8_t *>(&step);
        b.insert(b.end(), s, s + 8);
        if (applied && before)
            for (auto &p : *before) put(p.w);
        return b;
    }

    // `iteration`: the update the state stands for (none: before any).
    std::string import_state(const uint8_t *b, size_t n, std::optional<uint32_t> iteration) {
        if (n != core_bytes() && n != state_bytes())
            return "a state of " + std::to_string(n) + " bytes, expected " +
                   std::to_string(core_bytes()) + " or " + std::to_string(state_bytes());
        if (n == state_bytes() && !iteration)
            return "parameters from before an update, but no update applied";
        auto get = [&](std::vector<float> &v) {
            std::memcpy(v.data(), b, 4 * v.size());
            b += 4 * v.size();
        };
        for (auto &p : pieces) get(p.w);
        for (auto &p : pieces) get(p.m);
        for (auto &p : pieces) get(p.v);
        std::memcpy(&step, b, 8);
        b += 8;
        before.reset();
        if (n == state_bytes()) {
            before = pieces;
            for (auto &p : *before) get(p.w);
        }
        applied = iteration;
        kept.clear();
        grads.clear();
        return "";
    }

    void keep_grad(const Mb &mb, size_t piece, std::vector<float> g) {
        auto &v = grads[mb];
        v.resize(pieces.size());
        v[piece] = std::move(g);
    }

    // The sum of exactly the granted microbatches' gradients, in microbatch
    // order; "" or why not.
    std::string gradient(std::vector<Mb> granted, std::vector<float> &sum) const {
        std::sort(granted.begin(), granted.end());
        granted.erase(std::unique(granted.begin(), granted.end()), granted.end());
        sum.assign(num_params(), 0.0f);
        for (const Mb &mb : granted) {
            auto it = grads.find(mb);
            if (it == grads.end()) return "no gradient kept for a granted microbatch";
            size_t off = 0;
            for (size_t p = 0; p < pieces.size(); p++) {
                const auto &g = it->second[p];
                if (g.size() != pieces[p].w.size()) return "a granted microbatch misses a piece";
                for (size_t i = 0; i < g.size(); i++) sum[off + i] += g[i];
                off += g.size();
            }
        }
        return "";
    }

    std::string apply(uint32_t iteration, const float *mean, size_t n) {
        if (n != num_params()) return "a mean of " + std::to_string(n) + " for " +
                                      std::to_string(num_params()) + " parameters";
        before = pieces;
        applied = iteration;
        step++;
        const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
        float c1 = 1.0f - std::pow(b1, (float)step), c2 = 1.0f - std::pow(b2, (float)step);
        size_t off = 0;
        for (auto &p : pieces) {
            for (size_t i = 0; i < p.w.size(); i++) {
                float g = mean[off + i];
                p.m[i] = b1 * p.m[i] + (1 - b1) * g;
                p.v[i] = b2 * p.v[i] + (1 - b2) * g * g;
                p.w[i] -= LR * (p.m[i] / c1) / (std::sqrt(p.v[i] / c2) + eps);
            }
            off += p.w.size();
        }
        for (auto it = grads.begin(); it != grads.end();)
            it = std::get<1>(it->first) <= iteration ? grads.erase(it) : std::next(it);
        return "";
    }

    void forget(uint32_t first_kept) {
        for (auto it = kept.begin(); it != kept.end();)
            it = std::get<1>(it->first) < first_kept ? kept.erase(it) : std::next(it);
        for (auto it = grads.begin(); it != grads.end();)
            it = std::get<1>(it->first) < first_kept ? grads.erase(it) : std::next(it);
    }
};

// The microbatch's data, drawn from (seed, holder, iteration, index): a
// microbatch asked again is the same one. The task: y = (5x + 3) mod V,
// with one label in ten random. Kept for the loss and the backward.
inline Kept &draw_microbatch(Stage &st, const gwtf_microbatch &m) {
    Kept &k = st.kept[mb_of(m)];
    k.tokens.resize(BATCH);
    k.targets.resize(BATCH);
    uint64_t r = mix({st.seed, 0xda7a, m.holder, m.iteration, m.index});
    for (int b = 0; b < BATCH; b++) {
        int x = (int)(splitmix(r) % VOCAB);
        k.tokens[b] = x;
        k.targets[b] = splitmix(r) % 10 == 0 ? (int)(splitmix(r) % VOCAB) : (5 * x + 3) % VOCAB;
    }
    return k;
}

// ---- one process

class Trainer {
public:
    Trainer(gwtf::Peer &peer, Stage &st, uint32_t id) : peer_(peer), st_(st), id_(id) {}
    virtual ~Trainer() = default;

    void run(const gwtf_peer_task &t) {
        if (t.kind >= 100) return;  // events are the caller's
        if ((int)t.stage != st_.stage) {
            if (t.stage == 0 && st_.stage != 0) return fail(t, "a relay cannot become a data holder");
            st_.init((int)t.stage);  // a joiner's stage, before its state comes
        }
        std::string why;
        switch (t.kind) {
        case GWTF_TASK_KIND_EMBED:
        case GWTF_TASK_KIND_FORWARD:
        case GWTF_TASK_KIND_LOSS:
        case GWTF_TASK_KIND_BACKWARD:
        case GWTF_TASK_KIND_EMBED_BACKWARD:
            why = at_its_weights(t);
            break;
        case GWTF_TASK_KIND_GRADIENT: {
            std::vector<Mb> granted;
            for (size_t i = 0; i < t.granted_len; i++) granted.push_back(mb_of(t.granted[i]));
            std::vector<float> sum;
            why = st_.gradient(granted, sum);
            if (why.empty()) {
                uint8_t d[32];
                st_.digest(d);
                peer_.done_gradient(t.id, sum, d);
            }
            break;
        }
        case GWTF_TASK_KIND_APPLY:
            why = st_.apply(t.iteration, t.mean, t.mean_len);
            if (why.empty()) weights(t);
            break;
        case GWTF_TASK_KIND_EXPORT_STATE: {
            std::vector<uint8_t> b = st_.export_state();
            gwtf::Frame f = peer_.alloc(b.size());
            std::memcpy(f.data<uint8_t>(), b.data(), b.size());
            peer_.done(t.id, f);
            break;
        }
        case GWTF_TASK_KIND_IMPORT_STATE:
            why = st_.import_state(t.input, t.input_len,
                                   t.has_iteration ? std::optional<uint32_t>(t.iteration)
                                                   : std::nullopt);
            if (why.empty()) weights(t);
            break;
        case GWTF_TASK_KIND_INIT_STATE:
            // The stage's last node died: start it again from the seeded
            // initial weights; a microbatch of the iteration they stand
            // for runs on them too (what it saw is gone).
            st_.init((int)t.stage);
            if (t.has_iteration) {
                st_.applied = t.iteration;
                st_.before = st_.pieces;
            }
            weights(t);
            break;
        case GWTF_TASK_KIND_DISCARD:
            // Memory is full (--recompute): drop what this forward kept;
            // the same forward comes again before its backward.
            st_.kept.erase(mb_of(t.mb));
            peer_.done(t.id);
            break;
        case GWTF_TASK_KIND_FORGET:
            st_.forget(t.iteration);
            peer_.done(t.id);
            break;
        default:
            why = "unknown task kind " + std::to_string(t.kind);
        }
        if (!why.empty()) fail(t, why);
    }

protected:
    void fail(const gwtf_peer_task &t, const std::string &why) { swarm::fail(peer_, t, id_, why); }

    void weights(const gwtf_peer_task &t) {
        uint8_t d[32];
        st_.digest(d);
        peer_.done_weights(t.id, d);
    }

    // A microbatch's work runs on the weights of its iteration: those from
    // before the last update when it belongs to that update's iteration
    // (a recovery redid it after the stage applied).
    std::string at_its_weights(const gwtf_peer_task &t) {
        uint32_t it = t.mb.iteration;
        if (!st_.applied || it > *st_.applied) return compute(t);
        if (it < *st_.applied || !st_.before)
            return "a microbatch of iteration " + std::to_string(it) + " after the update of " +
                   std::to_string(*st_.applied) + ": its weights are gone";
        std::swap(st_.pieces, *st_.before);
        std::string r = compute(t);
        std::swap(st_.pieces, *st_.before);
        return r;
    }


    // Forward or backward of one microbatch on the stage's current weights.
    virtual std::string compute(const gwtf_peer_task &t) = 0;

    gwtf::Peer &peer_;
    Stage &st_;
    uint32_t id_;
};

// Serves the swarm with trainer `T` (a Trainer) until the node leaves.
template <class T> int serve_model(const char *name, const swarm::Args &a) {
    if (a.relay_stages < 1 || a.relay_stages > 16) swarm::usage(name, "--relay-stages is 1..16");
    Stage st;
    st.relay_stages = a.relay_stages;
    st.seed = a.seed;
    int stage = swarm::stage_of(a);
    // Every stage's sizes, from this program's own model.
    std::vector<uint64_t> act, state;
    for (int b = 0; b <= a.relay_stages; b++) {
        act.push_back(4ull * BATCH * width(b));
        Stage s;
        s.relay_stages = a.relay_stages;
        s.init(b);
        state.push_back(s.state_bytes());
    }
    if (stage >= 0) st.init(stage);
    swarm::Options so;
    swarm::base_options(a, so);
    so.o.memory_budget_bytes = 32u << 20;
    so.o.relay_stages = (uint32_t)a.relay_stages;
    so.o.activation_bytes = act.data();
    so.o.state_bytes = state.data();
    return swarm::serve(a, so.o, [&](gwtf::Peer &peer, const gwtf_peer_task &t, uint32_t id) {
        T(peer, st, id).run(t);
    });
}

}  // namespace
