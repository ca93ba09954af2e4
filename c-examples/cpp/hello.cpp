// hello.cpp: libgwtf from C++17 with RAII handles and exceptions.
#include "gwtf.hpp"

#include <iostream>

int main() {
    std::cout << "libgwtf " << gwtf::version() << " (ABI " << gwtf_abi_version() << ")\n";
    if (gwtf_abi_version() != GWTF_ABI_VERSION) {
        std::cerr << "ABI mismatch\n";
        return 1;
    }
    try {
        gwtf::CudaInfo::probe(-1);
        std::cerr << "an invalid detail was accepted\n";
        return 1;
    } catch (const gwtf::Error &e) {
        std::cout << "caught gwtf::Error status=" << e.status() << ": " << e.what() << "\n";
    }
    try {
        auto info = gwtf::CudaInfo::probe();
        std::cout << "cuda: " << info.describe() << "\n";
        std::cout << "cuda state " << info.state() << ", " << info.devices().size() << " device(s)\n";
        for (const auto &d : info.devices())
            std::cout << "  device " << d.ordinal << ": " << d.name << ", "
                      << (d.total_memory_bytes >> 20) << " MiB\n";
    } catch (const gwtf::Error &e) {
        std::cerr << "probe failed: " << e.what() << "\n";
        return 1;
    }
    std::cout << "hello_cpp: ok\n";
    return 0;
}
