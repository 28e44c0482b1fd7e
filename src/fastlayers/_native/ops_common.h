// fastlayers' C++ operators, what every family's operators share: the C kernels' declarations
// (linked in from lstm.c, gru.c, local.c, matmul.c), their typed table, and the dtype helpers.
// Included once, by ops.cpp: the operator library is one translation unit (torch's headers are
// parsed once; a build takes about 15 s), split into files by layer family.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>


extern "C" {
#define FL_LSTM_FWD(T, S)                                                                              \
  void lstm_step_forward_##S(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const T*, T*,     \
                             const T*, const T*, const T*, T*, T*, const T*, T*, T*, T*, T*, T*, T*,  \
                             T*, T*, const T*, const T*, const T*, const T*, T, T, const T*, const T*, \
                             T, T, int);
#define FL_LSTM_LOOP(T, S)                                                                             \
  void lstm_forward_loop_##S(int64_t, int64_t, int64_t, const int64_t*, int64_t, int64_t, const T*, T*, T*, \
                             const T*, T*, const T*, const T*, T*, T*, const T*, T*, T*, T*, T*, T*, T*,    \
                             T*, T*, const T*, const T*, const T*, const T*, T, T, const T*, const T*, T, T, \
                             int, int, int);
#define FL_GRU_FWD(T, S)                                                                               \
  void gru_step_forward_##S(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const T*, T*, const T*,  \
                            const T*, const T*, T*, const T*, const T*, T*, T*, T*, T*, T*, T*, T*,      \
                            const T*, T, const T*, T, int);
#define FL_GRU_LOOP(T, S)                                                                              \
  void gru_forward_loop_##S(int64_t, int64_t, int64_t, const int64_t*, int64_t, int64_t, const T*, T*, T*,  \
                            const T*, T*, const T*, const T*, T*, const T*, const T*, T*, T*, T*, T*, T*, T*, \
                            T*, const T*, T, const T*, T, int, int, int);
#define FL_LC2D(T, S)                                                                                  \
  void lc2d_forward_##S(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t,        \
                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,      \
                        int64_t, int, int64_t*);                                                     \
  void lc2d_backward_input_##S(const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t, int64_t,  \
                               int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,        \
                               int64_t, int);                                                        \
  void lc2d_backward_params_##S(const T*, const T*, T*, T*, int64_t, int64_t, int64_t, int64_t,      \
                                int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,       \
                                int64_t, int64_t, int, int64_t*);
#define FL_MATMUL(T, S)                                                                                \
  void fl_matmul_##S(int64_t, int64_t, int64_t, int64_t, const T*, const int64_t*, const T*, int, const T*, T*, T*, \
                     T*, int);
FL_LSTM_FWD(float, f32)
FL_LSTM_FWD(double, f64)
FL_LSTM_LOOP(float, f32)
FL_LSTM_LOOP(double, f64)
FL_GRU_FWD(float, f32)
FL_GRU_FWD(double, f64)
FL_GRU_LOOP(float, f32)
FL_GRU_LOOP(double, f64)
FL_LC2D(float, f32)
FL_LC2D(double, f64)
FL_MATMUL(float, f32)
FL_MATMUL(double, f64)
int fl_matmul_preferred(int64_t rows);
int64_t fl_matmul_scratch_rows(void);
}


namespace {

template <typename T> struct Kernels;
template <> struct Kernels<float> {
  static constexpr auto lstm = lstm_step_forward_f32;
  static constexpr auto lstm_loop = lstm_forward_loop_f32;
  static constexpr auto gru = gru_step_forward_f32;
  static constexpr auto gru_loop = gru_forward_loop_f32;
  static constexpr auto lc2d = lc2d_forward_f32;
  static constexpr auto lc2d_dx = lc2d_backward_input_f32;
  static constexpr auto lc2d_dw = lc2d_backward_params_f32;
  static constexpr auto matmul = fl_matmul_f32;
};
template <> struct Kernels<double> {
  static constexpr auto lstm = lstm_step_forward_f64;
  static constexpr auto lstm_loop = lstm_forward_loop_f64;
  static constexpr auto gru = gru_step_forward_f64;
  static constexpr auto gru_loop = gru_forward_loop_f64;
  static constexpr auto lc2d = lc2d_forward_f64;
  static constexpr auto lc2d_dx = lc2d_backward_input_f64;
  static constexpr auto lc2d_dw = lc2d_backward_params_f64;
  static constexpr auto matmul = fl_matmul_f64;
};

at::ScalarType compute_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Optional tensor in the compute dtype, contiguous (undefined stays undefined).
at::Tensor as(const at::Tensor& t, at::ScalarType dtype) {
  if (!t.defined() || (t.scalar_type() == dtype && t.is_contiguous())) return t;  // (no dispatch: the common case)
  return t.to(dtype).contiguous();
}
at::Tensor as(const std::optional<at::Tensor>& t, at::ScalarType dtype) {
  return t.has_value() ? as(*t, dtype) : at::Tensor();
}

template <typename T> T* ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr<T>() : nullptr; }

// An operand the kernels read through a raw pointer: absent, or a CPU tensor of exactly `shape`
// (a leading dimension of 1 may be left out). The kernels trust these sizes: without the check a
// wrong one reads past the tensor's end.
void check_operand(const std::optional<at::Tensor>& t, const char* name, std::vector<int64_t> shape) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->device().is_cpu(), name, ": expected a CPU tensor (this C++ kernel runs CPU tensors), got ",
              t->device());
  const at::IntArrayRef want(shape);
  TORCH_CHECK(t->sizes().equals(want) || (!shape.empty() && shape[0] == 1 && t->sizes().equals(want.slice(1))),
              name, ": expected shape ", want, ", got ", t->sizes());
}


}  // namespace
