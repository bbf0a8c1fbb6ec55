// `trellis plan DECK [options] [--section.key=value ...]`: memory per rank for the deck's layout
// and every layout of its model on N devices, ranked, before a job is submitted. Needs no MPI.
#pragma once
#include <string>
#include <vector>

namespace trellis {

/// The option list `trellis plan --help` prints.
extern const char* kPlanUsage;

/// Runs the planner; returns the exit status (2 for a bad deck or option, naming it).
int plan_main(const std::vector<std::string>& args);

/// "80GiB", "80GB", "1.5T", "4096" (bytes) → bytes; binary units for K/M/G/T alone. Throws
/// UserError naming `option` when the text is not a size, or one below `at_least` bytes.
double parse_size(const std::string& text, const std::string& option, double at_least = 1);

}  // namespace trellis
