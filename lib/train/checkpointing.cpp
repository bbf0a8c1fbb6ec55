#include "train/checkpointing.hpp"

#include <filesystem>

#include "comm/world.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace fs = std::filesystem;

namespace trellis {

Checkpointer::Checkpointer(const Config& cfg, const Grid& grid, const ParamTable& full,
                           const ParamTable& staged, ShardedParams& store, MPI_Comm world)
    : cfg_(cfg),
      grid_(grid),
      full_(full),
      staged_(staged),
      store_(store),
      world_(world),
      dp_(grid.dp_comm(), "dp checkpoint") {}

std::vector<CkptSlab> Checkpointer::slabs(const std::string& prefix, float* data,
                                          bool for_writing) const {
  const int tp_rank = grid_.tp_rank(), tp = grid_.tp_size();
  const int kv = cfg_.model.kv_heads;
  std::vector<CkptSlab> out;
  for (const ParamInfo& f : full_.params()) {
    CkptSlab s;
    s.name = prefix + f.name;
    s.global_shape = f.shape;
    s.col_begin = f.col_begin;
    s.col_end = f.col_end;
    const ParamInfo* mine = nullptr;
    for (const ParamInfo& p : staged_.params())
      if (p.name == f.name) mine = &p;
    if (mine) {
      s.rows = mine->rows;
      s.data = data + mine->offset;
      if (for_writing) {
        // One copy of everything: dp rank 0 writes; replicated tensors come from tp rank 0;
        // key/value rows shared by tp/kv ranks from the first of them (the others write only
        // their query rows, which come first locally).
        s.writer = grid_.dp_rank() == 0;
        if (mine->split == TpSplit::Replicated && tp_rank != 0) s.writer = false;
        if (mine->split == TpSplit::KvReplicated && tp_rank % (tp / kv) != 0) s.rows = {mine->rows[0]};
      }
    } else {
      s.writer = false;  // another pipeline stage holds it
    }
    out.push_back(std::move(s));
  }
  return out;
}

void Checkpointer::save(int64_t step) {
  std::vector<float> params = store_.gather_parameters(&dp_), m, v;
  store_.gather_optimizer_state(m, v, &dp_);
  std::vector<CkptSlab> all = slabs("model/", params.data(), true);
  for (auto& s : slabs("optim/m/", m.data(), true)) all.push_back(std::move(s));
  for (auto& s : slabs("optim/v/", v.data(), true)) all.push_back(std::move(s));

  const ParallelConfig& p = cfg_.parallel;
  CkptMeta meta;
  meta.integers["format_version"] = kCheckpointFormat;
  meta.integers["step"] = step;
  meta.integers["tokens_seen"] = step * int64_t(cfg_.train.global_batch) * cfg_.model.seq_len;
  meta.integers["train_seed"] = int64_t(cfg_.train.seed);
  meta.integers["adamw_steps"] = step;
  meta.text["deck"] = effective_deck_ini(cfg_);
  meta.text["layout"] = strfmt("dp=%d tp=%d pp=%d zero=%d schedule=%s virtual_stages=%d "
                               "sequence_parallel=%s", p.dp, p.tp, p.pp, p.zero, p.schedule.c_str(),
                               p.virtual_stages, p.sequence_parallel ? "true" : "false");
  meta.text["sampler"] = "stateless: sequence j of step s is window hash(train.seed, s, j); resume at step";

  const std::string dir = cfg_.checkpoint.dir;
  int rank = 0;
  MPI_Comm_rank(world_, &rank);
  // Rank 0 alone touches the directory and `latest`. Its failures (a full disk, a directory
  // removed under the run) are agreed, so that every rank throws the same UserError and none is
  // left waiting for it in a collective.
  auto on_rank0 = [&](auto&& work) {
    std::string err;
    if (rank == 0) {
      try {
        work();
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    err = agree_on_error(world_, err);
    if (!err.empty()) throw UserError(err);
  };
  on_rank0([&] { fs::create_directories(dir); });
  const std::string name = checkpoint_file_name(step);
  CkptIO io = write_checkpoint(world_, (fs::path(dir) / name).string(), all, meta);
  on_rank0([&] {
    publish_latest(dir, name);
    apply_retention(dir, cfg_.checkpoint.keep);
  });
  log(strfmt("checkpoint: %s/%s, %s in %.2f s (%.1f MB/s)", dir.c_str(), name.c_str(),
             format_bytes(io.bytes).c_str(), io.seconds, io.bytes / 1e6 / std::max(io.seconds, 1e-9)));
}

int64_t Checkpointer::load(const std::string& path) {
  const int64_t n = staged_.total();
  std::vector<float> params(n), m(n), v(n);
  std::vector<CkptSlab> all = slabs("model/", params.data(), false);
  for (auto& s : slabs("optim/m/", m.data(), false)) all.push_back(std::move(s));
  for (auto& s : slabs("optim/v/", v.data(), false)) all.push_back(std::move(s));
  CkptMeta meta;
  CkptIO io = read_checkpoint(world_, path, all, meta);
  const auto version = meta.integers.find("format_version");
  if (version == meta.integers.end() || version->second != kCheckpointFormat)
    throw UserError(path + ": not a Trellis checkpoint of format version " +
                    std::to_string(kCheckpointFormat));
  const int64_t step = meta.integers.at("step");
  store_.load_state(params.data(), m.data(), v.data(), step);
  log(strfmt("resumed from %s at step %lld (written as %s), %s in %.2f s (%.1f MB/s)", path.c_str(),
             (long long)step, meta.text["layout"].c_str(), format_bytes(io.bytes).c_str(),
             io.seconds, io.bytes / 1e6 / std::max(io.seconds, 1e-9)));
  return step;
}

std::optional<int64_t> Checkpointer::resume() {
  const std::string& how = cfg_.checkpoint.resume;
  if (how == "never") return std::nullopt;
  if (how != "auto") return load(how);  // an explicit path: any problem is the user's error
  for (const std::string& candidate : resume_candidates(world_, cfg_.checkpoint.dir)) {
    try {
      return load(candidate);
    } catch (const UserError& e) {
      log(std::string("warning: cannot resume from ") + candidate + ": " + e.what() +
          "; trying an older checkpoint");
    }
  }
  return std::nullopt;
}

}  // namespace trellis
