"""Partitioning rules: how the SPMD partitioner splits the softmax custom calls across a mesh.

Without rules the partitioner would treat our custom calls as opaque and replicate them: every
operand all-gathered, every device computing every row. Here each primitive lowers through
:func:`jax.experimental.custom_partitioning`, so that under ``jax.jit`` with sharded inputs

* axes other than the softmax (last) axis keep their sharding: each device runs the fused kernel
  on its own rows, with no collective at all. A bias or mask keeps its size-1 (broadcast) axes
  unsharded and is sharded like the scores along its full-size axes;
* a sharded softmax axis (keys split over devices: sequence or context parallelism) is never
  gathered: each device reduces its slice of every row to a max and a sum of exponentials, two
  all-reduces of one float per row combine them (a max, then the sum rescaled to the global max),
  and each device normalises its own slice. The backward all-reduces the row sums of ``dy * y``
  (of ``dy`` for log-softmax) the same way. Those local passes are XLA fusions, not the fused
  kernel;
* the causal rule counts queries and keys from the start of the whole array: with the query or key
  axis sharded, each shard's global offset (``axis_index * local size``) shifts its triangle. With
  only the query axis sharded the triangle becomes a small ``(Sq/n, Sk)`` mask for the fused kernel.

Both partitioners are served: a Shardy sharding rule (the default) and GSPMD's
``infer_sharding_from_operands``/``propagate_user_sharding`` callbacks. On one device and inside
``shard_map`` (every mesh axis manual) custom_partitioning inlines the kernel call, so nothing
changes there.

The public primitives (``softmax_fwd_p``, ``softmax_bwd_p``, with their batching and JVP rules)
lower to :func:`partitioned_fwd` / :func:`partitioned_bwd`, which bind the kernel primitives
(``kernel_fwd_p``, ``kernel_bwd_p``: abstract evaluation and the FFI lowering only) per shard.
"""

from __future__ import annotations

import functools

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_softmax import _reference

__all__ = ["partitioned_fwd", "partitioned_bwd"]


# --- the per-shard function -----------------------------------------------------------------------
# The partitioner traces a partition's lower_fn at compile time, under whatever mesh context the
# caller's jit had: with jax.set_mesh and explicit axes, every value traced there would carry the
# mesh's (replicated) sharding and lower with a Sharding annotation of its own, which nothing
# removes from the already-partitioned program (XLA then fails: "No registered implementation for
# untyped custom call to Sharding"). The per-shard values are plain local arrays: the arguments
# are re-typed without a mesh (an identity in HLO) and the body traced outside the mesh context.
_local_view_p = Primitive("jax_softmax_local_view")
_local_view_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(_local_view_p, lambda ctx, x: [x])
_NO_MESH = jax.sharding.AbstractMesh((), ())


def _per_shard(body):
    def lower_fn(*args):
        if jax.sharding.get_abstract_mesh().empty:
            return body(*args)
        with jax.sharding.use_abstract_mesh(_NO_MESH):
            return body(*(_local_view_p.bind(a) for a in args))

    return lower_fn


# --- specs ----------------------------------------------------------------------------------------
def _mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _full_spec(sharding, ndim: int):
    """The sharding's PartitionSpec padded to ndim entries, or None if it has no mesh axes to name
    (a GSPMDSharding built without a mesh)."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def _follow(spec, shape, like_shape) -> PartitionSpec:
    """An operand's spec: the scores' spec on its full-size axes, unsharded where it broadcasts."""
    return PartitionSpec(*(s if n == m else None for s, n, m in zip(spec, shape, like_shape)))


def _shard_offset(axes: tuple[str, ...], local_size: int):
    """Global index of this shard's first element along an axis sharded over mesh `axes`."""
    if not axes:
        return 0
    return jax.lax.axis_index(axes) * local_size


def _shapes_of(types):
    from jax.extend.mlir import ir

    return [tuple(ir.RankedTensorType(t).shape) for t in types]


def _operand_factors(factors, shape, like, k: int) -> tuple[str, ...]:
    """Shardy factors of operand k of `shape` beside the operand of `like` shape with `factors`:
    the same factor on a full-size axis, one of its own (left unsharded) on a broadcast one."""
    return tuple(f if n == m else f"o{k}_{i}" for i, (f, n, m) in enumerate(zip(factors, shape, like)))


def _sharding_rule(*args):
    """Shardy rule: every operand maps its full-size axes to the first operand's factors and its
    size-1 (broadcast) axes to factors of their own, which stay unsharded; the result is sharded
    as the first operand. The softmax axis is an ordinary factor: sharding it is allowed (the
    partition callback then all-reduces the row statistics)."""
    value_types = args[-2]
    shapes = _shapes_of(value_types)
    first = shapes[0]
    factors = [f"d{i}" for i in range(len(first))]
    mappings = [" ".join(factors)]
    for k, shape in enumerate(shapes[1:]):
        mappings.append(" ".join(_operand_factors(factors, shape, first, k)))
    return ", ".join(mappings) + " -> " + " ".join(factors)


def _first_sharding(mesh, arg_shapes):
    """The first operand's sharding; replicated where GSPMD asks before it knows it (None: a vmap
    over a replicated operand of sharded scores; answering None aborted the process)."""
    sharding = arg_shapes[0].sharding
    return NamedSharding(mesh, PartitionSpec()) if sharding is None else sharding


def _infer_from_operands(*args):
    """GSPMD: the result is sharded as the first operand (the scores, or y in the backward)."""
    mesh, arg_shapes, _ = args[-3:]
    sharding = _first_sharding(mesh, arg_shapes)
    spec = _full_spec(sharding, len(arg_shapes[0].shape))
    return sharding if spec is None else NamedSharding(mesh, PartitionSpec(*spec))


def _propagate_user_sharding(*args):
    """GSPMD, propagating backwards from the user(s) of the result(s): keep their shardings."""
    _, user_shape = args[-2:]
    if isinstance(user_shape, (list, tuple)):
        return [u.sharding for u in user_shape]
    return user_shape.sharding


def _plan(mesh, arg_shapes, causal: bool):
    """Operand and result shardings for one call, the mesh axes of the key (softmax) and query
    axes, or None when the shardings name no mesh (then the call runs replicated)."""
    first = arg_shapes[0]
    ndim = len(first.shape)
    spec = _full_spec(first.sharding, ndim)
    if spec is None or mesh is None or mesh.empty:
        return None
    arg_shardings = tuple(
        NamedSharding(mesh, _follow(spec, a.shape, first.shape)) for a in arg_shapes
    )
    # y and dy share the spec in the backward (their shapes are equal): dy follows y.
    out_sharding = NamedSharding(mesh, PartitionSpec(*spec))
    # Mesh axes of size 1 split nothing: an axis "sharded" only over those is whole on each device
    # and keeps the fused kernel.
    def split(entry):
        return tuple(a for a in _mesh_axes(entry) if mesh.shape[a] > 1)

    key_axes = split(spec[-1])
    query_axes = split(spec[-2]) if causal and ndim >= 2 else ()
    return arg_shardings, out_sharding, key_axes, query_axes


def _replicated(arg_shapes):
    """Fallback for shardings without a mesh: every operand whole on every device (correct, but
    gathered; jit with NamedSharding inputs never comes here)."""
    devices = np.asarray(arg_shapes[0].sharding._device_assignment)
    rep = NamedSharding(jax.sharding.Mesh(devices, ("devices",)), PartitionSpec())
    return rep, (rep,) * len(arg_shapes)


def _causal_as_mask(mask, has_mask: bool, shape, q_offset):
    """The causal triangle of this shard's (Sq/n, Sk) block as a boolean operand, combined with
    the user's mask: the kernel's own causal rule counts from the shard's first row."""
    valid = _reference.valid_positions(shape, mask, has_mask, True, q_offset=q_offset, broadcast=False)
    return valid.reshape((1,) * (len(shape) - valid.ndim) + valid.shape)


# --- the partitioned kernel calls ------------------------------------------------------------------
def _kernel(name: str) -> Primitive:
    """kernel_fwd_p or kernel_bwd_p, looked up at each bind: primitives.py imports this module."""
    from jax_softmax import primitives

    return getattr(primitives, name)


def _partitioned_call(kernel: str, param_names: tuple[str, ...], reference, statistics):
    """The custom_partitioning op of one kernel primitive, called as ``op(rows, other, mask,
    *params)``.

    Both kernels take three operands the same way: the rows (the scores x, or y in the backward),
    which give the shape, the plan and the result's sharding; a second operand sharded like them
    where it is full-size (the bias, or dy); the mask. `kernel` names the primitive in
    primitives.py and `param_names` its static parameters, in the order the op takes them.
    `reference` is the _reference formula each device runs on its slice when the softmax axis is
    sharded; `statistics` maps the names of its row-statistics hooks to the collective that
    combines them over the key shards (``{"row_max": jax.lax.pmax, "row_sum": jax.lax.psum}``).
    """

    def bind(rows, other, mask, params):
        return _kernel(kernel).bind(rows, other, mask, **params)

    def local(rows, other, mask, *static):
        return bind(rows, other, mask, dict(zip(param_names, static)))

    def partition(*args):
        *static, mesh, arg_shapes, _ = args
        params = dict(zip(param_names, static))
        causal, has_mask = params["causal"], params["has_mask"]
        plan = _plan(mesh, arg_shapes, causal)
        if plan is None:
            out, arg_shardings = _replicated(arg_shapes)
            return mesh, _per_shard(lambda *ops: bind(*ops, params)), out, arg_shardings
        arg_shardings, out_sharding, key_axes, query_axes = plan

        @_per_shard
        def lower_fn(rows, other, mask):
            if key_axes:
                n_rows, n_cols = rows.shape[-2] if rows.ndim >= 2 else 1, rows.shape[-1]
                # Each row statistic of this shard combined with the other key shards'.
                hooks = {name: functools.partial(op, axis_name=key_axes) for name, op in statistics.items()}
                return reference(
                    rows, other, mask, **params,
                    q_offset=_shard_offset(query_axes, n_rows) if causal else 0,
                    k_offset=_shard_offset(key_axes, n_cols) if causal else 0,
                    **hooks,
                )
            if causal and query_axes:
                q_offset = _shard_offset(query_axes, rows.shape[-2])
                mask = _causal_as_mask(mask, has_mask, rows.shape, q_offset)
                return bind(rows, other, mask, dict(params, has_mask=True, causal=False))
            return bind(rows, other, mask, params)

        return mesh, lower_fn, out_sharding, arg_shardings

    op = custom_partitioning(local, static_argnums=tuple(range(3, 3 + len(param_names))))
    op.def_partition(
        partition=partition,
        infer_sharding_from_operands=_infer_from_operands,
        propagate_user_sharding=_propagate_user_sharding,
        sharding_rule=_sharding_rule,
    )
    return op


_fwd_cp = _partitioned_call(
    "kernel_fwd_p", ("log", "scale", "has_bias", "has_mask", "causal"), _reference.forward,
    {"row_max": jax.lax.pmax, "row_sum": jax.lax.psum},
)
_bwd_cp = _partitioned_call(
    "kernel_bwd_p", ("log", "scale", "has_mask", "causal"), _reference.backward,
    {"row_sum": jax.lax.psum},
)


def partitioned_fwd(x, bias, mask, *, log, scale, has_bias, has_mask, causal):
    """softmax_fwd_p's lowering: the kernel per shard, under the partitioning rules above."""
    return _fwd_cp(x, bias, mask, log, scale, has_bias, has_mask, causal)


def partitioned_bwd(y, dy, mask, *, log, scale, has_mask, causal):
    """softmax_bwd_p's lowering, as partitioned_fwd."""
    return _bwd_cp(y, dy, mask, log, scale, has_mask, causal)
