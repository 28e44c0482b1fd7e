// fastlayers' locally connected operators (locally_connected2d and its backward): their CPU
// kernels over local.c (Python half: fastlayers/local/_ops_export.py).
// Included once, by ops.cpp: the operator library is one translation unit (torch's headers are
// parsed once; a build takes about 15 s), split into files by layer family.

#pragma once

#include <vector>

#include "ops_common.h"

namespace {

std::vector<int64_t> geometry(const at::Tensor& padded, const at::Tensor& w, at::IntArrayRef stride,
                              at::IntArrayRef dilation) {
  return {padded.size(0), padded.size(1), padded.size(2), padded.size(3), w.size(0), w.size(2), w.size(3),
          w.size(4),      w.size(5),      stride[0],      stride[1],      dilation[0], dilation[1]};
}

// the kernels' work space: their table of C * KH * KW input offsets (local.c)
at::Tensor offsets_table(const std::vector<int64_t>& g) { return at::empty({g[1] * g[5] * g[6]}, at::kLong); }

at::Tensor pad2d(const at::Tensor& x, at::IntArrayRef padding) {
  if (padding[0] == 0 && padding[1] == 0) return x;
  return at::constant_pad_nd(x, {padding[1], padding[1], padding[0], padding[0]}, 0);
}

template <typename T>
at::Tensor local_impl(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  const auto dt = compute_dtype(input.scalar_type());
  const auto x = as(pad2d(input, padding), dt), w = as(weight, dt);
  const auto b = as(bias, dt);
  const auto g = geometry(x, w, stride, dilation);
  auto y = at::empty({x.size(0), w.size(0), w.size(4), w.size(5)}, x.options());
  auto table = offsets_table(g);
  Kernels<T>::lc2d(x.data_ptr<T>(), w.data_ptr<T>(), ptr<T>(b), y.data_ptr<T>(), g[0], g[1], g[2], g[3], g[4], g[5],
                   g[6], g[7], g[8], g[9], g[10], g[11], g[12], at::get_num_threads(), table.data_ptr<int64_t>());
  return y.to(input.scalar_type());
}

// The geometry the kernels trust (they read through raw pointers): input (B, C, H, W) and weight
// (O, C, KH, KW, OH, OW) on the CPU, OH and OW what the stride, padding and dilation give (as
// conv2d's output size), a bias (O, OH, OW), a gradient (B, O, OH, OW).
void check_local(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding,
                 at::IntArrayRef dilation) {
  TORCH_CHECK(input.dim() == 4 && weight.dim() == 6, "locally_connected2d: expected input (B, C, H, W) and weight "
              "(O, C, KH, KW, OH, OW), got ", input.sizes(), " and ", weight.sizes());
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(),
              "locally_connected2d: this C++ kernel runs CPU tensors, got ", input.device(), " and ", weight.device());
  TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
              "locally_connected2d: expected stride, padding and dilation of 2 values each, got ", stride, ", ",
              padding, " and ", dilation);
  for (int i = 0; i < 2; i++)
    TORCH_CHECK(stride[i] >= 1 && dilation[i] >= 1 && padding[i] >= 0, "locally_connected2d: expected stride >= 1, "
                "dilation >= 1 and padding >= 0, got ", stride, ", ", dilation, " and ", padding);
  TORCH_CHECK(weight.size(1) == input.size(1), "weight: expected (O, C, KH, KW, OH, OW) with C = ", input.size(1),
              " (the input's channels), got ", weight.sizes());
  int64_t out[2];
  for (int i = 0; i < 2; i++)
    out[i] = (input.size(2 + i) + 2 * padding[i] - dilation[i] * (weight.size(2 + i) - 1) - 1) / stride[i] + 1;
  TORCH_CHECK(weight.size(4) == out[0] && weight.size(5) == out[1] && out[0] >= 1 && out[1] >= 1,
              "weight: expected (O, C, KH, KW, OH, OW) with (OH, OW) = (", out[0], ", ", out[1], ") for input ",
              input.sizes(), ", stride ", stride, ", padding ", padding, " and dilation ", dilation, ", got ",
              weight.sizes());
}

at::Tensor locally_connected2d(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation) {
  check_local(input, weight, stride, padding, dilation);
  check_operand(bias, "bias", {weight.size(0), weight.size(4), weight.size(5)});
  at::NoGradGuard no_grad;
  if (compute_dtype(input.scalar_type()) == at::kDouble)
    return local_impl<double>(input, weight, bias, stride, padding, dilation);
  return local_impl<float>(input, weight, bias, stride, padding, dilation);
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> local_backward_impl(const at::Tensor& grad, const at::Tensor& input,
                                                                   const at::Tensor& weight, at::IntArrayRef stride,
                                                                   at::IntArrayRef padding, at::IntArrayRef dilation,
                                                                   const c10::List<bool>& needs) {
  const auto dt = compute_dtype(input.scalar_type());
  const auto dy = grad.to(dt).contiguous();
  const auto padded = pad2d(input, padding);
  const auto g = geometry(padded, weight, stride, dilation);
  const int threads = at::get_num_threads();
  at::Tensor dx = at::empty({0}, grad.options()), dw = at::empty({0}, grad.options()),
             db = at::empty({0}, grad.options());
  if (needs[0]) {
    const auto w = weight.to(dt).contiguous();
    auto dx_pad = at::zeros({g[0], g[1], g[2], g[3]}, dy.options());
    Kernels<T>::lc2d_dx(dy.data_ptr<T>(), w.data_ptr<T>(), dx_pad.data_ptr<T>(), g[0], g[1], g[2], g[3], g[4], g[5],
                        g[6], g[7], g[8], g[9], g[10], g[11], g[12], threads);
    dx = dx_pad.slice(2, padding[0], g[2] - padding[0]).slice(3, padding[1], g[3] - padding[1]);
    dx = dx.to(input.scalar_type()).contiguous();
  }
  if (needs[1] || needs[2]) {
    const auto x = padded.to(dt).contiguous();
    auto w_grad = needs[1] ? at::empty(weight.sizes(), dy.options()) : at::Tensor();
    auto b_grad = needs[2] ? at::empty({weight.size(0), weight.size(4), weight.size(5)}, dy.options()) : at::Tensor();
    auto table = offsets_table(g);
    Kernels<T>::lc2d_dw(dy.data_ptr<T>(), x.data_ptr<T>(), ptr<T>(w_grad), ptr<T>(b_grad), g[0], g[1], g[2], g[3],
                        g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], threads, table.data_ptr<int64_t>());
    if (needs[1]) dw = w_grad.to(weight.scalar_type());
    if (needs[2]) db = b_grad.to(weight.scalar_type());
  }
  return {dx, dw, db};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> locally_connected2d_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, const c10::List<bool>& needs) {
  TORCH_CHECK(needs.size() == 3, "needs: expected 3 flags (input, weight, bias)");
  check_local(input, weight, stride, padding, dilation);
  check_operand(grad, "grad", {input.size(0), weight.size(0), weight.size(4), weight.size(5)});
  at::NoGradGuard no_grad;
  if (compute_dtype(input.scalar_type()) == at::kDouble)
    return local_backward_impl<double>(grad, input, weight, stride, padding, dilation, needs);
  return local_backward_impl<float>(grad, input, weight, stride, padding, dilation, needs);
}

}  // namespace
