#include "ckpt/export_hf.hpp"

#include <hdf5.h>

#include <cstdio>
#include <filesystem>

#include "ckpt/checkpoint.hpp"
#include "ckpt/impl/common.hpp"
#include "ckpt/safetensors.hpp"
#include "ckpt/stored_config.hpp"
#include "core/error.hpp"
#include "core/json.hpp"
#include "model/params.hpp"

namespace trellis {

using namespace ckpt_impl;

namespace {

const char* kExportUsage = R"(usage: trellis export CKPT --format hf-gpt2 OUTDIR

  CKPT      a checkpoint file, a `latest` pointer, or a checkpoint/run directory (its newest)
  OUTDIR    receives config.json and model.safetensors (float32), loadable with
            transformers.GPT2LMHeadModel.from_pretrained(OUTDIR)
Models with grouped key/value heads (model.kv_heads < model.heads) have no GPT-2 equivalent and
are refused (exit 2).
)";

/// The whole dataset model/<name> of an open file, checked against shape (checksums and content
/// digest verified; `digests`: kThese, each dataset must have one; kOther, none checked).
std::vector<float> read_tensor(hid_t file, const std::string& path, const ParamInfo& p,
                               Digests digests) {
  const std::string name = "model/" + p.name;
  H5Id dset;
  std::string err = open_checked(file, name, p.shape, file_size(path), dset);
  std::vector<float> data(size_t(p.global_numel()));
  bool has_digest = false;
  uint64_t stored = 0;
  if (err.empty() && digests != Digests::kOther) err = read_digest(dset.get(), has_digest, stored);
  if (err.empty() && !has_digest && digests == Digests::kThese) err = missing_digest();
  if (err.empty() && !data.empty() &&
      H5Dread(dset.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()) < 0)
    err = "read failed: " + h5_error();
  if (err.empty() && has_digest) {
    const int64_t rows = p.shape[0], cols = p.shape.size() == 2 ? p.shape[1] : 1;
    const uint64_t computed = digest_rows(digest_key(name), data.data(), rows, cols, 0, 0);
    if (computed != stored) err = digest_mismatch(stored, computed);
  }
  if (!err.empty()) throw UserError("checkpoint " + path + ": dataset " + name + ": " + err);
  return data;
}

/// (rows, cols) → (cols, rows).
std::vector<float> transposed(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = a[size_t(r * cols + c)];
  return t;
}

std::string config_json(const ModelConfig& m, const std::string& checkpoint, int64_t step) {
  // GPT-2's BPE vocabulary ends with <|endoftext|>; other vocabularies have no such token.
  const std::string eos = m.vocab == 50257 ? "50256" : "null";
  return strfmt(R"({
  "architectures": ["GPT2LMHeadModel"],
  "model_type": "gpt2",
  "vocab_size": %d,
  "n_positions": %d,
  "n_ctx": %d,
  "n_embd": %d,
  "n_layer": %d,
  "n_head": %d,
  "n_inner": %d,
  "activation_function": "gelu_new",
  "layer_norm_epsilon": 1e-05,
  "resid_pdrop": 0.0,
  "embd_pdrop": 0.0,
  "attn_pdrop": 0.0,
  "initializer_range": %g,
  "scale_attn_weights": true,
  "scale_attn_by_inverse_layer_idx": false,
  "reorder_and_upcast_attn": false,
  "tie_word_embeddings": true,
  "use_cache": true,
  "bos_token_id": %s,
  "eos_token_id": %s,
  "torch_dtype": "float32",
  "trellis_checkpoint": %s,
  "trellis_step": %lld
}
)",
                m.vocab, m.seq_len, m.seq_len, m.d_model, m.layers, m.heads, m.d_ff, m.init_std,
                eos.c_str(), eos.c_str(), json_string(checkpoint).c_str(), (long long)step);
}

}  // namespace

void export_hf_gpt2(const std::string& checkpoint_arg, const std::string& outdir) {
  const std::string path = resolve_checkpoint(checkpoint_arg);
  const Config cfg = stored_config(path);
  const ModelConfig& m = cfg.model;
  if (m.kv_heads != m.heads)
    throw UserError(strfmt("checkpoint %s: model.kv_heads = %d < model.heads = %d (grouped "
                           "key/value heads): HF GPT-2 has no such attention; not exported",
                           path.c_str(), m.kv_heads, m.heads));
  CkptMeta meta = read_checkpoint_meta(path);
  if (const std::string problem = counter_problem(meta); !problem.empty())
    throw UserError("checkpoint " + path + ": " + problem + " (damaged or edited)");
  const int64_t step = meta.integers["step"];

  silence_hdf5();
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok()) throw UserError("checkpoint " + path + ": " + open_failure(path));
  std::vector<SafeTensor> tensors;
  const ParamTable table(m);  // the whole model, global shapes
  // A file whose datasets carry digests carries one on each; another version's are not checked.
  const Digests stated = digests_stated(meta);
  bool digests = stated == Digests::kThese;
  for (const ParamInfo& p : table.params()) {
    if (stated == Digests::kOther) break;
    const std::string name = "model/" + p.name;
    digests |= H5Lexists(file.get(), "model", H5P_DEFAULT) > 0 &&
               H5Lexists(file.get(), name.c_str(), H5P_DEFAULT) > 0 &&
               H5Aexists_by_name(file.get(), name.c_str(), "content_digest", H5P_DEFAULT) > 0;
    H5Eclear2(H5E_DEFAULT);
  }
  for (const ParamInfo& p : table.params()) {
    SafeTensor t;
    t.name = "transformer." + p.name + (p.name == "wte" || p.name == "wpe" ? ".weight" : "");
    t.data = read_tensor(file.get(), path, p,
                         stated == Digests::kOther ? stated
                         : digests                 ? Digests::kThese
                                                   : Digests::kUnstated);
    t.shape = p.shape;
    // Conv1D: a block's 2-D weight (out, in) → (in, out).
    if (p.layer >= 0 && p.shape.size() == 2) {
      t.data = transposed(t.data, p.shape[0], p.shape[1]);
      t.shape = {p.shape[1], p.shape[0]};
    }
    tensors.push_back(std::move(t));
  }
  file.close();

  std::error_code ec;
  std::filesystem::create_directories(outdir, ec);
  if (ec || !std::filesystem::is_directory(outdir))
    throw UserError("OUTDIR " + outdir + ": cannot create this directory" +
                    (ec ? ": " + ec.message() : std::string()));
  remove_dead_writers_temporaries(outdir, {"model.safetensors", "config.json"});
  write_safetensors(outdir + "/model.safetensors", tensors, {{"format", "pt"}});
  const std::string json = config_json(m, path, step);
  write_file_atomically(outdir + "/config.json", [&](std::FILE* f) {
    return std::fwrite(json.data(), 1, json.size(), f) == json.size();
  });
}

int export_main(const std::vector<std::string>& args) {
  std::vector<std::string> positional;
  std::string format;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kExportUsage, stdout);
      return kExitOk;
    }
    if (a == "--format") {
      if (i + 1 == args.size()) {
        std::fprintf(stderr, "trellis export: error: --format needs a value (hf-gpt2)\n");
        return kExitBadInput;
      }
      format = args[++i];
    } else if (a.rfind("--format=", 0) == 0) {
      format = a.substr(9);
    } else if (a.rfind("--", 0) == 0) {
      std::fprintf(stderr, "trellis export: error: unknown option '%s'\n%s", a.c_str(), kExportUsage);
      return kExitBadInput;
    } else {
      positional.push_back(a);
    }
  }
  if (positional.size() != 2 || format.empty()) {
    std::fprintf(stderr, "trellis export: error: expected CKPT --format hf-gpt2 OUTDIR\n%s",
                 kExportUsage);
    return kExitBadInput;
  }
  if (format != "hf-gpt2") {
    std::fprintf(stderr, "trellis export: error: --format %s: unknown format (expected hf-gpt2)\n",
                 format.c_str());
    return kExitBadInput;
  }
  std::string path;
  try {
    // (A directory names no step: said below, with the file chosen for it.)
    ChosenCheckpoint chosen(positional[0], MPI_COMM_NULL, "trellis export");
    chosen.fault_point("setup");
    for (;;) {
      try {
        export_hf_gpt2(chosen.path(), positional[1]);
        break;
      } catch (const UserError& e) {
        if (chosen.choose_again(e.what())) continue;
        throw UserError(chosen.explained(e.what()));
      }
    }
    path = chosen.path();
  } catch (const UserError& e) {
    std::fprintf(stderr, "trellis export: error: %s\n", e.what());
    return kExitBadInput;
  }
  const std::filesystem::path out(positional[1]);  // ("hf-model/" names it as "hf-model" does)
  std::printf("exported %s → %s, %s (HF GPT-2)\n", path.c_str(),
              (out / "config.json").lexically_normal().c_str(),
              (out / "model.safetensors").lexically_normal().c_str());
  return kExitOk;
}

}  // namespace trellis
