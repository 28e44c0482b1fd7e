"""fastlayers' shared internals, below the layer families and above the kernels: the backend
choice (:mod:`.backend`), mixed precision (:mod:`.precision`), argument checks (:mod:`.checks`),
second derivatives through the reference twins (:mod:`.twice`), buffer reuse (:mod:`.pool`),
trace-time helpers that import nothing of fastlayers (:mod:`.compiling`), TorchScript's errors
(:mod:`.jit`) and the machine's description (:mod:`.system`). They import nothing of the layer
families (``make test``: import-linter's layers contract)."""
