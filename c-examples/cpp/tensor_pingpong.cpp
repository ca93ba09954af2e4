// tensor_pingpong.cpp: two libgwtf nodes in one process exchange float
// tensors over loopback TCP. A sends a tensor of shape [rows, cols]; B adds
// 1 to every element in place, in the received pool slot, and sends the same
// frame back (no copy); A checks every value. Then a node with the wrong
// swarm key is refused.
#include "gwtf.hpp"

#include <cmath>
#include <cstring>
#include <iostream>
#include <thread>

static bool expect(bool ok, const char *what) {
    if (!ok) std::cerr << "tensor_pingpong: FAILED: " << what << "\n";
    return ok;
}

int main() {
    const std::string key = "tensor-pingpong-swarm-key-0123456789";
    try {
        gwtf::Node a("127.0.0.1:0", key), b("127.0.0.1:0", key);
        uint64_t b_id = a.connect(b.local_addr());
        if (!expect(b_id == b.id(), "peer id")) return 1;

        // B: echo every tensor back with +1, in place.
        const int rounds = 6;
        std::thread echo([&] {
            for (int r = 0; r < rounds; ++r) {
                gwtf::Frame f = b.recv();
                float *x = f.data<float>();
                size_t n = f.size() / sizeof(float);
                for (size_t i = 0; i < n; ++i) x[i] += 1.0f;
                // Read the peer before moving the frame: argument evaluation
                // order is unspecified in C++.
                uint64_t from = f.peer();
                b.send(from, std::move(f));
            }
        });

        const uint64_t shapes[rounds][2] = {{1, 1}, {3, 5}, {64, 64}, {256, 1024}, {1024, 1024}, {0, 7}};
        bool ok = true;
        for (int r = 0; r < rounds; ++r) {
            uint64_t rows = shapes[r][0], cols = shapes[r][1], n = rows * cols;
            gwtf::Frame f = a.alloc(n * sizeof(float));
            float *x = f.data<float>();
            for (uint64_t i = 0; i < n; ++i) x[i] = std::sin(float(i)) * float(r + 1);
            gwtf_frame_header h;
            gwtf::check(gwtf_frame_header_init(&h));
            h.dtype = GWTF_DTYPE_F32;
            h.ndim = 2;
            h.shape[0] = rows;
            h.shape[1] = cols;
            h.microbatch = uint64_t(r);
            h.stage = 1;
            f.set_header(h);
            a.send(b_id, std::move(f));

            gwtf::Frame back = a.recv();
            gwtf_frame_header bh = back.header();
            ok &= expect(bh.magic == GWTF_FRAME_MAGIC && bh.version == GWTF_WIRE_VERSION, "magic/version");
            ok &= expect(bh.microbatch == uint64_t(r) && bh.stage == 1, "microbatch/stage");
            ok &= expect(bh.dtype == GWTF_DTYPE_F32 && bh.ndim == 2 && bh.shape[0] == rows && bh.shape[1] == cols, "shape");
            ok &= expect(bh.sender == b_id && back.peer() == b_id, "sender");
            ok &= expect(back.size() == n * sizeof(float), "length");
            const float *y = back.data<float>();
            for (uint64_t i = 0; i < n && ok; ++i)
                ok &= expect(y[i] == std::sin(float(i)) * float(r + 1) + 1.0f, "values");
            std::cout << "tensor [" << rows << " x " << cols << "] f32 round trip ok\n";
        }
        echo.join();
        if (!ok) return 1;

        gwtf_node_stats sa = a.stats(), sb = b.stats();
        std::cout << "frames a->b " << sa.frames_sent << ", b->a " << sb.frames_sent
                  << ", user-space copies " << sa.user_copies + sb.user_copies << "\n";
        if (!expect(sa.user_copies + sb.user_copies == 0, "zero copies")) return 1;
        if (!expect(sa.pool_in_use_bytes == 0, "pool released")) return 1;

        // A node without the swarm key is refused on both sides.
        gwtf::Node intruder("", "this-is-not-the-swarm-key-at-all!!");
        try {
            intruder.connect(b.local_addr());
            std::cerr << "tensor_pingpong: FAILED: wrong key accepted\n";
            return 1;
        } catch (const gwtf::Error &e) {
            std::cout << "intruder refused: status " << e.status() << "\n";
        }
        gwtf_event ev;
        bool refused = false;
        for (int i = 0; i < 100 && !refused; ++i)
            if (b.poll_event(ev, 100) && ev.kind == GWTF_EVENT_KIND_REFUSED) refused = true;
        if (!expect(refused && ev.reason == GWTF_CLOSE_REASON_AUTH_FAILED, "refused event")) return 1;
        std::cout << "b refused " << ev.addr << ": " << ev.message << "\n";
    } catch (const gwtf::Error &e) {
        std::cerr << "tensor_pingpong: error " << e.status() << ": " << e.what() << "\n";
        return 1;
    }
    std::cout << "tensor_pingpong: ok\n";
    return 0;
}
