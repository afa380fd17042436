"""The ZeRO mechanism, with no I/O: how a parameter tree becomes shards
(:mod:`.layout`), the collectives over them (:mod:`.collectives`), loss
scaling (:mod:`.precision`), the state (:mod:`.state`), the optax
transform (:mod:`.transform`: its configuration, ``tx.init`` and
``tx.update``) and what they run on each device: the state
(:mod:`.state_init`) and one update (:mod:`.apply`) in stages, plan
(:mod:`.plan`), reduce (:mod:`.grad_reduce`), norm (:mod:`.grad_norm`),
inner update (:mod:`.inner_update`) and gather (:mod:`.gather`); their
plain-jit entry (:mod:`.jit_mode`, with :mod:`.jit_mesh` and
:mod:`.reduced`); whether an inner optimizer may be sharded
(:mod:`.elementwise`, with the taint analysis of its jaxpr in
:mod:`.jaxpr_check`, its state's shard dims in :mod:`.state_dims`, the
numeric probe in :mod:`.probe` and the same program on whole leaves and
shards in :mod:`.size_check`), the shardings of its state (:mod:`.specs`,
:mod:`.shardings`), params sharded over other mesh axes on 2-D meshes
(:mod:`.param_axes`), the checks of what an update is handed
(:mod:`.checks`), the shard_map step (:mod:`.step`, with
:mod:`.param_storage` and :mod:`.on_mesh`) and the inner optax state
gathered back to parameter shapes (:mod:`.inner_state`). Around the
transform: what ``update`` returns (:mod:`.updates`), optax's calling
conventions (:mod:`.optax_protocol`), arrays closed over on an Explicit mesh
(:mod:`.explicit_consts`), a new state under a step past 0
(:mod:`.fresh_state`); around the check: which part is refused
(:mod:`.blame`), extra update arguments (:mod:`.extra_args`) and the
messages (:mod:`.refusal`).
Imports point down: step -> zero2 -> transform -> {apply, state_init,
jit_mode} -> {plan, grad_reduce, grad_norm, inner_update, gather} ->
collectives -> layout; docs/architecture.md has the whole graph.
"""
