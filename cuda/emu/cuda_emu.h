// Emulation of the CUDA device model for a host C++ compiler, so the kernels in cuda/*.cu
// can run (and be tested) on a machine without a GPU.
//
// The model, and why it is faithful enough for the kernels in this project:
// - Every thread of a block is a real std::thread, and the threads of a block run
//   concurrently, so a missing barrier is a real race. The blocks of a launch run in an
//   order shuffled from a seed, several at a time on their own threads (see runtime.cpp),
//   so a kernel whose blocks depend on one another's order is a real race too.
// - __syncthreads() is a barrier over the block's threads that have not returned (the
//   sm_70+ rule: exited threads no longer count), so an early `return` never deadlocks.
// - Shared memory is per block: SD_EMU_SHARED hands every thread of a block the same
//   buffer, filled with 0xFF bytes (NaN for floats) when the block starts, so a read
//   before a write shows up as a wrong result rather than as a stale value that happens
//   to be right. A plain __shared__ does not compile here.
// - Warp shuffles go through a per-warp exchange (32 slots and a barrier over the lanes of
//   the warp). Only the full mask is modelled; a shuffle that reads a lane that is absent
//   or has returned is reported as a launch error.
// - blockIdx/threadIdx/blockDim/gridDim are thread-locals set before the kernel body runs.
// Anything outside this model (atomics, dynamic shared memory, cooperative groups) is
// deliberately missing, so a kernel that needs it fails to compile here.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ SD_EMU_use_SD_SHARED_for_shared_memory

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

// bfloat16 as its 16 bits; conversions round to nearest even, as CUDA's do.
struct __nv_bfloat16 {
    uint16_t bits;
};

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(unsigned(h.bits) << 16); }

inline __nv_bfloat16 __float2bfloat16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{uint16_t((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{uint16_t(u >> 16)};
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
#include <math.h>  // ldexpf, expf, sinf, ... in the global namespace, as in CUDA
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

namespace sd_emu {

// Implemented in runtime.cpp.
void syncthreads();
void syncwarp();
void* shared_buffer(const void* key, size_t bytes);
uint64_t shuffle(uint64_t value, int src_lane, bool src_in_range);
unsigned lane_id();
void report(const char* message);

template <typename T>
T shfl_impl(T v, int src_lane, bool in_range) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a wide type");
    uint64_t raw = 0;
    std::memcpy(&raw, &v, sizeof(T));
    raw = shuffle(raw, src_lane, in_range);
    T out;
    std::memcpy(&out, &raw, sizeof(T));
    return out;
}

inline void check_mask(unsigned mask) {
    if (mask != 0xffffffffu) report("warp shuffle with a partial mask (not modelled)");
}

// The type code of one kernel parameter; the launcher checks the caller's codes against
// these, so an argument list that drifts from the kernel's signature is an error.
template <typename T>
constexpr char param_code() {
    if (std::is_pointer<T>::value) return 'p';
    if (std::is_same<T, int>::value) return 'i';
    if (std::is_same<T, unsigned>::value) return 'u';
    if (std::is_same<T, float>::value) return 'f';
    return '?';
}

using Invoker = void (*)(void* fn, void** params);

template <typename... A, size_t... I>
void invoke_with(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_reference<A>::type*>(params[I])...);
}

template <typename... A>
void invoke(void* fn, void** params) {
    invoke_with(reinterpret_cast<void (*)(A...)>(fn), params, std::index_sequence_for<A...>{});
}

void register_kernel(const char* name, void* fn, Invoker invoker, const char* signature);

template <typename... A>
struct Registrar {
    static constexpr char signature[sizeof...(A) + 1] = {param_code<A>()..., '\0'};
    Registrar(const char* name, void (*f)(A...)) {
        register_kernel(name, reinterpret_cast<void*>(f), &invoke<A...>, signature);
    }
};

}  // namespace sd_emu

inline void __syncthreads() { sd_emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    sd_emu::check_mask(mask);
    sd_emu::syncwarp();
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    sd_emu::check_mask(mask);
    return sd_emu::shfl_impl(v, int(sd_emu::lane_id() ^ unsigned(lane_mask)), true);
}

template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
    sd_emu::check_mask(mask);
    const unsigned src = sd_emu::lane_id() + delta;
    return sd_emu::shfl_impl(v, int(src), src < 32);
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane) {
    sd_emu::check_mask(mask);
    return sd_emu::shfl_impl(v, src_lane & 31, true);
}

// The address of a function-local static is unique per declaration site, so it names the
// buffer; every thread of the block gets the same one.
#define SD_EMU_SHARED(type, name, count)                                                  \
    static const char sd_emu_key_##name = 0;                                              \
    type* name = static_cast<type*>(sd_emu::shared_buffer(&sd_emu_key_##name, sizeof(type) * (count)))

#define SD_EMU_REGISTER(name) static sd_emu::Registrar sd_emu_registrar_##name(#name, &name);
