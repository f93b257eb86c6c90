"""What the tests and the benchmarks share: tiny checkpoints and a server in its own process.

No model hub is reachable from CI, so the tests build their models themselves,
in the real Hugging Face layout, with transformers' own classes where it has
them (:mod:`.checkpoints`, :mod:`.gemma4`, :mod:`.glm`, :mod:`.inkling`,
:mod:`.tools`); the benchmarks build bigger ones the same way. Needs the
``dev`` extra (transformers, CPU torch, tokenizers); nothing in the server
imports this package.
"""
