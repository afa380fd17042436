"""The ZeRO mechanism, with no I/O: how a parameter tree becomes shards
(:mod:`.layout`), the collectives over them (:mod:`.collectives`), loss
scaling (:mod:`.precision`), the optax transform (:mod:`.transform`), the
shardings of its state (:mod:`.specs`) and the shard_map step (:mod:`.step`).
Imports point down that list: step -> specs -> transform -> collectives ->
layout.
"""
