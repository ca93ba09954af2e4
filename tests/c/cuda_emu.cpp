/* Runtime of the CPU emulation of CUDA (see cuda_emu.h): the kernel registry,
 * the launcher and the fiber scheduler that gives every CUDA thread of a block
 * its own stack and runs them between barriers. x86-64 switches fibers with a
 * few instructions; elsewhere it falls back to ucontext (slower). */
#include "cuda_emu.h"

#include <map>
#include <mutex>
#include <stdint.h>
#include <stdio.h>
#include <string>
#include <vector>

gwtf_emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace {

struct Kernel {
    gwtf_emu_fn fn;
    gwtf_emu_invoker invoke;
};

std::map<std::string, Kernel> &registry() {
    static std::map<std::string, Kernel> r;
    return r;
}

const size_t kStack = 64 * 1024;

#if defined(__x86_64__)
/* Saves the callee-saved registers on the current stack, stores the stack
 * pointer in *save, loads `load` and restores the registers saved there. */
extern "C" void gwtf_emu_switch(void **save, void *load);
__asm__(".text\n"
        ".globl gwtf_emu_switch\n"
        ".type gwtf_emu_switch,@function\n"
        "gwtf_emu_switch:\n"
        "  pushq %rbp\n"
        "  pushq %rbx\n"
        "  pushq %r12\n"
        "  pushq %r13\n"
        "  pushq %r14\n"
        "  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n"
        "  popq %r14\n"
        "  popq %r13\n"
        "  popq %r12\n"
        "  popq %rbx\n"
        "  popq %rbp\n"
        "  ret\n"
        ".size gwtf_emu_switch, .-gwtf_emu_switch\n");
struct Context {
    void *sp = nullptr;
};
#else
#include <ucontext.h>
struct Context {
    ucontext_t uc;
};
#endif

enum Wait { kNone, kBlock, kWarp };

struct Fiber {
    Context ctx;
    std::vector<unsigned char> stack;
    bool done = false;
    Wait wait = kNone;
};

/* The emulated device (one launch at a time, under `lock`). */
struct Device {
    Context scheduler;
    std::vector<Fiber> fibers;
    std::vector<float> exchange; /* one slot per thread, for the warp shuffles */
    std::vector<unsigned> runnable, batch;
    std::vector<unsigned> block_waiters;
    std::vector<std::vector<unsigned>> warp_waiters;
    std::vector<unsigned> live_in_warp;
    unsigned live = 0;
    unsigned current = 0;
    const Kernel *kernel = nullptr;
    void **args = nullptr;
    uint64_t rng = 0x9E3779B97F4A7C15ull;

    uint64_t next() {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        return rng;
    }
    template <typename T> void shuffle(std::vector<T> &v) {
        for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next() % i]);
    }
};

Device dev;
std::mutex lock;

void fiber_body() {
    dev.kernel->invoke(dev.kernel->fn, dev.args);
    Fiber &f = dev.fibers[dev.current];
    f.done = true;
#if defined(__x86_64__)
    gwtf_emu_switch(&f.ctx.sp, dev.scheduler.sp);
#else
    swapcontext(&f.ctx.uc, &dev.scheduler.uc);
#endif
    __builtin_unreachable();
}

void start_fiber(Fiber &f) {
    f.done = false;
    f.wait = kNone;
#if defined(__x86_64__)
    /* A stack that `ret`s into fiber_body with the alignment of a call: the
     * return address slot of fiber_body, its entry, then six saved registers. */
    uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack.data()) + kStack) & ~uintptr_t(15);
    void **sp = reinterpret_cast<void **>(top);
    *--sp = nullptr;                                   /* fiber_body never returns */
    *--sp = reinterpret_cast<void *>(&fiber_body);
    for (int i = 0; i < 6; ++i) *--sp = nullptr;       /* rbp rbx r12 r13 r14 r15 */
    f.ctx.sp = sp;
#else
    getcontext(&f.ctx.uc);
    f.ctx.uc.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc.uc_stack.ss_size = kStack;
    f.ctx.uc.uc_link = nullptr;
    makecontext(&f.ctx.uc, &fiber_body, 0);
#endif
}

void resume(unsigned i) {
    dev.current = i;
    threadIdx.x = i;
    Fiber &f = dev.fibers[i];
#if defined(__x86_64__)
    gwtf_emu_switch(&dev.scheduler.sp, f.ctx.sp);
#else
    swapcontext(&dev.scheduler.uc, &f.ctx.uc);
#endif
}

/* Called on a fiber: wait at a barrier until the scheduler releases it. */
void wait_at(Wait w) {
    Fiber &f = dev.fibers[dev.current];
    f.wait = w;
    if (w == kBlock)
        dev.block_waiters.push_back(dev.current);
    else
        dev.warp_waiters[dev.current / 32].push_back(dev.current);
#if defined(__x86_64__)
    gwtf_emu_switch(&f.ctx.sp, dev.scheduler.sp);
#else
    swapcontext(&f.ctx.uc, &dev.scheduler.uc);
#endif
}

void release(std::vector<unsigned> &waiters) {
    for (unsigned i : waiters) {
        dev.fibers[i].wait = kNone;
        dev.runnable.push_back(i);
    }
    waiters.clear();
}

/* Runs one block of n threads to completion; false on a deadlock (a barrier
 * that not every live thread of its block or warp reaches). */
bool run_block(unsigned n) {
    dev.runnable.clear();
    dev.block_waiters.clear();
    for (unsigned i = 0; i < n; ++i) {
        start_fiber(dev.fibers[i]);
        dev.runnable.push_back(i);
    }
    for (auto &w : dev.warp_waiters) w.clear();
    for (unsigned w = 0; w < dev.live_in_warp.size(); ++w) dev.live_in_warp[w] = 32;
    dev.live = n;
    for (;;) {
        if (!dev.runnable.empty()) {
            /* One round: every runnable thread, in a fresh order, to its next barrier
             * or its end. */
            dev.shuffle(dev.runnable);
            std::swap(dev.batch, dev.runnable);
            dev.runnable.clear();
            for (unsigned i : dev.batch) {
                resume(i);
                if (dev.fibers[i].done) {
                    dev.live--;
                    dev.live_in_warp[i / 32]--;
                }
            }
            continue;
        }
        if (dev.live == 0) return true;
        /* Everyone left waits at a barrier: release the complete ones (threads
         * that have exited do not count, as on the device). */
        bool released = false;
        if (!dev.block_waiters.empty() && dev.block_waiters.size() == dev.live) {
            release(dev.block_waiters);
            released = true;
        }
        for (size_t w = 0; w < dev.warp_waiters.size(); ++w) {
            if (!dev.warp_waiters[w].empty() && dev.warp_waiters[w].size() == dev.live_in_warp[w]) {
                release(dev.warp_waiters[w]);
                released = true;
            }
        }
        if (!released) return false;
    }
}

} // namespace

extern "C" int gwtf_emu_register(const char *name, gwtf_emu_fn fn, gwtf_emu_invoker invoke) {
    std::lock_guard<std::mutex> guard(lock);
    registry()[name] = Kernel{fn, invoke};
    return 0;
}

extern "C" void gwtf_emu_syncthreads(void) { wait_at(kBlock); }

extern "C" float gwtf_emu_shfl_xor(float v, int lane_mask) {
    unsigned t = threadIdx.x;
    dev.exchange[t] = v;
    wait_at(kWarp);
    float r = dev.exchange[(t & ~31u) | ((t & 31u) ^ (unsigned)lane_mask)];
    wait_at(kWarp); /* nobody overwrites a slot before every lane has read */
    return r;
}

/* Launches kernel `name` on `grid` blocks of `block` threads (a multiple of 32,
 * at most 1024). 0: done; -1: no such kernel; -2: bad block size; -3: deadlock. */
extern "C" int gwtf_emu_launch(const char *name, unsigned grid, unsigned block, void **args) {
    std::lock_guard<std::mutex> guard(lock);
    auto it = registry().find(name);
    if (it == registry().end()) return -1;
    if (block == 0 || block % 32 != 0 || block > 1024) return -2;
    if (dev.fibers.size() < block) {
        dev.fibers.resize(block);
        for (auto &f : dev.fibers) f.stack.resize(kStack);
    }
    dev.exchange.assign(block, 0.0f);
    dev.warp_waiters.assign(block / 32, std::vector<unsigned>());
    dev.live_in_warp.assign(block / 32, 32);
    dev.kernel = &it->second;
    dev.args = args;
    gridDim = gwtf_emu_dim3{grid, 1, 1};
    blockDim = gwtf_emu_dim3{block, 1, 1};
    std::vector<unsigned> blocks(grid);
    for (unsigned b = 0; b < grid; ++b) blocks[b] = b;
    dev.shuffle(blocks);
    for (unsigned b : blocks) {
        blockIdx = gwtf_emu_dim3{b, 0, 0};
        if (!run_block(block)) {
            fprintf(stderr, "cuda_emu: %s deadlocked in block %u\n", name, b);
            return -3;
        }
    }
    return 0;
}

/* Number of registered kernels (to check that every entry point was registered). */
extern "C" int gwtf_emu_kernel_count(void) {
    std::lock_guard<std::mutex> guard(lock);
    return (int)registry().size();
}
