// The emulated GPU's device side (cuda_emu.hpp): a kernel's threads as fibers, their barriers,
// and the checks of a launch's configuration.
#include <sys/mman.h>
#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_emu.hpp"
#include "emu_internal.hpp"

// This file is built without the sanitizers (the Makefile's EMU_RUNTIME_FLAGS: the emulator's own
// bookkeeping, under every shuffle and barrier, is a quarter of the emulated tests' time) and
// linked with kernels built with them: TRELLIS_EMU_FOR_ASAN says so.
#if defined(__SANITIZE_ADDRESS__) || defined(TRELLIS_EMU_FOR_ASAN)
// Fiber switches are not announced to AddressSanitizer (__sanitizer_start_switch_fiber): that
// took a third of the emulator's time, and it only matters for code that unwinds a stack without
// returning (exceptions, longjmp), which kernels never do. Its one other effect, stale poison
// where a new fiber reuses a stack, is cleared when the fiber is made (run_block).
#include <sanitizer/asan_interface.h>
#define TRELLIS_EMU_ASAN 1
#endif

// Switching fibers. On x86-64 a switch of our own: the callee-saved registers pushed on the old
// stack, the stack pointer swapped, popped from the new one — no system call, where glibc's
// swapcontext makes two (the signal mask) and AddressSanitizer's wrapper of it clears the whole
// stack's shadow each time (together 80 % of a training test's time). Elsewhere: ucontext.
#if defined(__x86_64__)
asm(R"(
  .text
  .globl trellis_emu_switch
  .type trellis_emu_switch, @function
trellis_emu_switch:
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
  .size trellis_emu_switch, .-trellis_emu_switch
)");
extern "C" void trellis_emu_switch(void** save_sp, void* sp);
#endif

namespace trellis_emu {

namespace {

struct Context {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

// Saves the running context in `from` and runs `to`.
void switch_context(Context& from, Context& to) {
#if defined(__x86_64__)
  trellis_emu_switch(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

// A context that, switched to, calls start() on the given stack (start never returns).
void prepare(Context& c, char* stack, size_t bytes, void (*start)()) {
#if defined(__x86_64__)
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                              // start's return address (it never returns)
  *--sp = reinterpret_cast<void*>(start);       // what trellis_emu_switch's ret jumps to
  for (int r = 0; r < 6; ++r) *--sp = nullptr;  // rbp, rbx, r12–r15
  c.sp = sp;
#else
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, start, 0);
#endif
}

constexpr size_t kStackBytes = 256 << 10;  // per fiber: a kernel's locals under AddressSanitizer
constexpr int kMaxThreads = 1024;
constexpr size_t kUnpoisonBytes = 16 << 10;  // the top of a reused stack: see run_block

enum class State { runnable, at_block_barrier, at_warp_barrier, done };

// A cp.async copy issued and not yet waited for: its source bytes, read at the issue.
struct AsyncCopy {
  void* dst;
  unsigned char bytes[16];
  size_t size;
};

struct Fiber {
  Context context;
  State state = State::done;
  Index index;
  int linear = 0;  // the thread's index in its block (x fastest), fixed at the block's start
  size_t mma_calls = 0;
  int shuffles = 0;  // the lane's collective operations so far: its next one's exchange set
  // cp.async: the committed groups (oldest first) and the copies issued since the last commit.
  std::vector<std::vector<AsyncCopy>> copy_groups;
  std::vector<AsyncCopy> copies;
};

struct Warp {
  int alive = 0, arrived = 0;
  // The exchange areas of the warp's collective operations (shuffles, ldmatrix, mma.sync): two
  // sets, alternating (cuda_emu.hpp's shuffle), each 32 lanes × kExchangeBytes.
  alignas(16) unsigned char exchange[2][32 * kExchangeBytes];
};

struct Machine {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  char* stacks = nullptr;  // kMaxThreads stacks, mapped once (pages are touched as used)
  Context scheduler;
  Fiber* current = nullptr;
  int alive = 0, arrived = 0;  // the block's live threads, and those at __syncthreads
  // The order the block's threads (and each warp's lanes) take turns in: descending in blocks of
  // even linear index, ascending in odd ones (cuda_emu.hpp: which missing barriers each shows).
  bool ascending = false;
  void* shared = nullptr;
  size_t shared_bytes = 0;
  // Static shared variables (fresh_shared): the block's number, counted from 1, the last block
  // that filled each, and this block's static bytes.
  uint64_t block_number = 0;
  std::unordered_map<void*, uint64_t> filled_in;
  size_t static_bytes = 0;
  const std::function<void()>* body = nullptr;
};

Machine the_machine;  // one emulated device, driven from one host thread at a time
inline Machine& machine() { return the_machine; }

Fiber& current() {
  Machine& m = machine();
  if (!m.current) fault("device code called outside a kernel");
  return *m.current;
}

int linear(const Fiber& f) { return f.linear; }

char* stack_of(int i) { return machine().stacks + size_t(i) * kStackBytes; }

// The fiber f stops (at a barrier, or finished): the next runnable lane of its warp runs,
// switched to directly (a warp's lanes take turns at each shuffle: no detour through the
// scheduler), else the scheduler. Returns when f is resumed.
void yield(Fiber& f) {
  Machine& m = machine();
  const int first = f.linear - f.linear % 32, n = int(m.fibers.size());
  for (int k = 1; k < 32; ++k) {
    // the block's order (Machine::ascending), wrapping in the warp
    const int i = first + (f.linear - first + (m.ascending ? k : 32 - k)) % 32;
    if (i >= n || m.fibers[i].state != State::runnable) continue;
    m.current = &m.fibers[i];
    switch_context(f.context, m.fibers[i].context);
    return;
  }
  switch_context(f.context, m.scheduler);
}

// The scheduler runs f until some fiber of the block switches back to it.
void resume(Fiber& f) {
  Machine& m = machine();
  m.current = &f;
  switch_context(m.scheduler, f.context);
  m.current = nullptr;
}

Warp& warp_of(const Fiber& f) { return machine().warps[linear(f) / 32]; }

// Lets every fiber waiting at the block's (or w's) barrier go on, once all live ones are there.
void release_block_if_complete() {
  Machine& m = machine();
  if (m.arrived == 0 || m.arrived < m.alive) return;
  m.arrived = 0;
  for (Fiber& f : m.fibers)
    if (f.state == State::at_block_barrier) f.state = State::runnable;
}
void release_warp_if_complete(int w) {
  Machine& m = machine();
  Warp& warp = m.warps[w];
  if (warp.arrived == 0 || warp.arrived < warp.alive) return;
  warp.arrived = 0;
  const int end = std::min<int>(int(m.fibers.size()), (w + 1) * 32);
  for (int i = w * 32; i < end; ++i)
    if (m.fibers[i].state == State::at_warp_barrier) m.fibers[i].state = State::runnable;
}

void entry() {
  Machine& m = machine();
  Fiber& f = *m.current;
  (*m.body)();
  f.state = State::done;
  if (m.arrived > 0) fault("a thread returned while others wait at __syncthreads");
  --m.alive;
  const int w = linear(f) / 32;
  --m.warps[w].alive;
  release_warp_if_complete(w);
  release_block_if_complete();
  yield(f);
  fault("a finished fiber was resumed");
}

std::string describe(const Machine& m) {
  std::string s;
  for (size_t i = 0; i < m.fibers.size(); ++i) {
    const State st = m.fibers[i].state;
    if (st == State::done) continue;
    s += " thread " + std::to_string(i) +
         (st == State::at_block_barrier ? " at __syncthreads;" : " at a warp barrier;");
    if (s.size() > 400) return s + " ...";
  }
  return s;
}

void run_block(const Index& block, const std::function<void()>& body) {
  Machine& m = machine();
  const int n = int(block.block_dim.x * block.block_dim.y * block.block_dim.z);
  m.fibers.assign(n, Fiber{});
  m.warps.assign((n + 31) / 32, Warp{});
  m.body = &body;
  m.alive = n;
  m.arrived = 0;
  ++m.block_number;
  m.static_bytes = 0;
  const uint64_t linear_block =
      block.block.x + uint64_t(block.grid_dim.x) *
                          (block.block.y + uint64_t(block.grid_dim.y) * block.block.z);
  m.ascending = linear_block % 2 == 1;
  for (int i = 0; i < n; ++i) {
    Fiber& f = m.fibers[i];
    f.index = block;
    f.linear = i;
    f.index.thread =
        uint3{unsigned(i % block.block_dim.x), unsigned(i / block.block_dim.x % block.block_dim.y),
              unsigned(i / (block.block_dim.x * block.block_dim.y))};
    f.state = State::runnable;
    ++m.warps[i / 32].alive;
#ifdef TRELLIS_EMU_ASAN
    // The previous fiber on this stack died inside yield(): its frames' poison would be stale.
    __asan_unpoison_memory_region(stack_of(i) + kStackBytes - kUnpoisonBytes, kUnpoisonBytes);
#endif
    prepare(f.context, stack_of(i), kStackBytes, entry);
  }
  while (m.alive > 0) {
    bool ran = false;
    for (int k = 0; k < n; ++k) {  // the block's order: see cuda_emu.hpp
      Fiber& f = m.fibers[m.ascending ? k : n - 1 - k];
      if (f.state == State::runnable) {
        resume(f);
        ran = true;
      }
    }
    if (!ran && m.alive > 0) {
      const std::string where = describe(m);
      std::fprintf(stderr, "emulated GPU: block (%u,%u,%u) cannot go on:%s\n", block.block.x,
                   block.block.y, block.block.z, where.c_str());
      fault("deadlock: a barrier that not every live thread of the block (or warp) reaches");
    }
  }
}

}  // namespace

const Index& index() { return current().index; }
void* dynamic_shared() {
  current();
  return machine().shared;
}
void fresh_shared(void* p, size_t bytes) {
  current();
  Machine& m = machine();
  uint64_t& block = m.filled_in[p];
  if (block == m.block_number) return;  // this block's: another thread got here first
  block = m.block_number;
  std::memset(p, 0xff, bytes);
  m.static_bytes += bytes;
  if (m.static_bytes > kSharedDefault)
    fault("static shared memory over the 48 KiB a block may declare");
  if (m.static_bytes + m.shared_bytes > kSharedOptin)
    fault("static and dynamic shared memory over the device's most per block");
}
int lane() { return linear(current()) % 32; }
void* warp_exchange() {
  Fiber& f = current();
  Warp& w = warp_of(f);
  // The backend's shuffles (and ldmatrix, mma.sync) name all 32 lanes: on a GPU a lane that has
  // exited, or a warp short of 32, makes that undefined — here every lane would still pair up.
  if (w.alive < 32)
    fault("a warp-wide operation (shuffle, ldmatrix, mma.sync: all 32 lanes) in a warp with "
          "fewer than 32 live lanes");
  return w.exchange[f.shuffles++ & 1];
}
uint64_t shuffle_bits(uint64_t bits, int src) {
  if (src < 0 || src >= 32) fault("a shuffle from a lane outside the warp");
  auto* slots = static_cast<uint64_t*>(warp_exchange());
  slots[lane()] = bits;
  sync_warp();
  return slots[src];
}
bool in_shared(const void* p, size_t bytes) {
  const Machine& m = machine();
  const auto* c = static_cast<const char*>(p);
  const auto* shared = static_cast<const char*>(m.shared);
  return shared && c >= shared && c + bytes <= shared + m.shared_bytes;
}
size_t next_mma_call() { return current().mma_calls++; }

void copy_async(void* dst, const void* src, size_t size, size_t src_size) {
  Fiber& f = current();
  if (size > 16 || src_size > size) fault("cp.async: more than 16 bytes, or src-size over cp-size");
  if (reinterpret_cast<uintptr_t>(dst) % size != 0 || reinterpret_cast<uintptr_t>(src) % size != 0)
    fault("cp.async: an address not aligned to the copy's size");
  if (!in_shared(dst, size)) fault("cp.async: a destination outside the block's shared memory");
  AsyncCopy c{dst, {}, size};
  if (src_size > 0) {
    if (!is_device_range(src, src_size)) fault("cp.async: a source outside device memory");
    std::memcpy(c.bytes, src, src_size);  // the rest of cp-size is filled with zeros
  }
  // Between the issue and the wait the destination holds neither old nor new bytes on a GPU's
  // terms: NaN bits from now, the data at the wait. A thread still reading the old tile when
  // another issues the next one into it (no barrier between), and a thread reading the new one
  // before its copier waited and the block met, both read NaN.
  std::memset(dst, 0xff, size);
  f.copies.push_back(c);
}

void copy_async_commit() {
  Fiber& f = current();
  f.copy_groups.push_back(std::move(f.copies));
  f.copies.clear();
}

void copy_async_wait(int pending) {
  Fiber& f = current();
  while (int(f.copy_groups.size()) > pending) {
    for (const AsyncCopy& c : f.copy_groups.front()) std::memcpy(c.dst, c.bytes, c.size);
    f.copy_groups.erase(f.copy_groups.begin());
  }
}

void sync_block() {
  Machine& m = machine();
  Fiber& f = current();
  // CUDA asks that a __syncthreads be reached by the whole block (a condition around it the same
  // in every thread): one after some threads returned is reported, as is a return while others
  // wait (in entry), where this emulator would otherwise count only the threads left.
  if (m.alive < int(m.fibers.size()))
    fault("__syncthreads after some of the block's threads returned");
  f.state = State::at_block_barrier;
  ++m.arrived;
  release_block_if_complete();
  if (f.state != State::runnable) yield(f);
}

void sync_warp() {
  Fiber& f = current();
  const int w = linear(f) / 32;
  f.state = State::at_warp_barrier;
  ++machine().warps[w].arrived;
  release_warp_if_complete(w);
  if (f.state != State::runnable) yield(f);
}

void fault(const char* what) {
  std::fprintf(stderr, "emulated GPU: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

namespace {
int g_mma_fault = 0;  // TRELLIS_EMU_MMA_FAULT, as the running kernel's launch found it
}  // namespace

int mma_fault() { return g_mma_fault; }

void run_kernel(const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                const std::function<void()>& body) {
  Machine& m = machine();
  if (m.current) fault("a kernel launched from device code");
  const char* fault_env = std::getenv("TRELLIS_EMU_MMA_FAULT");
  g_mma_fault = fault_env ? std::atoi(fault_env) : 0;
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > kMaxThreads || block.z > 64 || grid.x == 0 || grid.y == 0 ||
      grid.z == 0 || grid.x > 2147483647u || int(grid.y) > grid_y_limit() || grid.z > 65535)
    return set_error(cudaErrorInvalidConfiguration);
  // Up to 48 KiB without opting in; once a kernel has opted in, up to what it opted into (the
  // attribute is the launch's limit, also where it was set below 48 KiB).
  const size_t opted = max_dynamic_shared(kernel);
  if (smem > kSharedOptin || smem > (opted > 0 ? opted : kSharedDefault))
    return set_error(cudaErrorInvalidValue);
  stream_order(stream);
  if (!m.stacks) {
    void* p = mmap(nullptr, kStackBytes * kMaxThreads, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fault("no memory for the fibers' stacks");
    m.stacks = static_cast<char*>(p);
  }
  Index idx{};
  idx.block_dim = block;
  idx.grid_dim = grid;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        // Fresh shared memory of exactly the launch's size (AddressSanitizer sees past its end),
        // holding NaN bits, as a GPU's holds whatever was there.
        void* shared = nullptr;
        if (smem > 0) {
          if (posix_memalign(&shared, 128, smem) != 0) fault("no memory for shared memory");
          std::memset(shared, 0xff, smem);
        }
        m.shared = shared;
        m.shared_bytes = smem;
        idx.block = uint3{x, y, z};
        run_block(idx, body);
        std::free(shared);
        m.shared = nullptr;
        m.shared_bytes = 0;
      }
}

}  // namespace trellis_emu
