"""What the tests and the benchmarks share: tiny checkpoints and a server in its own process.

No model hub is reachable from CI, so the tests build their models themselves,
in the real Hugging Face layout, with transformers' own classes where it has
them: the shared tokenizer and sizes (:mod:`.base`), mlx-lm's own families
(:mod:`.checkpoints`), a scripted tool caller (:mod:`.tools`); a family mlxcel
knows more of builds its own in its folder (``mlxcel/families/<family>/tiny.py``).
The benchmarks build bigger ones the same way. Needs the ``dev`` extra
(transformers, CPU torch, tokenizers); nothing in the server imports this
package or a family's ``tiny`` module.
"""
