// fastlayers' operators as C++ (TORCH_LIBRARY): the schemas, and the CPU kernels that run them
// without Python (torch.export -> AOTInductor packages, LibTorch programs). One translation unit:
// the kernels of each layer family are in its own file, included here (ops_rnn.h, ops_local.h; what
// they share: ops_common.h; the block cache of the layers' per-call tensors: ops_cache.h). Python
// registers the fake (shape) functions and the autograd of these operators, each family its own
// (fastlayers/rnn/_ops_export.py, fastlayers/local/_ops_export.py), once fastlayers/_native/ops_lib.py
// has built and loaded the library.

#include <torch/library.h>

#include "ops_cache.h"
#include "ops_common.h"
#include "ops_local.h"
#include "ops_rnn.h"

TORCH_LIBRARY(fastlayers, m) {
  m.def("lstm_padded(Tensor x, Tensor? lengths, Tensor h0, Tensor c0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, "
        "Tensor? b_hh, Tensor? ln_ih, Tensor? ln_hh, Tensor? ln_cell_weight, Tensor? ln_cell_bias, Tensor? peephole, "
        "Tensor? w_hr, Tensor? rmask, Tensor? zc, Tensor? zh, float cell_clip, float z_c, float z_h, "
        "float proj_clip) -> (Tensor, Tensor, Tensor)");
  m.def("gru_padded(Tensor x, Tensor? lengths, Tensor h0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, "
        "Tensor? ln_ih, Tensor? ln_hh, Tensor? rmask, Tensor? zh, float z_h) -> (Tensor, Tensor)");
  m.def("rnn_padded(Tensor x, Tensor? lengths, Tensor h0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, "
        "bool relu) -> (Tensor, Tensor)");
  m.def("locally_connected2d(Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding, "
        "int[] dilation) -> Tensor");
  m.def("locally_connected2d_backward(Tensor grad, Tensor input, Tensor weight, int[] stride, int[] padding, "
        "int[] dilation, bool[] needs) -> (Tensor, Tensor, Tensor)");
  // the block cache (ops_cache.h): no tensor inputs, one kernel for every dispatch key
  m.def("cached_empty(int[] size, ScalarType dtype) -> Tensor", &cached_empty);
  m.def("cache_release() -> ()", &cache_release);
  m.def("cache_info() -> int[]", &cache_info);
  m.def("cache_limit(int bytes) -> ()", &cache_limit);
}

TORCH_LIBRARY_IMPL(fastlayers, CPU, m) {
  m.impl("lstm_padded", &lstm_padded);
  m.impl("gru_padded", &gru_padded);
  m.impl("rnn_padded", &rnn_padded);
  m.impl("locally_connected2d", &locally_connected2d);
  m.impl("locally_connected2d_backward", &locally_connected2d_backward);
}
