"""The ZeRO mechanism, with no I/O: how a parameter tree becomes shards
(:mod:`.layout`), the collectives over them (:mod:`.collectives`), loss
scaling (:mod:`.precision`), the optax transform (:mod:`.transform`),
whether an inner optimizer may be sharded (:mod:`.elementwise`, with the
taint analysis of its jaxpr in :mod:`.jaxpr_check`), the
shardings of its state (:mod:`.specs`) and the shard_map step (:mod:`.step`).
Imports point down that list: step -> specs -> elementwise -> {jaxpr_check,
layout}, and specs -> transform -> collectives -> layout.
"""
