"""Locally connected layers: convolution with unshared weights, one filter per output location.

Legend: B batch, C_in / C_out channels, H x W (or L) input size, KH x KW (or K) kernel,
OH x OW (or OL) output size, computed with nn.Conv2d's formula:
``OH = floor((H + 2*padding - dilation*(KH - 1) - 1) / stride + 1)``.

    y[b, o, i, j] = bias[o, i, j] + sum_{c, p, q} weight[o, c, p, q, i, j] * x_pad[b, c, i*s + p*d, j*s + q*d]

Weight layout (C_out, C_in, KH, KW, OH, OW): nn.Conv2d's (C_out, C_in, KH, KW) with the output
location appended, so a tied (shared) filter is ``conv.weight[..., None, None].expand(...)`` and the
layer then equals ``F.conv2d``. Source: LeCun et al. 1989 / Taigman et al. 2014 (DeepFace,
"locally connected layers"); Keras' LocallyConnected2D; pytorch/pytorch#499.

On CPU (float32/float64) forward and backward run in C kernels built with the package
(``fastlayers/_native/local.c``): one pass over the input, no unfold copy, extra memory = the
output. On CUDA (and CPU tensors under Triton's interpreter) Triton kernels; elsewhere (other
dtypes, no compiler) the plain-PyTorch twin with the same semantics; :func:`fastlayers.backend`
forces one.

Non-finite input: a NaN or inf in the input reaches exactly the outputs whose receptive field
holds it (inf times a weight of the other sign against another inf, or a 0 weight, gives NaN,
as F.conv2d); no kernel assumes finite values. Inputs of size 1e4 give finite outputs.

The package (the same file roles as :mod:`fastlayers.rnn` and :mod:`fastlayers.attention`):
``_modules`` (functional forms and modules: validation), ``_routing`` (the backend choice, once
per call), ``_reference`` (the plain-PyTorch twin), ``_cpu`` (the C kernels' binding), ``_gpu``
(the Triton kernels' binding), ``_ops_export`` (the C++ operator's Python half: fake function and
autograd), ``_ops_onnx`` (its ONNX translation).
"""

from ._modules import LocallyConnected1d as LocallyConnected1d, LocallyConnected2d as LocallyConnected2d
from ._modules import locally_connected1d as locally_connected1d, locally_connected2d as locally_connected2d
from ._modules import output_size as output_size
from ._reference import locally_connected2d_reference as locally_connected2d_reference
