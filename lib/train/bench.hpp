// `trellis bench [DECK] [--section.key=value ...]`: how fast a training step runs next to the
// fastest thing this machine does — a large sgemm through the same backend — measured by the same
// program, side by side. `make bench` runs it on inputs/bench.deck.
#pragma once
#include <string>
#include <vector>

#include "comm/world.hpp"

namespace trellis {

int bench_main(const std::vector<std::string>& args, World& world);

extern const char* const kBenchUsage;  // trellis bench --help

}  // namespace trellis
