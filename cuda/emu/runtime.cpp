// The emulated launcher: runs a registered kernel over a grid with real threads per block
// (see cuda_emu.h for the model), and exposes `sd_emu_launch` to Rust.
//
// Invariants:
// - A launch owns all of its state (block groups, barriers, warp exchanges, shared
//   buffers), so any number of launches may run concurrently from different host threads.
// - The blocks of a launch are taken from one queue, in launch order or shuffled by a seed,
//   by `concurrent` groups of threads that each run one block at a time: up to that many
//   blocks are in flight at once, in an order no kernel may depend on (as on a GPU). A
//   group's threads wait at a full barrier between its blocks, while its first thread takes
//   the next block, drops the shared buffers and re-arms the barriers.
// - Nothing here throws across the C boundary: errors come back as a status and message.
#include "cuda_emu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace sd_emu {
namespace {

// A barrier over a changing set of participants: `leave` removes one for good (a thread
// that returned from the kernel), releasing the others if they were only waiting for it.
class Barrier {
   public:
    void arm(unsigned participants) {
        std::lock_guard<std::mutex> lock(mutex_);
        expected_ = participants;
        arrived_ = 0;
    }

    void arrive_and_wait() {
        std::unique_lock<std::mutex> lock(mutex_);
        const uint64_t generation = generation_;
        if (++arrived_ >= expected_) {
            release();
        } else {
            cv_.wait(lock, [&] { return generation_ != generation; });
        }
    }

    void leave() {
        std::lock_guard<std::mutex> lock(mutex_);
        if (expected_ > 0) --expected_;
        if (arrived_ > 0 && arrived_ >= expected_) release();
    }

   private:
    void release() {
        arrived_ = 0;
        ++generation_;
        cv_.notify_all();
    }

    std::mutex mutex_;
    std::condition_variable cv_;
    unsigned expected_ = 0;
    unsigned arrived_ = 0;
    uint64_t generation_ = 0;
};

struct Warp {
    Barrier barrier;
    uint64_t slots[32] = {};
    std::atomic<bool> active[32] = {};
};

struct KernelEntry {
    void* fn;
    Invoker invoker;
    const char* signature;
};

std::map<std::string, KernelEntry>& registry() {
    static std::map<std::string, KernelEntry> kernels;
    return kernels;
}

constexpr unsigned FAULT_NO_BARRIERS = 1;
constexpr unsigned FAULT_DROP_LAST_THREAD = 2;

// What every group of a launch shares: the kernel, its arguments, the block queue and the
// first error.
struct Launch {
    const KernelEntry* kernel = nullptr;
    void** params = nullptr;
    dim3 grid, block;
    unsigned faults = 0;

    std::vector<unsigned long long> order;  // block numbers, in the order they are taken
    std::atomic<size_t> next{0};

    std::mutex error_mutex;
    std::string error;

    void fail(const char* message) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (error.empty()) error = message;
    }

    // The next block to run; false when the queue is empty.
    bool take(unsigned long long* n) {
        const size_t i = next.fetch_add(1);
        if (i >= order.size()) return false;
        *n = order[i];
        return true;
    }
};

// One block in flight: the threads that run it and the per-block state they share.
struct Group {
    Launch* launch = nullptr;
    unsigned threads = 0;  // threads that actually run per block

    Barrier block_barrier;   // __syncthreads
    Barrier between_blocks;  // all threads of the group, between blocks
    std::vector<std::unique_ptr<Warp>> warps;

    std::mutex shared_mutex;
    std::map<const void*, std::vector<unsigned char>> shared;

    // Serialises the threads of a block in FAULT_NO_BARRIERS mode.
    std::mutex turn_mutex;
    std::condition_variable turn_cv;
    unsigned turn = 0;

    // Set by thread 0 between blocks, read by the others after the barrier.
    unsigned long long block = 0;
    bool done = false;

    void arm_block() {
        block_barrier.arm(threads);
        for (unsigned w = 0; w < warps.size(); ++w) {
            const unsigned first = w * 32;
            const unsigned lanes = std::min(32u, threads - first);
            warps[w]->barrier.arm(lanes);
            for (unsigned l = 0; l < 32; ++l) warps[w]->active[l] = l < lanes;
        }
        shared.clear();
        turn = 0;
    }
};

thread_local Group* current = nullptr;
thread_local unsigned linear_tid = 0;

void run_thread(Group* group, unsigned tid) {
    current = group;
    linear_tid = tid;
    Launch& launch = *group->launch;
    const dim3 b = launch.block, g = launch.grid;
    threadIdx = dim3(tid % b.x, (tid / b.x) % b.y, tid / (b.x * b.y));
    blockDim = b;
    gridDim = g;
    Warp& warp = *group->warps[tid / 32];
    const bool serial = launch.faults & FAULT_NO_BARRIERS;
    for (;;) {
        if (tid == 0) {
            group->done = !launch.take(&group->block);
            group->arm_block();
        }
        group->between_blocks.arrive_and_wait();
        if (group->done) break;
        const unsigned long long n = group->block;
        blockIdx = dim3(unsigned(n % g.x), unsigned((n / g.x) % g.y), unsigned(n / (1ull * g.x * g.y)));
        if (serial) {
            std::unique_lock<std::mutex> lock(group->turn_mutex);
            group->turn_cv.wait(lock, [&] { return group->turn == tid; });
        }
        launch.kernel->invoker(launch.kernel->fn, launch.params);
        if (serial) {
            std::lock_guard<std::mutex> lock(group->turn_mutex);
            ++group->turn;
            group->turn_cv.notify_all();
        }
        warp.active[tid % 32] = false;
        warp.barrier.leave();
        group->block_barrier.leave();
        // Every thread is out of the block before thread 0 re-arms for the next one.
        group->between_blocks.arrive_and_wait();
    }
    current = nullptr;
}

// splitmix64: a small, well-spread generator for the block order.
uint64_t mix(uint64_t& state) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Block numbers 0..blocks-1, shuffled (Fisher-Yates) unless `seed` is 0.
std::vector<unsigned long long> block_order(unsigned long long blocks, uint64_t seed) {
    std::vector<unsigned long long> order(blocks);
    std::iota(order.begin(), order.end(), 0ull);
    if (seed != 0) {
        uint64_t state = seed;
        for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[mix(state) % i]);
    }
    return order;
}

}  // namespace

void register_kernel(const char* name, void* fn, Invoker invoker, const char* signature) {
    registry()[name] = KernelEntry{fn, invoker, signature};
}

void report(const char* message) {
    if (current) current->launch->fail(message);
}

unsigned lane_id() { return linear_tid % 32; }

void syncthreads() {
    if (!current || (current->launch->faults & FAULT_NO_BARRIERS)) return;
    current->block_barrier.arrive_and_wait();
}

void syncwarp() {
    if (!current || (current->launch->faults & FAULT_NO_BARRIERS)) return;
    current->warps[linear_tid / 32]->barrier.arrive_and_wait();
}

void* shared_buffer(const void* key, size_t bytes) {
    std::lock_guard<std::mutex> lock(current->shared_mutex);
    auto& buffer = current->shared[key];
    if (buffer.empty()) buffer.assign(bytes, 0xff);
    return buffer.data();
}

uint64_t shuffle(uint64_t value, int src_lane, bool src_in_range) {
    Warp& warp = *current->warps[linear_tid / 32];
    const unsigned lane = linear_tid % 32;
    if (current->launch->faults & FAULT_NO_BARRIERS) {
        // No exchange at all: read whatever the source lane left behind.
        warp.slots[lane] = value;
        return src_in_range ? warp.slots[src_lane] : value;
    }
    warp.slots[lane] = value;
    warp.barrier.arrive_and_wait();
    uint64_t out = value;
    if (src_in_range) {
        if (src_lane < 0 || src_lane > 31 || !warp.active[src_lane]) {
            current->launch->fail("warp shuffle reads a lane that is absent or has returned");
        } else {
            out = warp.slots[src_lane];
        }
    }
    warp.barrier.arrive_and_wait();
    return out;
}

}  // namespace sd_emu

// Runs kernel `name` over grid x block with `params` laid out as cuLaunchKernel's
// kernelParams (params[i] points at the value of argument i). `signature` holds one type
// code per argument ('p' pointer, 'i' int, 'u' unsigned, 'f' float) and must equal the
// kernel's. `faults` injects bugs to prove the tests catch them: 1 = no barriers and the
// threads of a block run one at a time; 2 = the last thread of every block never runs.
// `order_seed` 0 takes the blocks in launch order, any other value in an order shuffled
// from it; `concurrent` blocks (at least 1) run at once, each on its own threads.
// Returns 0, or non-zero with a message in `error` (NUL-terminated, truncated to `error_len`).
extern "C" int sd_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz, void** params, const char* signature,
                             unsigned faults, unsigned long long order_seed, unsigned concurrent,
                             char* error, size_t error_len) {
    auto fail = [&](const std::string& message) {
        if (error && error_len > 0) {
            std::strncpy(error, message.c_str(), error_len - 1);
            error[error_len - 1] = '\0';
        }
        return 1;
    };
    try {
        auto found = sd_emu::registry().find(name ? name : "");
        if (found == sd_emu::registry().end()) return fail(std::string("no emulated kernel named ") + (name ? name : "(null)"));
        const sd_emu::KernelEntry& kernel = found->second;
        if (!signature || std::strcmp(signature, kernel.signature) != 0) {
            return fail(std::string(name) + ": arguments (" + (signature ? signature : "") +
                        ") do not match the kernel's parameters (" + kernel.signature + ")");
        }
        const unsigned long long threads = 1ull * bx * by * bz;
        if (gx == 0 || gy == 0 || gz == 0 || threads == 0 || threads > 1024) {
            return fail(std::string(name) + ": invalid launch shape");
        }
        sd_emu::Launch launch;
        launch.kernel = &kernel;
        launch.params = params;
        launch.grid = dim3(gx, gy, gz);
        launch.block = dim3(bx, by, bz);
        launch.faults = faults;
        const unsigned long long blocks = 1ull * gx * gy * gz;
        launch.order = sd_emu::block_order(blocks, order_seed);
        unsigned per_block = unsigned(threads);
        if ((faults & sd_emu::FAULT_DROP_LAST_THREAD) && per_block > 1) --per_block;
        const unsigned groups = unsigned(std::min<unsigned long long>(std::max(concurrent, 1u), blocks));
        std::vector<std::unique_ptr<sd_emu::Group>> group_list;
        for (unsigned i = 0; i < groups; ++i) {
            auto group = std::make_unique<sd_emu::Group>();
            group->launch = &launch;
            group->threads = per_block;
            for (unsigned w = 0; w * 32 < per_block; ++w) group->warps.emplace_back(new sd_emu::Warp());
            group->between_blocks.arm(per_block);
            group->arm_block();
            group_list.push_back(std::move(group));
        }
        std::vector<std::thread> workers;
        workers.reserve(size_t(groups) * per_block);
        for (auto& group : group_list) {
            for (unsigned t = 0; t < per_block; ++t) workers.emplace_back(sd_emu::run_thread, group.get(), t);
        }
        for (auto& w : workers) w.join();
        if (!launch.error.empty()) return fail(std::string(name) + ": " + launch.error);
        return 0;
    } catch (const std::exception& e) {
        return fail(std::string("emulated launch failed: ") + e.what());
    } catch (...) {
        return fail("emulated launch failed");
    }
}

// The emulator's own test kernels (not part of cuda/, never in the GPU build): launched by
// the unit tests of `EmuBackend` to show that a kernel whose blocks depend on each other's
// order is caught.

// A planted inter-block race: block b adds in[b] to what block b - 1 wrote to out, with no
// grid-wide synchronisation between them. It computes the prefix sums only when the blocks
// run one after another in launch order.
extern "C" __global__ void sd_emu_selftest_chained(const float* in, float* out, int n) {
    const int b = int(blockIdx.x);
    if (threadIdx.x == 0 && b < n) out[b] = (b > 0 ? out[b - 1] : 0.0f) + in[b];
}
SD_EMU_REGISTER(sd_emu_selftest_chained)

// The same prefix sums without the race: each block sums its own prefix of the input.
extern "C" __global__ void sd_emu_selftest_independent(const float* in, float* out, int n) {
    const int b = int(blockIdx.x);
    if (threadIdx.x != 0 || b >= n) return;
    float s = 0.0f;
    for (int i = 0; i <= b; ++i) s += in[i];
    out[b] = s;
}
SD_EMU_REGISTER(sd_emu_selftest_independent)

// Whether blocks run at the same time: each block marks itself in flight, waits (up to
// 0.2 s) to see another block in flight, records whether it did, and unmarks itself.
extern "C" __global__ void sd_emu_selftest_overlap(float* in_flight, float* saw_other, int n) {
    const int b = int(blockIdx.x);
    if (threadIdx.x != 0 || b >= n) return;
    volatile float* flags = in_flight;
    flags[b] = 1.0f;
    bool seen = false;
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    while (!seen && std::chrono::steady_clock::now() < until) {
        for (int j = 0; j < n; ++j) seen = seen || (j != b && flags[j] == 1.0f);
        std::this_thread::yield();
    }
    saw_other[b] = seen ? 1.0f : 0.0f;
    flags[b] = 0.0f;
}
SD_EMU_REGISTER(sd_emu_selftest_overlap)
