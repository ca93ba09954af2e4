// route_geo10.cpp: routes microbatches over the ten-region scenario with the
// GWTF routing solver, crashes the busiest relay, and prints the repaired
// routes. Usage: route_geo10 LINKS.csv COMPUTE.csv
#include "gwtf.hpp"

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Link {
    double latency_ms, gbps;
};

std::vector<std::vector<std::string>> read_csv(const char *path) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error(std::string("cannot read ") + path);
    std::vector<std::vector<std::string>> rows;
    std::string line;
    bool header = true;
    while (std::getline(in, line)) {
        if (line.empty() || line[0] == '#') continue;
        if (header) {  // the column names
            header = false;
            continue;
        }
        std::vector<std::string> cells;
        std::stringstream ss(line);
        std::string cell;
        while (std::getline(ss, cell, ',')) cells.push_back(cell);
        rows.push_back(cells);
    }
    return rows;
}

class Flow {
public:
    Flow(uint32_t stages, uint64_t activation_bytes) {
        gwtf_error *err = nullptr;
        gwtf_flow *raw = nullptr;
        gwtf::check(gwtf_flow_new_routing(stages, activation_bytes, &raw, &err), &err);
        ptr_.reset(raw);
    }
    gwtf_flow *get() const { return ptr_.get(); }
    gwtf_flow_metrics solve() {
        gwtf_error *err = nullptr;
        int32_t state = 0;
        gwtf::check(gwtf_flow_solve(get(), &state, &err), &err);
        gwtf_flow_metrics m;
        gwtf_flow_metrics_init(&m);
        gwtf::check(gwtf_flow_get_metrics(get(), &m, &err), &err);
        return m;
    }
    struct Route {
        std::vector<uint32_t> members;
        int64_t count, cost_us;
    };
    std::vector<Route> routes(uint64_t n) {
        std::vector<Route> out;
        for (uint64_t i = 0; i < n; ++i) {
            Route r{std::vector<uint32_t>(16), 0, 0};
            size_t len = 0;
            gwtf_error *err = nullptr;
            gwtf::check(gwtf_flow_route(get(), i, r.members.data(), r.members.size(), &len, &r.count, &r.cost_us, &err), &err);
            r.members.resize(len);
            out.push_back(r);
        }
        return out;
    }

private:
    std::unique_ptr<gwtf_flow, decltype(&gwtf_flow_free)> ptr_{nullptr, gwtf_flow_free};
};

}  // namespace

int main(int argc, char **argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s LINKS.csv COMPUTE.csv\n", argv[0]);
        return 2;
    }
    try {
        std::map<std::pair<std::string, std::string>, Link> links;
        for (auto &r : read_csv(argv[1])) {
            Link l{std::stod(r.at(2)), std::stod(r.at(3))};
            links[{r[0], r[1]}] = l;
            links[{r[1], r[0]}] = l;
        }
        std::vector<std::pair<std::string, double>> regions;
        for (auto &r : read_csv(argv[2])) regions.push_back({r.at(0), std::stod(r.at(1))});

        const uint32_t stages = 6;
        const uint64_t act_bytes = 4ull << 20;  // 4 MiB activations
        Flow flow(stages, act_bytes);
        gwtf_error *err = nullptr;
        std::vector<uint32_t> holder(regions.size());
        std::vector<std::vector<uint32_t>> relay(stages + 1);
        std::map<uint32_t, std::string> where;
        for (size_t g = 0; g < regions.size(); ++g) {
            const double compute_us = regions[g].second * 100000.0;  // relative time x 100 ms
            gwtf::check(gwtf_flow_add_data_holder(flow.get(), 2, compute_us, &holder[g], &err), &err);
            where[holder[g]] = regions[g].first + "/data";
            for (uint32_t s = 1; s <= stages; ++s) {
                uint32_t id = 0;
                int64_t cap = 1 + int64_t((g + s) % 3);
                gwtf::check(gwtf_flow_add_relay(flow.get(), s, cap, compute_us, &id, &err), &err);
                relay[s].push_back(id);
                where[id] = regions[g].first + "/s" + std::to_string(s);
            }
        }
        auto region_of = [&](uint32_t id) { return where[id].substr(0, where[id].find('/')); };
        auto connect = [&](uint32_t a, uint32_t b) {
            std::string ra = region_of(a), rb = region_of(b);
            Link l = ra == rb ? Link{1.0, 10.0} : links.at({ra, rb});
            double bytes_per_s = l.gbps * 1e9 / 8.0;
            gwtf::check(gwtf_flow_set_link(flow.get(), a, b, l.latency_ms * 1000, l.latency_ms * 1000,
                                           bytes_per_s, bytes_per_s, &err), &err);
        };
        for (uint32_t h : holder)
            for (uint32_t r : relay[1]) connect(h, r);
        for (uint32_t s = 1; s < stages; ++s)
            for (uint32_t a : relay[s])
                for (uint32_t b : relay[s + 1]) connect(a, b);
        for (uint32_t r : relay[stages])
            for (uint32_t h : holder) connect(r, h);

        auto print = [&](const char *title, const gwtf_flow_metrics &m) {
            std::printf("%s: %lld microbatches routed, %lld unrouted, %llu routes, critical path %.1f ms, "
                        "T_iter/flow %.1f ms, solve %.3f ms\n",
                        title, (long long)m.flow_value, (long long)m.unrouted, (unsigned long long)m.route_count,
                        m.critical_path_us / 1000.0, m.t_iter_per_flow_us / 1000.0, m.solve_ms);
            for (auto &r : flow.routes(m.route_count < 5 ? m.route_count : 5)) {
                std::printf("  x%lld %7.1f ms:", (long long)r.count, r.cost_us / 1000.0);
                for (uint32_t id : r.members) std::printf(" %s", where[id].c_str());
                std::printf("\n");
            }
        };
        gwtf_flow_metrics m = flow.solve();
        print("geo10, 6 stages", m);

        // Crash the relay that carries the most microbatches.
        std::map<uint32_t, int64_t> load;
        for (auto &r : flow.routes(m.route_count))
            for (size_t i = 1; i + 1 < r.members.size(); ++i) load[r.members[i]] += r.count;
        uint32_t victim = 0;
        int64_t most = -1;
        for (auto &[id, c] : load)
            if (c > most) most = c, victim = id;
        std::printf("crash: %s (carried %lld)\n", where[victim].c_str(), (long long)most);
        gwtf::check(gwtf_flow_remove_member(flow.get(), victim, &err), &err);
        gwtf_flow_metrics after = flow.solve();
        print("repaired", after);
        for (auto &r : flow.routes(after.route_count))
            for (uint32_t id : r.members)
                if (id == victim) throw std::runtime_error("a repaired route uses the crashed relay");
        std::printf("route_geo10: ok\n");
    } catch (const std::exception &e) {
        std::fprintf(stderr, "route_geo10: %s\n", e.what());
        return 1;
    }
    return 0;
}
