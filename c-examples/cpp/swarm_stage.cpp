// swarm_stage: a relay of a `gwtf node` swarm whose trainer is C++ driving
// libgwtf's own model through `gwtf_stage`: it does exactly what the
// built-in trainer of `gwtf node` does (src/swarm/model_trainer.rs), so
// `gwtf node` processes and these serve the same stages as replicas that
// agree bit for bit.
//
//   swarm_stage --listen 127.0.0.1:7003 --key-file KEY --node-key r3.key --stage 1
//               --model llama-tiny --stages 4 --iterations 30
//               --peer ID1/0/127.0.0.1:7001 --peer ID3/1/127.0.0.1:7003 ...
//
// (each ID is the one `gwtf keygen FILE` prints for that member's key file).
//
// The model flags must be those of the swarm's `gwtf node` processes.
// With --recompute (and memory for few microbatches: --memory-mb,
// --microbatch-bytes) a forward beyond memory keeps nothing and runs again
// before its backward, as `gwtf node` does.
#include "swarm_common.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>

namespace {

using Mb = std::tuple<uint32_t, uint32_t, uint32_t>;  // holder, iteration, index
Mb mb_of(const gwtf_microbatch &m) { return {m.holder, m.iteration, m.index}; }

class Relay {
public:
    Relay(const swarm::Args &a, const gwtf_model_run_info &info) : a_(a), info_(info) {}

    void run(gwtf::Peer &peer, const gwtf_peer_task &t, uint32_t id) {
        peer_ = &peer;
        id_ = id;
        std::string why = serve(t.stage);
        if (why.empty()) why = dispatch(t);
        if (!why.empty()) swarm::fail(peer, t, id, why);
    }

private:
    // Holds the model stage `stage` (a joiner learns it with its first task).
    std::string serve(uint32_t stage) {
        if (stage_ && stage == index_) return "";
        if (stage == 0) return "this program is a relay, not a data holder";
        gwtf_stage *raw = nullptr;
        gwtf_error *err = nullptr;
        gwtf::check(gwtf_stage_new(a_.model.c_str(), a_.stages, stage, a_.seed, &raw, &err), &err);
        stage_.reset(raw);
        index_ = stage;
        gwtf_stage_info si;
        gwtf::check(gwtf_stage_info_init(&si));
        gwtf::check(gwtf_stage_get_info(raw, &si, &err), &err);
        params_ = si.num_params;
        ids_.clear();
        grads_.clear();
        return "";
    }

    std::vector<float> params() {
        std::vector<float> p(params_);
        gwtf_error *err = nullptr;
        gwtf::check(gwtf_stage_export_params(stage_.get(), p.data(), p.size(), nullptr, &err), &err);
        return p;
    }
    void set_params(const std::vector<float> &p) {
        gwtf_error *err = nullptr;
        gwtf::check(gwtf_stage_import_params(stage_.get(), p.data(), p.size(), &err), &err);
    }
    void digest(uint8_t d[32]) {
        gwtf_error *err = nullptr;
        gwtf::check(gwtf_stage_state_digest(stage_.get(), d, &err), &err);
    }

    // After an import or a restart: nothing kept is of these weights; they
    // stand for the update of `t.iteration` (none: before any).
    // `before`: the parameters from before that update, if known.
    std::string new_state(const gwtf_peer_task &t, std::optional<std::vector<float>> before) {
        uint8_t d[32];
        ids_.clear();
        grads_.clear();
        if (t.has_iteration) applied_ = t.iteration;
        else applied_.reset();
        before_ = std::move(before);
        digest(d);
        peer_->done_weights(t.id, d);
        return "";
    }

    std::string dispatch(const gwtf_peer_task &t) {
        uint8_t d[32];
        switch (t.kind) {
        case GWTF_TASK_KIND_FORWARD:
        case GWTF_TASK_KIND_BACKWARD:
            return at_its_weights(t);
        case GWTF_TASK_KIND_GRADIENT: {
            // Exactly the granted microbatches, each once, in order.
            std::vector<Mb> granted;
            for (size_t i = 0; i < t.granted_len; i++) granted.push_back(mb_of(t.granted[i]));
            std::sort(granted.begin(), granted.end());
            granted.erase(std::unique(granted.begin(), granted.end()), granted.end());
            std::vector<float> sum(params_, 0.0f);
            for (const Mb &mb : granted) {
                auto it = grads_.find(mb);
                if (it == grads_.end()) return "no gradient kept for a granted microbatch";
                for (size_t i = 0; i < sum.size(); i++) sum[i] += it->second[i];
            }
            digest(d);
            peer_->done_gradient(t.id, sum, d);
            return "";
        }
        case GWTF_TASK_KIND_APPLY: {
            gwtf_adamw_options opt;
            gwtf_error *err = nullptr;
            gwtf::check(gwtf_model_run_adamw(a_.model.c_str(), a_.stages, a_.iterations, t.iteration,
                                             &opt, &err),
                        &err);
            before_ = params();
            applied_ = t.iteration;
            if (gwtf_stage_apply_mean(stage_.get(), t.mean, t.mean_len, &opt, &err) != GWTF_STATUS_OK) {
                std::string why = gwtf_error_message(err);
                gwtf_error_free(err);
                return why;
            }
            for (auto it = grads_.begin(); it != grads_.end();)
                it = std::get<1>(it->first) <= t.iteration ? grads_.erase(it) : std::next(it);
            digest(d);
            peer_->done_weights(t.id, d);
            return "";
        }
        case GWTF_TASK_KIND_EXPORT_STATE: {
            // gwtf node's format: per piece, its length (u64) and its state;
            // then, when known, the parameters from before the last update
            // (their length in bytes, u64, and the floats): a joiner may
            // have to run a microbatch of that update's iteration.
            size_t n = 0;
            gwtf_error *err = nullptr;
            gwtf_stage_export_state(stage_.get(), nullptr, 0, &n, nullptr);
            bool with_before = applied_ && before_;
            uint64_t before_len = with_before ? 4 * before_->size() : 0;
            gwtf::Frame f = peer_->alloc(8 + n + (with_before ? 8 + before_len : 0));
            uint8_t *p = f.data<uint8_t>();
            uint64_t len = n;
            std::memcpy(p, &len, 8);
            gwtf::check(gwtf_stage_export_state(stage_.get(), p + 8, n, nullptr, &err), &err);
            if (with_before) {
                std::memcpy(p + 8 + n, &before_len, 8);
                std::memcpy(p + 16 + n, before_->data(), before_len);
            }
            peer_->done(t.id, f);
            return "";
        }
        case GWTF_TASK_KIND_INIT_STATE: {
            // The stage's last node died: start it again from the seeded
            // initial weights, as gwtf node does.
            stage_.reset();
            std::string why = serve(t.stage);
            if (!why.empty()) return why;
            // A microbatch of the iteration these weights stand for runs on
            // them (what that iteration saw is gone).
            std::optional<std::vector<float>> before;
            if (t.has_iteration) before = params();
            return new_state(t, std::move(before));
        }
        case GWTF_TASK_KIND_IMPORT_STATE: {
            uint64_t len = 0;
            if (t.input_len < 8) return "state cut short";
            std::memcpy(&len, t.input, 8);
            if (len > t.input_len - 8) return "state cut short";
            size_t rest = t.input_len - 8 - len;
            std::optional<std::vector<float>> before;
            if (rest > 0) {
                uint64_t before_len = 0;
                if (rest < 8) return "state cut short";
                std::memcpy(&before_len, t.input + 8 + len, 8);
                if (before_len != rest - 8 || before_len != 4 * params_)
                    return "the parameters from before the last update: " +
                           std::to_string(rest - 8) + " bytes, " + std::to_string(4 * params_) +
                           " expected";
                if (!t.has_iteration) return "parameters from before an update, but no update applied";
                before.emplace(params_);
                std::memcpy(before->data(), t.input + 16 + len, before_len);
            }
            gwtf_error *err = nullptr;
            if (gwtf_stage_import_state(stage_.get(), t.input + 8, len, &err) != GWTF_STATUS_OK) {
                std::string why = gwtf_error_message(err);
                gwtf_error_free(err);
                return why;
            }
            return new_state(t, std::move(before));
        }
        case GWTF_TASK_KIND_DISCARD: {
            // Memory is full (--recompute): drop what this forward kept.
            // Before its backward the same forward comes again.
            auto it = ids_.find(mb_of(t.mb));
            if (it != ids_.end()) {
                gwtf_stage_discard(stage_.get(), it->second, nullptr, nullptr);
                ids_.erase(it);
            }
            std::printf("{\"event\":\"discard\",\"node\":%u,\"iteration\":%u}\n", id_,
                        t.mb.iteration);
            peer_->done(t.id);
            return "";
        }
        case GWTF_TASK_KIND_FORGET:
            for (auto it = ids_.begin(); it != ids_.end();) {
                if (std::get<1>(it->first) < t.iteration) {
                    gwtf_stage_discard(stage_.get(), it->second, nullptr, nullptr);
                    it = ids_.erase(it);
                } else {
                    ++it;
                }
            }
            for (auto it = grads_.begin(); it != grads_.end();)
                it = std::get<1>(it->first) < t.iteration ? grads_.erase(it) : std::next(it);
            peer_->done(t.id);
            return "";
        default:
            return "a relay got task kind " + std::to_string(t.kind);
        }
    }

    // A microbatch of the iteration whose update was applied last runs on
    // the weights from before that update.
    std::string at_its_weights(const gwtf_peer_task &t) {
        uint32_t it = t.mb.iteration;
        if (!applied_ || it > *applied_) return compute(t);
        if (it < *applied_ || !before_)
            return "a microbatch of iteration " + std::to_string(it) + " after the update of " +
                   std::to_string(*applied_) + ": its weights are gone";
        std::vector<float> now = params();
        set_params(*before_);
        std::string r = compute(t);
        set_params(now);
        return r;
    }

    std::string compute(const gwtf_peer_task &t) {
        Mb mb = mb_of(t.mb);
        const float *in = reinterpret_cast<const float *>(t.input);
        size_t n = t.input_len / 4;
        gwtf_error *err = nullptr;
        if (t.kind == GWTF_TASK_KIND_FORWARD) {
            auto old = ids_.find(mb);
            if (old != ids_.end()) gwtf_stage_discard(stage_.get(), old->second, nullptr, nullptr);
            uint64_t model_id = ++next_id_;
            ids_[mb] = model_id;
            gwtf::Frame f = peer_->alloc(t.output_bytes);
            // The stage writes its output straight into the frame sent on.
            gwtf::check(gwtf_stage_forward(stage_.get(), model_id, info_.batch, info_.seq, nullptr, in, n,
                                           nullptr, 0, f.data<float>(), t.output_bytes / 4, nullptr,
                                           nullptr, &err),
                        &err);
            peer_->done(t.id, f);
            return "";
        }
        auto id = ids_.find(mb);
        if (id == ids_.end()) return "backward of a microbatch whose forward is not kept";
        gwtf::Frame f = peer_->alloc(t.output_bytes);
        gwtf::check(gwtf_stage_backward(stage_.get(), id->second, in, n, f.data<float>(),
                                        t.output_bytes / 4, nullptr, &err),
                    &err);
        ids_.erase(id);
        std::vector<float> g(params_);
        gwtf::check(gwtf_stage_take_grads(stage_.get(), g.data(), g.size(), nullptr, &err), &err);
        grads_[mb] = std::move(g);
        peer_->done(t.id, f);
        return "";
    }

    const swarm::Args &a_;
    gwtf_model_run_info info_;
    gwtf::Peer *peer_ = nullptr;
    uint32_t id_ = 0;
    std::unique_ptr<gwtf_stage, decltype(&gwtf_stage_free)> stage_{nullptr, gwtf_stage_free};
    uint32_t index_ = 0;
    size_t params_ = 0;
    std::map<Mb, uint64_t> ids_;                 // the model's id of each kept forward
    uint64_t next_id_ = 0;
    std::map<Mb, std::vector<float>> grads_;     // per microbatch, until aggregated
    std::optional<uint32_t> applied_;
    std::optional<std::vector<float>> before_;
};

int run(const swarm::Args &a) {
    if (a.holder) swarm::usage("swarm_stage", "a relay only: data holders are gwtf node processes");
    gwtf_model_run_info info;
    gwtf_error *err = nullptr;
    gwtf::check(gwtf_model_run_info_get(a.model.c_str(), a.stages, a.iterations, &info, &err), &err);
    // The sizes gwtf node gives the swarm for this run.
    std::vector<uint64_t> act(info.relay_stages + 1, info.activation_bytes), state;
    uint64_t mine = 1;
    int stage = swarm::stage_of(a);
    for (uint32_t s = 0; s <= info.relay_stages; s++) {
        uint64_t st = 0, mb = 0;
        gwtf::check(gwtf_model_run_stage_bytes(a.model.c_str(), a.stages, s, &st, &mb, &err), &err);
        state.push_back(st);
        if ((stage < 0 && s > 0) || (int)s == stage) mine = std::max(mine, mb);
    }
    swarm::Options so;
    swarm::base_options(a, so);
    so.o.relay_stages = info.relay_stages;
    so.o.activation_bytes = act.data();
    so.o.state_bytes = state.data();
    so.o.microbatch_bytes = mine;
    Relay relay(a, info);
    return swarm::serve(a, so.o, [&](gwtf::Peer &peer, const gwtf_peer_task &t, uint32_t id) {
        relay.run(peer, t, id);
    });
}

}  // namespace

int main(int argc, char **argv) {
    return swarm::main_guard("swarm_stage", [&] { return run(swarm::parse(argc, argv)); });
}
