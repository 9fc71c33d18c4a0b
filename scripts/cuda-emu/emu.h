// memwall's CUDA emulator: runs CUDA C kernels on the CPU, compiled by g++ (C++20), so that
// a kernel can be checked against a plain C++ reference before it meets a GPU.
//
// Not for inclusion by hand into a kernel: a test `tests/foo_test.cpp` includes this header
// and then the kernel sources; `run.py` assembles them (the real prelude `common.cuh` first,
// with its inline PTX turned into calls the emulator understands), compiles and runs the test.
// See README.md next to this file.
//
// Model. One block runs at a time (blocks in order, or reversed/shuffled: EMU_ORDER). Each
// thread of the block is a fiber (its own stack, switched by hand: one OS thread, no data
// races of our own, deterministic). A fiber runs until it reaches a synchronisation point
// (__syncthreads*, a warp intrinsic, __syncwarp) or returns; when every thread of the block
// is waiting, the scheduler releases a warp group whose lanes have all arrived, else the
// block barrier when every thread still alive waits at it, else reports a deadlock. The order
// in which fibers run between synchronisation points is EMU_ORDER (forward, reverse, random),
// so a missing __syncthreads shows as a result that depends on the order.
//
// __shared__ variables are `static` (one block at a time); run.py registers each declaration
// so that it is filled with 0xFF bytes (a NaN for floats) when a block first reaches it, as is
// the dynamic (extern __shared__) buffer, sized exactly as launched (ASan sees an overrun).
#pragma once

#include <algorithm>
#include <cassert>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <math.h>
#include <new>
#include <random>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#endif

// ---------------------------------------------------------------------------------------------
// CUDA qualifiers and built-in variables.

#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __shared__ static
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 800
#endif
#define __CUDACC_RTC__ 1
#define __CUDA_EMU__ 1

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
        : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
// Set by the scheduler before it resumes a thread (one OS thread runs every fiber).
inline uint3 threadIdx{0, 0, 0};
inline uint3 blockIdx{0, 0, 0};
inline dim3 blockDim{1, 1, 1};
inline dim3 gridDim{1, 1, 1};
inline constexpr int warpSize = 32;

// Vector types (alignment as CUDA's).
#define EMU_VEC2(T, N, A)                                                                   \
    struct __attribute__((aligned(A))) N##2 { T x, y; };                                    \
    inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }
#define EMU_VEC3(T, N)                                                                      \
    struct N##3 { T x, y, z; };                                                             \
    inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }
#define EMU_VEC4(T, N, A)                                                                   \
    struct __attribute__((aligned(A))) N##4 { T x, y, z, w; };                              \
    inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
EMU_VEC2(float, float, 8)
EMU_VEC3(float, float)
EMU_VEC4(float, float, 16)
EMU_VEC2(int, int, 8)
EMU_VEC3(int, int)
EMU_VEC4(int, int, 16)
EMU_VEC2(unsigned int, uint, 8)
EMU_VEC4(unsigned int, uint, 16)
EMU_VEC2(double, double, 16)
EMU_VEC2(unsigned short, ushort, 4)
EMU_VEC4(unsigned short, ushort, 8)
EMU_VEC4(unsigned char, uchar, 4)
EMU_VEC4(signed char, char, 4)
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }
#undef EMU_VEC2
#undef EMU_VEC3
#undef EMU_VEC4

// ---------------------------------------------------------------------------------------------
// The runtime: fibers, the scheduler, errors.

namespace emu {

[[noreturn]] inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

enum class St : unsigned char { Runnable, Barrier, Warp, Done };
enum Op : unsigned char {
    OP_SHFL_IDX, OP_SHFL_UP, OP_SHFL_DOWN, OP_SHFL_XOR, OP_BALLOT, OP_ANY, OP_ALL,
    OP_SYNCWARP, OP_REDUCE_ADD, OP_REDUCE_MIN, OP_REDUCE_MAX, OP_REDUCE_AND, OP_REDUCE_OR,
    OP_REDUCE_XOR, OP_MATCH_ANY,
};
inline const char* op_name(int op) {
    static const char* n[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                              "__shfl_xor_sync", "__ballot_sync", "__any_sync", "__all_sync",
                              "__syncwarp", "__reduce_add_sync", "__reduce_min_sync",
                              "__reduce_max_sync", "__reduce_and_sync", "__reduce_or_sync",
                              "__reduce_xor_sync", "__match_any_sync"};
    return n[op];
}
enum Bar : unsigned char { BAR_SYNC, BAR_COUNT, BAR_AND, BAR_OR };
inline const char* bar_name(int b) {
    static const char* n[] = {"__syncthreads", "__syncthreads_count", "__syncthreads_and",
                              "__syncthreads_or"};
    return n[b];
}

struct Thread {
    void* sp = nullptr;  // saved stack pointer (x86-64 switch)
#if !defined(__x86_64__)
    ucontext_t ctx;
#endif
    char* stack_lo = nullptr;  // usable stack [stack_lo, stack_lo + stack_size)
    size_t stack_size = 0;
    St st = St::Done;
    uint3 idx{0, 0, 0};
    unsigned tid = 0;
    // At a barrier or warp operation:
    unsigned char bar = 0, op = 0, vsize = 0;
    int pred = 0;
    unsigned mask = 0;
    int b = 0, width = 32;
    uint64_t val = 0, result = 0;
    const char* file = "";
    unsigned line = 0;
};

struct State {
    std::vector<Thread> threads;
    Thread* cur = nullptr;  // the running fiber, or null (host code)
    void* sched_sp = nullptr;
#if !defined(__x86_64__)
    ucontext_t sched_ctx;
#endif
    void (*entry)(void*) = nullptr;
    void* closure = nullptr;
    const char* kernel = "";
    unsigned nthreads = 0;
    uint64_t block_gen = 0;  // bumped at each block: shared variables are poisoned once per gen
    std::unordered_map<void*, uint64_t> shared_seen;
    size_t static_shared = 0, dynamic_shared = 0;
    unsigned char* dyn = nullptr;  // the dynamic shared buffer of the running launch
    uint64_t atomics = 0;
    size_t stack_bytes = 0;
    int order = 0;  // 0 forward, 1 reverse, 2 random
    uint64_t seed = 1;
    std::mt19937_64 rng;
    bool poison = true;
    bool inited = false;
    unsigned long long launches = 0;
#if defined(EMU_ASAN)
    const void* main_stack_bottom = nullptr;
    size_t main_stack_size = 0;
#endif
};
inline State g;

inline void init() {
    if (g.inited) return;
    g.inited = true;
    const char* o = getenv("EMU_ORDER");
    std::string order = o ? o : "forward";
    if (order == "forward" || order.empty()) {
        g.order = 0;
    } else if (order == "reverse") {
        g.order = 1;
    } else if (order.rfind("random", 0) == 0) {
        g.order = 2;
        if (order.size() > 7 && order[6] == ':') g.seed = strtoull(order.c_str() + 7, nullptr, 0);
    } else {
        fprintf(stderr, "emu: EMU_ORDER=%s: expected forward, reverse or random[:SEED]\n",
                order.c_str());
        exit(2);
    }
    g.rng.seed(g.seed);
#if !defined(EMU_ASAN)
    // A fault in a fiber's guard page is a stack overflow: say so (ASan reports its own).
    static char alt[64 * 1024];
    stack_t ss{};
    ss.ss_sp = alt;
    ss.ss_size = sizeof alt;
    sigaltstack(&ss, nullptr);
    struct sigaction sa {};
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
    sa.sa_sigaction = [](int, siginfo_t* si, void*) {
        char* a = (char*)si->si_addr;
        for (auto& t : g.threads)
            if (t.stack_lo && a < t.stack_lo && a >= t.stack_lo - 4096) {
                static const char m[] = "emu: error: a thread overflowed its stack (raise "
                                        "EMU_STACK_KB, now the KiB of each thread's stack)\n";
                (void)!write(2, m, sizeof m - 1);
            }
    };
    sigaction(SIGSEGV, &sa, nullptr);
#endif
#if defined(EMU_ASAN)
    // After a sanitizer report: say which emulated thread made the access.
    __sanitizer_set_death_callback([] {
        if (g.cur)
            fprintf(stderr, "emu: the report above is from kernel %s, block (%u,%u,%u), thread "
                    "(%u,%u,%u)\n", g.kernel, blockIdx.x, blockIdx.y, blockIdx.z, g.cur->idx.x,
                    g.cur->idx.y, g.cur->idx.z);
    });
#endif
    const char* p = getenv("EMU_POISON");
    g.poison = !(p && (!strcmp(p, "0") || !strcmp(p, "none")));
    const char* s = getenv("EMU_STACK_KB");
    g.stack_bytes = (size_t)(s ? atoi(s) : 256) * 1024;
    if (g.stack_bytes < 32 * 1024) g.stack_bytes = 32 * 1024;
}

[[noreturn]] inline void vfail(const char* fmt, va_list ap) {
    fflush(stdout);
    fprintf(stderr, "emu: error");
    if (g.cur) {
        fprintf(stderr, " in kernel %s, block (%u,%u,%u), thread (%u,%u,%u)", g.kernel,
                blockIdx.x, blockIdx.y, blockIdx.z, g.cur->idx.x, g.cur->idx.y, g.cur->idx.z);
    } else if (g.nthreads) {
        fprintf(stderr, " in kernel %s, block (%u,%u,%u)", g.kernel, blockIdx.x, blockIdx.y,
                blockIdx.z);
    }
    fprintf(stderr, ": ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    fflush(stderr);
    if (getenv("EMU_ABORT")) abort();
    _exit(70);
}
[[noreturn]] inline void fail(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(fmt, ap);
}

inline Thread& self(const char* what) {
    if (!g.cur) fail("%s called outside a kernel", what);
    return *g.cur;
}
inline unsigned lane_of(const Thread& t) { return t.tid & 31; }

}  // namespace emu

// The context switch. x86-64: a hand-written switch of the callee-saved registers (30 ns a
// round trip, against 750 for swapcontext, which makes a system call each time).
#if defined(__x86_64__)
extern "C" void emu_switch(void** save_sp, void* new_sp);
extern "C" void emu_fiber_start();
extern "C" void emu_fiber_main();
asm(R"(
.text
.weak emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch,.-emu_switch
.weak emu_fiber_start
.type emu_fiber_start,@function
emu_fiber_start:
    call emu_fiber_main
    ud2
.size emu_fiber_start,.-emu_fiber_start
)");
#endif

namespace emu {

inline void to_sched(bool exiting) {
    Thread& t = *g.cur;
#if defined(EMU_ASAN)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, g.main_stack_bottom,
                                   g.main_stack_size);
#else
    (void)exiting;
#endif
#if defined(__x86_64__)
    emu_switch(&t.sp, g.sched_sp);
#else
    swapcontext(&t.ctx, &g.sched_ctx);
#endif
#if defined(EMU_ASAN)
    __sanitizer_finish_switch_fiber(fake, &g.main_stack_bottom, &g.main_stack_size);
#endif
}

inline void resume(Thread& t) {
    g.cur = &t;
    threadIdx = t.idx;
#if defined(EMU_ASAN)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, t.stack_lo, t.stack_size);
#endif
#if defined(__x86_64__)
    emu_switch(&g.sched_sp, t.sp);
#else
    swapcontext(&g.sched_ctx, &t.ctx);
#endif
#if defined(EMU_ASAN)
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    g.cur = nullptr;
}

}  // namespace emu

extern "C" __attribute__((used, noinline)) inline void emu_fiber_main() {
#if defined(EMU_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &emu::g.main_stack_bottom, &emu::g.main_stack_size);
#endif
    emu::g.entry(emu::g.closure);
    emu::g.cur->st = emu::St::Done;
    emu::to_sched(true);
    __builtin_trap();  // a finished fiber is never resumed
}

namespace emu {

inline void prepare(Thread& t) {
    if (!t.stack_lo) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        size_t size = (g.stack_bytes + page - 1) / page * page;
        // One guard page below the stack: an overflow faults instead of corrupting.
        char* m = (char*)mmap(nullptr, size + page, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) fail("cannot map a fiber stack of %zu bytes", size);
        mprotect(m, page, PROT_NONE);
        t.stack_lo = m + page;
        t.stack_size = size;
    }
#if defined(__x86_64__)
    uintptr_t top = ((uintptr_t)(t.stack_lo + t.stack_size) & ~(uintptr_t)15) - 16;
    uint64_t* p = (uint64_t*)(top - 64);
    p[0] = 0x1F80ull | (0x037Full << 32);  // MXCSR and x87 control word: the defaults
    for (int i = 1; i <= 6; i++) p[i] = 0;  // r15 r14 r13 r12 rbx rbp
    p[7] = (uint64_t)(uintptr_t)&emu_fiber_start;
    t.sp = p;
#else
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack_lo;
    t.ctx.uc_stack.ss_size = t.stack_size;
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, (void (*)())emu_fiber_main, 0);
#endif
    t.st = St::Runnable;
}

inline void poison_bytes(void* p, size_t n) {
    if (g.poison && n) memset(p, 0xFF, n);
}

// A __shared__ declaration reached by a thread (run.py adds the call after each one): the
// first thread of a block to reach it fills the variable with 0xFF bytes.
inline void shared_decl(const volatile void* pv, size_t n) {
    void* p = const_cast<void*>(pv);
    uint64_t& gen = g.shared_seen[p];
    if (gen != g.block_gen) {
        gen = g.block_gen;
        if (g.cur) {
            g.static_shared += n;
            if (g.static_shared > 48 * 1024)
                fail("static __shared__ memory of this block passes 48 KiB (%zu bytes)",
                     g.static_shared);
            if (g.static_shared + g.dynamic_shared > 227 * 1024)
                fail("static (%zu) + dynamic (%zu) shared memory passes 227 KiB",
                     g.static_shared, g.dynamic_shared);
        }
        poison_bytes(p, n);
    }
}
// A namespace-scope __shared__ variable: poisoned at every block.
inline std::vector<std::pair<void*, size_t>>& shared_globals() {
    static std::vector<std::pair<void*, size_t>> v;
    return v;
}
inline bool shared_global(void* p, size_t n) {
    shared_globals().push_back({p, n});
    return true;
}
inline unsigned char* dynamic_shared() { return g.dyn; }

// Releases the warp groups whose lanes have all arrived; returns whether any was.
inline bool release_warps() {
    bool any = false;
    unsigned n = g.nthreads;
    for (unsigned w = 0; w * 32 < n; w++) {
        Thread* lanes = &g.threads[w * 32];
        unsigned nl = std::min(32u, n - w * 32);
        for (unsigned l = 0; l < nl; l++) {
            Thread& t = lanes[l];
            if (t.st != St::Warp) continue;
            unsigned m = t.mask;
            bool ready = true;
            unsigned part = 0;  // the lanes taking part: in the mask, present and not exited
            for (unsigned j = 0; j < nl; j++) {
                if (!(m >> j & 1) || lanes[j].st == St::Done) continue;
                if (lanes[j].st != St::Warp || lanes[j].mask != m) {
                    ready = false;
                    break;
                }
                part |= 1u << j;
            }
            if (!ready) continue;
            // The group: check it agrees on what it does.
            for (unsigned j = 0; j < nl; j++) {
                if (!(part >> j & 1)) continue;
                Thread& u = lanes[j];
                if (u.op != t.op || u.width != t.width || u.vsize != t.vsize) {
                    g.cur = nullptr;
                    fail("warp %u: lanes %u and %u meet with mask 0x%08x at different warp "
                         "operations: %s (width %d, %d bytes) at %s:%u and %s (width %d, %d "
                         "bytes) at %s:%u",
                         w, l, j, m, op_name(t.op), t.width, t.vsize, t.file, t.line,
                         op_name(u.op), u.width, u.vsize, u.file, u.line);
                }
            }
            int op = t.op;
            uint64_t acc = 0;
            if (op == OP_BALLOT || op == OP_ANY || op == OP_ALL) {
                unsigned bal = 0;
                for (unsigned j = 0; j < nl; j++)
                    if ((part >> j & 1) && lanes[j].val) bal |= 1u << j;
                acc = op == OP_BALLOT ? bal : op == OP_ANY ? (bal != 0) : (bal == part);
            } else if (op >= OP_REDUCE_ADD && op <= OP_REDUCE_XOR) {
                bool sgn = t.b;  // signed
                bool first = true;
                for (unsigned j = 0; j < nl; j++) {
                    if (!(part >> j & 1)) continue;
                    uint32_t v = (uint32_t)lanes[j].val;
                    uint32_t a = (uint32_t)acc;
                    if (first) {
                        a = v;
                        first = false;
                    } else if (op == OP_REDUCE_ADD) {
                        a = a + v;
                    } else if (op == OP_REDUCE_MIN) {
                        a = sgn ? (uint32_t)std::min((int32_t)a, (int32_t)v) : std::min(a, v);
                    } else if (op == OP_REDUCE_MAX) {
                        a = sgn ? (uint32_t)std::max((int32_t)a, (int32_t)v) : std::max(a, v);
                    } else if (op == OP_REDUCE_AND) {
                        a &= v;
                    } else if (op == OP_REDUCE_OR) {
                        a |= v;
                    } else {
                        a ^= v;
                    }
                    acc = a;
                }
            }
            for (unsigned j = 0; j < nl; j++) {
                if (!(part >> j & 1)) continue;
                Thread& u = lanes[j];
                if (op <= OP_SHFL_XOR) {
                    // PTX shfl.sync: c = ((32 - width) << 8) | (up ? 0 : 31).
                    int lane = (int)j, segmask = 32 - u.width, cval = op == OP_SHFL_UP ? 0 : 31;
                    int maxl = (lane & segmask) | (cval & ~segmask), minl = lane & segmask;
                    int bv = u.b & 31, src;
                    bool ok;
                    switch (op) {
                    case OP_SHFL_UP: src = lane - bv; ok = src >= maxl; break;
                    case OP_SHFL_DOWN: src = lane + bv; ok = src <= maxl; break;
                    case OP_SHFL_XOR: src = lane ^ bv; ok = src <= maxl; break;
                    default: src = minl | (bv & ~segmask); ok = src <= maxl; break;
                    }
                    if (!ok) src = lane;
                    if (!(part >> src & 1)) {
                        g.cur = nullptr;
                        fail("warp %u lane %u: %s (mask 0x%08x, at %s:%u) reads lane %d, which %s: "
                             "the value is undefined on the GPU",
                             w, j, op_name(op), m, u.file, u.line, src,
                             (unsigned)src >= nl ? "does not exist (a partial warp)"
                             : lanes[src].st == St::Done ? "has exited"
                                                          : "is not in the mask");
                    }
                    u.result = lanes[src].val;
                } else if (op == OP_MATCH_ANY) {
                    unsigned r = 0;
                    for (unsigned k = 0; k < nl; k++)
                        if ((part >> k & 1) && lanes[k].val == u.val) r |= 1u << k;
                    u.result = r;
                } else {
                    u.result = acc;
                }
            }
            for (unsigned j = 0; j < nl; j++)
                if (part >> j & 1) lanes[j].st = St::Runnable;
            any = true;
        }
    }
    return any;
}

inline bool release_block() {
    Thread* first = nullptr;
    int count = 0, all = 1, anyp = 0;
    for (unsigned i = 0; i < g.nthreads; i++) {
        Thread& t = g.threads[i];
        if (t.st == St::Done) continue;
        if (t.st != St::Barrier) return false;
        if (!first) first = &t;
        if (t.bar != first->bar || t.line != first->line || strcmp(t.file, first->file)) {
            g.cur = nullptr;
            fail("threads (%u,%u,%u) and (%u,%u,%u) meet at different barriers: %s at %s:%u "
                 "and %s at %s:%u (undefined on the GPU)",
                 first->idx.x, first->idx.y, first->idx.z, t.idx.x, t.idx.y, t.idx.z,
                 bar_name(first->bar), first->file, first->line, bar_name(t.bar), t.file,
                 t.line);
        }
        count += t.pred != 0;
        all &= t.pred != 0;
        anyp |= t.pred != 0;
    }
    if (!first) return false;
    for (unsigned i = 0; i < g.nthreads; i++) {
        Thread& t = g.threads[i];
        if (t.st != St::Barrier) continue;
        t.result = t.bar == BAR_COUNT ? count : t.bar == BAR_AND ? all : anyp;
        t.st = St::Runnable;
    }
    return true;
}

[[noreturn]] inline void deadlock() {
    g.cur = nullptr;
    fflush(stdout);
    fprintf(stderr,
            "emu: error in kernel %s, block (%u,%u,%u): deadlock: no barrier or warp group can "
            "complete. Threads still running:\n",
            g.kernel, blockIdx.x, blockIdx.y, blockIdx.z);
    unsigned shown = 0;
    for (unsigned i = 0; i < g.nthreads;) {
        Thread& t = g.threads[i];
        unsigned j = i + 1;
        auto same = [&](Thread& u) {
            return u.st == t.st && u.line == t.line && !strcmp(u.file, t.file) &&
                   u.mask == t.mask && u.op == t.op && u.bar == t.bar;
        };
        while (j < g.nthreads && same(g.threads[j])) j++;
        if (t.st != St::Done && shown++ < 40) {
            if (t.st == St::Barrier)
                fprintf(stderr, "  threads %u..%u: %s at %s:%u\n", i, j - 1, bar_name(t.bar),
                        t.file, t.line);
            else
                fprintf(stderr, "  threads %u..%u: %s (mask 0x%08x) at %s:%u\n", i, j - 1,
                        op_name(t.op), t.mask, t.file, t.line);
        }
        i = j;
    }
    fprintf(stderr,
            "  (a warp operation waits for every lane of its mask that has not exited; "
            "__syncthreads for every thread that has not exited)\n");
    fflush(stderr);
    if (getenv("EMU_ABORT")) abort();
    _exit(70);
}

inline void run_block(unsigned n) {
    if (g.threads.size() < n) g.threads.resize(n);
    g.nthreads = n;
    g.block_gen++;
    g.static_shared = 0;
    for (auto& [p, sz] : shared_globals()) poison_bytes(p, sz);
    for (unsigned i = 0; i < n; i++) {
        Thread& t = g.threads[i];
        t.tid = i;
        t.idx = uint3{i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y)};
        t.file = "";
        t.line = 0;
        t.mask = 0;
        prepare(t);
    }
    std::vector<unsigned> order(n);
    for (;;) {
        for (unsigned i = 0; i < n; i++) order[i] = g.order == 1 ? n - 1 - i : i;
        if (g.order == 2) std::shuffle(order.begin(), order.end(), g.rng);
        for (unsigned i : order)
            if (g.threads[i].st == St::Runnable) resume(g.threads[i]);
        if (release_warps()) continue;
        if (release_block()) continue;
        bool done = true;
        for (unsigned i = 0; i < n; i++) done &= g.threads[i].st == St::Done;
        if (done) break;
        deadlock();
    }
    g.nthreads = 0;
}

// Synchronisation called by the kernels.
inline int block_barrier(int kind, int pred, const std::source_location& loc) {
    Thread& t = self(bar_name(kind));
    t.st = St::Barrier;
    t.bar = (unsigned char)kind;
    t.pred = pred;
    t.file = loc.file_name();
    t.line = loc.line();
    to_sched(false);
    return (int)t.result;
}

template <class T>
inline T warp_op(int op, unsigned mask, T v, int b, int width, const std::source_location& loc) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    Thread& t = self(op_name(op));
    if (!(mask >> lane_of(t) & 1))
        fail("%s at %s:%u: mask 0x%08x does not include the calling lane %u (undefined)",
             op_name(op), loc.file_name(), loc.line(), mask, lane_of(t));
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail("%s at %s:%u: width %d is not a power of two in 1..32", op_name(op),
             loc.file_name(), loc.line(), width);
    t.st = St::Warp;
    t.op = (unsigned char)op;
    t.mask = mask;
    t.val = 0;
    memcpy(&t.val, &v, sizeof(T));
    t.vsize = sizeof(T);
    t.b = b;
    t.width = width;
    t.file = loc.file_name();
    t.line = loc.line();
    to_sched(false);
    T r;
    memcpy(&r, &t.result, sizeof(T));
    return r;
}

// Kernel launch.
template <class Kernel, class Params>
struct Closure {
    Kernel k;
    Params params;
    static void call(void* c) {
        auto* s = static_cast<Closure*>(c);
        std::apply(s->k, s->params);  // each thread gets its own copy of the parameters
    }
};

inline void check_launch(const char* name, dim3 grid, dim3 block, size_t shmem) {
    unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (!threads || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64)
        fail("launch of %s: invalid block (%u,%u,%u): at most 1024 threads, z at most 64", name,
             block.x, block.y, block.z);
    if (!grid.x || !grid.y || !grid.z || grid.x > 2147483647u || grid.y > 65535 ||
        grid.z > 65535)
        fail("launch of %s: invalid grid (%u,%u,%u)", name, grid.x, grid.y, grid.z);
    if (shmem > 227 * 1024)
        fail("launch of %s: %zu bytes of dynamic shared memory (at most 227 KiB)", name, shmem);
    if (shmem > 48 * 1024) {
        static bool said = false;
        if (!said)
            fprintf(stderr,
                    "emu: note: %s launched with %zu bytes of dynamic shared memory: past 48 KiB "
                    "the GPU needs cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) first\n",
                    name, shmem);
        said = true;
    }
}

template <class... P, class... A>
void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t shmem,
            A&&... args) {
    static_assert(sizeof...(P) == sizeof...(A), "emu_launch: wrong number of kernel arguments");
    init();
    if (g.cur) fail("emu_launch inside a kernel (dynamic parallelism is not emulated)");
    check_launch(name, grid, block, shmem);
    using Params = std::tuple<std::decay_t<P>...>;
    Closure<void (*)(P...), Params> c{kernel, Params(std::forward<A>(args)...)};
    g.entry = &decltype(c)::call;
    g.closure = &c;
    g.kernel = name;
    g.atomics = 0;
    g.dynamic_shared = shmem;
    g.launches++;
    unsigned char* dyn = static_cast<unsigned char*>(
        ::operator new(shmem ? shmem : 1, std::align_val_t(256)));
    g.dyn = dyn;
    gridDim = grid;
    blockDim = block;
    unsigned long long nb = (unsigned long long)grid.x * grid.y * grid.z;
    std::vector<unsigned long long> blocks(nb);
    for (unsigned long long i = 0; i < nb; i++) blocks[i] = g.order == 1 ? nb - 1 - i : i;
    if (g.order == 2) std::shuffle(blocks.begin(), blocks.end(), g.rng);
    for (unsigned long long b : blocks) {
        blockIdx = uint3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                         (unsigned)(b / ((unsigned long long)grid.x * grid.y))};
        poison_bytes(dyn, shmem);
        run_block(block.x * block.y * block.z);
    }
    ::operator delete(dyn, std::align_val_t(256));
    g.dyn = nullptr;
    if (g.atomics)
        fprintf(stderr,
                "emu: note: kernel %s made %llu atomic operations (memwall's kernels are meant "
                "to be free of atomics: their order is not deterministic on the GPU)\n",
                name, (unsigned long long)g.atomics);
    g.kernel = "";
}

inline void count_atomic() { g.atomics++; }

}  // namespace emu

// emu_launch(kernel, grid, block, shared_bytes, args...): runs every block of the grid, one at
// a time, each thread a fiber; returns when the grid has finished (as a synchronous launch).
#define emu_launch(kernel, ...) ::emu::launch(#kernel, kernel, __VA_ARGS__)

// ---------------------------------------------------------------------------------------------
// Synchronisation and warp intrinsics.

#define EMU_LOC std::source_location loc = std::source_location::current()
inline void __syncthreads(EMU_LOC) { emu::block_barrier(emu::BAR_SYNC, 1, loc); }
inline int __syncthreads_count(int p, EMU_LOC) { return emu::block_barrier(emu::BAR_COUNT, p, loc); }
inline int __syncthreads_and(int p, EMU_LOC) { return emu::block_barrier(emu::BAR_AND, p, loc); }
inline int __syncthreads_or(int p, EMU_LOC) { return emu::block_barrier(emu::BAR_OR, p, loc); }
inline void __syncwarp(unsigned mask = 0xffffffffu, EMU_LOC) {
    emu::warp_op<int>(emu::OP_SYNCWARP, mask, 0, 0, 32, loc);
}

template <class T>
    requires std::is_arithmetic_v<T>
inline T __shfl_sync(unsigned mask, T var, int src, int width = warpSize, EMU_LOC) {
    return emu::warp_op<T>(emu::OP_SHFL_IDX, mask, var, src, width, loc);
}
template <class T>
    requires std::is_arithmetic_v<T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, EMU_LOC) {
    return emu::warp_op<T>(emu::OP_SHFL_UP, mask, var, (int)delta, width, loc);
}
template <class T>
    requires std::is_arithmetic_v<T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize, EMU_LOC) {
    return emu::warp_op<T>(emu::OP_SHFL_DOWN, mask, var, (int)delta, width, loc);
}
template <class T>
    requires std::is_arithmetic_v<T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize, EMU_LOC) {
    return emu::warp_op<T>(emu::OP_SHFL_XOR, mask, var, lane_mask, width, loc);
}
inline unsigned __ballot_sync(unsigned mask, int pred, EMU_LOC) {
    return emu::warp_op<unsigned>(emu::OP_BALLOT, mask, pred != 0, 0, 32, loc);
}
inline int __any_sync(unsigned mask, int pred, EMU_LOC) {
    return (int)emu::warp_op<unsigned>(emu::OP_ANY, mask, pred != 0, 0, 32, loc);
}
inline int __all_sync(unsigned mask, int pred, EMU_LOC) {
    return (int)emu::warp_op<unsigned>(emu::OP_ALL, mask, pred != 0, 0, 32, loc);
}
#define EMU_REDUCE(NAME, OP)                                                                \
    inline unsigned NAME(unsigned mask, unsigned v, EMU_LOC) {                              \
        return emu::warp_op<unsigned>(OP, mask, v, 0, 32, loc);                             \
    }                                                                                       \
    inline int NAME(unsigned mask, int v, EMU_LOC) {                                        \
        return (int)emu::warp_op<unsigned>(OP, mask, (unsigned)v, 1, 32, loc);              \
    }
EMU_REDUCE(__reduce_add_sync, emu::OP_REDUCE_ADD)
EMU_REDUCE(__reduce_min_sync, emu::OP_REDUCE_MIN)
EMU_REDUCE(__reduce_max_sync, emu::OP_REDUCE_MAX)
#undef EMU_REDUCE
inline unsigned __reduce_and_sync(unsigned mask, unsigned v, EMU_LOC) {
    return emu::warp_op<unsigned>(emu::OP_REDUCE_AND, mask, v, 0, 32, loc);
}
inline unsigned __reduce_or_sync(unsigned mask, unsigned v, EMU_LOC) {
    return emu::warp_op<unsigned>(emu::OP_REDUCE_OR, mask, v, 0, 32, loc);
}
inline unsigned __reduce_xor_sync(unsigned mask, unsigned v, EMU_LOC) {
    return emu::warp_op<unsigned>(emu::OP_REDUCE_XOR, mask, v, 0, 32, loc);
}
template <class T>
    requires std::is_arithmetic_v<T>
inline unsigned __match_any_sync(unsigned mask, T v, EMU_LOC) {
    return emu::warp_op<uint64_t>(emu::OP_MATCH_ANY, mask, (uint64_t)v, 0, 32, loc);
}
// The lanes of the caller's warp that have not exited (the GPU gives those converged with the
// caller at this point: a subset, which the emulator does not track).
inline unsigned __activemask() {
    emu::Thread& t = emu::self("__activemask");
    unsigned w = t.tid / 32, nl = std::min(32u, emu::g.nthreads - w * 32), m = 0;
    for (unsigned j = 0; j < nl; j++)
        if (emu::g.threads[w * 32 + j].st != emu::St::Done) m |= 1u << j;
    return m;
}
#undef EMU_LOC

inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
[[noreturn]] inline void __trap() { emu::fail("__trap()"); }
inline long long clock64() {
    static long long c = 0;
    return c += 1000;
}

// ---------------------------------------------------------------------------------------------
// Atomics: plain read-modify-writes (fibers switch only at synchronisation points), counted:
// a kernel that uses one runs, and the launch prints a note.

#define EMU_ATOMIC(NAME, T, EXPR)                                                           \
    inline T NAME(T* p, T v) {                                                              \
        emu::count_atomic();                                                                \
        T old = *p;                                                                         \
        *p = (EXPR);                                                                        \
        return old;                                                                         \
    }
EMU_ATOMIC(atomicAdd, int, old + v)
EMU_ATOMIC(atomicAdd, unsigned int, old + v)
EMU_ATOMIC(atomicAdd, unsigned long long, old + v)
EMU_ATOMIC(atomicAdd, float, old + v)
EMU_ATOMIC(atomicAdd, double, old + v)
EMU_ATOMIC(atomicSub, int, old - v)
EMU_ATOMIC(atomicSub, unsigned int, old - v)
EMU_ATOMIC(atomicExch, int, v)
EMU_ATOMIC(atomicExch, unsigned int, v)
EMU_ATOMIC(atomicExch, unsigned long long, v)
EMU_ATOMIC(atomicExch, float, v)
EMU_ATOMIC(atomicMin, int, std::min(old, v))
EMU_ATOMIC(atomicMin, unsigned int, std::min(old, v))
EMU_ATOMIC(atomicMin, long long, std::min(old, v))
EMU_ATOMIC(atomicMin, unsigned long long, std::min(old, v))
EMU_ATOMIC(atomicMax, int, std::max(old, v))
EMU_ATOMIC(atomicMax, unsigned int, std::max(old, v))
EMU_ATOMIC(atomicMax, long long, std::max(old, v))
EMU_ATOMIC(atomicMax, unsigned long long, std::max(old, v))
EMU_ATOMIC(atomicAnd, int, old & v)
EMU_ATOMIC(atomicAnd, unsigned int, old & v)
EMU_ATOMIC(atomicAnd, unsigned long long, old & v)
EMU_ATOMIC(atomicOr, int, old | v)
EMU_ATOMIC(atomicOr, unsigned int, old | v)
EMU_ATOMIC(atomicOr, unsigned long long, old | v)
EMU_ATOMIC(atomicXor, int, old ^ v)
EMU_ATOMIC(atomicXor, unsigned int, old ^ v)
EMU_ATOMIC(atomicXor, unsigned long long, old ^ v)
EMU_ATOMIC(atomicInc, unsigned int, old >= v ? 0u : old + 1)
EMU_ATOMIC(atomicDec, unsigned int, (old == 0 || old > v) ? v : old - 1)
#undef EMU_ATOMIC
#define EMU_CAS(T)                                                                          \
    inline T atomicCAS(T* p, T cmp, T v) {                                                  \
        emu::count_atomic();                                                                \
        T old = *p;                                                                         \
        if (old == cmp) *p = v;                                                             \
        return old;                                                                         \
    }
EMU_CAS(int)
EMU_CAS(unsigned int)
EMU_CAS(unsigned long long)
EMU_CAS(unsigned short)
#undef EMU_CAS

// ---------------------------------------------------------------------------------------------
// Bit casts, conversions, integer intrinsics.

inline unsigned int __float_as_uint(float x) {
    unsigned int u;
    memcpy(&u, &x, 4);
    return u;
}
inline float __uint_as_float(unsigned int u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}
inline int __float_as_int(float x) { return (int)__float_as_uint(x); }
inline float __int_as_float(int i) { return __uint_as_float((unsigned int)i); }
inline long long __double_as_longlong(double x) {
    long long u;
    memcpy(&u, &x, 8);
    return u;
}
inline double __longlong_as_double(long long u) {
    double x;
    memcpy(&x, &u, 8);
    return x;
}
namespace emu {
// float -> integer as the GPU does: NaN gives 0, out of range saturates.
template <class I>
inline I f2i(double r) {
    if (r != r) return 0;
    if (r <= (double)std::numeric_limits<I>::min()) return std::numeric_limits<I>::min();
    if (r >= (double)std::numeric_limits<I>::max()) return std::numeric_limits<I>::max();
    return (I)r;
}
}  // namespace emu
inline int __float2int_rn(float x) { return emu::f2i<int>(nearbyint((double)x)); }
inline int __float2int_rz(float x) { return emu::f2i<int>(trunc((double)x)); }
inline int __float2int_rd(float x) { return emu::f2i<int>(floor((double)x)); }
inline int __float2int_ru(float x) { return emu::f2i<int>(ceil((double)x)); }
inline unsigned __float2uint_rn(float x) { return emu::f2i<unsigned>(nearbyint((double)x)); }
inline unsigned __float2uint_rz(float x) { return emu::f2i<unsigned>(trunc((double)x)); }
inline long long __float2ll_rz(float x) { return emu::f2i<long long>(trunc((double)x)); }
inline float __int2float_rn(int i) { return (float)i; }
inline float __uint2float_rn(unsigned u) { return (float)u; }
inline float __ll2float_rn(long long i) { return (float)i; }
inline double __int2double_rn(int i) { return (double)i; }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline int __mulhi(int a, int b) { return (int)(((int64_t)a * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline int __mul24(int a, int b) { return (int)((int64_t)((a << 8) >> 8) * ((b << 8) >> 8)); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xFFFFFFu) * (b & 0xFFFFFFu); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)((v >> (((s >> (4 * i)) & 7) * 8)) & 0xFF) << (8 * i);
    return r;
}

// min and max: CUDA's overloads (mixed signedness goes unsigned, as CUDA's do).
#define EMU_MINMAX(A, B, R)                                                                 \
    inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; }                            \
    inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
EMU_MINMAX(int, int, int)
EMU_MINMAX(unsigned int, unsigned int, unsigned int)
EMU_MINMAX(int, unsigned int, unsigned int)
EMU_MINMAX(unsigned int, int, unsigned int)
EMU_MINMAX(long, long, long)
EMU_MINMAX(unsigned long, unsigned long, unsigned long)
EMU_MINMAX(long, unsigned long, unsigned long)
EMU_MINMAX(unsigned long, long, unsigned long)
EMU_MINMAX(long long, long long, long long)
EMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
EMU_MINMAX(long long, unsigned long long, unsigned long long)
EMU_MINMAX(unsigned long long, long long, unsigned long long)
#undef EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }

// ---------------------------------------------------------------------------------------------
// Math. + - * / sqrtf fmaf are IEEE on both sides (NVRTC: --fmad=false, no ftz, precise div and
// sqrt; run.py compiles with -ffp-contract=off), so they agree bitwise. The rest is the host's
// libm: CUDA's expf, logf, tanhf, rsqrtf, __expf... are other approximations (a few ulp).

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
inline float __tanhf(float x) { return tanhf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return (float)(1.0 / sqrt((double)x)); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }

// Cached and streaming loads and stores: plain accesses.
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---------------------------------------------------------------------------------------------
// Inline PTX: run.py turns `asm("text" : "=x"(out) : "y"(in))` into
// `emu::asm_exec("text", &(out), (in))`; the instructions known are below (others fail with
// their text when reached).

namespace emu {

inline uint32_t f32_bits(float x) { return __float_as_uint(x); }

// cvt.f32.f16: exact. A NaN gives the canonical NaN 0x7FFFFFFF (what NVIDIA's own host
// emulation, cuda_fp16.hpp's __internal_half2float, does; payload bits unverified on silicon).
inline float cvt_f32_f16(unsigned short h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FFu;
    if (e == 0x1F) return __uint_as_float(m ? 0x7FFFFFFFu : (sign | 0x7F800000u));
    if (e == 0) {
        float v = (float)m * 0x1p-24f;  // exact
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
}
// cvt.rn.f16.f32: round to nearest even; overflow gives infinity; a NaN gives 0x7FFF (as
// cuda_fp16.hpp's __internal_float2half).
inline unsigned short cvt_rn_f16_f32(float x) {
    uint32_t u = __float_as_uint(x), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0x7FFF;
    if (a == 0x7F800000u) return (unsigned short)(sign | 0x7C00u);
    uint32_t r;
    if (a >= 0x38800000u) {  // normal f16 range (|x| >= 2^-14) or overflow
        uint32_t t = a - 0x38000000u;  // rebias the exponent: 127 - 15 = 112 = 0x70 << 23
        r = (t + 0xFFFu + ((t >> 13) & 1u)) >> 13;
        if (r >= 0x7C00u) r = 0x7C00u;
    } else if (a < 0x33000001u) {  // |x| <= 2^-25: rounds to zero (2^-25 is a tie, to even)
        r = 0;
    } else {  // subnormal f16: the 24-bit significand shifted right by 126 - exp
        uint32_t e = a >> 23, shift = 126 - e, mant = (a & 0x7FFFFFu) | 0x800000u;
        uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        r = q + (rem > half || (rem == half && (q & 1u)));
    }
    return (unsigned short)(sign | r);
}
// cvt.rn.bf16.f32 (sm_80): round to nearest even; a NaN gives 0x7FFF.
inline unsigned short cvt_rn_bf16_f32(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// cvt.f32.bf16 (sm_90): exact.
inline float cvt_f32_bf16(unsigned short h) { return __uint_as_float((uint32_t)h << 16); }

inline std::string asm_norm(const char* text) {
    // Collapse blanks, drop braces and the final ';'.
    std::string s;
    for (const char* p = text; *p; p++) {
        char c = *p;
        if (c == '{' || c == '}') continue;
        if (c == '\n' || c == '\t' || c == ' ') {
            if (!s.empty() && s.back() != ' ') s += ' ';
            continue;
        }
        s += c;
    }
    while (!s.empty() && (s.back() == ' ' || s.back() == ';')) s.pop_back();
    while (!s.empty() && s.front() == ' ') s.erase(0, 1);
    return s;
}
// The instruction a text names (cached by the literal's address: asm_exec runs often).
enum AsmKind { ASM_UNKNOWN, ASM_CVT_RN_F16_F32, ASM_CVT_F32_F16, ASM_CVT_RN_BF16_F32, ASM_CVT_F32_BF16 };
inline int asm_kind(const char* text) {
    static std::unordered_map<const char*, int> cache;
    auto it = cache.find(text);
    if (it != cache.end()) return it->second;
    std::string s = asm_norm(text);
    int k = s == "cvt.rn.f16.f32 %0, %1"    ? ASM_CVT_RN_F16_F32
            : s == "cvt.f32.f16 %0, %1"     ? ASM_CVT_F32_F16
            : s == "cvt.rn.bf16.f32 %0, %1" ? ASM_CVT_RN_BF16_F32
            : s == "cvt.f32.bf16 %0, %1"    ? ASM_CVT_F32_BF16
                                            : ASM_UNKNOWN;
    cache[text] = k;
    return k;
}
inline void asm_exec(const char* text, unsigned short* d, float a) {
    int k = asm_kind(text);
    if (k == ASM_CVT_RN_F16_F32) *d = cvt_rn_f16_f32(a);
    else if (k == ASM_CVT_RN_BF16_F32) *d = cvt_rn_bf16_f32(a);
    else fail("inline PTX not emulated: \"%s\" (unsigned short output, float input)", text);
}
inline void asm_exec(const char* text, float* d, unsigned short a) {
    int k = asm_kind(text);
    if (k == ASM_CVT_F32_F16) *d = cvt_f32_f16(a);
    else if (k == ASM_CVT_F32_BF16) *d = cvt_f32_bf16(a);
    else fail("inline PTX not emulated: \"%s\" (float output, unsigned short input)", text);
}
template <class... A>
inline void asm_exec(const char* text, A&&...) {
    fail("inline PTX not emulated: \"%s\" (%zu operands of these types); add it to emu.h",
         text, sizeof...(A));
}

// ---------------------------------------------------------------------------------------------
// Checks for tests: count and report failures; main returns emu::finish().

inline unsigned long long checks = 0, failures = 0;
inline bool note_failure() { return ++failures <= 20; }  // print the first 20

inline void check(bool ok, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
inline void check(bool ok, const char* file, int line, const char* fmt, ...) {
    checks++;
    if (ok) return;
    if (!note_failure()) return;
    fprintf(stderr, "FAIL %s:%d: ", file, line);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
}

// got ≈ want elementwise: |got - want| <= atol + rtol·|want|; NaN only matches NaN, an
// infinity only itself. Prints the first mismatches and the worst one.
inline bool expect_near(const char* what, const float* got, const float* want, size_t n,
                        double atol, double rtol) {
    size_t bad = 0, worst = 0;
    double worst_err = -1;
    for (size_t i = 0; i < n; i++) {
        double g_ = got[i], w = want[i];
        bool ok;
        double err = 0;
        if (std::isnan(w) || std::isnan(g_)) ok = std::isnan(w) && std::isnan(g_);
        else if (std::isinf(w) || std::isinf(g_)) ok = g_ == w;
        else {
            err = fabs(g_ - w);
            ok = err <= atol + rtol * fabs(w);
        }
        if (!ok) {
            if (bad < 5 && failures < 20)
                fprintf(stderr, "FAIL %s[%zu]: got %.9g, want %.9g (error %.3g)\n", what, i,
                        got[i], want[i], err);
            bad++;
        }
        if (!ok && (err > worst_err || std::isnan(err))) {
            worst_err = err;
            worst = i;
        }
    }
    checks++;
    if (bad) {
        failures++;
        fprintf(stderr, "FAIL %s: %zu of %zu values out of tolerance (atol %g, rtol %g); worst "
                "[%zu]: got %.9g, want %.9g\n", what, bad, n, atol, rtol, worst, got[worst],
                want[worst]);
    }
    return !bad;
}
inline bool expect_near(const char* what, const std::vector<float>& got,
                        const std::vector<float>& want, double atol, double rtol) {
    if (got.size() != want.size()) {
        checks++;
        failures++;
        fprintf(stderr, "FAIL %s: %zu values, want %zu\n", what, got.size(), want.size());
        return false;
    }
    return expect_near(what, got.data(), want.data(), got.size(), atol, rtol);
}
// Bitwise equality of two arrays of a trivially copyable type.
template <class T>
inline bool expect_bits(const char* what, const T* got, const T* want, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &want[i], sizeof(T)) == 0) continue;
        if (bad < 5 && failures < 20) {
            uint64_t a = 0, b = 0;
            memcpy(&a, &got[i], std::min(sizeof(T), sizeof a));
            memcpy(&b, &want[i], std::min(sizeof(T), sizeof b));
            fprintf(stderr, "FAIL %s[%zu]: bits 0x%llx, want 0x%llx\n", what, i,
                    (unsigned long long)a, (unsigned long long)b);
        }
        bad++;
    }
    checks++;
    if (bad) {
        failures++;
        fprintf(stderr, "FAIL %s: %zu of %zu values differ bitwise\n", what, bad, n);
    }
    return !bad;
}
template <class T>
inline bool expect_bits(const char* what, const std::vector<T>& got, const std::vector<T>& want) {
    if (got.size() != want.size()) {
        checks++;
        failures++;
        fprintf(stderr, "FAIL %s: %zu values, want %zu\n", what, got.size(), want.size());
        return false;
    }
    return expect_bits(what, got.data(), want.data(), got.size());
}

// Prints the summary; the exit status of the test.
inline int finish() {
    const char* o = getenv("EMU_ORDER");
    if (failures) {
        fprintf(stderr, "FAILED: %llu of %llu checks (EMU_ORDER=%s)\n", failures, checks,
                o ? o : "forward");
        return 1;
    }
    printf("ok: %llu checks, %llu launches (EMU_ORDER=%s)\n", checks, g.launches,
           o ? o : "forward");
    return 0;
}

}  // namespace emu

#define EMU_CHECK(cond, ...) ::emu::check((cond), __FILE__, __LINE__, __VA_ARGS__)
