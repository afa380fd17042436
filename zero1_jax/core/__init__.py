"""The ZeRO mechanism, with no I/O: how a parameter tree becomes shards
(:mod:`.layout`), the collectives over them (:mod:`.collectives`), loss
scaling (:mod:`.precision`), the state (:mod:`.state`), the optax
transform (:mod:`.transform`) and its plain-jit entry (:mod:`.jit_mode`),
whether an inner optimizer may be sharded (:mod:`.elementwise`, with the
taint analysis of its jaxpr in :mod:`.jaxpr_check`), the
shardings of its state (:mod:`.specs`) and the shard_map step (:mod:`.step`).
Imports point down that list: step -> transform -> jit_mode -> specs ->
{elementwise -> {jaxpr_check, layout}, state}, and transform -> collectives
-> layout.
"""
