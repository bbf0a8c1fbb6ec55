// Output a person reads: only rank 0 prints (unless told otherwise), tables are boxed.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace trellis {

/// Set once at start-up; log() prints only where this rank is the printing one.
void set_log_rank(int rank);
bool is_log_rank();
void log(const std::string& line);           // stdout, rank 0 only, with a newline
void log_error(const std::string& message);  // stderr, every rank that calls it

/// A boxed table: a title, a header row, rows. Column widths fit the contents.
std::string format_table(const std::string& title, const std::vector<std::string>& header,
                         const std::vector<std::vector<std::string>>& rows);

/// Human-readable sizes: 1.5 KiB, 12.0 MiB.
std::string format_bytes(double bytes);

}  // namespace trellis
