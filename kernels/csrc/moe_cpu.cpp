// Fused experts (CPU): a mixture-of-experts layer's experts over one step's tokens (kvpilot/kernels/fused_moe.py).
//
// The step's (token, slot) pairs are counted and laid out by expert (a counting sort, stable: tokens in order
// within an expert), the tokens' rows gathered once, and each expert that has pairs runs its gated MLP over its
// rows: its weights read once a step, however many tokens chose it (a loop over tokens reads them once a token; a
// mask per expert touches every token for every expert). Then each token's slots are summed, weighted, in float32.
// Weights dense (float32 / bfloat16: ATen's matmuls) or in panels of GGUF-style blocks (gguf_linear_panel's
// layouts and instruction sets; the gate's SiLU and the up product ride on its epilogues).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <string>
#include <vector>

torch::Tensor gguf_linear_panel(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m, int64_t kind, int64_t n,
                                c10::optional<torch::Tensor> bias, int64_t epilogue, c10::optional<torch::Tensor> other, std::string isa,
                                c10::optional<torch::Tensor> perm);

namespace {

constexpr int64_t EPILOGUE_NONE = 0, EPILOGUE_SILU = 1, EPILOGUE_MUL = 2;  // gguf_linear_panel's

struct Grouping {
  std::vector<int64_t> offsets;  // [experts + 1]: expert e's rows are offsets[e] .. offsets[e + 1] of the grouped order
  std::vector<int64_t> row_of;   // [pairs]: pair t * top_k + j -> its row in the grouped order
  torch::Tensor tokens;          // int64 [pairs]: each grouped row's token
};

Grouping group_by_expert(const torch::Tensor& ids, int64_t experts) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == torch::kLong && ids.is_contiguous(), "ids: contiguous int64 [tokens, top_k]");
  const int64_t pairs = ids.numel(), top_k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  Grouping g;
  g.offsets.assign(experts + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < experts, "ids: an expert index outside [0, ", experts, ")");
    ++g.offsets[id[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) g.offsets[e + 1] += g.offsets[e];
  std::vector<int64_t> next(g.offsets.begin(), g.offsets.end() - 1);
  g.row_of.resize(pairs);
  g.tokens = torch::empty({pairs}, ids.options());
  int64_t* token = g.tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t row = next[id[i]]++;
    g.row_of[i] = row;
    token[row] = i / top_k;
  }
  return g;
}

// out[t] = sum_j weights[t, j] * rows[row_of[t * top_k + j]] (rows float32 [pairs, hidden]), cast to `dtype`.
torch::Tensor combine(const torch::Tensor& rows, const torch::Tensor& weights, const Grouping& g, at::ScalarType dtype) {
  const int64_t tokens = weights.size(0), top_k = weights.size(1), hidden = rows.size(1);
  auto out = torch::empty({tokens, hidden}, rows.options());
  const float* r = rows.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* dst = o + t * hidden;
      for (int64_t c = 0; c < hidden; ++c) dst[c] = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        const float wj = w[t * top_k + j];
        const float* src = r + g.row_of[t * top_k + j] * hidden;
        for (int64_t c = 0; c < hidden; ++c) dst[c] += wj * src[c];
      }
    }
  });
  return dtype == torch::kFloat ? out : out.to(dtype);
}

void check_routing(const torch::Tensor& x, const torch::Tensor& weights, const torch::Tensor& ids) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [tokens, hidden]");
  TORCH_CHECK(weights.scalar_type() == torch::kFloat && weights.is_contiguous() && weights.sizes() == ids.sizes() && weights.size(0) == x.size(0),
              "weights: contiguous float32 [tokens, top_k], as ids");
}

}  // namespace

// Experts as dense matrices: w13 [experts, 2 * inner, hidden] (gate rows, then up rows), w2 [experts, hidden, inner], in x's dtype.
torch::Tensor fused_experts_dense(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor weights, torch::Tensor ids, bool gelu) {
  check_routing(x, weights, ids);
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) && w13.size(1) == 2 * w2.size(2) && w13.size(2) == x.size(1) &&
              w2.size(1) == x.size(1) && w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "w13 [experts, 2 * inner, hidden] and w2 [experts, hidden, inner] in x's dtype");
  const int64_t inner = w2.size(2);
  const Grouping g = group_by_expert(ids, w13.size(0));
  const auto grouped = x.index_select(0, g.tokens);
  auto rows = torch::empty({ids.numel(), x.size(1)}, x.options().dtype(torch::kFloat));
  for (int64_t e = 0; e < w13.size(0); ++e) {
    const int64_t start = g.offsets[e], n = g.offsets[e + 1] - start;
    if (n == 0) continue;
    const auto h = at::mm(grouped.narrow(0, start, n), w13[e].t());
    const auto gate = h.narrow(1, 0, inner), up = h.narrow(1, inner, inner);
    const auto gated = (gelu ? at::gelu(gate, "tanh") : at::silu(gate)) * up;
    rows.narrow(0, start, n).copy_(at::mm(gated, w2[e].t()));
  }
  return combine(rows, weights, g, x.scalar_type());
}

// Experts in panels (gguf_linear_panel's layout), each projection's experts stacked on a leading dimension: gate and
// up [experts, ...] of `inner` output rows, down [experts, ...] of hidden; x float32.
torch::Tensor fused_experts_panel(torch::Tensor x, torch::Tensor weights, torch::Tensor ids, torch::Tensor gate_qs, torch::Tensor gate_d,
                                  c10::optional<torch::Tensor> gate_m, int64_t gate_kind, torch::Tensor up_qs, torch::Tensor up_d,
                                  c10::optional<torch::Tensor> up_m, int64_t up_kind, torch::Tensor down_qs, torch::Tensor down_d,
                                  c10::optional<torch::Tensor> down_m, int64_t down_kind, int64_t inner, bool gelu, std::string isa) {
  check_routing(x, weights, ids);
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "x: float32 rows");
  const int64_t experts = gate_qs.size(0), hidden = x.size(1);
  TORCH_CHECK(up_qs.size(0) == experts && down_qs.size(0) == experts && gate_d.size(0) == experts && up_d.size(0) == experts &&
              down_d.size(0) == experts, "every projection's panels stacked for the same experts");
  const Grouping g = group_by_expert(ids, experts);
  const auto grouped = x.index_select(0, g.tokens);
  auto rows = torch::empty({ids.numel(), hidden}, x.options());
  auto pick = [](const c10::optional<torch::Tensor>& m, int64_t e) { return m ? c10::optional<torch::Tensor>(m->select(0, e)) : c10::nullopt; };
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t start = g.offsets[e], n = g.offsets[e + 1] - start;
    if (n == 0) continue;
    const auto xe = grouped.narrow(0, start, n);
    auto gated = gguf_linear_panel(xe, gate_qs.select(0, e), gate_d.select(0, e), pick(gate_m, e), gate_kind, inner, c10::nullopt,
                                   gelu ? EPILOGUE_NONE : EPILOGUE_SILU, c10::nullopt, isa, c10::nullopt);
    if (gelu) gated = at::gelu(gated, "tanh");
    const auto h = gguf_linear_panel(xe, up_qs.select(0, e), up_d.select(0, e), pick(up_m, e), up_kind, inner, c10::nullopt, EPILOGUE_MUL, gated,
                                     isa, c10::nullopt);
    rows.narrow(0, start, n).copy_(gguf_linear_panel(h, down_qs.select(0, e), down_d.select(0, e), pick(down_m, e), down_kind, hidden,
                                                     c10::nullopt, EPILOGUE_NONE, c10::nullopt, isa, c10::nullopt));
  }
  return combine(rows, weights, g, torch::kFloat);
}
