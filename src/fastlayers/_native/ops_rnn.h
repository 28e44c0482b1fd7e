// fastlayers' recurrent operators (lstm_padded, gru_padded, rnn_padded): their CPU kernels.
//
// Legend: T time (padded), B batch, F input features, H hidden size, G gates (4H LSTM, 3H GRU, H
// RNN), P output size (proj_size, or H), D directions (stacked in dim 0 of every weight), N the
// valid (t, b) rows of one direction (sum of the lengths).
//
// The recurrent operators take one layer (all directions) of a padded time-major batch with
// optional per-sequence lengths and return the padded output (zeros at t >= len_b) and the final
// states, torch's PackedSequence semantics: the forward direction ends at each sequence's own
// last step, the reverse one starts there. The CPU kernels run the same steps as the Python
// engine (fastlayers/rnn/_cpu.py, _cpu_recurrence.py): the valid rows of both directions packed
// step after step (the reverse direction reads each sequence back to front), one batched GEMM for
// the input projection, the time loop in one call of lstm.c / gru.c (linked in: per step the
// recurrent product on gemm.h's kernel and the fused step kernel; an LSTM with a projection runs
// per step an ATen GEMM, the step kernel and the projection's ATen ops), one scatter back to the
// padded layout. Forward only: Python registers the fake (shape) functions and the autograd of
// these operators (fastlayers/rnn/_ops_export.py); its eager layers call the C kernels through
// their own autograd Functions, and these operators where no gradient is recorded. With one direction the weights,
// biases, gains and masks may omit the leading D = 1 (as a cell's parameters are).
//
// float32 and float64 run in their dtype; bfloat16 / float16 in float32 (the operands are exact
// in float32), outputs in the input's dtype.
//
// Included once, by ops.cpp: the operator library is one translation unit (torch's headers are
// parsed once; a build takes about 15 s), split into files by layer family.

#pragma once


#include <vector>

#include "ops_common.h"

namespace {

constexpr double kEps = 1e-5;  // the LayerNorms' epsilon (fastlayers/rnn/_cpu_recurrence.py EPS)

template <typename T> T* at_row(const at::Tensor& t, int64_t row) {
  return t.defined() ? t.data_ptr<T>() + row * t.stride(1) : nullptr;
}

// The packing of a padded batch (fastlayers/rnn/_lengths.py make_plan): sequences sorted longest
// first (stable); at step t the active ones are a prefix of size active[t]; packed row k of
// direction d reads padded row src[d][k] of the (T*B, F) input.
struct Plan {
  at::Tensor order, unorder;  // (B,) int64: sorted -> original, original -> sorted
  std::vector<int64_t> active, offsets;  // per step; offsets has one more entry (the total N)
  at::Tensor src;  // (D, N) int64; undefined where the packing is the identity (identity())
  int64_t rows = 0;
  bool full = true;  // every sequence runs all T steps: the sorted order is the batch order
  // one direction, no padding: packed row k is padded row k (no index tensor, no gather or scatter)
  bool identity() const { return !src.defined(); }
};

Plan make_plan(const std::optional<at::Tensor>& lengths, int64_t steps, int64_t batch, int64_t dirs) {
  Plan p;
  std::vector<int64_t> len(batch, steps);
  if (lengths.has_value() && lengths->defined()) {
    TORCH_CHECK(lengths->dim() == 1 && lengths->size(0) == batch, "lengths: expected shape (", batch,
                "), got ", lengths->sizes());
    auto l = lengths->to(at::kCPU).to(at::kLong).contiguous();
    const int64_t* lp = l.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; b++) {
      // (the messages of the Python half's checks, fastlayers/_core/checks.py: torch's own first)
      TORCH_CHECK(lp[b] >= 1, "Length of all samples has to be greater than 0, but found an element in 'lengths' "
                  "that is <= 0; lengths: every length must be >= 1, got ", lp[b]);
      TORCH_CHECK(lp[b] <= steps, "lengths: every length must be <= T = ", steps, " (the padded time size), got ",
                  lp[b]);
      len[b] = lp[b];
    }
  }
  for (int64_t b = 0; b < batch; b++) p.full = p.full && len[b] == steps;
  std::vector<int64_t> order(batch);
  for (int64_t b = 0; b < batch; b++) order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len[a] > len[b]; });
  const int64_t longest = batch ? len[order[0]] : 0;
  p.offsets.push_back(0);
  for (int64_t t = 0; t < longest; t++) {
    int64_t n = 0;
    while (n < batch && len[order[n]] > t) n++;
    p.active.push_back(n);
    p.offsets.push_back(p.offsets.back() + n);
  }
  p.rows = p.offsets.back();
  if (p.full && dirs == 1) return p;
  p.src = at::empty({dirs, p.rows}, at::kLong);
  int64_t* s = p.src.data_ptr<int64_t>();
  for (int64_t t = 0, k = 0; t < longest; t++) {
    for (int64_t slot = 0; slot < p.active[t]; slot++, k++) {
      const int64_t seq = order[slot];
      s[k] = t * batch + seq;
      if (dirs == 2) s[p.rows + k] = (len[seq] - 1 - t) * batch + seq;
    }
  }
  if (!p.full) {
    p.order = at::tensor(order, at::kLong);
    p.unorder = at::empty_like(p.order);
    p.unorder.index_put_({p.order}, at::arange(batch, at::kLong));
  }
  return p;
}

// A state (D, B, X) in the sorted batch order, as a fresh tensor of `dtype` (the kernels update it).
at::Tensor sorted_state(const at::Tensor& t, const Plan& p, at::ScalarType dtype) {
  return p.full ? t.to(dtype, false, true).contiguous() : t.to(dtype).index_select(1, p.order).contiguous();
}

// A final state back in the batch order.
at::Tensor unsorted(const at::Tensor& t, const Plan& p) { return p.full ? t : t.index_select(1, p.unorder); }

// (D, T, B, X) masks in original time and batch order -> (D, N, X) packed rows.
at::Tensor pack_mask(const at::Tensor& m, const Plan& p, int64_t steps, int64_t batch, at::ScalarType dtype) {
  if (!m.defined()) return m;
  const int64_t dirs = m.size(0), width = m.size(3);
  if (p.identity()) return m.reshape({1, steps * batch, width}).to(dtype).contiguous();
  std::vector<at::Tensor> parts;
  for (int64_t d = 0; d < dirs; d++)
    parts.push_back(m[d].reshape({steps * batch, width}).index_select(0, p.src[d]));
  return at::stack(parts).to(dtype).contiguous();
}

// The packed output (D, N, P) -> padded (T, B, D*P), zeros at t >= len_b. With the identity
// packing `y` is the caller's own fresh tensor (out_rows), returned as a view. Outputs come from the
// block cache (ops_cache.h: no first-touch page faults on a repeated call).
at::Tensor scatter(const at::Tensor& y, const Plan& p, int64_t steps, int64_t batch) {
  const int64_t dirs = y.size(0), width = y.size(2);
  if (p.identity()) return y.view({steps, batch, width});
  auto dst = (p.src * dirs + at::arange(dirs, at::kLong).unsqueeze(1)).flatten();
  // every row is written when every sequence runs all T steps: no zero fill first
  const std::vector<int64_t> shape{steps * batch * dirs, width};
  return (p.full ? output_empty(shape, y.options()) : output_empty(shape, y.options()).zero_())
      .index_copy_(0, dst, y.reshape({dirs * p.rows, width}))
      .view({steps, batch, dirs * width});
}

// The packed output rows (D, N, X): the work space's region, or with the identity packing a fresh
// tensor that scatter() hands out as it is (no copy).
at::Tensor out_rows(const at::Tensor& region, const Plan& p, int64_t dirs, int64_t width,
                    const at::TensorOptions& opt) {
  return p.identity() ? output_empty({dirs, p.rows, width}, opt) : region;
}

// Whether one step (T = 1: a cell's call) of `dirs` weights W_hh (gsize x hidden) over `batch` rows
// runs its recurrent product on W_hh's transposed view (ATen bmm) instead of packing the weight for
// the time loop's kernel (lstm.c / gru.c), whose packing one step cannot amortise: a small weight
// (at most 64K values), a batch under 16 (the LayerNorm LSTMCell of hidden 512 at batch 1 took 4.6x
// torch.nn.LSTMCell's step with the packing, 1.1x without; GRUCell of hidden 1024 5.8x, 1.3x), or a
// weight of 2M values or more (LSTMCell of hidden 1024 at batch 32: 1.08-1.87x with the packing,
// 0.87-1.04x without, three runs each). Between those, at batch >= 16, the packed kernel was the
// faster (hidden 512 at batch 32: LSTMCell 0.87-0.90x against 0.96-1.00x, GRUCell 0.78-0.86x
// against 1.01-1.06x), and one step of both directions of the seed's layer keeps the loop, whose
// threads take a direction each (benchmarks/rnn/bench_cell_steps.py, Zen 5, 2 threads).
bool stepwise_step(int64_t batch, int64_t dirs, int64_t gsize, int64_t hidden) {
  const int64_t values = gsize * hidden;
  return batch < 16 || dirs * values <= 65536 || values >= (int64_t(1) << 21);
}

// A call's work space: its packed buffers are views of one block of the block cache (ops_cache.h;
// below its 1 MiB floor, torch's allocator), which comes back there when the call ends. The next
// call reuses it mapped already (first-touch page faults cost about 0.2 ms per MB on the project's
// machine, tens of ms per layer at the seed shape), and fastlayers.empty_cache() frees it between
// calls with the cache's other idle blocks. (A per-thread buffer kept each thread's largest call
// until the thread ended, which empty_cache could not free: one per thread that ever ran a call.)
struct Workspace {
  struct Region {
    std::vector<int64_t> shape;  // empty: absent (a null pointer, an undefined tensor)
    bool view;                   // also wanted as a tensor (an operand of an ATen op); else a pointer only
  };
  struct Taken {
    std::vector<at::Tensor> views;  // undefined where !view
    std::vector<char*> pointers;    // the base pointers (null where absent)
    at::Tensor held;                // the block: keep it for the call (the views do not own it)
  };

  // One buffer per region, all of `dtype`, 64-byte aligned in one block (both allocators align it).
  static Taken take(const std::vector<Region>& regions, at::ScalarType dtype) {
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    std::vector<int64_t> offsets;
    int64_t total = 0;
    for (const auto& r : regions) {
      int64_t numel = r.shape.empty() ? 0 : 1;
      for (int64_t d : r.shape) numel *= d;
      offsets.push_back(total);
      total += (numel * item + 63) / 64 * 64;
    }
    Taken out;
    out.held = output_empty({total}, at::TensorOptions().dtype(at::kByte));
    char* base = static_cast<char*>(out.held.data_ptr());
    for (size_t i = 0; i < regions.size(); i++) {
      const bool present = !regions[i].shape.empty();
      out.pointers.push_back(present ? base + offsets[i] : nullptr);
      // from_blob: a view of the block without dispatcher calls (held for the call by `held`)
      out.views.push_back(present && regions[i].view
                              ? at::from_blob(base + offsets[i], regions[i].shape, at::TensorOptions().dtype(dtype))
                              : at::Tensor());
    }
    return out;
  }
};

// The packed input rows (D, N, F): `out` (work space) filled by one gather, or x itself where the
// packing is the identity (one direction, no padding).
at::Tensor gather_into(at::Tensor& out, const at::Tensor& x, const Plan& p) {
  if (p.identity()) return x.contiguous().view({1, p.rows, x.size(2)});
  auto flat = out.view({-1, x.size(2)});
  at::index_select_out(flat, x.reshape({-1, x.size(2)}), 0, p.src.flatten());
  return out;
}

// Work space for gemm.h's packed copy of D weights of K x N (its panels: N rounded up to 32 columns), as
// fastlayers/rnn/_cpu_recurrence.py's _packed_weight.
at::Tensor packed_weight(int64_t k, int64_t n, int64_t dirs, const at::TensorOptions& opt) {
  return at::empty({dirs * k * ((n + 31) / 32 * 32)}, opt);
}

// Whether the input projection of `p`'s packed rows runs on matmul.c (fl_matmul_preferred: the faster
// one on this CPU and at this size) with the packing's gather inside it (a packing that is not the
// identity): then the (D, N, F) packed input is never written.
bool gathered_projection(const Plan& p) { return !p.identity() && fl_matmul_preferred(p.rows); }

// The input projection xp = xs W_ih^T (+ bias: (D, G), added to every row): (D, N, F) x (D, G, F) ->
// (D, N, G), every operand contiguous; with `p` (gathered_projection), xs is the padded input x
// (T, B, F) and the plan's rows of it are read. matmul.c's kernel where fl_matmul_preferred, else
// torch's BLAS.
template <typename T>
void project(at::Tensor& xp, const at::Tensor& xs, const at::Tensor& w_ih, const at::Tensor& bias,
             const Plan* p = nullptr) {
  const int64_t dirs = w_ih.size(0), gsize = w_ih.size(1), width = w_ih.size(2), rows = xp.size(1);
  if (p || fl_matmul_preferred(rows)) {
    const int threads = at::get_num_threads();
    auto packed = packed_weight(width, gsize, dirs, xp.options());
    auto scratch = p ? at::empty({threads * fl_matmul_scratch_rows() * width}, xp.options()) : at::Tensor();
    Kernels<T>::matmul(dirs, rows, width, gsize, ptr<T>(xs), p ? p->src.data_ptr<int64_t>() : nullptr,
                       ptr<T>(w_ih), 1, ptr<T>(bias), ptr<T>(xp), ptr<T>(packed), ptr<T>(scratch), threads);
  } else if (bias.defined()) {
    at::baddbmm_out(xp, bias.view({dirs, 1, gsize}), xs, w_ih.transpose(1, 2));
  } else {
    at::bmm_out(xp, xs, w_ih.transpose(1, 2));
  }
}

void check_layer(const at::Tensor& x, const at::Tensor& w_ih, const at::Tensor& w_hh, const at::Tensor& h0,
                 int64_t gates) {
  TORCH_CHECK(x.device().is_cpu(), "fastlayers: this C++ kernel runs CPU tensors, got ", x.device());
  TORCH_CHECK(x.dim() == 3, "x: expected (T, B, F), got ", x.sizes());
  TORCH_CHECK(w_ih.dim() == 3 && w_ih.size(2) == x.size(2) && w_ih.size(1) % gates == 0,
              "w_ih: expected (D, G, F) with F = ", x.size(2), ", got ", w_ih.sizes());
  TORCH_CHECK(w_hh.dim() == 3 && w_hh.size(0) == w_ih.size(0) && w_hh.size(1) == w_ih.size(1),
              "w_hh: expected (D, G, P), got ", w_hh.sizes());
  TORCH_CHECK(h0.dim() == 3 && h0.size(0) == w_ih.size(0) && h0.size(1) == x.size(1) && h0.size(2) == w_hh.size(2),
              "h0: expected (D, B, P) = (", w_ih.size(0), ", ", x.size(1), ", ", w_hh.size(2), "), got ", h0.sizes());
  for (const auto* t : {&w_ih, &w_hh, &h0})
    TORCH_CHECK(t->device().is_cpu(), "fastlayers: this C++ kernel runs CPU tensors, got ", t->device());
}

// The per-layer operands of an LSTM / GRU (G = gates * H; P = the state's width, H without a
// projection): biases and LayerNorm gains (D, G), the training masks (rmask (D, B, P), zoneout
// (D, T, B, P) for h).
void check_operands(const at::Tensor& x, const at::Tensor& w_ih, const at::Tensor& w_hh, int64_t gates,
                    const std::optional<at::Tensor>& b_ih, const std::optional<at::Tensor>& b_hh,
                    const std::optional<at::Tensor>& ln_ih, const std::optional<at::Tensor>& ln_hh,
                    const std::optional<at::Tensor>& rmask, const std::optional<at::Tensor>& zh) {
  const int64_t dirs = w_ih.size(0), g = w_ih.size(1), width = w_hh.size(2);
  check_operand(b_ih, "b_ih", {dirs, g});
  check_operand(b_hh, "b_hh", {dirs, g});
  check_operand(ln_ih, "ln_ih", {dirs, g});
  check_operand(ln_hh, "ln_hh", {dirs, g});
  check_operand(rmask, "rmask", {dirs, x.size(1), width});
  check_operand(zh, "zh", {dirs, x.size(0), x.size(1), width});
  TORCH_CHECK(gates == 4 || width == g / gates, "w_hh: expected (D, G, H) with H = ", g / gates, ", got ",
              w_hh.sizes());
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_impl(
    const at::Tensor& x_in, const std::optional<at::Tensor>& lengths, const at::Tensor& h0_in,
    const at::Tensor& c0_in, const at::Tensor& w_ih_in, const at::Tensor& w_hh_in,
    const std::optional<at::Tensor>& b_ih_in, const std::optional<at::Tensor>& b_hh_in,
    const std::optional<at::Tensor>& gx_in,
    const std::optional<at::Tensor>& gh_in, const std::optional<at::Tensor>& gc_in,
    const std::optional<at::Tensor>& bc_in, const std::optional<at::Tensor>& peep_in,
    const std::optional<at::Tensor>& w_hr_in, const std::optional<at::Tensor>& rmask_in,
    const std::optional<at::Tensor>& zc_in, const std::optional<at::Tensor>& zh_in, double clip, double zc_const,
    double zh_const, double pclip) {
  const auto dt = compute_dtype(x_in.scalar_type());
  const int64_t steps = x_in.size(0), batch = x_in.size(1);
  const auto w_ih = as(w_ih_in, dt), w_hh = as(w_hh_in, dt);
  const int64_t dirs = w_ih.size(0), gsize = w_ih.size(1), hidden = gsize / 4, out = h0_in.size(2);
  const bool proj = w_hr_in.has_value() && w_hr_in->defined();
  const auto gx = as(gx_in, dt), gh = as(gh_in, dt), gc = as(gc_in, dt), bc = as(bc_in, dt), peep = as(peep_in, dt);
  const auto b_ih = as(b_ih_in, dt), b_hh = as(b_hh_in, dt), w_hr = as(w_hr_in, dt);
  // the kernel adds one bias, b_ih + b_hh (with the input LayerNorm: after it)
  const auto bias = b_ih.defined() && b_hh.defined() ? (b_ih + b_hh).contiguous() : (b_ih.defined() ? b_ih : b_hh);
  const Plan p = make_plan(lengths, steps, batch, dirs);
  const int64_t rows = p.rows, first = p.active.empty() ? 0 : p.active[0];
  const auto opt = w_ih.options();
  auto rmask = as(rmask_in, dt);
  if (rmask.defined()) rmask = sorted_state(rmask, p, dt);
  const auto zc = pack_mask(as(zc_in, dt), p, steps, batch, dt), zh = pack_mask(as(zh_in, dt), p, steps, batch, dt);
  auto h = sorted_state(h0_in, p, dt), c = sorted_state(c0_in, p, dt);
  auto rows3 = [&](int64_t width, bool use, bool view) {
    return Workspace::Region{use ? std::vector<int64_t>{dirs, rows, width} : std::vector<int64_t>{}, view};
  };
  // what a backward would read (gates, c1, statistics, chist): one step's rows, reused, when the whole
  // loop runs in lstm.c (keep = 0); every step's with a projection (the per-step kernel's layout)
  const int64_t srows = proj ? rows : batch;
  auto saved3 = [&](int64_t width, bool use) {
    return Workspace::Region{use ? std::vector<int64_t>{dirs, srows, width} : std::vector<int64_t>{}, false};
  };
  const bool gathered = gathered_projection(p);
  auto [ws, raw, held] = Workspace::take(
      {rows3(x_in.size(2), !gathered, true), rows3(gsize, true, true), rows3(out, true, true),
       rows3(out, !p.identity(), true),
       {{dirs * first * gsize}, true}, rows3(hidden, proj, true), saved3(gsize, true),
       saved3(hidden, true), saved3(2, gx.defined()), saved3(gsize, gh.defined()),
       {gh.defined() ? std::vector<int64_t>{dirs, srows} : std::vector<int64_t>{}, false},
       saved3(2, gc.defined()), saved3(hidden, zc.defined() || zc_const != 0)}, dt);
  auto xs = ws[0], xp = ws[1], hd = ws[2], y = out_rows(ws[3], p, dirs, out, opt), r = ws[4];
  const auto y1 = ws[5];
  // kernel-only buffers: the step's rows start at row o (width X: pointer + o * X)
  T *gates = reinterpret_cast<T*>(raw[6]), *c1 = reinterpret_cast<T*>(raw[7]), *xstat = reinterpret_cast<T*>(raw[8]);
  T *rhat = reinterpret_cast<T*>(raw[9]), *rrstd = reinterpret_cast<T*>(raw[10]), *cstat = reinterpret_cast<T*>(raw[11]);
  T* chist = reinterpret_cast<T*>(raw[12]);
  auto row = [](T* base, int64_t o, int64_t width) { return base ? base + o * width : nullptr; };
  if (gathered) project<T>(xp, as(x_in, dt), w_ih, gx.defined() ? at::Tensor() : bias, &p);
  else project<T>(xp, gather_into(xs, as(x_in, dt), p), w_ih, gx.defined() ? at::Tensor() : bias);
  auto hk = proj ? at::zeros({dirs, batch, hidden}, opt) : h;
  const auto ybuf = proj ? y1 : y;
  const auto h_first = rmask.defined() ? h * rmask : h;  // the first step's recurrent input (first rows)
  // the projection's per-step products (ATen bmm) on contiguous transposes: see _cpu_recurrence.py
  // (issue 62); lstm.c's loop packs W_hh as it is. One step (a cell's call) runs the per-step path
  // too where packing the weight costs more than the product: stepwise_step() (the GRU's rule too)
  const int64_t last = static_cast<int64_t>(p.active.size()) - 1;
  const bool stepwise = proj || (last == 0 && stepwise_step(batch, dirs, gsize, w_hh.size(2)));
  const auto w_hh_t = proj ? w_hh.transpose(1, 2).contiguous() : w_hh.transpose(1, 2);
  const auto w_hr_t = proj ? w_hr.transpose(1, 2).contiguous() : at::Tensor();
  const int threads = at::get_num_threads();
  if (!stepwise && last >= 0) {  // the whole time loop in one call, with its own step products (lstm.c)
    hd.narrow(1, 0, first).copy_(h_first);
    auto wp = packed_weight(hidden, gsize, dirs, opt);  // packed W_hh^T
    Kernels<T>::lstm_loop(dirs, batch, last + 1, p.active.data(), hidden, rows, ptr<T>(w_hh), ptr<T>(wp),
                          ptr<T>(r), ptr<T>(xp), xstat, ptr<T>(gx), ptr<T>(bias), ptr<T>(c), ptr<T>(h),
                          ptr<T>(rmask), ptr<T>(y), gates, c1, chist, ptr<T>(hd), rhat, rrstd, cstat, ptr<T>(gh),
                          ptr<T>(gc), ptr<T>(bc), ptr<T>(peep), static_cast<T>(clip), static_cast<T>(kEps),
                          ptr<T>(zc), ptr<T>(zh), static_cast<T>(zc_const), static_cast<T>(zh_const), 0, 0,
                          threads);
  }
  for (int64_t t = 0; t <= (stepwise ? last : -1); t++) {
    const int64_t n = p.active[t], o = p.offsets[t], n_next = t < last ? p.active[t + 1] : 0;
    auto rt = r.narrow(0, 0, dirs * n * gsize).view({dirs, n, gsize});
    at::bmm_out(rt, (t == 0 ? h_first : hd).narrow(1, o, n), w_hh_t);
    Kernels<T>::lstm(dirs, batch, n, n_next, hidden, rows, at_row<T>(xp, o), row(xstat, o, 2), ptr<T>(gx),
                     ptr<T>(bias), ptr<T>(rt), ptr<T>(c), ptr<T>(hk), proj ? nullptr : ptr<T>(rmask),
                     at_row<T>(ybuf, o), row(gates, o, gsize), row(c1, o, hidden), row(chist, o, hidden),
                     (proj || t == last) ? nullptr : at_row<T>(hd, o + n), row(rhat, o, gsize), row(rrstd, o, 1),
                     row(cstat, o, 2), ptr<T>(gh), ptr<T>(gc),
                     ptr<T>(bc), ptr<T>(peep), static_cast<T>(clip), static_cast<T>(kEps), at_row<T>(zc, o),
                     proj ? nullptr : at_row<T>(zh, o), static_cast<T>(zc_const),
                     static_cast<T>(proj ? 0.0 : zh_const), threads);
    if (proj) {  // the projection, proj_clip, zoneout of h and the next recurrent input as ATen ops
      auto hp = at::bmm(y1.narrow(1, o, n), w_hr_t);
      if (pclip > 0) hp.clamp_(-pclip, pclip);
      auto hn = h.narrow(1, 0, n);
      if (zh.defined()) {
        const auto kh = zh.narrow(1, o, n);
        hn.copy_(kh * hn + (1 - kh) * hp);
      } else if (zh_const != 0) {
        hn.copy_(zh_const * hn + (1 - zh_const) * hp);
      } else {
        hn.copy_(hp);
      }
      y.narrow(1, o, n).copy_(hn);
      if (t < last) {
        auto nxt = h.narrow(1, 0, n_next);
        hd.narrow(1, o + n, n_next).copy_(rmask.defined() ? nxt * rmask.narrow(1, 0, n_next) : nxt);
      }
    }
  }
  const auto low = x_in.scalar_type();
  return {as(scatter(y, p, steps, batch), low), as(unsorted(h, p), low), as(unsorted(c, p), low)};
}

// One direction may come without its leading D = 1 (the cells pass their parameters as they are). The
// per-gate vectors (biases, LayerNorm gains, peepholes) are read through their pointers only (d * G + j),
// so (G,) and (1, G) need no view.
at::Tensor one_dir(const at::Tensor& t, int64_t dims) { return t.dim() == dims - 1 ? t.unsqueeze(0) : t; }
std::optional<at::Tensor> one_dir(const std::optional<at::Tensor>& t, int64_t dims) {
  if (!t.has_value() || !t->defined()) return t;
  return one_dir(*t, dims);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_padded(
    const at::Tensor& x, const std::optional<at::Tensor>& lengths, const at::Tensor& h0, const at::Tensor& c0,
    const at::Tensor& w_ih_in, const at::Tensor& w_hh_in, const std::optional<at::Tensor>& b_ih,
    const std::optional<at::Tensor>& b_hh, const std::optional<at::Tensor>& ln_ih, const std::optional<at::Tensor>& ln_hh,
    const std::optional<at::Tensor>& ln_cell_weight, const std::optional<at::Tensor>& ln_cell_bias,
    const std::optional<at::Tensor>& peephole, const std::optional<at::Tensor>& w_hr,
    const std::optional<at::Tensor>& rmask, const std::optional<at::Tensor>& zc, const std::optional<at::Tensor>& zh,
    double cell_clip, double z_c, double z_h, double proj_clip) {
  const auto w_ih = one_dir(w_ih_in, 3), w_hh = one_dir(w_hh_in, 3);
  check_layer(x, w_ih, w_hh, h0, 4);
  TORCH_CHECK(c0.dim() == 3 && c0.size(0) == w_ih.size(0) && c0.size(1) == x.size(1) &&
                  c0.size(2) == w_ih.size(1) / 4,
              "c0: expected (D, B, H), got ", c0.sizes());
  TORCH_CHECK(c0.device().is_cpu(), "fastlayers: this C++ kernel runs CPU tensors, got ", c0.device());
  check_operands(x, w_ih, w_hh, 4, b_ih, b_hh, ln_ih, ln_hh, rmask, zh);
  const int64_t dirs = w_ih.size(0), hidden = w_ih.size(1) / 4;
  check_operand(ln_cell_weight, "ln_cell_weight", {dirs, hidden});
  check_operand(ln_cell_bias, "ln_cell_bias", {dirs, hidden});
  check_operand(peephole, "peephole", {dirs, 3 * hidden});
  check_operand(zc, "zc", {dirs, x.size(0), x.size(1), hidden});
  if (w_hr.has_value() && w_hr->defined()) check_operand(w_hr, "w_hr", {dirs, w_hh.size(2), hidden});
  else TORCH_CHECK(w_hh.size(2) == hidden, "w_hh: expected (D, 4H, H) with H = ", hidden, " (no w_hr), got ",
                   w_hh.sizes());
  at::NoGradGuard no_grad;
  if (compute_dtype(x.scalar_type()) == at::kDouble)
    return lstm_impl<double>(x, lengths, h0, c0, w_ih, w_hh, b_ih, b_hh, ln_ih, ln_hh, ln_cell_weight, ln_cell_bias,
                             peephole, one_dir(w_hr, 3), one_dir(rmask, 3), one_dir(zc, 4), one_dir(zh, 4), cell_clip,
                             z_c, z_h, proj_clip);
  return lstm_impl<float>(x, lengths, h0, c0, w_ih, w_hh, b_ih, b_hh, ln_ih, ln_hh, ln_cell_weight, ln_cell_bias,
                          peephole, one_dir(w_hr, 3), one_dir(rmask, 3), one_dir(zc, 4), one_dir(zh, 4), cell_clip, z_c,
                          z_h, proj_clip);
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> gru_impl(const at::Tensor& x_in, const std::optional<at::Tensor>& lengths,
                                            const at::Tensor& h0_in, const at::Tensor& w_ih_in,
                                            const at::Tensor& w_hh_in, const std::optional<at::Tensor>& b_ih_in,
                                            const std::optional<at::Tensor>& b_hh_in,
                                            const std::optional<at::Tensor>& gx_in,
                                            const std::optional<at::Tensor>& gh_in,
                                            const std::optional<at::Tensor>& rmask_in,
                                            const std::optional<at::Tensor>& zh_in, double zh_const) {
  const auto dt = compute_dtype(x_in.scalar_type());
  const int64_t steps = x_in.size(0), batch = x_in.size(1);
  const auto w_ih = as(w_ih_in, dt), w_hh = as(w_hh_in, dt);
  const int64_t dirs = w_ih.size(0), gsize = w_ih.size(1), hidden = gsize / 3;
  const auto gx = as(gx_in, dt), gh = as(gh_in, dt), b_ih = as(b_ih_in, dt), b_hh = as(b_hh_in, dt);
  const Plan p = make_plan(lengths, steps, batch, dirs);
  const int64_t rows = p.rows, first = p.active.empty() ? 0 : p.active[0];
  auto rmask = as(rmask_in, dt);
  if (rmask.defined()) rmask = sorted_state(rmask, p, dt);
  const auto zh = pack_mask(as(zh_in, dt), p, steps, batch, dt);
  auto h = sorted_state(h0_in, p, dt);
  auto rows3 = [&](int64_t width, bool use, bool view) {
    return Workspace::Region{use ? std::vector<int64_t>{dirs, rows, width} : std::vector<int64_t>{}, view};
  };
  // what a backward would read (gates, hbn, hist, statistics): one step's rows, reused (keep = 0)
  auto saved3 = [&](int64_t width, bool use) {
    return Workspace::Region{use ? std::vector<int64_t>{dirs, batch, width} : std::vector<int64_t>{}, false};
  };
  const bool gathered = gathered_projection(p);
  auto [ws, raw, held] = Workspace::take(
      {rows3(x_in.size(2), !gathered, true), rows3(gsize, true, true), rows3(hidden, true, true),
       rows3(hidden, !p.identity(), true), {{dirs * first * gsize}, true}, saved3(gsize, true),
       saved3(hidden, true), saved3(hidden, true), saved3(2, gx.defined()),
       saved3(gsize, gh.defined()), {gh.defined() ? std::vector<int64_t>{dirs, batch} : std::vector<int64_t>{},
                                     false}}, dt);
  auto xs = ws[0], xp = ws[1], hd = ws[2], y = out_rows(ws[3], p, dirs, hidden, h.options()), r = ws[4];
  T *gates = reinterpret_cast<T*>(raw[5]), *hbn = reinterpret_cast<T*>(raw[6]), *hist = reinterpret_cast<T*>(raw[7]);
  T *xstat = reinterpret_cast<T*>(raw[8]), *rhat = reinterpret_cast<T*>(raw[9]), *rrstd = reinterpret_cast<T*>(raw[10]);
  if (gathered) project<T>(xp, as(x_in, dt), w_ih, gx.defined() ? at::Tensor() : b_ih, &p);
  else project<T>(xp, gather_into(xs, as(x_in, dt), p), w_ih, gx.defined() ? at::Tensor() : b_ih);
  const auto h_first = rmask.defined() ? h * rmask : h;  // the first step's recurrent input (first rows)
  const int threads = at::get_num_threads();
  const int64_t last = static_cast<int64_t>(p.active.size()) - 1;
  // one step as the LSTM's (lstm_impl): its product on W_hh's transposed view, no packed copy
  if (last == 0 && stepwise_step(batch, dirs, gsize, hidden)) {
    const int64_t n = p.active[0];
    auto rt = r.narrow(0, 0, dirs * n * gsize).view({dirs, n, gsize});
    at::bmm_out(rt, h_first.narrow(1, 0, n), w_hh.transpose(1, 2));
    Kernels<T>::gru(dirs, batch, n, 0, hidden, rows, ptr<T>(xp), xstat, ptr<T>(gx), ptr<T>(b_ih), ptr<T>(rt),
                    ptr<T>(h), ptr<T>(rmask), ptr<T>(b_hh), ptr<T>(y), gates, hbn, hist, nullptr, rhat, rrstd,
                    ptr<T>(gh), static_cast<T>(kEps), ptr<T>(zh), static_cast<T>(zh_const), threads);
  } else if (last >= 0) {  // the whole time loop in one call, with its own step products (gru.c; W_hh as it is)
    hd.narrow(1, 0, first).copy_(h_first);
    auto wp = packed_weight(hidden, gsize, dirs, h.options());  // packed W_hh^T
    Kernels<T>::gru_loop(dirs, batch, last + 1, p.active.data(), hidden, rows, ptr<T>(w_hh), ptr<T>(wp),
                         ptr<T>(r), ptr<T>(xp), xstat, ptr<T>(gx), ptr<T>(b_ih), ptr<T>(h), ptr<T>(rmask),
                         ptr<T>(b_hh), ptr<T>(y), gates, hbn, hist, ptr<T>(hd), rhat, rrstd, ptr<T>(gh),
                         static_cast<T>(kEps), ptr<T>(zh), static_cast<T>(zh_const), 0, 0, threads);
  }
  const auto low = x_in.scalar_type();
  return {as(scatter(y, p, steps, batch), low), as(unsorted(h, p), low)};
}

std::tuple<at::Tensor, at::Tensor> gru_padded(const at::Tensor& x, const std::optional<at::Tensor>& lengths,
                                              const at::Tensor& h0, const at::Tensor& w_ih_in,
                                              const at::Tensor& w_hh_in,
                                              const std::optional<at::Tensor>& b_ih,
                                              const std::optional<at::Tensor>& b_hh,
                                              const std::optional<at::Tensor>& ln_ih,
                                              const std::optional<at::Tensor>& ln_hh,
                                              const std::optional<at::Tensor>& rmask,
                                              const std::optional<at::Tensor>& zh, double z_h) {
  const auto w_ih = one_dir(w_ih_in, 3), w_hh = one_dir(w_hh_in, 3);
  check_layer(x, w_ih, w_hh, h0, 3);
  check_operands(x, w_ih, w_hh, 3, b_ih, b_hh, ln_ih, ln_hh, rmask, zh);
  at::NoGradGuard no_grad;
  if (compute_dtype(x.scalar_type()) == at::kDouble)
    return gru_impl<double>(x, lengths, h0, w_ih, w_hh, b_ih, b_hh, ln_ih, ln_hh, one_dir(rmask, 3), one_dir(zh, 4),
                            z_h);
  return gru_impl<float>(x, lengths, h0, w_ih, w_hh, b_ih, b_hh, ln_ih, ln_hh, one_dir(rmask, 3), one_dir(zh, 4), z_h);
}

// Elman RNN (torch.nn.RNN): h_t = act(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh), ATen ops per step on
// the packed rows (torch has no fused kernel for one step that this would beat).
std::tuple<at::Tensor, at::Tensor> rnn_padded(const at::Tensor& x_in, const std::optional<at::Tensor>& lengths,
                                              const at::Tensor& h0_in, const at::Tensor& w_ih_in,
                                              const at::Tensor& w_hh_in, const std::optional<at::Tensor>& b_ih_in,
                                              const std::optional<at::Tensor>& b_hh_in, bool relu) {
  check_layer(x_in, w_ih_in, w_hh_in, h0_in, 1);
  check_operands(x_in, w_ih_in, w_hh_in, 1, b_ih_in, b_hh_in, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  at::NoGradGuard no_grad;
  const auto dt = compute_dtype(x_in.scalar_type());
  const int64_t steps = x_in.size(0), batch = x_in.size(1);
  const auto w_ih = w_ih_in.to(dt), w_hh = w_hh_in.to(dt);
  const int64_t dirs = w_ih.size(0), hidden = w_ih.size(1);
  const Plan p = make_plan(lengths, steps, batch, dirs);
  auto xs = at::empty({dirs, p.rows, x_in.size(2)}, w_ih.options());
  xs = gather_into(xs, as(x_in, dt), p);
  auto xp = at::bmm(xs, w_ih.transpose(1, 2));
  if (b_ih_in.has_value() && b_ih_in->defined()) xp.add_(b_ih_in->to(dt).unsqueeze(1));
  if (b_hh_in.has_value() && b_hh_in->defined()) xp.add_(b_hh_in->to(dt).unsqueeze(1));
  auto h = sorted_state(h0_in, p, dt);
  auto y = at::empty({dirs, p.rows, hidden}, xp.options());
  const auto w_hh_t = w_hh.transpose(1, 2).contiguous();
  for (size_t t = 0; t < p.active.size(); t++) {
    const int64_t n = p.active[t], o = p.offsets[t];
    auto hn = h.narrow(1, 0, n);
    auto pre = at::baddbmm(xp.narrow(1, o, n), hn, w_hh_t);
    hn.copy_(relu ? at::relu(pre) : at::tanh(pre));
    y.narrow(1, o, n).copy_(hn);
  }
  const auto low = x_in.scalar_type();
  return {as(scatter(y, p, steps, batch), low), as(unsorted(h, p), low)};
}

}  // namespace
