// Chooses the token source by data.source.
#include "core/error.hpp"
#include "data/data.hpp"

namespace trellis {

std::unique_ptr<TokenSource> make_token_source(const DataConfig& data, const ModelConfig& model) {
  if (data.source == "synthetic") return make_synthetic_source(data, model);
  if (data.source == "text") return make_text_source(data, model);
  if (data.source == "tokens") return make_tokens_source(data, model);
  throw UserError(strfmt("data.source = '%s' is not one of synthetic, text, tokens",
                         data.source.c_str()));
}

}  // namespace trellis
