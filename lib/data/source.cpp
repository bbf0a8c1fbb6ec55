// Chooses the token source by data.source, for training and for the held-out evaluation.
#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>

#include "core/error.hpp"
#include "data/data.hpp"
#include "data/rng.hpp"

namespace trellis {

std::unique_ptr<TokenSource> make_token_source(const DataConfig& data, const ModelConfig& model,
                                               const std::string& key) {
  if (data.source == "synthetic") return make_synthetic_source(data, model);
  if (data.source == "text") return make_text_source(data, model, key);
  if (data.source == "tokens") return make_tokens_source(data, model, key);
  throw UserError(strfmt("data.source = '%s' is not one of synthetic, text, tokens",
                         data.source.c_str()));
}

std::string held_out_overlap(const TokenSource& training, const TokenSource& held_out) {
  return held_out_overlap(training.files(), held_out);
}

std::vector<TokenSource::File> files_named(const DataConfig& data) {
  std::vector<std::string> paths;
  if (data.source == "text") {
    paths.push_back(data.path);
  } else if (data.source == "tokens") {
    glob_t g{};
    if (::glob(data.path.c_str(), 0, nullptr, &g) == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
  }
  std::vector<TokenSource::File> out;
  for (const std::string& p : paths) {
    struct stat st;
    if (::stat(p.c_str(), &st) == 0)
      out.push_back({p, {uint64_t(st.st_dev), uint64_t(st.st_ino)}});
  }
  return out;
}

std::string held_out_overlap(const std::vector<TokenSource::File>& training,
                             const TokenSource& held_out) {
  std::map<std::pair<uint64_t, uint64_t>, std::string> trained;
  for (const TokenSource::File& f : training) trained.emplace(f.id, f.path);
  for (const TokenSource::File& f : held_out.files())
    if (auto it = trained.find(f.id); it != trained.end())
      return "eval.path and data.path both read " + f.path +
             (it->second == f.path ? std::string() : " (as " + it->second + " in data.path)") +
             ": the held-out loss would be measured on the training data";
  return {};
}

uint64_t content_fingerprint(const TokenSource& source) {
  using data_rng::hash_combine;
  uint64_t h = hash_combine(0x7E11150, uint64_t(source.vocab()));
  for (int64_t n : source.piece_sizes()) h = hash_combine(h, uint64_t(n));
  const int64_t n = source.num_windows(1);  // every token, numbered piece by piece
  const int64_t samples = std::min<int64_t>(n, 1024);
  for (int64_t i = 0; i < samples; ++i) {
    // i·(n − 1)/(samples − 1): from the first token to the last, evenly (i < 2^10: no overflow
    // below 2^53 tokens).
    const int64_t k = samples == 1 ? 0 : i * (n - 1) / (samples - 1);
    int32_t token = 0;
    source.window(k, 1, &token);
    h = hash_combine(h, uint64_t(uint32_t(token)));
  }
  return h;
}

std::unique_ptr<TokenSource> make_held_out_source(const DataConfig& data, const EvalConfig& eval,
                                                  const ModelConfig& model, int64_t sequences) {
  DataConfig held_out = data;
  if (data.source == "synthetic") {
    // Windows at a stride of seq_len: the last of `sequences` ends at token sequences·T.
    held_out.synthetic_tokens = sequences * model.seq_len + 1;
    return make_synthetic_source(held_out, model, /*skip=*/data.synthetic_tokens);
  }
  held_out.path = eval.path;
  return make_token_source(held_out, model, "eval.path");
}

}  // namespace trellis
