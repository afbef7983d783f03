/*
 * cudart_sim.cc: the subset of the CUDA runtime that moonshard uses, simulated on the host
 * (the model: sim.h), with the real declarations of <cuda_runtime_api.h>.
 *
 * Devices.  MS_SIM_DEVICES of them (default 1; 0: cudaGetDeviceCount says
 * cudaErrorNoDevice), each with MS_SIM_MEM_BYTES of memory (default 16 GiB; beyond it an
 * allocation fails with cudaErrorMemoryAllocation) and a stream-ordered memory pool unless
 * MS_SIM_NO_POOLS=1 (then cudaDevAttrMemoryPoolsSupported is 0 and cudaMallocAsync fails
 * with cudaErrorNotSupported, as on a device without pools).  The current device is
 * per thread (0 until cudaSetDevice).
 *
 * Memory.  Device memory is host memory (aligned to 256 bytes, filled with 0xff bytes, so
 * that memory used before it is written reads NaN or -1) handed out as its address + kTag,
 * in a registry that every call checks its device ranges against: a range outside one live
 * allocation is cudaErrorInvalidValue, as is freeing what is not an allocation's start.  An
 * allocation whose cudaFreeAsync was called is no longer live for the calls that follow,
 * although the free itself runs in stream order.  cudaMallocHost's memory is registered as
 * pinned, which decides how cudaMemcpyAsync treats it (below).
 *
 * Streams.  A stream is a FIFO of operations that runs only when someone waits for it
 * (cudaStreamSynchronize, cudaEventSynchronize, a query that decides to run it, cudaMemcpy,
 * cudaMemset, cudaFree, cudaFreeHost, cudaDeviceSynchronize, cudaStreamDestroy): then the
 * waiting thread runs its operations, in order, one at a time.  An operation may wait for
 * another stream in turn (cudaStreamWaitEvent).  A thread that needs a stream another thread
 * is running waits for that thread's progress instead of taking the stream over: a wait
 * ends as soon as the operations it waits for have run, whoever ran them (so two streams
 * that wait for each other's earlier events cannot deadlock, as they cannot on a GPU).
 * A gated operation (mssim::enqueue_gated; NCCL's collectives, cudaStreamWaitEvent's wait)
 * stops the stream until its try_run says it is done: a blocking wait tries it again after
 * short sleeps (20 us, doubling up to 1 ms), a query tries it once and answers
 * cudaErrorNotReady; a query also answers cudaErrorNotReady, without waiting, while another
 * thread is running the stream (that thread may be waiting at a gated operation itself).
 * Stream 0, cudaStreamLegacy and cudaStreamPerThread are all the calling thread's own stream
 * for its current device (the per-thread default stream: there is no legacy stream that
 * synchronizes with the others); the thread's streams run when it exits.
 *
 * Copies (cudaMemcpyAsync), as the CUDA documentation describes them: from pageable host
 * memory to the device the source is copied at the call (the caller may reuse it at once);
 * into pageable host memory the call returns once the copy has run (the stream runs up to
 * it); pinned memory is left to the stream.  cudaMemcpyDefault finds each side in the
 * registry; an explicit kind must match what the registry says.
 *
 * Events.  cudaEventRecord enqueues a marker.  cudaEventQuery on an event whose marker has
 * not run says cudaErrorNotReady the first time it is asked, and the next query runs the
 * stream up to the marker and says cudaSuccess, so that a caller's polling loop goes round
 * at least once, deterministically; unless a gated operation before the marker is not done
 * (or another thread runs the stream): then cudaErrorNotReady again, and each later query
 * tries once more.  A stream's cudaStreamQuery does the same.
 *
 * Errors.  A failed call sets the calling thread's last error (cudaGetLastError returns and
 * clears it; cudaErrorNotReady is an answer, not an error, and is not recorded).  A fault
 * the GPU would report asynchronously (a copy whose device memory was freed before the copy
 * ran, a divergent __syncthreads) aborts the process with a message instead: on a GPU the
 * context would be lost anyway.
 *
 * Kernels (cuda_sim_device.h) run when their stream runs, every thread of every block on
 * the host thread that runs the stream; __syncthreads through fibers (run_grid below).
 */
#include "cuda_sim_device.h"

#include <cuda_runtime_api.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define MSSIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MSSIM_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define MSSIM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MSSIM_TSAN 1
#endif
#endif
#ifdef MSSIM_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#ifdef MSSIM_TSAN
#include <sanitizer/tsan_interface.h>
#endif

/* Fibers switch with a few instructions on x86-64 (swapcontext makes a system call at every
 * switch, to save the signal mask); elsewhere, or with -DMSSIM_UCONTEXT, with ucontext. */
#if defined(__x86_64__) && !defined(MSSIM_UCONTEXT)
#define MSSIM_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace mssim {
namespace {

/* ---------------------------------------------------------------- basics */

[[noreturn]] __attribute__((format(printf, 1, 2))) void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("mssim (simulated CUDA device): ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

/* A non-negative integer from the environment, else def (a malformed value is fatal: a test
 * asked for something it would not get). */
unsigned long long env_number(const char *name, unsigned long long def) {
    const char *v = getenv(name);
    if (!v || !*v) return def;
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    if (*end || *v == '-') fatal("%s='%s' is not a non-negative integer", name, v);
    return x;
}

thread_local cudaError_t t_last_error = cudaSuccess;

cudaError_t fail(cudaError_t e) {
    if (e != cudaSuccess && e != cudaErrorNotReady) t_last_error = e;
    return e;
}

thread_local int t_device = 0;

struct Stream;
struct Event;

struct Alloc {
    size_t size;
    int device;
    bool freeing; /* cudaFree or cudaFreeAsync was called: no longer live for new calls */
};

/* The process's devices, memory and handles.  Never destroyed: a thread that exits after
 * main returns may still drain its streams. */
struct State {
    int devices;
    size_t mem_limit;
    bool pools;

    std::mutex mem_lock; /* the registries below */
    std::map<uintptr_t, Alloc> device_mem; /* by host address */
    std::map<uintptr_t, size_t> pinned;    /* cudaMallocHost's, by address: size */
    std::vector<size_t> used;              /* live device bytes, per device */

    std::mutex obj_lock; /* the handles below */
    std::unordered_map<const void *, std::shared_ptr<Stream>> streams; /* every live stream */
    std::unordered_map<const void *, std::shared_ptr<Event>> events;
    std::vector<char> pool_handles; /* cudaMemPool_t of device d: &pool_handles[d] */

    State() {
        devices = (int)std::min(env_number("MS_SIM_DEVICES", 1), 1024ULL);
        mem_limit = (size_t)env_number("MS_SIM_MEM_BYTES", 16ULL << 30);
        pools = env_number("MS_SIM_NO_POOLS", 0) == 0;
        used.assign((size_t)devices, 0);
        pool_handles.assign((size_t)devices + 1, 0);
    }
};

State &state() {
    static State *s = new State;
    return *s;
}

bool valid_device(int d) { return d >= 0 && d < state().devices; }

/* ---------------------------------------------------------------- the memory registry */

bool tagged(const void *p) { return ((uintptr_t)p >> 62) == 1; } /* bit 62 set, bit 63 clear */

/* The host memory behind [p, p + n) of device memory (p may be the end when n is 0), or
 * nullptr; with_freeing: an allocation whose free is pending counts (what an operation
 * enqueued before the free may still use).  Under mem_lock. */
char *lookup_locked(const void *p, size_t n, bool with_freeing, int *device) {
    if (!tagged(p)) return nullptr;
    State &st = state();
    const uintptr_t h = (uintptr_t)p - kTag;
    auto it = st.device_mem.upper_bound(h);
    if (it == st.device_mem.begin()) return nullptr;
    --it;
    const uintptr_t off = h - it->first;
    if (off > it->second.size || n > it->second.size - off) return nullptr;
    if (it->second.freeing && !with_freeing) return nullptr;
    if (device) *device = it->second.device;
    return (char *)h;
}

char *lookup(const void *p, size_t n, bool with_freeing, int *device = nullptr) {
    std::lock_guard<std::mutex> lk(state().mem_lock);
    return lookup_locked(p, n, with_freeing, device);
}

/* Inside an operation: the host memory of a device range that was checked when the
 * operation was enqueued; its loss since is the use-after-free a GPU reports as an illegal
 * address (and loses the context over). */
char *device_at_run(const void *p, size_t n, const char *what) {
    char *h = lookup(p, n, true);
    if (!h)
        fatal("%s: device memory %p (%zu bytes) was freed before the operation ran (on a GPU: "
              "cudaErrorIllegalAddress)", what, p, n);
    return h;
}

enum class Mem { device, pinned, pageable };

struct Where {
    Mem kind;
    char *host; /* the memory itself */
    int device; /* Mem::device's */
};

/* Where [p, p + n) is; false for a null pointer and for a tagged range outside live device
 * memory. */
bool where(const void *p, size_t n, Where *w) {
    if (!p) return false;
    State &st = state();
    std::lock_guard<std::mutex> lk(st.mem_lock);
    if (tagged(p)) {
        w->kind = Mem::device;
        w->host = lookup_locked(p, n, false, &w->device);
        return w->host != nullptr;
    }
    w->kind = Mem::pageable, w->host = (char *)p, w->device = -1;
    auto it = st.pinned.upper_bound((uintptr_t)p);
    if (it != st.pinned.begin()) {
        --it;
        const uintptr_t off = (uintptr_t)p - it->first;
        if (off <= it->second && n <= it->second - off) w->kind = Mem::pinned;
    }
    return true;
}

/* ---------------------------------------------------------------- streams */

/* One operation of a stream: run (a plain operation: it completes when it returns) or
 * try_run (a gated one: the stream's progress stops at it until a call returns true). */
struct StreamOp {
    std::function<void()> run;
    std::function<bool()> try_run;
};

struct Stream {
    int device;
    unsigned flags;
    bool per_thread;
    std::mutex m; /* everything below; never held while an operation runs */
    std::condition_variable cv; /* completed moved, or running ended */
    std::deque<StreamOp> ops; /* not yet completed (a gated one that was tried stays first) */
    uint64_t enqueued = 0, completed = 0;  /* operations so far: sequence numbers 1, 2, ... */
    bool running = false;                  /* an operation has started and not returned */
    std::thread::id runner;
    bool asked = false; /* cudaStreamQuery said cudaErrorNotReady and has not run it since */

    Stream(int d, unsigned f, bool pt) : device(d), flags(f), per_thread(pt) {}

    uint64_t push(StreamOp op) {
        std::lock_guard<std::mutex> lk(m);
        ops.push_back(std::move(op));
        return ++enqueued;
    }
    uint64_t push(std::function<void()> op) { return push(StreamOp{std::move(op), nullptr}); }

    uint64_t tail() {
        std::lock_guard<std::mutex> lk(m);
        return enqueued;
    }

    bool reached(uint64_t target) {
        std::lock_guard<std::mutex> lk(m);
        return completed >= target;
    }

    /* Runs the first operation (lk held on entry and on return, released meanwhile); false
     * when it is a gated operation that could not complete yet: it stays first. */
    bool step(std::unique_lock<std::mutex> &lk) {
        StreamOp op = std::move(ops.front());
        ops.pop_front();
        running = true, runner = std::this_thread::get_id();
        lk.unlock();
        bool done = true;
        if (op.try_run) done = op.try_run();
        else op.run();
        if (done) op = StreamOp{}; /* what it held (a staging buffer) goes now */
        lk.lock();
        if (done) completed++;
        else ops.push_front(std::move(op));
        running = false, runner = std::thread::id();
        cv.notify_all();
        return done;
    }

    /* Runs the stream until its first `target` operations have completed: on this thread
     * while no other runs it, else waiting for the one that does.  Blocking: a gated
     * operation that cannot complete is tried again after a short sleep (growing to 1 ms),
     * for as long as it takes (forever, if it never can: a GPU would spin as long). */
    void run_until(uint64_t target) {
        std::unique_lock<std::mutex> lk(m);
        long sleep_us = 20;
        while (completed < target) {
            if (running) {
                if (runner == std::this_thread::get_id())
                    fatal("an operation of a stream waits for a later operation of the same stream");
                cv.wait(lk);
                continue;
            }
            if (step(lk)) {
                sleep_us = 20;
                continue;
            }
            lk.unlock();
            std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
            sleep_us = std::min(sleep_us * 2, 1000L);
            lk.lock();
        }
    }

    /* Non-blocking: runs the stream towards `target` on this thread (plain operations run to
     * their end, as before) and says whether it got there; false, at once, when a gated
     * operation cannot complete yet (tried once) or another thread is running the stream
     * (that thread makes the progress; a query must not wait for it, since it may be
     * waiting for a gated operation itself). */
    bool try_until(uint64_t target) {
        std::unique_lock<std::mutex> lk(m);
        while (completed < target) {
            if (running) {
                if (runner == std::this_thread::get_id())
                    fatal("an operation of a stream waits for a later operation of the same stream");
                return false;
            }
            if (!step(lk)) return false;
        }
        return true;
    }

    void run_all() { run_until(tail()); }
};

/* What a thread keeps: its per-thread streams (one a device) and its fibers' stacks. */
struct Fiber;
struct ThreadState {
    std::vector<std::shared_ptr<Stream>> streams;
    std::vector<std::unique_ptr<Fiber>> fibers;
    ~ThreadState();
};

ThreadState &thread_state() {
    static thread_local ThreadState ts;
    return ts;
}

bool is_default(cudaStream_t s) { return !s || s == cudaStreamPerThread || s == cudaStreamLegacy; }

/* The stream behind a handle (the calling thread's own for 0 and cudaStreamPerThread), or
 * null when it is not live. */
std::shared_ptr<Stream> resolve(cudaStream_t s) {
    State &st = state();
    if (is_default(s)) {
        if (!valid_device(t_device)) return nullptr;
        ThreadState &ts = thread_state();
        if (ts.streams.size() <= (size_t)t_device) ts.streams.resize((size_t)t_device + 1);
        std::shared_ptr<Stream> &p = ts.streams[(size_t)t_device];
        if (!p) {
            p = std::make_shared<Stream>(t_device, cudaStreamNonBlocking, true);
            std::lock_guard<std::mutex> lk(st.obj_lock);
            st.streams[p.get()] = p;
        }
        return p;
    }
    std::lock_guard<std::mutex> lk(st.obj_lock);
    auto it = st.streams.find(s);
    return it == st.streams.end() || it->second->per_thread ? nullptr : it->second;
}

/* Every live stream of `device` (-1: of every device), each run as far as it had been
 * enqueued when this was called: what the calls that synchronize the device wait for. */
void run_device(int device) {
    std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> todo;
    {
        State &st = state();
        std::lock_guard<std::mutex> lk(st.obj_lock);
        for (auto &kv : st.streams)
            if (device < 0 || kv.second->device == device) todo.emplace_back(kv.second, 0);
    }
    for (auto &t : todo) t.second = t.first->tail();
    for (auto &t : todo) t.first->run_until(t.second);
}

/* ---------------------------------------------------------------- events */

struct Event {
    int device;
    unsigned flags;
    std::mutex m;
    std::shared_ptr<Stream> stream; /* of the last record; null: never recorded */
    uint64_t target = 0;            /* the marker's sequence number on it */
    bool asked = false;             /* cudaEventQuery said cudaErrorNotReady for this record */
    Event(int d, unsigned f) : device(d), flags(f) {}
};

std::shared_ptr<Event> find_event(cudaEvent_t e) {
    State &st = state();
    std::lock_guard<std::mutex> lk(st.obj_lock);
    auto it = st.events.find(e);
    return it == st.events.end() ? nullptr : it->second;
}

/* ---------------------------------------------------------------- copies and sets */

/* Device memory for the calls that take only device memory: the host memory behind it. */
cudaError_t device_range(const void *p, size_t n, char **host) {
    *host = lookup(p, n, false);
    return *host ? cudaSuccess : cudaErrorInvalidValue;
}

/* cudaMemcpyAsync, and cudaMemcpy (sync: on the thread's stream, waited for). */
cudaError_t copy(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t hs, bool sync) {
    if (state().devices == 0) return fail(cudaErrorNoDevice);
    if ((int)kind < (int)cudaMemcpyHostToHost || (int)kind > (int)cudaMemcpyDefault)
        return fail(cudaErrorInvalidMemcpyDirection);
    std::shared_ptr<Stream> s = resolve(hs);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if (n == 0) return cudaSuccess;
    Where d, f;
    if (!where(dst, n, &d) || !where(src, n, &f)) return fail(cudaErrorInvalidValue);
    const bool dd = d.kind == Mem::device, fd = f.kind == Mem::device;
    bool ok = true;
    switch (kind) {
    case cudaMemcpyHostToHost: ok = !dd && !fd; break;
    case cudaMemcpyHostToDevice: ok = dd && !fd; break;
    case cudaMemcpyDeviceToHost: ok = !dd && fd; break;
    case cudaMemcpyDeviceToDevice: ok = dd && fd; break;
    default: break;
    }
    if (!ok) return fail(cudaErrorInvalidValue); /* a host pointer passed as device memory, or back */
    std::function<void()> op;
    if (dd && f.kind == Mem::pageable) { /* staged now: the caller may reuse src on return */
        auto stage = std::make_shared<std::vector<char>>(f.host, f.host + n);
        op = [dst, stage, n] { memcpy(device_at_run(dst, n, "cudaMemcpyAsync"), stage->data(), n); };
    } else {
        op = [dst, src, n, dd, fd] {
            char *to = dd ? device_at_run(dst, n, "cudaMemcpyAsync") : (char *)dst;
            const char *from = fd ? device_at_run(src, n, "cudaMemcpyAsync") : (const char *)src;
            memmove(to, from, n);
        };
    }
    const uint64_t seq = s->push(std::move(op));
    /* into pageable memory (or between host buffers): done when the call returns */
    if (sync || d.kind == Mem::pageable || (!dd && !fd)) s->run_until(seq);
    return cudaSuccess;
}

cudaError_t set(void *p, int value, size_t n, cudaStream_t hs, bool sync) {
    if (state().devices == 0) return fail(cudaErrorNoDevice);
    std::shared_ptr<Stream> s = resolve(hs);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if (n == 0) return cudaSuccess;
    char *h;
    if (device_range(p, n, &h) != cudaSuccess) return fail(cudaErrorInvalidValue);
    const uint64_t seq = s->push([p, value, n] { memset(device_at_run(p, n, "cudaMemsetAsync"), value, n); });
    if (sync) s->run_until(seq);
    return cudaSuccess;
}

/* ---------------------------------------------------------------- allocation */

cudaError_t device_alloc(void **out, size_t size, int device) {
    if (!out) return fail(cudaErrorInvalidValue);
    *out = nullptr;
    if (size == 0) return cudaSuccess; /* as the runtime: success, and a null pointer */
    State &st = state();
    const size_t rounded = (size + 255) / 256 * 256;
    if (rounded < size) return fail(cudaErrorMemoryAllocation);
    {
        std::lock_guard<std::mutex> lk(st.mem_lock);
        if (rounded > st.mem_limit - st.used[(size_t)device]) return fail(cudaErrorMemoryAllocation);
        st.used[(size_t)device] += rounded;
    }
    char *h = (char *)aligned_alloc(256, rounded);
    if (!h) {
        std::lock_guard<std::mutex> lk(st.mem_lock);
        st.used[(size_t)device] -= rounded;
        return fail(cudaErrorMemoryAllocation);
    }
    memset(h, 0xff, rounded); /* not zero: memory read before it is written shows */
    std::lock_guard<std::mutex> lk(st.mem_lock);
    st.device_mem[(uintptr_t)h] = Alloc{size, device, false};
    *out = (void *)((uintptr_t)h + kTag);
    return cudaSuccess;
}

/* Marks the allocation that starts at p as being freed; its device in *device. */
cudaError_t begin_free(void *p, int *device) {
    State &st = state();
    std::lock_guard<std::mutex> lk(st.mem_lock);
    if (!tagged(p)) return cudaErrorInvalidValue;
    auto it = st.device_mem.find((uintptr_t)p - kTag);
    if (it == st.device_mem.end() || it->second.freeing) return cudaErrorInvalidValue;
    it->second.freeing = true;
    *device = it->second.device;
    return cudaSuccess;
}

void end_free(void *p) {
    State &st = state();
    char *h = (char *)((uintptr_t)p - kTag);
    {
        std::lock_guard<std::mutex> lk(st.mem_lock);
        auto it = st.device_mem.find((uintptr_t)h);
        st.used[(size_t)it->second.device] -= (it->second.size + 255) / 256 * 256;
        st.device_mem.erase(it);
    }
    free(h);
}

/* ---------------------------------------------------------------- fibers */

/* One simulated thread of a block, run on a stack of its own when the block has barriers
 * (or to find out whether it has: thread 0). */
struct Fiber {
    enum Phase { ready, barrier, done };
    char *map = nullptr; /* guard page, then the stack */
    size_t map_size = 0;
    char *stack = nullptr;
    size_t stack_size = 0;
#ifdef MSSIM_ASM_SWITCH
    void *sp = nullptr;
#else
    ucontext_t ctx;
#endif
    Phase phase = ready;
    uint3 idx{0, 0, 0};
#ifdef MSSIM_ASAN
    void *fake_stack = nullptr;
#endif
#ifdef MSSIM_TSAN
    void *tsan = nullptr;
#endif

    Fiber() {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        stack_size = 256 << 10; /* a kernel's frames are small; ASan's are larger */
        map_size = stack_size + page;
        void *m = mmap(nullptr, map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1,
                       0);
        if (m == MAP_FAILED) fatal("cannot map a %zu-byte fiber stack", map_size);
        map = (char *)m;
        if (mprotect(map, page, PROT_NONE)) fatal("cannot protect a fiber stack's guard page");
        stack = map + page;
    }
    ~Fiber() {
#ifdef MSSIM_TSAN
        if (tsan) __tsan_destroy_fiber(tsan);
#endif
        munmap(map, map_size);
    }
    Fiber(const Fiber &) = delete;
    Fiber &operator=(const Fiber &) = delete;
};

/* One launch running on this host thread. */
struct Runner {
    void (*thread)(void *);
    void (*rest)(void *);
    void *ctx;
    const char *what;
    std::vector<std::unique_ptr<Fiber>> *fibers;
    Fiber *cur; /* the fiber running; null while threads run as plain calls */
#ifdef MSSIM_ASM_SWITCH
    void *sched_sp;
#else
    ucontext_t sched;
#endif
#ifdef MSSIM_ASAN
    void *fake_stack;
    const void *sched_bottom;
    size_t sched_size;
#endif
#ifdef MSSIM_TSAN
    void *tsan_sched;
#endif
};

thread_local Runner *t_runner = nullptr;

} // namespace
} // namespace mssim

#ifdef MSSIM_ASM_SWITCH
/* mssim_fiber_switch(save, to): saves the callee-saved registers and the stack pointer (into
 * *save), and resumes the context whose stack pointer is `to` (saved by an earlier switch,
 * or prepared by start_fiber).  The SSE and x87 control words are not switched: every fiber
 * of a thread shares them, and no kernel changes them (restoring them at each switch took
 * 20% of a barrier-heavy kernel's time). */
extern "C" void mssim_fiber_switch(void **save, void *to) __attribute__((visibility("hidden")));
asm(R"(
    .text
    .globl mssim_fiber_switch
    .hidden mssim_fiber_switch
    .type mssim_fiber_switch, @function
mssim_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size mssim_fiber_switch, .-mssim_fiber_switch
)");
#endif

namespace mssim {
namespace {

/* From the running fiber back to the block's scheduler (run_block).  Inlined, so that in
 * fiber_main it is not instrumented either (below). */
inline __attribute__((always_inline)) void to_scheduler(Runner &r, Fiber &f) {
#ifdef MSSIM_ASAN
    __sanitizer_start_switch_fiber(f.phase == Fiber::done ? nullptr : &f.fake_stack, r.sched_bottom, r.sched_size);
#endif
#ifdef MSSIM_TSAN
    __tsan_switch_to_fiber(r.tsan_sched, 0);
#endif
#ifdef MSSIM_ASM_SWITCH
    mssim_fiber_switch(&f.sp, r.sched_sp);
#else
    swapcontext(&f.ctx, &r.sched);
#endif
#ifdef MSSIM_ASAN
    __sanitizer_finish_switch_fiber(f.fake_stack, &r.sched_bottom, &r.sched_size);
#endif
}

/* Where every fiber starts: the thread's kernel call, then back to the scheduler for good.
 * Never instrumented by TSan: it never returns, and each entry it recorded would stay on
 * the fiber's shadow call stack, which grows with every reuse of the fiber until TSan
 * fails (past 65536 frames). */
#ifdef MSSIM_TSAN
__attribute__((no_sanitize_thread))
#endif
void fiber_main() {
#ifdef MSSIM_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &t_runner->sched_bottom, &t_runner->sched_size);
#endif
    Runner &r = *t_runner;
    r.thread(r.ctx);
    Fiber &f = *r.cur;
    f.phase = Fiber::done;
    to_scheduler(r, f);
    fatal("a finished fiber was resumed");
}

void start_fiber(Fiber &f, uint3 idx) {
    f.phase = Fiber::ready;
    f.idx = idx;
#ifdef MSSIM_ASAN
    __asan_unpoison_memory_region(f.stack, f.stack_size); /* what the last user left poisoned */
#endif
#ifdef MSSIM_TSAN
    if (!f.tsan) f.tsan = __tsan_create_fiber(0);
#endif
#ifdef MSSIM_ASM_SWITCH
    /* the stack as mssim_fiber_switch leaves it: six registers, then the address it returns
     * to (fiber_main, entered as if called: the stack pointer 8 past a 16-byte boundary),
     * above it fiber_main's return address (it never returns) */
    uintptr_t top = ((uintptr_t)f.stack + f.stack_size) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = nullptr;
    *--sp = (void *)&fiber_main;
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = f.stack_size;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

/* Runs fiber f until it reaches a barrier or finishes. */
void resume(Runner &r, Fiber &f) {
    threadIdx = f.idx;
    r.cur = &f;
#ifdef MSSIM_ASAN
    __sanitizer_start_switch_fiber(&r.fake_stack, f.stack, f.stack_size);
#endif
#ifdef MSSIM_TSAN
    __tsan_switch_to_fiber(f.tsan, 0);
#endif
#ifdef MSSIM_ASM_SWITCH
    mssim_fiber_switch(&r.sched_sp, f.sp);
#else
    swapcontext(&r.sched, &f.ctx);
#endif
#ifdef MSSIM_ASAN
    __sanitizer_finish_switch_fiber(r.fake_stack, nullptr, nullptr);
#endif
}

uint3 thread_of(unsigned t) {
    return uint3{t % blockDim.x, t / blockDim.x % blockDim.y, t / (blockDim.x * blockDim.y)};
}

/* The launching function, out of mssim::launch's __PRETTY_FUNCTION__ ("... [with F =
 * LAUNCHER::<lambda ...>; ...]"), for messages. */
std::string launcher(const char *what) {
    std::string s = what;
    size_t a = s.find("F = "), b = s.find("::<lambda");
    if (a == std::string::npos || b == std::string::npos || b < a) return s;
    return s.substr(a + 4, b - a - 4);
}

[[noreturn]] void divergent(const Runner &r, uint3 waiting, uint3 skipped) {
    fatal("a divergent __syncthreads in block (%u,%u,%u) of the kernel launched by %s: thread (%u,%u,%u) waits at "
          "a barrier that thread (%u,%u,%u) finished without reaching (undefined behaviour on a GPU)",
          blockIdx.x, blockIdx.y, blockIdx.z, launcher(r.what).c_str(), waiting.x, waiting.y, waiting.z, skipped.x,
          skipped.y, skipped.z);
}

/* One block.  Thread 0 first, as a fiber: when it finishes without a barrier, the others
 * run as plain calls (a barrier one of them reaches is divergent); when it stops at one,
 * every thread runs as a fiber, all of them to the barrier, round after round, and the
 * round must end with all of them at a barrier or all of them finished. */
void run_block(Runner &r) {
    const unsigned n = blockDim.x * blockDim.y * blockDim.z;
    std::vector<std::unique_ptr<Fiber>> &fibers = *r.fibers;
    if (fibers.empty()) fibers.emplace_back(new Fiber);
    start_fiber(*fibers[0], thread_of(0));
    resume(r, *fibers[0]);
    r.cur = nullptr;
    if (fibers[0]->phase == Fiber::done) {
        r.rest(r.ctx);
        return;
    }
    while (fibers.size() < n) fibers.emplace_back(new Fiber);
    for (unsigned t = 1; t < n; t++) start_fiber(*fibers[t], thread_of(t));
    for (unsigned first = 1;; first = 0) {
        for (unsigned t = first; t < n; t++) resume(r, *fibers[t]);
        r.cur = nullptr;
        unsigned finished = 0, one_done = 0, one_waiting = 0;
        for (unsigned t = 0; t < n; t++) {
            if (fibers[t]->phase != Fiber::done) one_waiting = t;
            else if (!finished++) one_done = t;
        }
        if (finished == n) return;
        if (finished) divergent(r, fibers[one_waiting]->idx, fibers[one_done]->idx);
    }
}

} // namespace

/* ---------------------------------------------------------------- sim.h */

void *host_of(const void *p, size_t bytes, int *device) { return lookup(p, bytes, false, device); }

bool is_device(const void *p) {
    std::lock_guard<std::mutex> lk(state().mem_lock);
    /* inside, not at the end: one byte */
    return lookup_locked(p, 1, false, nullptr) != nullptr;
}

int current_device() { return t_device; }

cudaError_t enqueue(cudaStream_t s, std::function<void()> op) {
    std::shared_ptr<Stream> st = resolve(s);
    if (!st) return cudaErrorInvalidResourceHandle;
    st->push(std::move(op));
    return cudaSuccess;
}

cudaError_t enqueue_gated(cudaStream_t s, std::function<bool()> try_run) {
    std::shared_ptr<Stream> st = resolve(s);
    if (!st) return cudaErrorInvalidResourceHandle;
    st->push(StreamOp{nullptr, std::move(try_run)});
    return cudaSuccess;
}

cudaError_t drain(cudaStream_t s) {
    std::shared_ptr<Stream> st = resolve(s);
    if (!st) return cudaErrorInvalidResourceHandle;
    st->run_all();
    return cudaSuccess;
}

void set_last_error(cudaError_t e) { fail(e); }

/* ---------------------------------------------------------------- cuda_sim_device.h */

namespace detail {

void *kernel_pointer(const void *p, bool *ok) {
    if (!p) return nullptr;
    int device = -1;
    void *h = lookup(p, 0, false, &device);
    if (!h || device != t_device) {
        *ok = false;
        return nullptr;
    }
    return h;
}

cudaError_t launch_check(dim3 grid, dim3 block, size_t shmem, cudaStream_t s) {
    if (state().devices == 0) return cudaErrorNoDevice;
    const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (threads < 1 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64 || grid.x < 1 ||
        grid.x > 0x7fffffffu || grid.y < 1 || grid.y > 65535 || grid.z < 1 || grid.z > 65535)
        return cudaErrorInvalidConfiguration;
    if (shmem > 48 * 1024) return cudaErrorInvalidValue; /* dynamic shared memory is not simulated anyway */
    std::shared_ptr<Stream> st = resolve(s);
    if (!st || st->device != t_device) return cudaErrorInvalidResourceHandle;
    return cudaSuccess;
}

void run_grid(dim3 grid, dim3 block, void (*thread)(void *), void (*rest)(void *), void *ctx, const char *what) {
    Runner r{};
    r.thread = thread, r.rest = rest, r.ctx = ctx, r.what = what;
    r.fibers = &thread_state().fibers;
#ifdef MSSIM_TSAN
    r.tsan_sched = __tsan_get_current_fiber();
#endif
    Runner *outer = t_runner;
    const uint3 saved_thread = threadIdx, saved_block = blockIdx;
    const dim3 saved_grid = gridDim, saved_dim = blockDim;
    t_runner = &r;
    gridDim = grid, blockDim = block;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = uint3{x, y, z};
                run_block(r);
            }
    t_runner = outer;
    threadIdx = saved_thread, blockIdx = saved_block, gridDim = saved_grid, blockDim = saved_dim;
}

} // namespace detail

namespace {

ThreadState::~ThreadState() {
    /* the thread's streams run now (nobody else can wait for them: their handle is the
     * thread's own), then leave the device's list; an event recorded on one keeps it */
    for (auto &s : streams)
        if (s) s->run_all();
    State &st = state();
    std::lock_guard<std::mutex> lk(st.obj_lock);
    for (auto &s : streams)
        if (s) st.streams.erase(s.get());
}

} // namespace
} // namespace mssim

void __syncthreads() {
    mssim::Runner *r = mssim::t_runner;
    if (!r) mssim::fatal("__syncthreads called outside a kernel");
    if (!r->cur)
        mssim::divergent(*r, threadIdx, uint3{0, 0, 0});
    r->cur->phase = mssim::Fiber::barrier;
    mssim::to_scheduler(*r, *r->cur);
}

/* ---------------------------------------------------------------- the runtime */

using namespace mssim;

namespace {

struct ErrorText {
    cudaError_t e;
    const char *name, *text;
};

const ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources", "too many resources requested for launch"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

const ErrorText &error_text(cudaError_t e) {
    for (const ErrorText &t : kErrors)
        if (t.e == e) return t;
    return kErrors[sizeof kErrors / sizeof kErrors[0] - 1];
}

bool no_device() { return state().devices == 0; }

} // namespace

/* ---- errors */

cudaError_t CUDARTAPI cudaGetLastError(void) {
    cudaError_t e = mssim::t_last_error;
    mssim::t_last_error = cudaSuccess;
    return e;
}

cudaError_t CUDARTAPI cudaPeekAtLastError(void) { return mssim::t_last_error; }

const char *CUDARTAPI cudaGetErrorName(cudaError_t error) { return error_text(error).name; }

const char *CUDARTAPI cudaGetErrorString(cudaError_t error) { return error_text(error).text; }

/* ---- devices */

cudaError_t CUDARTAPI cudaGetDeviceCount(int *count) {
    if (!count) return fail(cudaErrorInvalidValue);
    *count = state().devices;
    return *count ? cudaSuccess : fail(cudaErrorNoDevice);
}

cudaError_t CUDARTAPI cudaSetDevice(int device) {
    if (no_device()) return fail(cudaErrorNoDevice);
    if (!valid_device(device)) return fail(cudaErrorInvalidDevice);
    mssim::t_device = device;
    return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetDevice(int *device) {
    if (!device) return fail(cudaErrorInvalidValue);
    if (no_device()) return fail(cudaErrorNoDevice);
    *device = mssim::t_device;
    return cudaSuccess;
}

/* An H100-like device, for the attributes anyone is likely to ask for. */
cudaError_t CUDARTAPI cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
    if (!value) return fail(cudaErrorInvalidValue);
    if (no_device()) return fail(cudaErrorNoDevice);
    if (!valid_device(device)) return fail(cudaErrorInvalidDevice);
    switch (attr) {
    case cudaDevAttrMemoryPoolsSupported: *value = state().pools; break;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxBlockDimX: *value = 1024; break;
    case cudaDevAttrMaxBlockDimY: *value = 1024; break;
    case cudaDevAttrMaxBlockDimZ: *value = 64; break;
    case cudaDevAttrMaxGridDimX: *value = 0x7fffffff; break;
    case cudaDevAttrMaxGridDimY: *value = 65535; break;
    case cudaDevAttrMaxGridDimZ: *value = 65535; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 << 10; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrUnifiedAddressing: *value = 1; break;
    case cudaDevAttrCanMapHostMemory: *value = 1; break;
    case cudaDevAttrIntegrated: *value = 0; break;
    case cudaDevAttrManagedMemory: *value = 0; break; /* not simulated */
    case cudaDevAttrConcurrentKernels: *value = 1; break;
    case cudaDevAttrAsyncEngineCount: *value = 3; break;
    case cudaDevAttrL2CacheSize: *value = 50 << 20; break;
    case cudaDevAttrTotalConstantMemory: *value = 64 << 10; break;
    case cudaDevAttrPciBusId: *value = device + 1; break;
    case cudaDevAttrPciDeviceId: *value = 0; break;
    default: return fail(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

cudaError_t CUDARTAPI cudaDeviceGetDefaultMemPool(cudaMemPool_t *memPool, int device) {
    if (!memPool) return fail(cudaErrorInvalidValue);
    if (no_device()) return fail(cudaErrorNoDevice);
    if (!valid_device(device)) return fail(cudaErrorInvalidDevice);
    if (!state().pools) return fail(cudaErrorNotSupported);
    *memPool = (cudaMemPool_t)&state().pool_handles[(size_t)device];
    return cudaSuccess;
}

/* The pool's attributes are accepted and have no effect: the simulated pool hands what is
 * freed back at once. */
cudaError_t CUDARTAPI cudaMemPoolSetAttribute(cudaMemPool_t memPool, enum cudaMemPoolAttr attr, void *value) {
    State &st = state();
    const char *p = (const char *)memPool;
    if (!value || !st.pools || p < st.pool_handles.data() || p >= st.pool_handles.data() + st.devices)
        return fail(cudaErrorInvalidValue);
    switch (attr) {
    case cudaMemPoolAttrReleaseThreshold:
    case cudaMemPoolReuseFollowEventDependencies:
    case cudaMemPoolReuseAllowOpportunistic:
    case cudaMemPoolReuseAllowInternalDependencies: return cudaSuccess;
    default: return fail(cudaErrorInvalidValue);
    }
}

cudaError_t CUDARTAPI cudaDeviceSynchronize(void) {
    if (no_device()) return fail(cudaErrorNoDevice);
    run_device(mssim::t_device);
    return cudaSuccess;
}

/* ---- memory */

cudaError_t CUDARTAPI cudaMalloc(void **devPtr, size_t size) {
    if (no_device()) return fail(cudaErrorNoDevice);
    return device_alloc(devPtr, size, mssim::t_device);
}

/* As the runtime: the device is synchronized first (every stream of the allocation's
 * device runs), so nothing enqueued can still use the memory. */
cudaError_t CUDARTAPI cudaFree(void *devPtr) {
    if (!devPtr) return cudaSuccess;
    int device;
    if (begin_free(devPtr, &device) != cudaSuccess) return fail(cudaErrorInvalidValue);
    run_device(device);
    end_free(devPtr);
    return cudaSuccess;
}

/* From the stream's device's pool, usable at once (the simulated pool has no stream-ordered
 * reuse to wait for). */
cudaError_t CUDARTAPI cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream) {
    if (no_device()) return fail(cudaErrorNoDevice);
    if (!state().pools) return fail(cudaErrorNotSupported);
    std::shared_ptr<Stream> s = resolve(hStream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    return device_alloc(devPtr, size, s->device);
}

/* The free is an operation of the stream: it happens when the stream runs it (after what
 * was enqueued before); calls after this one may no longer use the memory. */
cudaError_t CUDARTAPI cudaFreeAsync(void *devPtr, cudaStream_t hStream) {
    if (no_device()) return fail(cudaErrorNoDevice);
    if (!state().pools) return fail(cudaErrorNotSupported);
    std::shared_ptr<Stream> s = resolve(hStream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    if (!devPtr) return cudaSuccess;
    int device;
    if (begin_free(devPtr, &device) != cudaSuccess) return fail(cudaErrorInvalidValue);
    s->push([devPtr] { end_free(devPtr); });
    return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMallocHost(void **ptr, size_t size) {
    if (!ptr) return fail(cudaErrorInvalidValue);
    if (no_device()) return fail(cudaErrorNoDevice);
    *ptr = nullptr;
    if (size == 0) return cudaSuccess;
    const size_t rounded = (size + 255) / 256 * 256;
    if (rounded < size) return fail(cudaErrorMemoryAllocation);
    void *p = aligned_alloc(256, rounded);
    if (!p) return fail(cudaErrorMemoryAllocation);
    State &st = state();
    std::lock_guard<std::mutex> lk(st.mem_lock);
    st.pinned[(uintptr_t)p] = size;
    *ptr = p;
    return cudaSuccess;
}

/* Synchronizes every device first, as the runtime does: a copy enqueued into or out of the
 * memory has run when it goes. */
cudaError_t CUDARTAPI cudaFreeHost(void *ptr) {
    if (!ptr) return cudaSuccess;
    State &st = state();
    {
        std::lock_guard<std::mutex> lk(st.mem_lock);
        if (st.pinned.find((uintptr_t)ptr) == st.pinned.end()) return fail(cudaErrorInvalidValue);
    }
    run_device(-1);
    {
        std::lock_guard<std::mutex> lk(st.mem_lock);
        if (!st.pinned.erase((uintptr_t)ptr)) return fail(cudaErrorInvalidValue); /* freed meanwhile */
    }
    free(ptr);
    return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
    return copy(dst, src, count, kind, cudaStreamPerThread, true);
}

cudaError_t CUDARTAPI cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                                      cudaStream_t stream) {
    return copy(dst, src, count, kind, stream, false);
}

cudaError_t CUDARTAPI cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream) {
    return set(devPtr, value, count, stream, false);
}

cudaError_t CUDARTAPI cudaMemset(void *devPtr, int value, size_t count) {
    return set(devPtr, value, count, cudaStreamPerThread, true);
}

cudaError_t CUDARTAPI cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr) {
    if (!attributes) return fail(cudaErrorInvalidValue);
    memset(attributes, 0, sizeof *attributes);
    Where w;
    if (!where(ptr, 0, &w)) {
        if (tagged(ptr)) return fail(cudaErrorInvalidValue); /* freed, or never device memory */
        attributes->type = cudaMemoryTypeUnregistered, attributes->device = -2;
        return cudaSuccess;
    }
    switch (w.kind) {
    case Mem::device:
        attributes->type = cudaMemoryTypeDevice, attributes->device = w.device;
        attributes->devicePointer = (void *)ptr;
        break;
    case Mem::pinned:
        attributes->type = cudaMemoryTypeHost, attributes->device = 0;
        attributes->devicePointer = attributes->hostPointer = (void *)ptr;
        break;
    case Mem::pageable: attributes->type = cudaMemoryTypeUnregistered, attributes->device = -2; break;
    }
    return cudaSuccess;
}

/* ---- streams */

cudaError_t CUDARTAPI cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags) {
    if (!pStream || (flags & ~(unsigned)cudaStreamNonBlocking)) return fail(cudaErrorInvalidValue);
    if (no_device()) return fail(cudaErrorNoDevice);
    auto s = std::make_shared<Stream>(mssim::t_device, flags, false);
    State &st = state();
    std::lock_guard<std::mutex> lk(st.obj_lock);
    st.streams[s.get()] = s;
    *pStream = (cudaStream_t)s.get();
    return cudaSuccess;
}

cudaError_t CUDARTAPI cudaStreamCreate(cudaStream_t *pStream) {
    return cudaStreamCreateWithFlags(pStream, cudaStreamDefault);
}

/* Runs what the stream holds, then the handle goes (an event recorded on it keeps what it
 * needs). */
cudaError_t CUDARTAPI cudaStreamDestroy(cudaStream_t stream) {
    if (is_default(stream)) return fail(cudaErrorInvalidResourceHandle);
    std::shared_ptr<Stream> s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    s->run_all();
    State &st = state();
    std::lock_guard<std::mutex> lk(st.obj_lock);
    st.streams.erase(s.get());
    return cudaSuccess;
}

cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t stream) {
    if (no_device()) return fail(cudaErrorNoDevice);
    std::shared_ptr<Stream> s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    s->run_all();
    return cudaSuccess;
}

/* cudaErrorNotReady the first time it is asked while work is pending; from the next time
 * on the stream runs (try_until) and the answer is cudaSuccess once it got through,
 * cudaErrorNotReady while a gated operation holds it up (tried once a query). */
cudaError_t CUDARTAPI cudaStreamQuery(cudaStream_t stream) {
    if (no_device()) return fail(cudaErrorNoDevice);
    std::shared_ptr<Stream> s = resolve(stream);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    uint64_t target;
    {
        std::lock_guard<std::mutex> lk(s->m);
        if (s->completed == s->enqueued) return cudaSuccess;
        if (!s->asked) {
            s->asked = true;
            return cudaErrorNotReady;
        }
        target = s->enqueued;
    }
    if (!s->try_until(target)) return cudaErrorNotReady;
    std::lock_guard<std::mutex> lk(s->m);
    s->asked = false;
    return cudaSuccess;
}

/* The stream's later work waits for the event's last record: an operation that runs the
 * recorded stream up to the marker.  An event never recorded: nothing to wait for. */
cudaError_t CUDARTAPI cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    if (no_device()) return fail(cudaErrorNoDevice);
    if (flags & ~(unsigned)cudaEventWaitExternal) return fail(cudaErrorInvalidValue);
    std::shared_ptr<Stream> s = resolve(stream);
    std::shared_ptr<Event> ev = find_event(event);
    if (!s || !ev) return fail(cudaErrorInvalidResourceHandle);
    std::shared_ptr<Stream> on;
    uint64_t target;
    {
        std::lock_guard<std::mutex> lk(ev->m);
        on = ev->stream, target = ev->target;
    }
    /* gated, so that a query of s never blocks on the other stream's gated operations */
    if (on && on != s) s->push(StreamOp{nullptr, [on, target] { return on->try_until(target); }});
    return cudaSuccess;
}

/* ---- events */

cudaError_t CUDARTAPI cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
    const unsigned known = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
    if (!event || (flags & ~known) || ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming)))
        return fail(cudaErrorInvalidValue);
    if (no_device()) return fail(cudaErrorNoDevice);
    auto e = std::make_shared<Event>(mssim::t_device, flags);
    State &st = state();
    std::lock_guard<std::mutex> lk(st.obj_lock);
    st.events[e.get()] = e;
    *event = (cudaEvent_t)e.get();
    return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

/* A marker at the stream's end: the event completes when the stream has run up to it. */
cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    if (no_device()) return fail(cudaErrorNoDevice);
    std::shared_ptr<Event> ev = find_event(event);
    std::shared_ptr<Stream> s = resolve(stream);
    if (!ev || !s || ev->device != s->device) return fail(cudaErrorInvalidResourceHandle);
    std::lock_guard<std::mutex> lk(ev->m);
    ev->target = s->push([] {});
    ev->stream = s;
    ev->asked = false;
    return cudaSuccess;
}

/* cudaErrorNotReady the first time it is asked about a record whose marker has not run; from
 * the next time on the stream runs towards the marker (try_until): cudaSuccess once it got
 * there, cudaErrorNotReady while a gated operation before the marker holds it up (tried
 * once a query), as a GPU still spinning in a collective would answer. */
cudaError_t CUDARTAPI cudaEventQuery(cudaEvent_t event) {
    std::shared_ptr<Event> ev = find_event(event);
    if (!ev) return fail(cudaErrorInvalidResourceHandle);
    std::shared_ptr<Stream> s;
    uint64_t target;
    {
        std::lock_guard<std::mutex> lk(ev->m);
        if (!ev->stream || ev->stream->reached(ev->target)) return cudaSuccess;
        if (!ev->asked) {
            ev->asked = true;
            return cudaErrorNotReady;
        }
        s = ev->stream, target = ev->target;
    }
    return s->try_until(target) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t CUDARTAPI cudaEventSynchronize(cudaEvent_t event) {
    std::shared_ptr<Event> ev = find_event(event);
    if (!ev) return fail(cudaErrorInvalidResourceHandle);
    std::shared_ptr<Stream> s;
    uint64_t target;
    {
        std::lock_guard<std::mutex> lk(ev->m);
        s = ev->stream, target = ev->target;
    }
    if (s) s->run_until(target);
    return cudaSuccess;
}

/* The handle goes at once; waits already enqueued on it still wait (they hold the stream and
 * the marker, not the event). */
cudaError_t CUDARTAPI cudaEventDestroy(cudaEvent_t event) {
    State &st = state();
    std::lock_guard<std::mutex> lk(st.obj_lock);
    if (!st.events.erase(event)) return fail(cudaErrorInvalidResourceHandle);
    return cudaSuccess;
}

/* ---------------------------------------------------------------- faults */

#if !defined(MSSIM_ASAN) && !defined(MSSIM_TSAN)
#include <signal.h>

namespace mssim {
namespace {

/* A host access to device memory (a tagged, non-canonical address) is a general protection
 * fault, which Linux reports as SIGSEGV with no address: say what it most likely was, then
 * die of the signal as before.  (The sanitizers have handlers of their own.) */
void on_segv(int sig) {
    static const char msg[] = "mssim (simulated CUDA device): segmentation fault; under the simulated device "
                              "that is most often host code dereferencing a device pointer (device memory is "
                              "host memory + 2^62, which the host cannot address)\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    signal(sig, SIG_DFL);
    raise(sig);
}

struct SegvHint {
    SegvHint() {
        struct sigaction old;
        /* leave a handler the program installed itself alone */
        if (sigaction(SIGSEGV, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) signal(SIGSEGV, on_segv);
    }
} segv_hint;

} // namespace
} // namespace mssim
#endif
