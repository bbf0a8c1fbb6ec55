// The CUDA backend's token embedding gradient (cuda_embedding.cu): each token's rows added in an
// order the tokens alone fix, so that dwte comes out the same bits run to run. Checked bit for
// bit against that order computed here, and the atomics it replaces (TRELLIS_EMBEDDING_SORTED=0)
// against the same values to 1e-4 (500 rows of one token added in another order). Skips when no
// CUDA device is present.
#include <bit>

#include "cuda_test_util.hpp"
#ifdef TRELLIS_HAVE_CUDA

namespace {

class CudaEmbedding : public CudaKernelTest {};

constexpr int kSumWarps = 8;  // cuda_embedding.cu's: warp w adds rows w, w + 8, ... of a token

/// dwte0 + each token's rows of dout in cuda_embedding.cu's order: the token's positions in
/// order, the i-th of them into partial sum i mod 8, then the partial sums in order, added once.
std::vector<float> fixed_order_gradient(const std::vector<float>& dwte0,
                                        const std::vector<float>& dout,
                                        const std::vector<int32_t>& tokens, int C, int vocab_begin,
                                        int vocab_count) {
  std::vector<std::vector<int>> positions(vocab_count);
  for (int n = 0; n < int(tokens.size()); ++n) {
    const int v = tokens[n] - vocab_begin;
    if (v >= 0 && v < vocab_count) positions[v].push_back(n);
  }
  std::vector<float> dwte = dwte0;
  for (int v = 0; v < vocab_count; ++v) {
    if (positions[v].empty()) continue;
    for (int c = 0; c < C; ++c) {
      float partial[kSumWarps] = {};
      for (size_t i = 0; i < positions[v].size(); ++i)
        partial[i % kSumWarps] += dout[size_t(positions[v][i]) * C + c];
      float sum = partial[0];
      for (int w = 1; w < kSumWarps; ++w) sum += partial[w];
      dwte[size_t(v) * C + c] += sum;
    }
  }
  return dwte;
}

/// How many entries of got differ from want in their bits.
size_t differing_bits(const std::vector<float>& got, const std::vector<float>& want) {
  size_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i)
    differ += std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i]);
  return differ;
}

// N = 5000 positions (3 tiles of the counting sort, the last partial), this rank's 1500 tokens
// from 7 (2 blocks of 1024 for the prefix sums) of a vocabulary of 1600: tokens below and above
// the rank's rows, one token at 1 position in 10 (500 rows: each warp 62 or 63), a few repeated
// a handful of times, most once or never. fp32 and bf16 dout, rows that take 16-byte chunks
// (several blocks of 32 chunks across, the last partly idle) and rows that do not.
TEST_F(CudaEmbedding, GradientAddsEachTokensRowsInAFixedOrder) {
  const int N = 5000, vocab_begin = 7, vocab_count = 1500, vocab = 1600;
  std::vector<int32_t> tokens(N);
  uint32_t state = 12345;
  for (int n = 0; n < N; ++n) {
    state = state * 1664525u + 1013904223u;
    const uint32_t r = state >> 8;
    tokens[n] = n % 10 == 3 ? 700 : r % 4 == 0 ? int(r / 4 % 40) * 37 % vocab : int(r % vocab);
  }
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    const bool bf16 = std::string(precision) == "bf16";
    for (const int C : {bf16 ? 520 : 516, 21}) {
      SCOPED_TRACE("C = " + std::to_string(C));
      const std::vector<float> dout_f = random_vec(size_t(N) * C, 50);
      const Bits dout_b = bits_of(dout_f);
      const std::vector<float> dout = bf16 ? widen(dout_b) : dout_f;  // as the GPU reads it
      const std::vector<float> dwte0 = random_vec(size_t(vocab_count) * C, 51);
      const std::vector<float> want =
          fixed_order_gradient(dwte0, dout, tokens, C, vocab_begin, vocab_count);
      for (const char* sorted : {"1", "0"}) {
        fresh_gpu({{"TRELLIS_EMBEDDING_SORTED", sorted}});
        gpu->set_precision(precision);
        int32_t* d_tok = up(tokens);
        float* d_dwte = up(dwte0);
        if (bf16)
          gpu->embedding_backward(d_dwte, up(dout_b), d_tok, N, C, vocab_begin, vocab_count);
        else
          gpu->embedding_backward(d_dwte, up(dout_f), d_tok, N, C, vocab_begin, vocab_count);
        const std::vector<float> got = down(d_dwte, dwte0.size());
        if (std::string(sorted) == "1") {
          const size_t differ = differing_bits(got, want);
          std::printf("embedding gradient %s C = %d: %zu of %zu differ from the fixed order\n",
                      precision, C, differ, got.size());
          EXPECT_EQ(differ, 0u);
        } else {
          expect_f32(got, want, 1e-4, "dwte by atomics (+=)");
        }
      }
    }
  }
}

// A micro-batch of one token repeated (a single run over every tile) and one of no token of this
// rank (no run at all): dwte gets the fixed-order sum, and stays as it was.
TEST_F(CudaEmbedding, GradientOfOneRepeatedTokenAndOfNone) {
  const int N = 2100, C = 16, vocab_begin = 100, vocab_count = 50;
  const std::vector<float> dout = random_vec(size_t(N) * C, 52);
  const std::vector<float> dwte0 = random_vec(size_t(vocab_count) * C, 53);
  for (const int token : {149, 99}) {
    SCOPED_TRACE("token " + std::to_string(token));
    const std::vector<int32_t> tokens(N, token);
    const std::vector<float> want =
        fixed_order_gradient(dwte0, dout, tokens, C, vocab_begin, vocab_count);
    float* d_dwte = up(dwte0);
    gpu->embedding_backward(d_dwte, up(dout), up(tokens), N, C, vocab_begin, vocab_count);
    const std::vector<float> got = down(d_dwte, dwte0.size());
    EXPECT_EQ(differing_bits(got, want), 0u);
  }
}

// A micro-batch past 32 tiles of 2048 positions (N = 70001: 32 tiles of 2188, the last one
// shorter) and tokens over 3 blocks of the prefix sums (2500 of this rank's, 100 above them),
// fp32 rows of two 16-byte chunks.
TEST_F(CudaEmbedding, GradientOverManyTiles) {
  const int N = 70001, C = 8, vocab_begin = 0, vocab_count = 2500;
  std::vector<int32_t> tokens(N);
  uint32_t state = 777;
  for (int32_t& t : tokens) {
    state = state * 1664525u + 1013904223u;
    t = int32_t((state >> 8) % 2600);
  }
  const std::vector<float> dout = random_vec(size_t(N) * C, 54);
  const std::vector<float> dwte0 = random_vec(size_t(vocab_count) * C, 55);
  const std::vector<float> want =
      fixed_order_gradient(dwte0, dout, tokens, C, vocab_begin, vocab_count);
  float* d_dwte = up(dwte0);
  gpu->embedding_backward(d_dwte, up(dout), up(tokens), N, C, vocab_begin, vocab_count);
  EXPECT_EQ(differing_bits(down(d_dwte, dwte0.size()), want), 0u);
}

}  // namespace

#endif  // TRELLIS_HAVE_CUDA
