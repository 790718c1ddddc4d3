"""Dev tooling: `make run`'s launcher, the process supervisor, the local vLLM CPU node and the tiny models.

Used by `make run`, tests/ and benchmarks/ from a checkout (it is not part of the distribution);
never imported by the apps (tenants, adapters, serving, frontend) nor by mint_site. Its heavy
dependencies (transformers, tokenizers) come with the `dev` extra, the local engine with
`engine-cpu`. Command lines: `python -m devtools.launcher` (`make run`), `python -m
devtools.tiny_models`, `python -m devtools.demo_adapter`.
"""
