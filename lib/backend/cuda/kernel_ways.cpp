// The bookkeeping of the kernels' timed ways (kernel_ways.hpp).
#include "backend/cuda/kernel_ways.hpp"

#include <algorithm>
#include <cstdio>

namespace trellis::cuda {

namespace {
double least(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
}  // namespace

KernelWays::Pick KernelWays::pick(const std::string& kernel, const std::string& shape,
                                  const std::vector<std::string>& ways) {
  if (ways.size() <= 1) return {};
  // (the ways are part of the key: which apply can change with a call's pointers' alignment)
  std::string key = kernel + '\n' + shape;
  for (const std::string& w : ways) key += '\n' + w;
  auto [it, added] = index_.emplace(key, int(entries_.size()));
  if (added) {
    entries_.push_back({kernel, shape, ways, std::vector<int>(ways.size(), 0),
                        std::vector<std::vector<double>>(ways.size()), -1});
  }
  const int slot = it->second;
  Entry& e = entries_[size_t(slot)];
  if (e.chosen >= 0) return {e.chosen, false, slot};
  int next = -1;  // the way launched least, while some way lacks its samples
  for (int w = 0; w < int(ways.size()); ++w) {
    const int n = e.launched[size_t(w)];
    if (n < kSamples && (next < 0 || n < e.launched[size_t(next)])) next = w;
  }
  if (next >= 0) {
    ++e.launched[size_t(next)];
    return {next, true, slot};
  }
  return {0, false, slot};  // (samples still on their way)
}

void KernelWays::choose(Entry& e) {
  for (const auto& t : e.times)
    if (int(t.size()) < kSamples) return;
  int best = 0;
  for (int w = 1; w < int(e.ways.size()); ++w)
    if (least(e.times[size_t(w)]) < least(e.times[size_t(best)])) best = w;
  e.chosen = best;
}

void KernelWays::record(int slot, int way, double ms) {
  Entry& e = entries_.at(size_t(slot));
  e.times.at(size_t(way)).push_back(ms);
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
