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
