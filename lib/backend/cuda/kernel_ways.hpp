// Which of a kernel's ways to the same bits a call takes, chosen by timing them on the device.
//
// Some kernels of the CUDA backend have ways that compute the same values in the same order and
// differ only in how they move memory: the fused cross-entropy (its rows double-buffered in shared
// memory, a row a block in shared memory, or read from memory in each pass), the layer norm
// forwards (each lane's share of a row held in registers, or read again for each sum), the fused
// layer norm backward (a row's dinp copied into shared memory with its other loads, the next row
// copied while this one is computed, or dinp loaded after the row's means), the column sums of the
// bias gradients (16-byte chunks with 8 or 16 rows' loads in flight, or a value a thread). Which
// is fastest depends on the device, the shape and what else the device is doing — a choice made
// without timing them there is a guess. So the first calls of each kernel at each shape take its
// ways in turn, each timed by CUDA events kSamples times, and once every sample is back every
// later call takes the fastest (the least of its samples; ties to the way listed first). Results
// never depend on the choice, only the time (tests hold every way to the same bits), so ranks that
// choose differently still agree bit for bit.
//
// This file is the bookkeeping, without CUDA: the backend records the events around the calls it
// is told to time and hands their times back (cuda_backend.cu, WayTrial).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace trellis::cuda {

/// The ways that apply to a call: ids into its kernel's table of way names, in the order
/// preferred without timing (at most 4; no allocation, as every call of the kernel makes one).
class WaySet {
 public:
  WaySet() = default;
  WaySet(std::initializer_list<int> ways) {
    for (int w : ways) add(w);
  }
  void add(int way) {
    if (n_ == 4 || way < 0 || way > 255)
      throw std::logic_error("WaySet: at most 4 ways, ids 0 to 255");
    ways_[n_++] = way;
  }
  int size() const { return n_; }
  int operator[](int i) const { return ways_[i]; }
  uint32_t key() const {  // (the ids in order, a byte each)
    uint32_t k = 0;
    for (int i = 0; i < n_; ++i) k = k << 8 | uint32_t(ways_[i]);
    return k;
  }

 private:
  int ways_[4] = {};
  int n_ = 0;
};

class KernelWays {
 public:
  static constexpr int kSamples = 2;  // timed calls of each way before choosing

  struct Pick {
    int way = 0;         // the way's id (one of the set's)
    bool timed = false;  // time this call and record() its device time
    int slot = -1;       // what record() takes back
    int index = 0;       // the way's place in the set
  };
  /// The way a call of `kernel` ("cross-entropy bf16": a string literal, kept by reference) on
  /// rows × cols takes among `ways` (names[id] names way id). One way: that one, untimed. While
  /// each way has not yet been launched kSamples times, the way launched least (the first such),
  /// timed; then, until every sample is back, the first way, untimed; then the fastest.
  Pick pick(std::string_view kernel, int rows, int cols, const char* const* names,
            const WaySet& ways);
  /// The device time of a timed call (pick's slot and index); the last sample of a kernel's
  /// trials makes the choice.
  void record(int slot, int index, double ms);
  /// Whether some kernel's ways are still being timed (a benchmark warms up until they are not).
  bool settling() const;
  /// One line for a run's log: each kernel's way kept, with how many shapes kept it where its
  /// shapes differ ("cross-entropy bf16: double-buffered; column sums bf16: 16 B × 16 rows (3
  /// shapes), 16 B × 8 rows (1)"), "still timing" for a kernel none of whose shapes has chosen
  /// yet; empty when no kernel had ways to time.
  std::string summary() const;
  /// One row a kernel and shape: kernel, shape, each way's least time in ms so far ("name
  /// 1.234", "name -" before its first sample), the way chosen ("-" while timing).
  std::vector<std::vector<std::string>> report() const;

 private:
  struct Entry {
    std::string kernel, shape;
    std::vector<int> ids;              // the ways, by their place in the set
    std::vector<std::string> ways;     // their names
    std::vector<int> launched;               // timed launches, by way
    std::vector<std::vector<double>> times;  // their device times (ms) once known, by way
    int chosen = -1;
  };
  /// Chooses the fastest once every way has its samples.
  static void choose(Entry& e);
  std::vector<Entry> entries_;
  // (kernel, rows, cols, the set's key) → entries_; the set is part of the key, since which ways
  // apply can change with a call's pointers' alignment
  std::map<std::tuple<std::string_view, int, int, uint32_t>, int> index_;
};

}  // namespace trellis::cuda
