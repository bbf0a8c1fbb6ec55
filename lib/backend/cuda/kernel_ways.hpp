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
#include <map>
#include <string>
#include <vector>

namespace trellis::cuda {

class KernelWays {
 public:
  static constexpr int kSamples = 2;  // timed calls of each way before choosing

  struct Pick {
    int way = 0;         // index into the ways asked about
    bool timed = false;  // time this call and record() its device time
    int slot = -1;       // what record() takes back
  };
  /// The way a call of `kernel` ("cross-entropy bf16") at `shape` ("65536×50304") takes among
  /// `ways` (their names, in the order preferred without timing). One way: that one, untimed.
  /// While each way has not yet been launched kSamples times, the way launched least (the first
  /// such), timed; then, until every sample is back, the first way, untimed; then the fastest.
  Pick pick(const std::string& kernel, const std::string& shape,
            const std::vector<std::string>& ways);
  /// The device time of a timed call (pick's slot and way); the last sample of a kernel's trials
  /// makes the choice.
  void record(int slot, int way, double ms);
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
    std::vector<std::string> ways;
    std::vector<int> launched;               // timed launches, by way
    std::vector<std::vector<double>> times;  // their device times (ms) once known, by way
    int chosen = -1;
  };
  /// Chooses the fastest once every way has its samples.
  static void choose(Entry& e);
  std::vector<Entry> entries_;
  std::map<std::string, int> index_;  // kernel, shape and ways → entries_
};

}  // namespace trellis::cuda
