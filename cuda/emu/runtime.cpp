// The emulated launcher: runs a registered kernel over a grid with real threads per block
// (see cuda_emu.h for the model), and exposes `sd_emu_launch` to Rust.
//
// Invariants:
// - A launch owns all of its state (barriers, warp exchanges, shared buffers), so any
//   number of launches may run concurrently from different host threads.
// - Blocks run one after another; between blocks every thread of the launch waits at a
//   full barrier, then shared buffers are dropped and the barriers re-armed.
// - Nothing here throws across the C boundary: errors come back as a status and message.
#include "cuda_emu.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
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

struct Launch {
    const KernelEntry* kernel = nullptr;
    void** params = nullptr;
    dim3 grid, block;
    unsigned threads = 0;  // threads that actually run per block
    unsigned faults = 0;

    Barrier block_barrier;     // __syncthreads
    Barrier between_blocks;    // all threads of the launch, between blocks
    std::vector<std::unique_ptr<Warp>> warps;

    std::mutex shared_mutex;
    std::map<const void*, std::vector<unsigned char>> shared;

    // Serialises the threads of a block in FAULT_NO_BARRIERS mode.
    std::mutex turn_mutex;
    std::condition_variable turn_cv;
    unsigned turn = 0;

    std::mutex error_mutex;
    std::string error;

    void fail(const char* message) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (error.empty()) error = message;
    }

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

thread_local Launch* current = nullptr;
thread_local unsigned linear_tid = 0;

void run_thread(Launch* launch, unsigned tid) {
    current = launch;
    linear_tid = tid;
    const dim3 b = launch->block, g = launch->grid;
    threadIdx = dim3(tid % b.x, (tid / b.x) % b.y, tid / (b.x * b.y));
    blockDim = b;
    gridDim = g;
    const unsigned long long blocks = 1ull * g.x * g.y * g.z;
    Warp& warp = *launch->warps[tid / 32];
    const bool serial = launch->faults & FAULT_NO_BARRIERS;
    for (unsigned long long n = 0; n < blocks; ++n) {
        blockIdx = dim3(unsigned(n % g.x), unsigned((n / g.x) % g.y), unsigned(n / (1ull * g.x * g.y)));
        if (serial) {
            std::unique_lock<std::mutex> lock(launch->turn_mutex);
            launch->turn_cv.wait(lock, [&] { return launch->turn == tid; });
        }
        launch->kernel->invoker(launch->kernel->fn, launch->params);
        if (serial) {
            std::lock_guard<std::mutex> lock(launch->turn_mutex);
            ++launch->turn;
            launch->turn_cv.notify_all();
        }
        warp.active[tid % 32] = false;
        warp.barrier.leave();
        launch->block_barrier.leave();
        launch->between_blocks.arrive_and_wait();
        if (tid == 0) launch->arm_block();
        launch->between_blocks.arrive_and_wait();
    }
    current = nullptr;
}

}  // namespace

void register_kernel(const char* name, void* fn, Invoker invoker, const char* signature) {
    registry()[name] = KernelEntry{fn, invoker, signature};
}

void report(const char* message) {
    if (current) current->fail(message);
}

unsigned lane_id() { return linear_tid % 32; }

void syncthreads() {
    if (!current || (current->faults & FAULT_NO_BARRIERS)) return;
    current->block_barrier.arrive_and_wait();
}

void syncwarp() {
    if (!current || (current->faults & FAULT_NO_BARRIERS)) return;
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
    if (current->faults & FAULT_NO_BARRIERS) {
        // No exchange at all: read whatever the source lane left behind.
        warp.slots[lane] = value;
        return src_in_range ? warp.slots[src_lane] : value;
    }
    warp.slots[lane] = value;
    warp.barrier.arrive_and_wait();
    uint64_t out = value;
    if (src_in_range) {
        if (src_lane < 0 || src_lane > 31 || !warp.active[src_lane]) {
            current->fail("warp shuffle reads a lane that is absent or has returned");
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
// Returns 0, or non-zero with a message in `error` (NUL-terminated, truncated to `error_len`).
extern "C" int sd_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz, void** params, const char* signature,
                             unsigned faults, char* error, size_t error_len) {
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
        launch.threads = unsigned(threads);
        if ((faults & sd_emu::FAULT_DROP_LAST_THREAD) && launch.threads > 1) --launch.threads;
        for (unsigned w = 0; w * 32 < launch.threads; ++w) launch.warps.emplace_back(new sd_emu::Warp());
        launch.between_blocks.arm(launch.threads);
        launch.arm_block();
        std::vector<std::thread> workers;
        workers.reserve(launch.threads);
        for (unsigned t = 0; t < launch.threads; ++t) workers.emplace_back(sd_emu::run_thread, &launch, t);
        for (auto& w : workers) w.join();
        if (!launch.error.empty()) return fail(std::string(name) + ": " + launch.error);
        return 0;
    } catch (const std::exception& e) {
        return fail(std::string("emulated launch failed: ") + e.what());
    } catch (...) {
        return fail("emulated launch failed");
    }
}
