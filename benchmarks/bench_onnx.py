"""ONNX Runtime's forward time of fastlayers' BLSTM exported with fastlayers.onnx against the eager layer
(issue 39, 3: "record ONNX Runtime's forward time at the seed shape with lengths against eager
fastlayers").

The seed's BLSTM (input 512, hidden 256 per direction, 2 layers, bidirectional), T=800, B=32, lengths
uniform in [400, 800] (one of 800), float32; plain (ONNX's LSTM operator) and layer_norm=True (a Scan
over time). The model is exported at a smaller shape with dynamic batch, time and lengths, then run at
the seed shape; eager under torch.no_grad(). Both run in this one process, interleaved, medians after
two warm-up calls each; ONNX Runtime's CPU provider with as many intra-op threads as torch uses.

    python benchmarks/bench_onnx.py [--repeats 7] [--quick]

``--quick``: T=100, B=8, 64 -> 32 (a check that the script runs, not a measurement).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import numpy as np
import onnxruntime as ort
import torch
from torch.export import Dim
from torch.utils._pytree import tree_leaves

import fastlayers
import fastlayers.onnx
from fastlayers._core.system import cpu_name


def _error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small shapes (T=100, B=8, 64 -> 32)")
    args = parser.parse_args()
    steps, batch, features, hidden = (100, 8, 64, 32) if args.quick else (800, 32, 512, 256)
    torch.manual_seed(0)
    x = torch.randn(steps, batch, features)
    lengths = torch.randint(steps // 2, steps + 1, (batch,))
    lengths[0] = steps
    threads = torch.get_num_threads()
    print(f"{cpu_name()}, {threads} threads, torch {torch.__version__}, onnxruntime {ort.__version__}; T={steps}, "
          f"B={batch}, {features} -> {hidden}x2, 2 layers, lengths in [{steps // 2}, {steps}]; forward, medians of "
          f"{args.repeats} after 2 warm-up calls")
    rows = []
    for name, options in (("LSTM", {}), ("LSTM(layer_norm=True)", {"layer_norm": True})):
        model = fastlayers.LSTM(features, hidden, num_layers=2, bidirectional=True, **options).eval()
        example = (torch.randn(7, 4, features), torch.tensor([7, 3, 5, 1]))
        start = time.perf_counter()
        program = fastlayers.onnx.export(model, (example[0],), kwargs={"lengths": example[1]}, verbose=False,
                                         dynamic_shapes={"input": {0: Dim("T"), 1: Dim("B")}, "lengths": {0: Dim("B")}})
        exported = time.perf_counter() - start
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        session = ort.InferenceSession(program.model_proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), (x, lengths))}
        ops = sorted({n.op_type for n in program.model_proto.graph.node} & {"LSTM", "Scan"})
        with torch.no_grad():
            eager, onnx = (lambda: model(x, lengths=lengths)), (lambda: session.run(None, feed))
            for fn in (eager, onnx, eager, onnx):
                fn()
            got, want = onnx(), [t.numpy() for t in tree_leaves(eager())]
            model64 = copy.deepcopy(model).double()
            exact = [t.numpy() for t in tree_leaves(model64(x.double(), lengths=lengths))]
            # the layer's own sensitivity: the float64 output after scaling the input by 1 + 1e-12
            nudged = [t.numpy() for t in tree_leaves(model64(x.double() * (1 + 1e-12), lengths=lengths))]
            sensitivity = _error(nudged[0], exact[0])
            errors = tuple(max(_error(a, b) for a, b in zip(run, exact)) for run in (got, want))
            check = max(_error(a, b) for a, b in zip(got, want))
            times: dict[str, list[float]] = {"eager": [], "onnx": []}
            for _ in range(args.repeats):
                times["eager"].append(_once(eager))
                times["onnx"].append(_once(onnx))
        e, o = statistics.median(times["eager"]), statistics.median(times["onnx"])
        rows.append((name, "/".join(ops), e, o, check, errors, sensitivity, exported))
    print()
    print("| layer | ONNX graph | eager fastlayers | ONNX Runtime | ORT / eager | ORT vs eager | vs float64: ORT, eager "
          "| float64, input x (1 + 1e-12) | export |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, ops, e, o, check, (ort_err, eager_err), sensitivity, exported in rows:
        print(f"| {name} | {ops} | {e * 1e3:.1f} ms | {o * 1e3:.1f} ms | {o / e:.2f}x | {check:.1e} | {ort_err:.1e}, "
              f"{eager_err:.1e} | {sensitivity:.1e} | {exported:.1f} s |")
    print("(errors: the largest over the outputs of ||a - b|| / ||b||; float64: the eager layer in float64; "
          "input x (1 + 1e-12): how far the float64 layer's output moves when its input is scaled by 1 + 1e-12, "
          "the layer's own sensitivity to rounding)")
    if os.environ.get("OMP_NUM_THREADS"):
        print(f"(OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})")


if __name__ == "__main__":
    main()
