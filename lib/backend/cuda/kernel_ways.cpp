// The bookkeeping of the kernels' timed ways (kernel_ways.hpp).
#include "backend/cuda/kernel_ways.hpp"

#include <algorithm>
#include <cstdio>

namespace trellis::cuda {

namespace {
double least(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
}  // namespace

KernelWays::Pick KernelWays::pick(std::string_view kernel, int rows, int cols,
                                  const char* const* names, const WaySet& ways) {
  if (ways.size() <= 1) return {ways.size() ? ways[0] : 0, false, -1, 0};
  auto [it, added] =
      index_.emplace(std::tuple(kernel, rows, cols, ways.key()), int(entries_.size()));
  if (added) {
    Entry e;
    e.kernel = kernel;
    e.shape = std::to_string(rows) + "×" + std::to_string(cols);
    for (int i = 0; i < ways.size(); ++i) {
      e.ids.push_back(ways[i]);
      e.ways.push_back(names[ways[i]]);
    }
    e.launched.assign(size_t(ways.size()), 0);
    e.times.resize(size_t(ways.size()));
    entries_.push_back(std::move(e));
  }
  const int slot = it->second;
  Entry& e = entries_[size_t(slot)];
  const auto at = [&](int index, bool timed) {
    return Pick{e.ids[size_t(index)], timed, slot, index};
  };
  if (e.chosen >= 0) return at(e.chosen, false);
  int next = -1;  // the way launched least, while some way lacks its samples
  for (int w = 0; w < ways.size(); ++w) {
    const int n = e.launched[size_t(w)];
    if (n < kSamples && (next < 0 || n < e.launched[size_t(next)])) next = w;
  }
  if (next >= 0) {
    ++e.launched[size_t(next)];
    return at(next, true);
  }
  return at(0, false);  // (samples still on their way)
}

void KernelWays::choose(Entry& e) {
  for (const auto& t : e.times)
    if (int(t.size()) < kSamples) return;
  int best = 0;
  for (int w = 1; w < int(e.ways.size()); ++w)
    if (least(e.times[size_t(w)]) < least(e.times[size_t(best)])) best = w;
  e.chosen = best;
}

void KernelWays::record(int slot, int index, double ms) {
  Entry& e = entries_.at(size_t(slot));
  e.times.at(size_t(index)).push_back(ms);
  if (e.chosen < 0) choose(e);
}

bool KernelWays::settling() const {
  for (const Entry& e : entries_)
    if (e.chosen < 0) return true;
  return false;
}

std::string KernelWays::summary() const {
  // kernel → (way kept → shapes), in the order the kernels first ran
  std::vector<std::pair<std::string, std::vector<std::pair<std::string, int>>>> kept;
  for (const Entry& e : entries_) {
    auto k = std::find_if(kept.begin(), kept.end(),
                          [&](const auto& x) { return x.first == e.kernel; });
    if (k == kept.end()) k = kept.insert(kept.end(), {e.kernel, {}});
    if (e.chosen < 0) continue;
    const std::string& way = e.ways[size_t(e.chosen)];
    auto w = std::find_if(k->second.begin(), k->second.end(),
                          [&](const auto& x) { return x.first == way; });
    if (w == k->second.end())
      k->second.push_back({way, 1});
    else
      ++w->second;
  }
  std::string line;
  for (const auto& [kernel, ways] : kept) {
    line += (line.empty() ? "" : "; ") + kernel + ": ";
    if (ways.empty()) line += "still timing";
    for (size_t i = 0; i < ways.size(); ++i) {
      line += (i ? ", " : "") + ways[i].first;
      if (ways.size() > 1)
        line += " (" + std::to_string(ways[i].second) +
                (i > 0 ? ")" : ways[i].second == 1 ? " shape)" : " shapes)");
    }
  }
  return line;
}

std::vector<std::vector<std::string>> KernelWays::report() const {
  std::vector<std::vector<std::string>> rows;
  char buf[128];
  for (const Entry& e : entries_) {
    std::string times;
    for (size_t w = 0; w < e.ways.size(); ++w) {
      if (e.times[w].empty())
        std::snprintf(buf, sizeof buf, "%s -", e.ways[w].c_str());
      else
        std::snprintf(buf, sizeof buf, "%s %.3f", e.ways[w].c_str(), least(e.times[w]));
      times += (w ? ", " : "") + std::string(buf);
    }
    rows.push_back({e.kernel, e.shape, times, e.chosen >= 0 ? e.ways[size_t(e.chosen)] : "-"});
  }
  return rows;
}

}  // namespace trellis::cuda
