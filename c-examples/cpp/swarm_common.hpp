// swarm_common.hpp: what the swarm trainers of the examples share (their
// command line, their gwtf_peer options, and the loop that pulls tasks and
// prints events as JSON lines); each brings its own model.
#pragma once

#include "gwtf.hpp"

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace swarm {

/// The command line of a swarm trainer (like `gwtf node`'s).
struct Args {
    std::string listen, key_file, node_key, stage = "auto", model = "llama-tiny";
    uint32_t chosen_id = 0, iterations = 30, microbatches = 4, stages = 4, memory_mb = 256;
    uint32_t slow_ms = 0;  // test aid: each microbatch task takes this much longer
    uint64_t microbatch_bytes = 0;  // memory one microbatch takes here (0: the library's guess)
    bool recompute = false;         // the trainer can run a forward again (GWTF_TASK_KIND_DISCARD)
    int relay_stages = 2;
    bool holder = false, log = false;
    bool trace_work = false;  // test aid: a line before each microbatch task
    uint64_t seed = 1;
    std::vector<std::tuple<uint32_t, uint32_t, std::string>> peers;
    std::vector<std::string> join;
};

[[noreturn]] inline void usage(const char *prog, const std::string &why) {
    std::fprintf(stderr,
                 "%s: %s\nusage: %s --listen ADDR --key-file FILE [--node-key FILE | --chosen-id N] "
                 "(--peer ID/STAGE/ADDR ... | --join ADDR) [--holder | --stage K|auto] "
                 "[--relay-stages N] [--model PRESET --stages S] [--iterations N] "
                 "[--microbatches N] [--seed N] [--memory-mb N] [--microbatch-bytes N] [--recompute] "
                 "[--slow-ms N] [--trace-work] [--log]\n",
                 prog, why.c_str(), prog);
    std::exit(2);
}

inline Args parse(int argc, char **argv) {
    Args a;
    const char *prog = argv[0];
    for (int i = 1; i < argc; i++) {
        std::string k = argv[i];
        auto val = [&]() -> std::string {
            if (i + 1 >= argc) usage(prog, k + " needs a value");
            return argv[++i];
        };
        auto num = [&]() -> uint64_t {
            std::string v = val();
            char *end = nullptr;
            unsigned long long x = std::strtoull(v.c_str(), &end, 10);
            if (v.empty() || *end) usage(prog, k + " " + v + ": not a number");
            return x;
        };
        if (k == "--listen") a.listen = val();
        else if (k == "--key-file") a.key_file = val();
        else if (k == "--node-key") a.node_key = val();
        else if (k == "--chosen-id") a.chosen_id = (uint32_t)num();
        else if (k == "--holder") a.holder = true;
        else if (k == "--stage") a.stage = val();
        else if (k == "--relay-stages") a.relay_stages = (int)num();
        else if (k == "--model") a.model = val();
        else if (k == "--stages") a.stages = (uint32_t)num();
        else if (k == "--iterations") a.iterations = (uint32_t)num();
        else if (k == "--microbatches") a.microbatches = (uint32_t)num();
        else if (k == "--seed") a.seed = num();
        else if (k == "--memory-mb") a.memory_mb = (uint32_t)num();
        else if (k == "--microbatch-bytes") a.microbatch_bytes = num();
        else if (k == "--recompute") a.recompute = true;
        else if (k == "--slow-ms") a.slow_ms = (uint32_t)num();
        else if (k == "--trace-work") a.trace_work = true;
        else if (k == "--log") a.log = true;
        else if (k == "--join") a.join.push_back(val());
        else if (k == "--peer") {
            std::string v = val();
            size_t s1 = v.find('/'), s2 = v.find('/', s1 + 1);
            if (s1 == std::string::npos || s2 == std::string::npos)
                usage(prog, v + ": not ID/STAGE/ADDR");
            a.peers.emplace_back((uint32_t)std::stoul(v.substr(0, s1), nullptr, 0),
                                 (uint32_t)std::stoul(v.substr(s1 + 1, s2 - s1 - 1)),
                                 v.substr(s2 + 1));
        } else usage(prog, "unknown argument " + k);
    }
    if (a.listen.empty() || a.key_file.empty()) usage(prog, "--listen and --key-file are required");
    if (a.peers.empty() == a.join.empty()) usage(prog, "give the founding members (--peer) or --join");
    return a;
}

/// The stage asked for: 0 for a holder, K, or -1 for auto (a joiner).
inline int stage_of(const Args &a) {
    return a.holder ? 0 : a.stage == "auto" ? -1 : std::atoi(a.stage.c_str());
}

/// `s` as the inside of a JSON string.
inline std::string esc(const std::string &s) {
    std::string o;
    for (char c : s) {
        if (c == '"' || c == '\\') o += '\\';
        if ((unsigned char)c >= 0x20) o += c;
    }
    return o;
}

inline std::string hex(const uint8_t *d, size_t n) {
    static const char *x = "0123456789abcdef";
    std::string s;
    for (size_t i = 0; i < n; i++) {
        s += x[d[i] >> 4];
        s += x[d[i] & 15];
    }
    return s;
}

/// gwtf_peer_options with what the command line says (the model's sizes
/// are the caller's to set), and the memory its pointers point into.
struct Options {
    gwtf_peer_options o;
    std::vector<gwtf_peer_contact> boot;
    std::string key;
};

inline void base_options(const Args &a, Options &out) {
    std::ifstream kf(a.key_file, std::ios::binary);
    out.key.assign(std::istreambuf_iterator<char>(kf), std::istreambuf_iterator<char>());
    if (out.key.size() < 16) usage("swarm", "the key file holds fewer than 16 bytes");
    for (auto &p : a.peers)
        out.boot.push_back({std::get<0>(p), std::get<1>(p), std::get<2>(p).c_str()});
    for (auto &j : a.join) out.boot.push_back({0, 0, j.c_str()});
    gwtf::check(gwtf_peer_options_init(&out.o));
    int stage = stage_of(a);
    out.o.role = a.holder ? GWTF_PEER_ROLE_HOLDER : GWTF_PEER_ROLE_RELAY;
    out.o.stage = stage < 0 ? GWTF_STAGE_AUTO : stage;
    // The id follows from the node key (a fresh one when no file is
    // given); a chosen id is for test swarms only (insecure).
    out.o.node_key_path = a.node_key.empty() ? nullptr : a.node_key.c_str();
    out.o.node_id = a.chosen_id;
    out.o.chosen_ids = a.chosen_id != 0 ? 1 : 0;
    out.o.listen_addr = a.listen.c_str();
    out.o.bootstrap = out.boot.data();
    out.o.bootstrap_len = out.boot.size();
    out.o.swarm_key = reinterpret_cast<const uint8_t *>(out.key.data());
    out.o.swarm_key_len = out.key.size();
    out.o.memory_budget_bytes = (uint64_t)a.memory_mb << 20;
    out.o.microbatch_bytes = a.microbatch_bytes;
    out.o.recompute = a.recompute ? 1 : 0;
    out.o.seed = a.seed;
    out.o.microbatches_per_iteration = a.microbatches;
    out.o.log_to_stderr = a.log ? 1 : 0;
}

inline std::atomic<bool> &stop_requested() {
    static std::atomic<bool> flag{false};
    return flag;
}
extern "C" inline void on_signal(int) { stop_requested() = true; }

/// Starts the peer and pulls until a holder's last iteration or a signal:
/// events are printed as JSON lines, tasks go to `run(peer, task, id)`.
/// SIGTERM or SIGINT leaves gracefully.
template <class Run> int serve(const Args &a, const gwtf_peer_options &o, Run run) {
    std::signal(SIGTERM, on_signal);
    std::signal(SIGINT, on_signal);
    std::signal(SIGPIPE, SIG_IGN);
    gwtf::Peer peer(o);
    uint32_t id = peer.id();
    std::printf("{\"event\":\"listening\",\"node\":%u,\"addr\":\"%s\",\"stage\":%d}\n", id,
                a.listen.c_str(), stage_of(a));
    std::fflush(stdout);
    bool done = false;
    while (!done && !stop_requested()) {
        gwtf_peer_task t;
        if (!peer.next_task(t, 100)) continue;
        switch (t.kind) {
        case GWTF_TASK_KIND_EVENT_ITERATION:
            std::printf("{\"event\":\"iteration\",\"node\":%u,\"iteration\":%u,\"loss\":%.6f,"
                        "\"microbatches\":%llu}\n",
                        id, t.iteration, t.loss, (unsigned long long)t.microbatches);
            done = a.holder && t.iteration + 1 >= a.iterations;
            break;
        case GWTF_TASK_KIND_EVENT_APPLIED:
            std::printf("{\"event\":\"applied\",\"node\":%u,\"stage\":%u,\"iteration\":%u,"
                        "\"weights\":\"%s\"}\n",
                        id, t.stage, t.iteration, hex(t.weights, 32).c_str());
            break;
        case GWTF_TASK_KIND_EVENT_STATE_DOWNLOADED:
            // ms: from the request to the whole state, its hash checked.
            std::printf("{\"event\":\"state_download\",\"node\":%u,\"from\":%llu,\"bytes\":%llu,"
                        "\"ms\":%.1f}\n",
                        id, (unsigned long long)t.peer, (unsigned long long)t.bytes, t.ms);
            break;
        case GWTF_TASK_KIND_EVENT_ACTIVE:
            std::printf("{\"event\":\"active\",\"node\":%u,\"stage\":%u}\n", id, t.stage);
            break;
        case GWTF_TASK_KIND_EVENT_PEER_LOST:
            std::printf("{\"event\":\"peer_lost\",\"node\":%u,\"peer\":%llu}\n", id,
                        (unsigned long long)t.peer);
            break;
        case GWTF_TASK_KIND_EVENT_RECOVERED:
            std::printf("{\"event\":\"recovered\",\"node\":%u,\"message\":\"%s\"}\n", id,
                        esc(t.message).c_str());
            break;
        case GWTF_TASK_KIND_EVENT_ERROR:
            std::printf("{\"event\":\"error\",\"node\":%u,\"message\":\"%s\"}\n", id,
                        esc(t.message).c_str());
            break;
        default:
            if (t.kind >= 100) break;
            if (t.kind <= GWTF_TASK_KIND_EMBED_BACKWARD) {
                if (a.trace_work) {
                    std::printf("{\"event\":\"work\",\"node\":%u,\"kind\":%d,\"iteration\":%u}\n",
                                id, t.kind, t.mb.iteration);
                    std::fflush(stdout);
                }
                if (a.slow_ms) std::this_thread::sleep_for(std::chrono::milliseconds(a.slow_ms));
            }
            run(peer, t, id);
        }
        std::fflush(stdout);
    }
    gwtf_peer_stats s = peer.stats();
    peer.leave();
    std::printf("{\"event\":\"%s\",\"node\":%u,\"tasks\":%llu,\"refused\":%llu,"
                "\"compute_ms\":%.1f}\n",
                done ? "done" : "left", id, (unsigned long long)s.tasks_done,
                (unsigned long long)s.answers_refused, s.compute_ns / 1e6);
    return 0;
}

/// Runs `body`, turning a libgwtf error into a JSON line and exit status 1.
template <class Body> int main_guard(const char *prog, Body body) {
    try {
        return body();
    } catch (const gwtf::Error &e) {
        std::printf("{\"event\":\"error\",\"message\":\"%s\"}\n", esc(e.what()).c_str());
        std::fprintf(stderr, "%s: %s\n", prog, e.what());
        return 1;
    }
}

/// Prints a task the trainer could not do and reports it failed.
inline void fail(gwtf::Peer &peer, const gwtf_peer_task &t, uint32_t id, const std::string &why) {
    std::printf("{\"event\":\"task_failed\",\"node\":%u,\"task\":\"%s\",\"reason\":\"%s\"}\n", id,
                esc(t.message).c_str(), esc(why).c_str());
    peer.failed(t.id, why);
}

}  // namespace swarm
