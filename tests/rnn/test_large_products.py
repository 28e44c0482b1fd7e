"""The recurrent layers' large products on the native kernel (``_native/matmul.c``: the input
projection, its input gradient and the weight gradients), chosen per CPU and size
(:func:`fastlayers._native.own_products`):
the kernel against torch.bmm at sizes past its row blocks, panels and k blocks, and the layers
with it against the layers on torch's BLAS."""

import ctypes

import pytest
import torch

import fastlayers
from fastlayers import _native
from fastlayers.rnn import _cpu_recurrence

pytestmark = pytest.mark.skipif(_native.library() is None, reason="needs the native library")


@pytest.fixture
def choice():
    """Restores the CPU's choice after a test forced one."""
    yield _native.prefer_own_products
    _native.prefer_own_products(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dirs,rows,k,n", [(1, 1, 1, 1), (2, 97, 130, 33), (1, 250, 300, 70), (2, 0, 8, 16),
                                           (2, 5, 0, 40), (1, 193, 257, 128), (2, 19, 4500, 40), (1, 641, 20, 24)])
@pytest.mark.parametrize("trans", [0, 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_kernel_matches_bmm(dtype, dirs, rows, k, n, trans, bias, threads):
    """C_d = A_d @ op(B_d) (+ bias_d): rows over one block of 96, k over several blocks of the
    panel slice (2048 values of k with AVX-512, 4096 with AVX2 / without: gemm.h FL_GEMM_KC), partial
    panels, empty rows, k = 0; more threads than items; a block count the threads do not divide
    (641 rows: smaller blocks, matmul.c fl_matmul_mc)."""
    torch.manual_seed(0)
    a = torch.randn(dirs, rows, k, dtype=dtype)
    b = torch.randn(dirs, n, k, dtype=dtype) if trans else torch.randn(dirs, k, n, dtype=dtype)
    c0 = torch.randn(dirs, n, dtype=dtype) if bias else None
    out = torch.full((dirs, rows, n), float("nan"), dtype=dtype)
    packed = torch.empty(_cpu_recurrence._packed_weight(k, n, dirs), dtype=dtype)
    suffix = "f32" if dtype == torch.float32 else "f64"
    fn = getattr(_cpu_recurrence._matmul_lib(), f"fl_matmul_{suffix}")
    fn(dirs, rows, k, n, a.data_ptr(), None, b.data_ptr(), trans, c0.data_ptr() if bias else None, out.data_ptr(),
       packed.data_ptr(), None, threads)
    want = torch.bmm(a, b.transpose(1, 2) if trans else b)
    if bias:
        want = want + c0.unsqueeze(1)
    # (float32 sums of k products of N(0, 1) values: their rounding grows about as sqrt(k))
    tol = dict(rtol=1e-5, atol=max(1e-4, 1e-5 * k ** 0.5)) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dirs,rows,k,n,threads", [(2, 250, 130, 70, 2), (1, 97, 33, 40, 3), (2, 1, 5, 3, 1)])
def test_kernel_reads_gathered_rows(dtype, dirs, rows, k, n, threads):
    """With a row map (the C++ operators' packing): row i of A_d is row rows[d, i] of the shared A,
    gathered block by block in the threads' scratch."""
    torch.manual_seed(0)
    src = torch.randn(300, k, dtype=dtype)
    index = torch.randint(0, 300, (dirs, rows))
    w = torch.randn(dirs, n, k, dtype=dtype)
    bias = torch.randn(dirs, n, dtype=dtype)
    out = torch.full((dirs, rows, n), float("nan"), dtype=dtype)
    packed = torch.empty(_cpu_recurrence._packed_weight(k, n, dirs), dtype=dtype)
    lib = _native.library()  # (fl_matmul_scratch_rows's int64 result declared where it loads)
    scratch = torch.full((threads * lib.fl_matmul_scratch_rows() * k,), float("nan"), dtype=dtype)
    suffix = "f32" if dtype == torch.float32 else "f64"
    getattr(_cpu_recurrence._matmul_lib(), f"fl_matmul_{suffix}")(
        dirs, rows, k, n, src.data_ptr(), index.data_ptr(), w.data_ptr(), 1, bias.data_ptr(), out.data_ptr(),
        packed.data_ptr(), scratch.data_ptr(), threads)
    want = torch.bmm(src[index], w.transpose(1, 2)) + bias.unsqueeze(1)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dirs,k,m,n", [(1, 1, 1, 1), (2, 300, 97, 33), (1, 513, 270, 70), (2, 0, 8, 16),
                                        (1, 40, 0, 5), (2, 7, 9, 0), (3, 260, 13, 129)])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_transposed_kernel_matches_bmm(dtype, dirs, k, m, n, threads):
    """C_d = P_d^T Q_d (the weight gradients): k over two blocks of 256 and a partial one, rows over a
    sub-block of 256 and partial row blocks, partial panels, k = 0 (zeros), empty rows or columns,
    more threads than row blocks; work space and output start as NaN, and the work space it asked
    for is all it writes."""
    torch.manual_seed(0)
    p = torch.randn(dirs, k, m, dtype=dtype)
    q = torch.randn(dirs, k, n, dtype=dtype)
    suffix = "f32" if dtype == torch.float32 else "f64"
    lib = _cpu_recurrence._matmul_lib()
    values = ctypes.c_int64()
    getattr(lib, f"fl_matmul_tn_scratch_{suffix}")(n, threads, ctypes.addressof(values))
    scratch = torch.full((values.value + 4096,), float("nan"), dtype=dtype)  # + a tail it must not write
    out = torch.full((dirs, m, n), float("nan"), dtype=dtype)
    getattr(lib, f"fl_matmul_tn_{suffix}")(dirs, m, n, k, p.data_ptr(), q.data_ptr(), None, out.data_ptr(),
                                           scratch.data_ptr(), threads)
    assert scratch[values.value:].isnan().all()
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, torch.bmm(p.transpose(1, 2), q), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dirs,k,m,n,threads", [(2, 300, 97, 33, 2), (1, 513, 20, 70, 3), (2, 1, 5, 3, 1)])
def test_transposed_kernel_reads_rows_through_an_index(dtype, dirs, k, m, n, threads):
    """With qrows (the layers' weight gradient dW_ih without a packed copy of the input): row k of
    Q_d is row qrows[d, k] of the shared Q."""
    torch.manual_seed(0)
    p = torch.randn(dirs, k, m, dtype=dtype)
    q = torch.randn(400, n, dtype=dtype)
    index = torch.randint(0, 400, (dirs, k))
    suffix = "f32" if dtype == torch.float32 else "f64"
    lib = _cpu_recurrence._matmul_lib()
    values = ctypes.c_int64()
    getattr(lib, f"fl_matmul_tn_scratch_{suffix}")(n, threads, ctypes.addressof(values))
    scratch = torch.full((values.value,), float("nan"), dtype=dtype)
    out = torch.full((dirs, m, n), float("nan"), dtype=dtype)
    getattr(lib, f"fl_matmul_tn_{suffix}")(dirs, m, n, k, p.data_ptr(), q.data_ptr(), index.data_ptr(),
                                           out.data_ptr(), scratch.data_ptr(), threads)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, torch.bmm(p.transpose(1, 2), q[index]), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dirs,rows,pad,k,n,trans,threads", [(2, 250, 0, 130, 70, 0, 2), (2, 200, 31, 33, 40, 1, 3),
                                                              (1, 97, 5, 64, 33, 0, 1), (3, 1, 2, 5, 3, 1, 2),
                                                              (2, 0, 4, 8, 5, 0, 2), (2, 641, 3, 20, 24, 1, 2)])
@pytest.mark.parametrize("order", ["identity", "shuffled"])
def test_sum_kernel_adds_every_direction_into_the_padded_rows(dtype, dirs, rows, pad, k, n, trans, threads, order):
    """fl_matmul_sum (the layers' dX without a per-direction copy): output row crows[i] = sum_d
    A_d[arows[d, i]] @ op(B_d); rows in consecutive runs read and written in place, the others
    through the scratch (a shuffled order); the padded rows no index names stay as they were."""
    torch.manual_seed(0)
    total = rows + pad
    crows = torch.arange(rows) if order == "identity" else torch.randperm(total)[:rows]
    arows = torch.stack([torch.arange(rows) if d == 0 and order == "identity" else torch.randperm(rows)
                         for d in range(dirs)])
    a = torch.randn(dirs, rows, k, dtype=dtype)
    b = torch.randn(dirs, n, k, dtype=dtype) if trans else torch.randn(dirs, k, n, dtype=dtype)
    out = torch.full((total, n), 7.0, dtype=dtype)
    suffix = "f32" if dtype == torch.float32 else "f64"
    lib = _cpu_recurrence._matmul_lib()
    values = ctypes.c_int64()
    getattr(lib, f"fl_matmul_sum_scratch_{suffix}")(k, n, threads, ctypes.addressof(values))
    scratch = torch.full((values.value,), float("nan"), dtype=dtype)
    packed = torch.empty(_cpu_recurrence._packed_weight(k, n, dirs), dtype=dtype)
    getattr(lib, f"fl_matmul_sum_{suffix}")(dirs, rows, k, n, a.data_ptr(), rows, arows.data_ptr(), b.data_ptr(),
                                            trans, out.data_ptr(), crows.data_ptr(), packed.data_ptr(),
                                            scratch.data_ptr(), threads)
    want = torch.full((total, n), 7.0, dtype=dtype)
    if rows:
        op = b.transpose(1, 2) if trans else b
        want[crows] = sum(a[d][arows[d]] @ op[d] for d in range(dirs))
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, want, **tol)


def test_choice_follows_the_cpu_and_can_be_forced(choice):
    choice(None)
    with open("/proc/cpuinfo") as f:
        vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    start = _native.own_products_from()
    with open("/proc/cpuinfo") as f:
        family = next((int(line.split(":", 1)[1]) for line in f if line.startswith("cpu family")), 0)
    if _native.built_as() == "default":  # (no AVX2: never chosen by the CPU, so no start either)
        assert start is None and not _native.own_products()
    else:
        assert start == (640 if family < 26 else 64 if _native.built_as() == "avx512" else 256)
        assert _native.own_products(start) == (vendor == "AuthenticAMD")
        assert _native.own_products(640) == (vendor == "AuthenticAMD")
        assert not _native.own_products(start - 1)  # (small products: torch's BLAS on every CPU)
    choice(True)
    assert _native.own_products(1)
    choice(False)
    assert not _native.own_products(1 << 20)


@pytest.mark.parametrize("cell,options", [("LSTM", dict(layer_norm=True)), ("LSTM", dict(peephole=True)),
                                          ("LSTM", dict(bias=False, zoneout=0.1)), ("GRU", dict(layer_norm=True)),
                                          ("GRU", dict(recurrent_dropout=0.2))])
def test_layers_match_torch_products(choice, cell, options):
    """Training fwd+bwd (every gradient: dX and the weight gradients on matmul.c too) and the eval
    no-grad call (the C++ operator, whose projection gathers the packed rows itself on matmul.c)
    with the products on matmul.c equal those on torch's BLAS, float64, two layers, lengths, more
    rows than one block."""
    torch.manual_seed(0)
    m = getattr(fastlayers, cell)(37, 45, num_layers=2, bidirectional=True, dtype=torch.float64, **options)
    x = torch.randn(41, 5, 37, dtype=torch.float64)
    lengths = torch.tensor([41, 7, 30, 1, 41])
    results = []
    for own in (True, False):
        choice(own)
        m.train()
        torch.manual_seed(1)
        xi = x.clone().requires_grad_()
        y = m(xi, lengths=lengths)[0]
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.size(-1), dtype=y.dtype)).sum(),
                                    [xi, *m.parameters()])
        m.eval()
        with torch.no_grad():
            y_eval = m(x, lengths=lengths)[0]
        results.append((y.detach(), grads, y_eval))
    (y1, g1, e1), (y2, g2, e2) = results
    torch.testing.assert_close(y1, y2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(e1, e2, rtol=1e-10, atol=1e-10)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
@pytest.mark.parametrize("bidirectional,lengths", [(True, None), (False, [9, 3, 7]), (True, [9, 9, 9])])
def test_layers_reading_the_padded_rows_match_torch_products(choice, cell, bidirectional, lengths):
    """The Functions read the packed rows from the padded input through their index where the
    products run on matmul.c (no gathered copy; dX summed over the directions into the padded rows,
    zero on the padding): values and every gradient as on torch's BLAS (which gathers), without
    lengths, one direction with lengths, and all sequences full; float64 gradcheck and gradgradcheck
    (the recorded backward gathers the rows differentiably)."""
    torch.manual_seed(0)
    m = getattr(fastlayers, cell)(6, 5, bidirectional=bidirectional, layer_norm=True, dtype=torch.float64)
    x = torch.randn(9, 3, 6, dtype=torch.float64)
    kw = {} if lengths is None else dict(lengths=torch.tensor(lengths))
    results = []
    for own in (True, False):
        choice(own)
        xi = x.clone().requires_grad_()
        y = m(xi, **kw)[0]
        results.append((y.detach(), torch.autograd.grad((y * torch.linspace(-1, 1, y.size(-1), dtype=y.dtype)).sum(),
                                                        [xi, *m.parameters()])))
    (y1, g1), (y2, g2) = results
    torch.testing.assert_close(y1, y2, rtol=1e-10, atol=1e-10)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    choice(True)
    xi = x[:4].clone().requires_grad_()
    kw = {} if lengths is None else dict(lengths=torch.tensor(lengths).clamp(max=4))
    torch.autograd.gradcheck(lambda v: m(v, **kw)[0], (xi,))
    torch.autograd.gradgradcheck(lambda v: m(v, **kw)[0], (xi,))


@pytest.mark.parametrize("dirs,rows,k,n", [(1, 1, 1, 1), (2, 97, 130, 33), (1, 250, 301, 70), (2, 0, 8, 16),
                                           (1, 193, 257, 128), (2, 19, 4500, 40), (1, 641, 20, 24)])
@pytest.mark.parametrize("trans", [0, 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("w_bf16", [False, True])
def test_bf16_kernel_gives_the_products_of_bf16_operands(dirs, rows, k, n, trans, bias, w_bf16):
    """fl_matmul_bf16 (the large products under bf16 on CPUs with AVX512-BF16 and no AMX): C_d =
    A_d @ op(B_d) (+ bias_d) in float32 with A bf16, B float32 (rounded to bf16 as packed) or bf16:
    the products of the bf16 operands summed in float32 (against float64), past its row blocks
    (96 rows, 12-row tiles), the k blocks (2048 pairs), partial panels, odd k. Where the CPU has no
    AVX512-BF16 the layers never choose it."""
    if not _native.bf16_products():
        assert not _native.bf16_large_products(1 << 40)
        pytest.skip("no AVX512-BF16 on this CPU: the layers never choose the kernel (checked above)")
    torch.manual_seed(0)
    a = torch.randn(dirs, rows, k).to(torch.bfloat16)
    b = torch.randn(dirs, n, k) if trans else torch.randn(dirs, k, n)
    b = b.to(torch.bfloat16) if w_bf16 else b
    c0 = torch.randn(dirs, n) if bias else None
    out = torch.full((dirs, rows, n), float("nan"))
    _cpu_recurrence._native_matmul_bf16(a, b, bool(trans), c0, out)
    b64 = b.to(torch.bfloat16).double()
    want = torch.bmm(a.double(), b64.transpose(1, 2) if trans else b64)
    if bias:
        want = want + c0.double().unsqueeze(1)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=max(1e-4, 1e-5 * k ** 0.5))
