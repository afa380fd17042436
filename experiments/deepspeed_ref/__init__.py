"""DeepSpeed 0.19.8 itself, the reference: run in a torch + deepspeed venv
(each file's docstring has the commands), never imported by the package or
the tests. ``record_parity.py`` records ZeRO-1 runs as the fixtures of
tests/test_ds_parity.py, ``probe_config.py`` runs its config parser on the
rules of docs/ds_0.19.8_reference.md, ``bench_peer.py`` benchmarks its ZeRO-1
beside plain data parallel (docs/results.md).
"""
