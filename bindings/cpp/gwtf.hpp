// gwtf.hpp: a thin C++17 layer over gwtf.h for the examples: RAII handles and
// exceptions that carry the status. Header-only; it adds no ABI of its own.
#pragma once

#include <gwtf.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace gwtf {

/// A failed libgwtf call.
class Error : public std::runtime_error {
public:
    Error(gwtf_status status, const std::string &message)
        : std::runtime_error(message), status_(status) {}
    gwtf_status status() const noexcept { return status_; }

private:
    gwtf_status status_;
};

/// Throws when `status` is not OK, taking ownership of `*errp`. The error is
/// passed by address: the order in which C++ evaluates a call's arguments is
/// unspecified, so `check(f(&err), err)` could read `err` before `f` set it.
inline void check(gwtf_status status, gwtf_error **errp = nullptr) {
    gwtf_error *err = errp ? *errp : nullptr;
    if (errp) *errp = nullptr;
    if (status == GWTF_STATUS_OK) return;
    std::unique_ptr<gwtf_error, decltype(&gwtf_error_free)> guard(err, gwtf_error_free);
    throw Error(status, err ? gwtf_error_message(err) : gwtf_status_str(status));
}

inline std::string version() { return gwtf_version(); }

struct CudaDevice {
    uint32_t ordinal;
    std::string name;
    uint64_t total_memory_bytes;
};

/// The result of a CUDA probe; freed automatically.
class CudaInfo {
public:
    static CudaInfo probe(int32_t detail = GWTF_CUDA_PROBE_DETAIL_DEVICES) {
        gwtf_cuda_probe_options opts;
        check(gwtf_cuda_probe_options_init(&opts));
        opts.detail = detail;
        gwtf_cuda_info *raw = nullptr;
        gwtf_error *err = nullptr;
        check(gwtf_cuda_probe(&opts, &raw, &err), &err);
        return CudaInfo(raw);
    }

    int32_t state() const {
        int32_t s = 0;
        gwtf_error *err = nullptr;
        check(gwtf_cuda_info_state(ptr_.get(), &s, &err), &err);
        return s;
    }

    std::string describe() const {
        size_t len = 0;
        gwtf_cuda_info_describe(ptr_.get(), nullptr, 0, &len, nullptr);
        std::string text(len + 1, '\0');
        gwtf_error *err = nullptr;
        check(gwtf_cuda_info_describe(ptr_.get(), text.data(), text.size(), &len, &err), &err);
        text.resize(len);
        return text;
    }

    std::vector<CudaDevice> devices() const {
        uint32_t count = 0;
        gwtf_error *err = nullptr;
        check(gwtf_cuda_info_device_count(ptr_.get(), &count, &err), &err);
        std::vector<CudaDevice> out;
        for (uint32_t i = 0; i < count; ++i) {
            char name[256];
            uint64_t mem = 0;
            check(gwtf_cuda_info_device_name(ptr_.get(), i, name, sizeof name, nullptr, &mem, &err), &err);
            out.push_back({i, name, mem});
        }
        return out;
    }

private:
    explicit CudaInfo(gwtf_cuda_info *raw) : ptr_(raw, gwtf_cuda_info_free) {}
    std::unique_ptr<gwtf_cuda_info, decltype(&gwtf_cuda_info_free)> ptr_;
};

}  // namespace gwtf

namespace gwtf {

/// A frame: allocated to send, or received (a lease on a pool slot).
class Frame {
public:
    Frame() = default;
    explicit Frame(gwtf_frame *raw) : ptr_(raw, gwtf_frame_release) {}

    gwtf_frame_view view() const {
        gwtf_frame_view v;
        gwtf_error *err = nullptr;
        check(gwtf_frame_get_view(ptr_.get(), &v, &err), &err);
        return v;
    }
    template <class T> T *data() const { return static_cast<T *>(static_cast<void *>(view().data)); }
    size_t size() const { return view().len; }
    gwtf_frame_header header() const { return view().header; }
    uint64_t peer() const { return view().peer_id; }

    void set_header(const gwtf_frame_header &h) {
        gwtf_error *err = nullptr;
        check(gwtf_frame_set_header(ptr_.get(), &h, &err), &err);
    }
    /// Gives up ownership (for gwtf_node_send).
    gwtf_frame *release() { return ptr_.release(); }
    /// The handle, still owned here.
    gwtf_frame *get() const { return ptr_.get(); }

private:
    std::unique_ptr<gwtf_frame, decltype(&gwtf_frame_release)> ptr_{nullptr, gwtf_frame_release};
};

/// A transport node; shut down and freed automatically.
class Node {
public:
    Node(const std::string &listen, const std::string &key, bool log = false) {
        gwtf_node_options o;
        check(gwtf_node_options_init(&o));
        o.listen_addr = listen.empty() ? nullptr : listen.c_str();
        o.swarm_key = reinterpret_cast<const uint8_t *>(key.data());
        o.swarm_key_len = key.size();
        o.max_payload_bytes = 16u << 20;
        o.pool_bytes = 64u << 20;
        o.connect_attempts = 1;
        o.log_to_stderr = log ? 1 : 0;
        gwtf_node *raw = nullptr;
        gwtf_error *err = nullptr;
        check(gwtf_node_new(&o, &raw, &err), &err);
        ptr_.reset(raw);
    }

    uint64_t id() const {
        uint64_t id = 0;
        gwtf_error *err = nullptr;
        check(gwtf_node_id(ptr_.get(), &id, &err), &err);
        return id;
    }

    std::string local_addr() const {
        char buf[64];
        gwtf_error *err = nullptr;
        check(gwtf_node_local_addr(ptr_.get(), buf, sizeof buf, nullptr, &err), &err);
        return buf;
    }

    uint64_t connect(const std::string &addr, uint32_t timeout_ms = 10000) {
        uint64_t peer = 0;
        gwtf_error *err = nullptr;
        check(gwtf_node_connect(ptr_.get(), addr.c_str(), timeout_ms, &peer, &err), &err);
        return peer;
    }

    Frame alloc(size_t bytes, uint32_t timeout_ms = 10000) {
        gwtf_frame *f = nullptr;
        gwtf_error *err = nullptr;
        check(gwtf_node_frame_alloc(ptr_.get(), bytes, timeout_ms, &f, &err), &err);
        return Frame(f);
    }

    /// Sends `frame` (it is consumed, even when this throws).
    void send(uint64_t peer, Frame frame, uint32_t timeout_ms = 10000) {
        gwtf_error *err = nullptr;
        check(gwtf_node_send(ptr_.get(), peer, frame.release(), timeout_ms, &err), &err);
    }

    Frame recv(uint32_t timeout_ms = 10000) {
        gwtf_frame *f = nullptr;
        gwtf_error *err = nullptr;
        check(gwtf_node_recv(ptr_.get(), timeout_ms, &f, &err), &err);
        return Frame(f);
    }

    /// The next event, or false after `timeout_ms`.
    bool poll_event(gwtf_event &ev, uint32_t timeout_ms) {
        gwtf_error *err = nullptr;
        gwtf_status st = gwtf_node_poll_event(ptr_.get(), timeout_ms, &ev, &err);
        if (st == GWTF_STATUS_TIMEOUT) {
            gwtf_error_free(err);
            return false;
        }
        check(st, &err);
        return true;
    }

    gwtf_node_stats stats() const {
        gwtf_node_stats s;
        gwtf_error *err = nullptr;
        check(gwtf_node_get_stats(ptr_.get(), &s, sizeof s, &err), &err);
        return s;
    }

private:
    std::unique_ptr<gwtf_node, decltype(&gwtf_node_free)> ptr_{nullptr, gwtf_node_free};
};

/// A swarm member driven by this process's trainer (gwtf_peer); leaves
/// abruptly (as a crash) when destroyed without leave().
class Peer {
public:
    explicit Peer(const gwtf_peer_options &o) {
        gwtf_peer *raw = nullptr;
        gwtf_error *err = nullptr;
        check(gwtf_peer_new(&o, &raw, &err), &err);
        ptr_.reset(raw);
    }

    uint32_t id() const {
        uint32_t id = 0;
        gwtf_error *err = nullptr;
        check(gwtf_peer_id(ptr_.get(), &id, &err), &err);
        return id;
    }

    /// The next task or event, or false after `timeout_ms`.
    bool next_task(gwtf_peer_task &t, uint32_t timeout_ms) {
        gwtf_error *err = nullptr;
        gwtf_status st = gwtf_peer_next_task(ptr_.get(), timeout_ms, &t, sizeof t, &err);
        if (st == GWTF_STATUS_TIMEOUT) {
            gwtf_error_free(err);
            return false;
        }
        check(st, &err);
        return true;
    }

    Frame alloc(size_t bytes, uint32_t timeout_ms = 30000) {
        gwtf_frame *f = nullptr;
        gwtf_error *err = nullptr;
        check(gwtf_peer_alloc(ptr_.get(), bytes, timeout_ms, &f, &err), &err);
        return Frame(f);
    }

    /// Answers with `out` (may be empty): it passes to the library only when
    /// the answer is accepted; a refused answer throws and leaves it here.
    void done(uint64_t task, Frame &out) {
        gwtf_error *err = nullptr;
        check(gwtf_peer_task_done(ptr_.get(), task, out.get(), &err), &err);
        out.release();
    }
    void done(uint64_t task) {
        gwtf_error *err = nullptr;
        check(gwtf_peer_task_done(ptr_.get(), task, nullptr, &err), &err);
    }
    void done_loss(uint64_t task, float loss, Frame &grad) {
        gwtf_error *err = nullptr;
        check(gwtf_peer_task_done_loss(ptr_.get(), task, loss, grad.get(), &err), &err);
        grad.release();
    }
    /// The sum is copied into the library.
    void done_gradient(uint64_t task, const std::vector<float> &sum, const uint8_t *digest) {
        gwtf_error *err = nullptr;
        check(gwtf_peer_task_done_gradient(ptr_.get(), task, sum.data(), sum.size(), digest, &err),
              &err);
    }
    void done_weights(uint64_t task, const uint8_t *digest) {
        gwtf_error *err = nullptr;
        check(gwtf_peer_task_done_weights(ptr_.get(), task, digest, &err), &err);
    }
    /// An average-states task: the rebuilt weights' digest and how many of
    /// its states they average (0: none fitted; the initial weights).
    void done_rebuilt(uint64_t task, const uint8_t *digest, uint32_t averaged) {
        gwtf_error *err = nullptr;
        check(gwtf_peer_task_done_rebuilt(ptr_.get(), task, digest, averaged, &err), &err);
    }
    void failed(uint64_t task, const std::string &reason) {
        gwtf_error *err = nullptr;
        check(gwtf_peer_task_failed(ptr_.get(), task, reason.c_str(), &err), &err);
    }

    gwtf_peer_stats stats() const {
        gwtf_peer_stats s;
        gwtf_error *err = nullptr;
        check(gwtf_peer_get_stats(ptr_.get(), &s, sizeof s, &err), &err);
        return s;
    }

    /// Leaves gracefully (goodbye to the swarm) and waits until done.
    void leave() {
        gwtf_error *err = nullptr;
        check(gwtf_peer_leave(ptr_.get(), &err), &err);
    }

private:
    std::unique_ptr<gwtf_peer, decltype(&gwtf_peer_free)> ptr_{nullptr, gwtf_peer_free};
};

}  // namespace gwtf
