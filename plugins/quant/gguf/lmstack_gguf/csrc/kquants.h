// GGUF K-quants (Q2_K-Q6_K) and Q5_0 / Q5_1 kept packed (kquants.cpp; Q4_K panels' slabs too); bound to Python in
// gguf_matmul.cpp's module, which also provides the two helpers declared first.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace gguf_matmul {
int64_t best_isa();  // 2: AVX-512 (F, BW, DQ, VL, VNNI), 1: AVX2+FMA+F16C, 0: scalar
// x fp32 [M, K] -> (int8 q [M, K], dx [M, K / 32], dx * sum(q) [M, K / 32]) per 32-block.
std::vector<torch::Tensor> quantize_q8(const torch::Tensor& x, int64_t isa);
}  // namespace gguf_matmul

namespace kquants {
std::vector<int64_t> kq_types();
int64_t kq_row_bytes(int64_t type, int64_t k);
torch::Tensor kq_dequantize(const torch::Tensor& w, int64_t type, int64_t k, std::optional<torch::Tensor> into,
                            int64_t isa);
torch::Tensor kq_matmul_q8(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t isa);
torch::Tensor kq_panel_dequantize(const torch::Tensor& packed, int64_t type, int64_t k, int64_t r0, int64_t r1,
                                  torch::Tensor into);
}  // namespace kquants
