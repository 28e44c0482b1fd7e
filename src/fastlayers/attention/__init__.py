"""Masked attention pooling over a padded batch: scores, softmax over valid steps, context vector.

Legend: B batch, T time (padded), Dq query features, Dk key features, Dv value features,
A attention size (additive score).

Scores (one per step):
  * ``"dot"``:         e_bt = <q_b, k_bt>                      (Luong et al. 2015, requires Dq == Dk)
  * ``"scaled_dot"``:  e_bt = <q_b, k_bt> / sqrt(Dk)           (Vaswani et al. 2017)
  * ``"additive"``:    e_bt = v . tanh(W_q q_b + W_k k_bt + b) (Bahdanau et al. 2015, eq. 6 and App. A.1.2)
Weights: alpha_b = softmax over t < len_b of e_bt; alpha_bt = 0 exactly for t >= len_b.
Context: c_b = sum_t alpha_bt v_bt.

Everything runs as batched matmuls on the 3-D tensors (no per-step or per-column slicing), so
autograd's backward costs a small multiple of the forward (seed 001's per-column-view cliff).

The package (the file roles of :mod:`fastlayers.rnn` and :mod:`fastlayers.local`): ``_modules``
(:func:`attention_pool` and :class:`AttentionPooling`: validation, then the backend choice),
``_reference`` (:func:`attention_pool_reference`, the plain-PyTorch twin: the reference path, the
path of low precision, traced calls and torch.func transforms, and what the CPU and Triton paths'
double backwards differentiate; ``attention_pool_varlen_reference``, the varlen form as segment
operations, what a traced call runs), ``_cpu`` (every score on CPU in float32 / float64: torch's
products with backwards of their own), ``_gpu`` (the Triton kernels' autograd binding). No operators of its own: an
exported model holds the twin's torch ops.
"""

from ._modules import AttentionPooling as AttentionPooling, attention_pool as attention_pool
from ._reference import SCORES as SCORES, attention_pool_reference as attention_pool_reference
