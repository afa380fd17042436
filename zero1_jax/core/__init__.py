"""The ZeRO mechanism, with no I/O: how a parameter tree becomes shards
(:mod:`.layout`), the collectives over them (:mod:`.collectives`), loss
scaling (:mod:`.precision`), the state (:mod:`.state`), the optax
transform (:mod:`.transform`) and its plain-jit entry (:mod:`.jit_mode`),
whether an inner optimizer may be sharded (:mod:`.elementwise`, with the
taint analysis of its jaxpr in :mod:`.jaxpr_check` and the same program on
whole leaves and shards in :mod:`.size_check`), the
shardings of its state (:mod:`.specs`), params sharded over other mesh axes
on 2-D meshes (:mod:`.param_axes`), the checks of what an update is handed
(:mod:`.checks`), the shard_map step (:mod:`.step`) and the inner
optax state gathered back to parameter shapes (:mod:`.inner_state`). Around
the transform: what ``update`` returns (:mod:`.updates`), optax's calling
conventions (:mod:`.optax_protocol`), arrays closed over on an Explicit mesh
(:mod:`.explicit_consts`), a new state under a step past 0
(:mod:`.fresh_state`); around the check: which part is refused
(:mod:`.blame`), extra update arguments (:mod:`.extra_args`) and the
messages (:mod:`.refusal`).
Imports point down that list: step -> transform -> jit_mode -> specs ->
{elementwise -> {jaxpr_check, size_check, layout}, state}, transform -> {checks,
collectives} -> layout, and step, transform, jit_mode, specs -> param_axes ->
layout.
"""
