#include "train/report.hpp"

#include "comm/world.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/memory.hpp"

namespace trellis {

std::string time_table(MPI_Comm comm, const Timers& timers, const std::vector<std::string>& sections) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  const double total = timers.get("total");
  // Each row's share of the ranks' average total (not of this rank's: the total row is 100 %).
  const double avg_total = min_avg_max(comm, total).avg;
  std::vector<std::vector<std::string>> rows;
  auto row = [&](const std::string& name, double seconds) {
    MinAvgMax s = min_avg_max(comm, seconds);
    rows.push_back({name, strfmt("%.3f", s.min), strfmt("%.3f", s.avg), strfmt("%.3f", s.max),
                    strfmt("%.1f", avg_total > 0 ? 100 * s.avg / avg_total : 0.0)});
  };
  double accounted = 0;
  for (const auto& section : sections) {
    accounted += timers.get(section);
    row(section, timers.get(section));
  }
  row("other", total - accounted);
  row("total", total);
  return format_table(strfmt("where the time went (seconds, over %d rank%s)", size, size > 1 ? "s" : ""),
                      {"section", "min", "avg", "max", "% of avg total"}, rows);
}

std::string comm_table(MPI_Comm comm, const std::vector<GroupStats>& groups, int64_t steps) {
  std::vector<std::vector<std::string>> rows;
  const double per = steps > 0 ? 1.0 / double(steps) : 0.0;
  for (const auto& g : groups) {
    MinAvgMax payload = min_avg_max(comm, g.stats.payload_values * per);
    MinAvgMax bytes = min_avg_max(comm, g.stats.payload_bytes * per);  // halved by a bf16 wire
    MinAvgMax flight = min_avg_max(comm, g.stats.seconds_in_flight);
    MinAvgMax blocked = min_avg_max(comm, g.stats.seconds_blocked);
    MinAvgMax calls = min_avg_max(comm, double(g.stats.calls) * per);
    const double hidden = flight.avg > 0 ? 100.0 * (flight.avg - blocked.avg) / flight.avg : 0.0;
    rows.push_back({g.name, strfmt("%.1f", calls.avg), strfmt("%.0f", payload.max),
                    format_bytes(bytes.max),
                    strfmt("%.3f / %.3f / %.3f", flight.min, flight.avg, flight.max),
                    strfmt("%.3f / %.3f / %.3f", blocked.min, blocked.avg, blocked.max),
                    strfmt("%.1f", hidden > 0 ? hidden : 0.0)});
  }
  return format_table("communication per rank (payload as the ZeRO paper counts it: all-reduce = 2n)",
                      {"group", "calls/step", "payload values/step", "bytes/step", "in flight s min/avg/max",
                       "blocked s min/avg/max", "hidden % (avg)"},
                      rows);
}

std::string memory_table(MPI_Comm comm, const ModelStates& formula,
                         const std::vector<double>& planned) {
  const MemoryStats& mem = memory_stats();
  const bool plan = planned.size() == size_t(MemKind::Count) + 1;
  auto plan_cells = [&](size_t i, double max) -> std::vector<std::string> {
    if (!plan) return {};
    return {format_bytes(planned[i]), planned[i] > 0 ? strfmt("%.3f", max / planned[i]) : ""};
  };
  std::vector<std::vector<std::string>> rows;
  for (int k = 0; k < int(MemKind::Count); ++k) {
    MinAvgMax s = min_avg_max(comm, double(mem.peak[k]));
    if (s.max == 0 && !(plan && planned[k] > 0)) continue;
    double expect = 0;
    if (MemKind(k) == MemKind::Params) expect = formula.params;
    if (MemKind(k) == MemKind::Grads) expect = formula.grads;
    if (MemKind(k) == MemKind::Optim) expect = formula.optim;
    rows.push_back({mem_kind_name(MemKind(k)), format_bytes(s.min), format_bytes(s.max),
                    expect > 0 ? format_bytes(expect) : "",
                    expect > 0 ? strfmt("%.3f", s.max / expect) : ""});
    for (std::string& cell : plan_cells(size_t(k), s.max)) rows.back().push_back(cell);
  }
  MinAvgMax peak = min_avg_max(comm, double(mem.total_peak));
  rows.push_back({"peak total", format_bytes(peak.min), format_bytes(peak.max), "", ""});
  for (std::string& cell : plan_cells(size_t(MemKind::Count), peak.max))
    rows.back().push_back(cell);
  std::vector<std::string> header = {"kind", "min", "max", "ZeRO formula", "max / formula"};
  if (plan) header.insert(header.end(), {"trellis plan", "max / plan"});
  return format_table("memory per rank (peak, measured from the allocations)", header, rows);
}

}  // namespace trellis
