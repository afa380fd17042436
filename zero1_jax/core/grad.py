"""``z1.value_and_grad`` / ``z1.grad``: jax's, with the gradients
reduce-scattered inside the backward, for plain ``jax.jit`` programs.

Under plain ``jax.jit`` with replicated params, ``jax.grad`` returns the
whole reduced gradient: jit's partitioner all-reduces it (2 Psi of traffic
per device in the ZeRO paper's units), and zero1's update then all-gathers
the weights (Psi): 1.5x data parallelism's bytes. These functions take the
user's loss as ``jax.value_and_grad`` does and run it per device over the
data axis (a ``shard_map`` inside the user's jit, the other mesh axes left
to the partitioner), differentiating through ZeRO-2's hooks
(:func:`zero1_jax.core.zero2.reduced_grad_fn`): each leaf's gradient (or
group of small leaves) is reduce-scattered as the backward produces it, so
the step moves reduce-scatter Psi + all-gather Psi, as ``z1.train_step`` and
DeepSpeed do. The gradients come back as a tree like the params holding
``jax.value_and_grad``'s values, sharded over the data axis
(:mod:`zero1_jax.core.sharded_grads`): tree-maps over them work, and
``tx.update`` (``TrainState.apply_gradients``) takes them without reducing.
Arguments that are not arrays (an Equinox model's static part) are closed
over; a closed-over array sharded over the data axis is warned
(:mod:`zero1_jax.core.closed_over`).

Stock Flax layers work unchanged: the params are ordinary replicated arrays
(unlike :func:`zero1_jax.reduced_params`, whose reduced-typed params JAX
refuses to add to sharded activations).

Example:
  >>> import jax, jax.numpy as jnp, optax, zero1_jax as z1
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> tx = z1.zero1(optax.sgd(0.5), axis_name="data")
  >>> loss = lambda p, x: jnp.mean(x @ p["w"])
  >>> with jax.set_mesh(mesh):
  ...   params = {"w": jnp.ones(3)}
  ...   state = tx.init(params)
  ...   value, grads = jax.jit(z1.value_and_grad(loss, tx))(params, jnp.ones((2, 3)))
  ...   updates, state = tx.update(grads, state, params)
  >>> float(value), [float(u) for u in updates["w"]]
  (3.0, [-0.5, -0.5, -0.5])
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zero1_jax.core import aux as aux_
from zero1_jax.core import empty_leaves
from zero1_jax.core import jit_mesh
from zero1_jax.core import jit_mode as jm
from zero1_jax.core import layout as lay
from zero1_jax.core import order as ordering
from zero1_jax.core import param_axes as pax
from zero1_jax.core import platform as platforms
from zero1_jax.core import rows as batch_rows
from zero1_jax.core import specs as zspecs
from zero1_jax.core import zero2
from zero1_jax.core import closed_over
from zero1_jax.core import explicit_consts
from zero1_jax.core import collectives as col
from zero1_jax.core import lookup
from zero1_jax.core import sharded_grads
from zero1_jax.core import vag_args
from zero1_jax.core.tx_config import Zero1Transformation

NOT_ZERO1 = ("z1.value_and_grad(fun, tx): tx must be the transformation "
             "z1.zero1(...) or z1.zero2(...) returns (its layout decides the "
             "shards), got {got}.")


def value_and_grad(fun: Callable, tx: Zero1Transformation, *,
                   has_aux: bool = False,
                   batch_argnums: Sequence[int] = (1,),
                   shard_lookups: bool | str = "auto",
                   aux_reduce: str | Callable = aux_.MEAN,
                   device_keys: bool = True) -> Callable:
  """``jax.value_and_grad(fun, has_aux=has_aux)`` for ``tx``'s training:
  ``f(params, *args) -> (value, grads)`` (``((value, aux), grads)`` with
  ``has_aux``).

  Args:
    fun: ``fun(params, *args)`` -> the scalar mean loss over the batch it is
      given (or ``(loss, aux)``), as for ``jax.value_and_grad``; run on
      each device's rows, so a loss that mixes rows (batch statistics,
      in-batch negatives) is warned of (core/rows.py).
    tx: from :func:`zero1_jax.zero1` (small leaves packed into buckets, as
      its update reduces them) or :func:`zero1_jax.zero2` (large leaves
      reduce-scattered alone, as the backward produces them).
    has_aux: ``fun`` returns ``(loss, aux)``. Each aux leaf whose leading
      dim grows with the batch (per example) comes back for the whole batch,
      as ``jax.value_and_grad``'s, split over the data axis; the others are
      reduced over the devices by ``aux_reduce`` (:mod:`zero1_jax.core.aux`).
    batch_argnums: positions (in ``(params, *args)``) of the arguments split
      over the data axis on their leading dim: the batch. Other arguments
      (an RNG key, a step) are handed whole to every device.
    device_keys: each PRNG key among the other arguments (a typed key, or a
      raw ``uint32[2]`` one from ``jax.random.PRNGKey``) reaches ``fun`` with
      the device's index along the data axis folded in
      (``jax.random.fold_in(key, jax.lax.axis_index(axis))``, as flax's pmap
      examples fold it into their dropout key; a raw one is told by its
      dtype and shape alone, and a warning says so), so the devices draw
      different dropout masks and noise for their rows; ``jax.value_and_grad``
      draws one for the whole batch, so the draws differ from its, not their
      distribution. False: every device gets the key as given and draws the
      same numbers for its rows. A key ``fun`` closes over is the same on
      every device (a warning says so).
    shard_lookups: a 2-D leaf split over the data axis on its columns that
      ``fun`` reads by rows (an embedding) has its lookups' gradient sent
      to each device's column block (core/lookup.py): the rows read from
      the whole table, their gradient summed by one all-to-all of the
      rows instead of in the table's reduce-scatter, which then no longer
      waits for the backward's end. The same rows; that gradient summed
      in another order. ``"auto"``: on for a program compiled for GPUs or
      TPUs on one host.
    aux_reduce: ``"mean"`` (the devices' mean: a mean over the batch, as
      ``value``), ``"sum"`` (a sum or count over the batch), or a function
      ``(aux, axis_name) -> aux`` of one device's aux (its per-example leaves
      None) that reduces with ``jax.lax`` collectives.

  Returns:
    ``f``: runs under ``jax.jit`` (or eagerly) with a mesh set by
    ``jax.set_mesh`` or carried by the arguments. ``value`` is the loss of
    the whole batch (the mean of the devices' means); ``grads`` is a tree
    like ``params`` of jax.value_and_grad's values, sharded over the data
    axis, which ``tx.update`` takes without reducing.

  Raises:
    TypeError: ``tx`` is not zero1's.
    ValueError: params sharded over other mesh axes (2-D meshes), or a
      batch not divisible over the data axis.
  """
  if not isinstance(tx, Zero1Transformation):
    raise TypeError(NOT_ZERO1.format(got=type(tx).__qualname__))
  fun_given = fun
  cfg = tx.config
  axis = cfg.axis_name
  argnums = tuple(int(i) for i in batch_argnums)
  if 0 in argnums:
    raise ValueError("batch_argnums: position 0 is the params")
  aux_.check_reduce(aux_reduce)

  def f(params, *args):
    # What jax.value_and_grad takes besides arrays (an Equinox model's
    # static part) is closed over; the shard_map takes the arrays.
    args, rebuild = closed_over.split_static(args)
    mesh, where = jit_mesh.find_mesh(axis, params, *args, fallback=cfg.mesh)
    n = where.shape[axis]
    if pax.resolve(params, dict(where.shape), axis, cfg.param_specs) is not None:
      raise ValueError(jm.SHARDED_2D)
    vag_args.check_batch(args, argnums, axis)
    if device_keys:
      vag_args.say_raw_keys(args, argnums)
    layout = lay.plan(params, n)
    fun = fun_given
    # The whole batch's shapes, no placement: traced for what fun closes
    # over, its aux and its read order, fun runs as jax.value_and_grad would
    # run it, minus the batch's sharding types, which code written for one
    # device (flax's Dropout: a mask typed whole, its input split) refuses.
    shapes = vag_args.abstract(args)
    with vag_args.data_axis(axis, n):   # as the shard_map binds it
      if closed_over.check_closed_over(lambda p, *a: fun(p, *rebuild(a)),
                                       (params,) + shapes, axis, n, argnums):
        # arrays on an Explicit mesh it closes over, which shard_map refuses:
        # moved off the mesh where the closure reaches them
        fun = explicit_consts.movable(fun)
        closed_over.check_closed_over(lambda p, *a: fun(p, *rebuild(a)),
                                      (params,) + shapes, axis, n, argnums,
                                      movable=False)
      platform = platforms.resolve(where)
      plain = lambda p, *a: _loss_only(fun(p, *rebuild(a)), has_aux)
      batch_rows.warn_mixing(plain, (params,) + shapes, argnums, axis)
      rows = (aux_.per_example(lambda p, *a: fun(p, *rebuild(a))[1],
                               (params,) + shapes,
                               (params,) + _pieces(args, argnums, n), n,
                               aux_reduce, argnums)
              if has_aux else None)
      lookups = _lookups(shard_lookups, platform, where, layout, plain, params,
                         args, argnums, n, cfg.mesh)
      # Reduced in the order the backward completes the gradients
      # (core/order.py; tree order on CPU, which neither combines nor
      # overlaps collectives), each group after the one before (XLA
      # otherwise queues them at the backward's end).
      gpu_like = platform != "cpu"
      order = ordering.first_reads(plain, params, *shapes,
                                   lookups=lookups) if gpu_like else None
    # GPUs on several hosts: the hooks' leaves packed, their chain kept
    # whole (zero2.reduced_grad_fn; measured on GPUs only).
    apart = platform == "gpu" and not platforms.one_host(where, cfg.mesh)

    def per_device(p, *a):
      if device_keys:
        a = vag_args.device_keys(a, argnums, axis)
      # The lookups read the whole table; their blocks stand only for the
      # gradient, so zeros of a block's shape (no slice of the table that XLA
      # could merge with tx.update's and keep live from the first lookup to
      # the update: BERT-base fp32 on 8 H100s, 11.2 MiB at the peak).
      tables = {i: jnp.zeros_like(col.local_shard(x, layout.leaves[i], axis))
                for i, x in enumerate(jax.tree.leaves(p)) if i in lookups}
      call = (lookup.rewrite(lambda q, *b: fun(q, *rebuild(b)), p, *a,
                             leaves=lookups, axis=axis, local=True)
              if lookups else None)

      def loss_of(q, *rest):   # (tables, args) with lookups, else (args,)
        out = (call(q, rest[0], *rest[1]) if lookups
               else fun(q, *rebuild(rest[0])))
        loss, aux = out if has_aux else (out, None)
        return loss, (loss, aux)
      g, (loss, aux), summed = zero2.reduced_grad_fn(
          loss_of, p, cfg, n, order, platform, tables or None,
          chain=gpu_like, across_hosts=apart, total=True)(a)
      if lookups:   # the lookups' gradient, summed over every device already
        g, g_tables = g
        g = _add_tables(g, g_tables, layout.treedef)
      if has_aux:
        aux = aux_.reduce(aux, rows, aux_reduce, axis)
      return summed / n, aux, g   # jax.lax.pmean(loss, axis)'s sum and divide

    args = tuple(jax.tree.map(lambda x: _split(x, mesh, where, axis), a)
                 if i + 1 in argnums else a for i, a in enumerate(args))
    in_specs = (jax.tree.map(lambda _: P(), params),) + tuple(
        jax.tree.map(lambda _: P(axis) if i + 1 in argnums else P(), a)
        for i, a in enumerate(args))
    g_specs = layout.treedef.unflatten(
        [None if s.kind == lay.STATIC else zspecs.leaf_spec(s, axis)
         for s in layout.leaves])
    try:
      loss, aux, grads = empty_leaves.shard_map(
          per_device, mesh=mesh, in_specs=in_specs,
          out_specs=(P(), P() if rows is None else aux_.out_specs(rows, axis),
                     g_specs), axis_names={axis},
          check_vma=False)(params, *args)
    except (TypeError, ValueError) as e:
      hint = vag_args.batch_hint(args, argnums)
      if hint:
        e.add_note(hint)
      raise
    value = (loss, aux) if has_aux else loss
    # tx.update gathers the new weights in the groups the backward reduced
    # (core/plan.py backward_buckets); CPU keeps its packed plan.
    groups = (None if platform == "cpu"
              else zero2.backward_groups(layout, cfg, order, platform, apart))
    return value, sharded_grads.publish(grads, params, n, groups)

  return f


def _lookups(shard_lookups: bool | str, platform: str, where: Any,
             layout: lay.Layout, plain: Callable, params: Any, args: tuple,
             argnums: tuple, n: int, concrete: Any = None) -> frozenset[int]:
  """The leaves whose row lookups read each device's column block: 2-D,
  split on the columns without padding, not fp16 (whose sums travel
  pre-divided), read by rows; ``"auto"``: GPU/TPU on one host only (across
  hosts the rows' all-to-all reaches every peer over the network)."""
  if shard_lookups == "auto":
    shard_lookups = platform != "cpu" and platforms.one_host(where, concrete)
  elif shard_lookups not in (True, False):
    raise ValueError(f"shard_lookups must be True, False or 'auto', got "
                     f"{shard_lookups!r}")
  candidates = [i for i, s in enumerate(layout.leaves)
                if s.kind == lay.SHARD and s.dim == 1 and len(s.shape) == 2
                and s.padded_shape == s.shape and s.dtype != jnp.float16]
  if not shard_lookups or not candidates:
    return frozenset()
  return lookup.find(plain, params, *_pieces(args, argnums, n),
                     candidates=candidates)


def _pieces(args: tuple, argnums: tuple, n: int) -> tuple:
  """``args`` as one device sees them, abstract: the batch arguments'
  leading dims split ``n`` ways."""
  return tuple(jax.tree.map(
      lambda x, i=i: jax.ShapeDtypeStruct(
          ((jnp.shape(x)[0] // n,) if i + 1 in argnums else jnp.shape(x)[:1])
          + jnp.shape(x)[1:], jnp.result_type(x)), a)
      for i, a in enumerate(args))


def _add_tables(g: Any, g_tables: dict, treedef: Any) -> Any:
  """``g`` (this device's summed shards) with the lookups' gradient of each
  table leaf (its column block, summed over every device's tokens) added;
  ``treedef``: the params' (a None of the program's own is no leaf)."""
  leaves = treedef.flatten_up_to(g)
  for i, v in g_tables.items():
    leaves[i] = leaves[i] + v.reshape(leaves[i].shape).astype(leaves[i].dtype)
  return treedef.unflatten(leaves)


def _loss_only(out, has_aux: bool):
  return out[0] if has_aux else out


def _split(x, mesh, where, axis: str):
  """A batch leaf placed split over ``axis`` on its leading dim (on an
  Explicit axis a reshard, on an Auto one a sharding constraint)."""
  kind = dict(zip(where.axis_names, where.axis_types))[axis]
  target = P(axis) if mesh is None else jax.sharding.NamedSharding(mesh, P(axis))
  if kind == jax.sharding.AxisType.Explicit:
    return jax.sharding.reshard(x, target)
  return jax.lax.with_sharding_constraint(x, target)


def grad(fun: Callable, tx: Zero1Transformation, *, has_aux: bool = False,
         batch_argnums: Sequence[int] = (1,),
         shard_lookups: bool | str = "auto",
         aux_reduce: str | Callable = aux_.MEAN,
         device_keys: bool = True) -> Callable:
  """``jax.grad`` for ``tx``'s training: ``f(params, *args) -> grads`` (or
  ``(grads, aux)``), the gradients reduce-scattered in the backward, as
  :func:`value_and_grad`."""
  vg = value_and_grad(fun, tx, has_aux=has_aux, batch_argnums=batch_argnums,
                      shard_lookups=shard_lookups, aux_reduce=aux_reduce,
                      device_keys=device_keys)

  def f(params, *args):
    value, grads = vg(params, *args)
    return (grads, value[1]) if has_aux else grads

  return f
