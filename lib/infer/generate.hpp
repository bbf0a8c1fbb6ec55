// `trellis generate CKPT`: loads a checkpoint's model onto np tensor-parallel ranks (pp = dp = 1;
// checkpoints are layout-free), prefills the prompt in one forward, then samples one token at a
// time with the key/value cache (decoder.hpp), and reports time to first token and tokens/s.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "comm/world.hpp"
#include "infer/decoder.hpp"
#include "infer/sampling.hpp"
#include "model/params.hpp"

namespace trellis {

/// Collective over comm: reads the model's tensors (model/<name>) of `table` (this rank's part of
/// the whole model) into params (table.total() floats). A missing or damaged file, or tensors of
/// another shape → UserError naming the file on every rank.
void load_model_parameters(MPI_Comm comm, const std::string& path, const ParamTable& table,
                           float* params);

struct Generation {
  std::vector<int32_t> tokens;  // the generated tokens (not the prompt)
  double first_token_s = 0;     // from the start of the prefill to the first token on every rank
  double decode_s = 0;          // from the first token to the last
  /// With keep_logits: the logits (V each) after every token fed to the model, in order — the
  /// prompt's rows, then one per generated token but the last (never fed).
  std::vector<float> logits;
};

/// Collective over tp (null: one rank). Prefills `prompt` (≥ 1 token) from position 0, then
/// draws `count` tokens: rank 0 samples, every rank gets its token by broadcast, so all ranks
/// agree even where their logits differ in the last bit. prompt + count ≤ the context (checked).
Generation generate(Decoder& decoder, Comm* tp, const std::vector<int32_t>& prompt, int count,
                    TokenSampler& sampler, bool keep_logits = false);

/// Bytes (token ids 0–255) as text: printable ASCII, newlines, tabs and well-formed UTF-8 as they
/// are; any other byte as \xNN, a backslash as \\; an id past 255 (not a byte) as \id{ID}.
std::string bytes_as_text(const std::vector<int32_t>& tokens);

/// `trellis generate` with its arguments (after the command); returns the exit status. Bad
/// options, a bad checkpoint or an np that does not split the model → status 2 on every rank.
int generate_main(const std::vector<std::string>& args, World& world);

/// The usage text of `trellis generate --help`.
const char* generate_usage();

}  // namespace trellis
