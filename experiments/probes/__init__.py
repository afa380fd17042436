"""One question each, answered by measuring (``python -m
experiments.probes.<name>``): what one collective costs alone
(``collective_costs``), the ways to train side by side (``forms``), the bytes a
compiled step writes (``hlo_bytes``), plain-jit ZeRO-1 vs ``z1.train_step``
(``jit_mode_bench``), why a compiled peak differs (``peak_breakdown``), long
CPU runs under load (``rendezvous``), the elementwise check's start-up cost
(``startup``) and ZeRO-1 vs ZeRO-2 (``zero2_compare``). docs/results.md gives
what each found, with its command.
"""
