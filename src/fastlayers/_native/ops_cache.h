// A cache of large CPU memory blocks for the tensors the recurrent layers make on every call and
// hand on (their outputs, the input gradients, the packed input rows autograd keeps), behind the
// operators fastlayers::cached_empty / cache_release / cache_info / cache_limit.
//
// Why: torch's CPU allocator returns a large block to the system when its tensor dies (glibc maps
// every block of 32 MiB or more on its own), so the next call's tensor of that size is fresh memory
// whose first touch costs a page fault per 4 KiB page, zeroed by the kernel. At the seed shape
// (bidirectional LayerNorm LSTM 512 -> 256, T = 800, B = 32, fwd+bwd) the engine made about 420 MB
// of such tensors per call: 1.567 s a call, 1.418 s with this cache (AMD Zen 4,
// benchmarks/rnn/probe_page_faults.py, issue 62). A block whose tensor dies comes back here
// instead, idle, and the next request it fits reuses it (mapped already).
//
// Policy: a new block has the size asked for rounded up to 2 MiB (no more: the profiler counts the
// whole block: headroom of 1/8 showed as 3 % more peak memory in bench_gru_engine.py); a request
// takes the smallest idle block of at least its size and at most 1.5 times it (a batch of another T
// reuses the blocks of a longer one), or the size a new block for it would have. Idle blocks are
// kept up to the limit (FASTLAYERS_CPU_CACHE_MB MiB, read once, default 1024; cache_limit sets it),
// the smallest leaving first; a block larger than the limit is freed when its tensor dies (limit 0:
// the cache keeps nothing); cache_release frees every idle block. Memory comes from c10::alloc_cpu
// (torch's own alignment and huge-page settings). The tensors are ordinary CPU tensors (resizable:
// a resize takes its new block from here too). Thread-safe: a tensor may die on any thread. The
// torch profiler's memory records see a block as allocated while a tensor uses it and as freed when
// it comes back (as torch's CPU allocator reports its blocks), so peak-memory figures stay true.
//
// Included once, by ops.cpp.

#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace fl_cache {

struct State {
  std::mutex lock;
  std::multimap<size_t, void*> idle;         // blocks no tensor uses, by size
  std::unordered_map<void*, size_t> size;    // every block, in use or idle
  size_t idle_bytes = 0, used_bytes = 0;
  size_t limit = limit_from_environment();
  int64_t hits = 0, misses = 0;

  static size_t limit_from_environment() {
    const char* raw = std::getenv("FASTLAYERS_CPU_CACHE_MB");
    constexpr size_t fallback = size_t(1024) << 20;
    if (raw == nullptr) return fallback;
    // digits between optional white space, as the Python side reads it (pool.py: strip, isdigit);
    // another value: the default (the Python side warns about it; no warning from here, where a
    // call through torch.ops would only log it)
    while (std::isspace(static_cast<unsigned char>(*raw))) raw++;
    const char* digits = raw;
    size_t mb = 0;
    for (; std::isdigit(static_cast<unsigned char>(*raw)); raw++)
      mb = std::min<size_t>(mb * 10 + size_t(*raw - '0'), size_t(1) << 40);  // (saturates: no overflow)
    const bool whole = raw != digits;
    while (std::isspace(static_cast<unsigned char>(*raw))) raw++;
    return !whole || *raw != '\0' ? fallback : mb << 20;
  }
};

// Never destroyed: a tensor may die while the process exits, after static destructors ran.
inline State& state() {
  static State* s = new State();
  return *s;
}

constexpr size_t kGrain = size_t(2) << 20;  // new blocks: whole 2 MiB

// The size of a new block for a request of n bytes.
inline size_t grown(size_t n) { return (n + kGrain - 1) / kGrain * kGrain; }

// Frees `blocks` (outside the lock).
inline void free_all(const std::vector<void*>& blocks) {
  for (void* p : blocks) c10::free_cpu(p);
}

// Idle blocks leave, smallest first, until `room` more bytes fit under the limit. Lock held.
inline void make_room(State& s, size_t room, std::vector<void*>& out) {
  while (!s.idle.empty() && s.idle_bytes + room > s.limit) {
    auto it = s.idle.begin();
    s.idle_bytes -= it->first;
    s.size.erase(it->second);
    out.push_back(it->second);
    s.idle.erase(it);
  }
}

// What the torch profiler records (only while it records memory).
inline void report(void* p, int64_t delta, size_t used) {
  if (c10::memoryProfilingEnabled())
    c10::reportMemoryUsageToProfiler(p, delta, used, used, c10::Device(c10::DeviceType::CPU));
}

inline void give_back(void* p) {
  if (p == nullptr) return;
  State& s = state();
  std::vector<void*> leaving;
  size_t n, used;
  {
    std::lock_guard<std::mutex> guard(s.lock);
    n = s.size.at(p);
    s.used_bytes -= n;
    used = s.used_bytes;
    if (n > s.limit) {
      s.size.erase(p);
      leaving.push_back(p);
    } else {
      make_room(s, n, leaving);
      s.idle.emplace(n, p);
      s.idle_bytes += n;
    }
  }
  report(p, -int64_t(n), used);
  free_all(leaving);
}

inline void* take(size_t n) {
  if (n == 0) return nullptr;
  State& s = state();
  void* p = nullptr;
  size_t got = 0, used = 0;
  {
    std::lock_guard<std::mutex> guard(s.lock);
    auto it = s.idle.lower_bound(n);
    if (it != s.idle.end() && it->first <= std::max(n + n / 2, grown(n))) {
      p = it->second;
      got = it->first;
      s.idle_bytes -= got;
      s.used_bytes += got;
      used = s.used_bytes;
      s.idle.erase(it);
      s.hits++;
    } else {
      s.misses++;
    }
  }
  if (p == nullptr) {
    got = grown(n);
    p = c10::alloc_cpu(got);  // raises c10::Error when out of memory, as torch.empty does
    std::lock_guard<std::mutex> guard(s.lock);
    s.size.emplace(p, got);
    s.used_bytes += got;
    used = s.used_bytes;
  }
  report(p, int64_t(got), used);
  return p;
}

struct Allocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = take(n);
    return {p, p, &give_back, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &give_back; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

inline Allocator* allocator() {
  static Allocator* a = new Allocator();
  return a;
}

}  // namespace fl_cache

namespace {

// An uninitialised contiguous CPU tensor whose memory comes from the cache (torch.empty's contract:
// filled with NaN, 0 for integers, under torch.utils.deterministic.fill_uninitialized_memory with
// deterministic algorithms on, so the poisoned test pass sees reads of unwritten memory).
at::Tensor cached_empty(at::IntArrayRef size, at::ScalarType dtype) {
  auto out = at::detail::empty_generic(size, fl_cache::allocator(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                       dtype, std::nullopt);
  auto& ctx = at::globalContext();
  if (ctx.deterministicFillUninitializedMemory() && ctx.deterministicAlgorithms())
    out.fill_(out.is_floating_point() ? std::numeric_limits<double>::quiet_NaN() : 0);
  return out;
}

// at::empty(size, opt) for an operator's per-call output: from the cache for CPU tensors of at least
// 1 MiB (smaller blocks malloc keeps mapped itself; fastlayers/_core/pool.py CACHE_MIN_BYTES).
at::Tensor output_empty(at::IntArrayRef size, const at::TensorOptions& opt) {
  int64_t numel = 1;
  for (int64_t d : size) numel *= d;
  if (opt.device().type() != c10::DeviceType::CPU || numel * int64_t(opt.dtype().itemsize()) < (int64_t(1) << 20))
    return at::empty(size, opt);
  return cached_empty(size, c10::typeMetaToScalarType(opt.dtype()));
}

// Frees every idle block (tensors in use keep theirs; they come back later).
void cache_release() {
  auto& s = fl_cache::state();
  std::vector<void*> leaving;
  {
    std::lock_guard<std::mutex> guard(s.lock);
    for (auto& kv : s.idle) {
      s.size.erase(kv.second);
      leaving.push_back(kv.second);
    }
    s.idle.clear();
    s.idle_bytes = 0;
  }
  fl_cache::free_all(leaving);
}

// (idle bytes, bytes of blocks in use, requests served by an idle block, requests that allocated, the limit)
std::vector<int64_t> cache_info() {
  auto& s = fl_cache::state();
  std::lock_guard<std::mutex> guard(s.lock);
  return {int64_t(s.idle_bytes), int64_t(s.used_bytes), s.hits, s.misses, int64_t(s.limit)};
}

// Sets the limit on idle bytes (0: keep none; idle blocks over it leave now).
void cache_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "cache_limit: expected a number of bytes >= 0, got ", bytes);
  auto& s = fl_cache::state();
  std::vector<void*> leaving;
  {
    std::lock_guard<std::mutex> guard(s.lock);
    s.limit = size_t(bytes);
    fl_cache::make_room(s, 0, leaving);
  }
  fl_cache::free_all(leaving);
}

}  // namespace
