// The synthetic source: a random Markov source of order k over V tokens. Each context (the
// previous k tokens) has `branching` distinct successors, chosen and weighted (a symmetric
// Dirichlet(alpha) draw) by a stream seeded from a hash of (seed, context), so nothing is
// enumerated up front. Its entropy rate Σ π(ctx)·H(next | ctx) is the lowest loss a model can
// reach; π is computed exactly by power iteration over the closed class the corpus ends in when
// V^k is small enough, else estimated from the corpus' own context frequencies.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <unordered_set>
#include <vector>

#include "core/error.hpp"
#include "core/watchdog.hpp"
#include "data/data.hpp"
#include "data/rng.hpp"

namespace trellis {
namespace {

using namespace data_rng;

// Exact π when V^k ≤ 2^22 contexts and V^k · branching ≤ 2^20 transitions: the power
// iteration takes ~100-200 sweeps over the transitions, about a second at 2^20 (V = 512,
// order 2, branching 4); beyond that π is estimated from the corpus.
constexpr uint64_t kMaxDenseStates = uint64_t{1} << 22;
constexpr uint64_t kMaxDenseEdges = uint64_t{1} << 20;
// Power iteration of P_eps = eps·I + (1 - eps)·P: the same π, aperiodic. It stops when the L1
// change of one step is below kPowerTol, or after kPowerBudget transition updates in all.
constexpr double kLazy = 0.2;
constexpr double kPowerTol = 1e-13;
constexpr double kPowerBudget = 2.0e9;

struct Law {
  uint64_t seed;
  int vocab, order, branching;
  double alpha;
};

/// Successors of `ctx` (order tokens) into tok[branching], prob[branching]; returns H in nats.
double law_successors(const Law& law, const int32_t* ctx, int32_t* tok, double* prob) {
  uint64_t h = hash_combine(mix64(law.seed ^ 0x53594E5448455449ull), uint64_t(law.order));
  for (int i = 0; i < law.order; ++i) h = hash_combine(h, uint64_t(uint32_t(ctx[i])));
  SplitMix64 g(h);
  const int V = law.vocab, b = law.branching;
  // Floyd's sampling of b distinct tokens out of V.
  if (b <= 64) {
    int n = 0;
    for (int j = V - b; j < V; ++j) {
      int32_t t = int32_t(below(g, uint64_t(j) + 1));
      if (std::find(tok, tok + n, t) != tok + n) t = j;
      tok[n++] = t;
    }
  } else {
    std::unordered_set<int32_t> chosen;
    chosen.reserve(size_t(b) * 2);
    int n = 0;
    for (int j = V - b; j < V; ++j) {
      int32_t t = int32_t(below(g, uint64_t(j) + 1));
      if (chosen.count(t)) t = j;
      chosen.insert(t);
      tok[n++] = t;
    }
  }
  // Dirichlet(alpha): normalized gamma variates, in log space.
  double mx = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < b; ++i) {
    prob[i] = log_gamma_variate(g, law.alpha);
    mx = std::max(mx, prob[i]);
  }
  double sum = 0.0;
  for (int i = 0; i < b; ++i) sum += (prob[i] = std::exp(prob[i] - mx));
  double H = 0.0;
  for (int i = 0; i < b; ++i) {
    prob[i] /= sum;
    if (prob[i] > 0.0) H -= prob[i] * std::log(prob[i]);
  }
  return H;
}

/// Index of the successor drawn by u ∈ [0, 1).
inline int pick(const double* prob, int b, double u) {
  double c = 0.0;
  for (int i = 0; i < b - 1; ++i) {
    c += prob[i];
    if (u < c) return i;
  }
  return b - 1;
}

class SyntheticSource final : public TokenSource {
 public:
  SyntheticSource(const DataConfig& data, const ModelConfig& model, int64_t skip) : skip_(skip) {
    if (model.vocab < 1)
      throw UserError(strfmt("data: synthetic source needs model.vocab ≥ 1 (got %d)", model.vocab));
    if (data.synthetic_order < 0)
      throw UserError(strfmt("data.synthetic_order must be ≥ 0 (got %d)", data.synthetic_order));
    if (data.synthetic_branching < 1 || data.synthetic_branching > model.vocab)
      throw UserError(strfmt("data.synthetic_branching must be in [1, model.vocab = %d] (got %d)",
                             model.vocab, data.synthetic_branching));
    if (!(data.synthetic_alpha > 0.0) || !std::isfinite(data.synthetic_alpha))
      throw UserError(strfmt("data.synthetic_alpha must be a positive number (got %g)",
                             data.synthetic_alpha));
    if (data.synthetic_tokens < 1)
      throw UserError(strfmt("data.synthetic_tokens must be ≥ 1 (got %lld)",
                             static_cast<long long>(data.synthetic_tokens)));
    law_ = Law{data.synthetic_seed, model.vocab, data.synthetic_order, data.synthetic_branching,
                data.synthetic_alpha};
    // V^k, saturating.
    uint64_t states = 1;
    bool big = false;
    for (int i = 0; i < law_.order && !big; ++i) {
      if (states > kMaxDenseStates) big = true;
      states *= uint64_t(law_.vocab);
    }
    big = big || states > kMaxDenseStates || states * uint64_t(law_.branching) > kMaxDenseEdges;
    // The held-out source walks on from where the training corpus ends: the walk of skip + n
    // tokens, its first skip dropped (each token takes one draw, so the prefix is the corpus).
    const int64_t n = skip_ + data.synthetic_tokens;
    if (big)
      generate_estimated(n);
    else
      generate_exact(n, states);
    if (skip_ > 0) {
      tokens_.erase(tokens_.begin(), tokens_.begin() + skip_);
      tokens_.shrink_to_fit();  // the training corpus is held by the training source
    }
  }

  std::string describe() const override {
    std::string floor = estimated_
                            ? strfmt("entropy floor %.4f nats/token (estimated from the corpus' "
                                     "context frequencies)", floor_)
                            : strfmt("entropy floor %.4f nats/token%s", floor_,
                                     converged_ ? "" : " (power iteration not fully converged)");
    return strfmt(
               "synthetic Markov source%s: %lld tokens, vocab %d, order %d, %d successors per "
               "context (Dirichlet alpha %g, seed %llu), ",
               skip_
                   ? strfmt(" (held out: the walk's tokens from %lld on)", (long long)skip_).c_str()
                   : "",
               static_cast<long long>(tokens_.size()), law_.vocab, law_.order, law_.branching,
               law_.alpha, static_cast<unsigned long long>(law_.seed)) +
           floor;
  }
  int vocab() const override { return law_.vocab; }
  int64_t size() const override { return int64_t(tokens_.size()); }
  int64_t num_windows(int len) const override {
    return std::max<int64_t>(0, size() - len + 1);
  }
  void window(int64_t k, int len, int32_t* out) const override {
    TRELLIS_CHECK(k >= 0 && len >= 0 && k + len <= size(), "window %lld of %d tokens",
                  static_cast<long long>(k), len);
    std::copy_n(tokens_.data() + k, len, out);
  }
  std::optional<double> entropy_floor() const override { return floor_; }

 private:
  Law law_{};
  int64_t skip_;  // tokens of the walk before this source's: 0, or the training corpus' length
  std::vector<int32_t> tokens_;  // (data.synthetic_tokens, or the held-out count) the walk's tokens
  double floor_ = 0.0;
  bool estimated_ = false;
  bool converged_ = true;

  // A long corpus (billions of tokens) is progress for the hang watchdog, every 2^20 tokens.
  static constexpr int64_t kBeatEvery = (int64_t(1) << 20) - 1;

  Xoshiro256 corpus_rng() const { return Xoshiro256(hash_combine(law_.seed, 0xC0524755ull)); }

  /// Fills the first max(n, order) entries of tokens_ with a random initial context.
  void initial_context(Xoshiro256& rng, int64_t n) {
    tokens_.assign(size_t(std::max<int64_t>(n, law_.order)), 0);
    for (int i = 0; i < law_.order; ++i) tokens_[i] = int32_t(below(rng, uint64_t(law_.vocab)));
  }

  // Large V^k: successors computed on the fly; π estimated by the corpus' context frequencies,
  // i.e. the floor is the mean of H(next | ctx) over the corpus' positions.
  void generate_estimated(int64_t n) {
    estimated_ = true;
    Xoshiro256 rng = corpus_rng();
    initial_context(rng, n);
    const int k = law_.order, b = law_.branching;
    std::vector<int32_t> tok(b);
    std::vector<double> prob(b);
    double hsum = 0.0;
    for (int64_t t = k; t < n; ++t) {
      if ((t & kBeatEvery) == 0) watchdog_beat("generating the synthetic corpus");
      hsum += law_successors(law_, tokens_.data() + t - k, tok.data(), prob.data());
      tokens_[t] = tok[pick(prob.data(), b, uniform(rng))];
    }
    floor_ = n > k ? hsum / double(n - k)
                   : law_successors(law_, tokens_.data(), tok.data(), prob.data());
    tokens_.resize(size_t(n));
  }

  // V^k small: every context met gets a compact id and a cached row of successors; π is the
  // stationary distribution of the closed class the corpus ends in (power iteration of the lazy
  // chain eps·I + (1 - eps)·P, which has the same π and is aperiodic, started from the corpus'
  // context frequencies on that class).
  void generate_exact(int64_t n, uint64_t states) {
    const int k = law_.order, b = law_.branching;
    const uint64_t V = uint64_t(law_.vocab);
    const uint64_t shift_mod = k == 0 ? 1 : states / V;  // V^(k-1)
    std::vector<int32_t> id(size_t(states), -1);
    std::vector<uint64_t> code_of;
    std::vector<int32_t> succ;  // (ids, b) successor tokens
    std::vector<double> prob;   // (ids, b)
    std::vector<double> H;      // (ids,)
    std::vector<int32_t> ctx(static_cast<size_t>(k));
    auto state = [&](uint64_t code) -> int32_t {
      int32_t& s = id[size_t(code)];
      if (s >= 0) return s;
      s = int32_t(code_of.size());
      code_of.push_back(code);
      uint64_t c = code;
      for (int i = k - 1; i >= 0; --i) {
        ctx[size_t(i)] = int32_t(c % V);
        c /= V;
      }
      succ.resize(succ.size() + size_t(b));
      prob.resize(prob.size() + size_t(b));
      H.push_back(law_successors(law_, ctx.data(), succ.data() + size_t(s) * b,
                                 prob.data() + size_t(s) * b));
      return s;
    };
    auto next_code = [&](uint64_t code, int32_t t) -> uint64_t {
      return k == 0 ? 0 : (code % shift_mod) * V + uint64_t(t);
    };

    Xoshiro256 rng = corpus_rng();
    initial_context(rng, n);
    uint64_t code = 0;
    for (int i = 0; i < k; ++i) code = code * V + uint64_t(tokens_[i]);
    std::vector<double> count;
    for (int64_t t = k; t < n; ++t) {
      if ((t & kBeatEvery) == 0) watchdog_beat("generating the synthetic corpus");
      const int32_t s = state(code);
      if (size_t(s) >= count.size()) count.resize(size_t(s) + 1, 0.0);
      count[size_t(s)] += 1.0;
      const int32_t tok = succ[size_t(s) * b + pick(&prob[size_t(s) * b], b, uniform(rng))];
      tokens_[t] = tok;
      code = next_code(code, tok);
    }
    tokens_.resize(size_t(n));
    const int32_t last = state(code);
    if (size_t(last) >= count.size()) count.resize(size_t(last) + 1, 0.0);
    count[size_t(last)] += 1.0;

    // The states reachable from the last context (its closed class, in practice).
    std::vector<int32_t> reach{last};
    std::vector<char> seen(code_of.size(), 0);
    seen[size_t(last)] = 1;
    std::vector<int32_t> next_id;  // (ids, b)
    for (size_t r = 0; r < reach.size(); ++r) {
      const int32_t s = reach[r];
      for (int i = 0; i < b; ++i) {
        const int32_t ns = state(next_code(code_of[size_t(s)], succ[size_t(s) * b + i]));
        if (next_id.size() < code_of.size() * b) next_id.resize(code_of.size() * b, -1);
        if (seen.size() < code_of.size()) seen.resize(code_of.size(), 0);
        next_id[size_t(s) * b + i] = ns;
        if (!seen[size_t(ns)]) {
          seen[size_t(ns)] = 1;
          reach.push_back(ns);
        }
      }
    }
    count.resize(code_of.size(), 0.0);

    // Renumber the class 0..R-1 in BFS order so that the iteration runs over dense arrays.
    const size_t R = reach.size();
    std::vector<int32_t> rid(code_of.size(), -1);
    for (size_t r = 0; r < R; ++r) rid[size_t(reach[r])] = int32_t(r);
    std::vector<int32_t> to(R * b);   // (R, b) successor's class index
    std::vector<double> w(R * b);     // (R, b) (1 - eps) · probability
    std::vector<double> pi(R), nxt(R), h(R);
    double total = 0.0;
    for (size_t r = 0; r < R; ++r) {
      const size_t s = size_t(reach[r]);
      for (int i = 0; i < b; ++i) {
        to[r * b + i] = rid[size_t(next_id[s * b + i])];
        w[r * b + i] = (1.0 - kLazy) * prob[s * b + i];
      }
      h[r] = H[s];
      total += pi[r] = count[s];
    }
    for (double& x : pi) x /= total;
    const int64_t max_iter =
        std::max<int64_t>(1000, int64_t(kPowerBudget / (double(R) * double(b))));
    converged_ = false;
    for (int64_t it = 0; it < max_iter; ++it) {
      for (size_t r = 0; r < R; ++r) nxt[r] = kLazy * pi[r];
      for (size_t r = 0; r < R; ++r) {
        const double m = pi[r];
        const double* wr = &w[r * b];
        const int32_t* tr = &to[r * b];
        for (int i = 0; i < b; ++i) nxt[size_t(tr[i])] += m * wr[i];
      }
      double diff = 0.0;
      for (size_t r = 0; r < R; ++r) diff += std::abs(nxt[r] - pi[r]);
      pi.swap(nxt);
      if (diff < kPowerTol) {
        converged_ = true;
        break;
      }
    }
    double norm = 0.0, rate = 0.0;
    for (size_t r = 0; r < R; ++r) {
      norm += pi[r];
      rate += pi[r] * h[r];
    }
    floor_ = rate / norm;
  }
};

}  // namespace

SyntheticSuccessors synthetic_successors(uint64_t seed, int vocab, int order, int branching,
                                         double alpha, const int32_t* context) {
  TRELLIS_CHECK(vocab >= 1 && order >= 0 && branching >= 1 && branching <= vocab && alpha > 0,
                "vocab %d order %d branching %d alpha %g", vocab, order, branching, alpha);
  SyntheticSuccessors out;
  out.tokens.resize(size_t(branching));
  out.probs.resize(size_t(branching));
  law_successors(Law{seed, vocab, order, branching, alpha}, context, out.tokens.data(),
                 out.probs.data());
  return out;
}

std::unique_ptr<TokenSource> make_synthetic_source(const DataConfig& data, const ModelConfig& model,
                                                   int64_t skip) {
  return std::make_unique<SyntheticSource>(data, model, skip);
}

}  // namespace trellis
