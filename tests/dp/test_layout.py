"""dp.Layout: data x FSDP x tensor x pipeline on one mesh, each equal to one device.

The model (tests/multihost/workers/nd_model.py) is written once and runs dense on one device;
every layout trains its twin copies (Adam and plain SGD) and must equal plain single-device
optax on the whole batch.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import dp, parallel
from jaxcoll._core.vma import varying_axes
from tests.multihost.workers import nd_model
from tests.multihost.workers.nd_model import (
    MICRO,
    SPECS,
    TWIN,
    D,
    F,
    data,
    loss_fn,
    optimizer,
    params0,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return nd_model.reference()


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


#: (layout's name, sync); sync None: the layout's default (FSDP over a shard role, else DDP).
LAYOUTS = [
    ("dp8", None),
    ("fsdp8", None),
    ("dp2xfsdp4", None),
    ("fsdp4xtp2", None),
    ("fsdp4xtp2", dp.sync.ZeRO1()),
    ("dp2xtp2xpp2", None),
    ("fsdp2xtp2xpp2", None),
]


def _id(case):
    name, sync = case
    return name if sync is None else f"{name}-{type(sync).__name__.lower()}"


def _trainer(name, loss=loss_fn, schedule=None, sync=None):
    zero1 = isinstance(sync, dp.sync.ZeRO1)
    return dp.Trainer(
        loss,
        optimizer(),
        sync=sync,
        layout=dataclasses.replace(dp.Layout.parse(name), schedule=schedule),
        # Accumulation: its sums of sliced gradients are typed as the slices are.
        accum_steps=2 if name in ("fsdp2xtp2xpp2", "dp2xtp2xpp2", "fsdp4xtp2") and not zero1 else 1,
        extra=dp.ema(0.5) if zero1 else None,
    )


def _max_rel(got, want):
    diffs = jax.tree_util.tree_map(
        lambda a, b: float(np.max(np.abs(np.asarray(a) - b)) / (np.max(np.abs(b)) + 1e-12)),
        got,
        want,
    )
    return max(jax.tree_util.tree_leaves(diffs))


@pytest.mark.parametrize("name, sync", LAYOUTS, ids=[_id(c) for c in LAYOUTS])
def test_every_layout_equals_one_device(name, sync, reference):
    trainer = _trainer(name, sync=sync)
    state = trainer.init(params0(), jax.random.key(1), specs=SPECS)
    for batch in data():
        state, metrics = trainer.step(state, batch)
    got = trainer.host_params(state)
    for k in TWIN:
        assert _max_rel(got[k], reference[k]) <= TOL, (name, k)
    # The placement each role promises, per device: the tensor-split kernels hold 1/t of
    # their columns, the pipeline 1/p of the layers, FSDP 1/d more (HSDP: 1/shard).
    sizes = dict(trainer.mesh.shape)
    w1 = state.params["sgd"]["blocks"]["w1"]
    held = w1.addressable_shards[0].data.size / w1.size
    want = 1.0
    for a in trainer.layout.axes:
        want /= sizes[a]
    if isinstance(trainer.sync, dp.sync.FSDP):
        want /= sizes["shard"]
    assert held == pytest.approx(want), (name, held, want)
    want_sync = type(sync) if sync is not None else dp.sync.DDP
    if sync is None and "fsdp" in name:
        want_sync = dp.sync.FSDP
    assert type(trainer.sync) is want_sync, (name, trainer.sync)
    assert np.isfinite(float(metrics["loss"]))


# Every schedule under FSDP x tensor x pipeline with accumulation; the DDP variant once (the
# schedules' own code is the same under both, and each schedule costs a compile of ~10 s).
PIPELINED = [
    ("dp2xtp2xpp2", parallel.GPipe(nd_model.MICRO)),
    ("fsdp2xtp2xpp2", parallel.GPipe(nd_model.MICRO)),
    ("fsdp2xtp2xpp2", parallel.OneFOneB(nd_model.MICRO)),
    ("fsdp2xtp2xpp2", parallel.Interleaved(nd_model.MICRO, virtual=2)),
    ("fsdp2xtp2xpp2", parallel.ZeroBubble(nd_model.MICRO)),
]


@pytest.mark.parametrize("name, schedule", PIPELINED, ids=[f"{n}-{s!r}" for n, s in PIPELINED])
def test_every_pipelined_layout_trains_with_each_schedule_equal_to_one_device(
    name, schedule, reference
):
    # The schedule's own backward (parallel.pipeline_loss) inside the Trainer's
    # value_and_grad, with tensor parallel stages, DDP or FSDP, and accumulation (fsdp2x...).
    # Interleaved: the 4 stacked layers as (2, 2, ...), P(None, "pipe"): stage s holds model
    # chunks s and s + 2, one layer each.
    params, specs = params0(), SPECS
    if isinstance(schedule, parallel.Interleaved):
        v = schedule.virtual
        params = {
            k: {**p, "blocks": nd_model.interleave(p["blocks"], v)} for k, p in params.items()
        }
        specs = {
            k: {**c, "blocks": jax.tree.map(lambda q: P(None, *q), c["blocks"], is_leaf=_is_spec)}
            for k, c in SPECS.items()
        }
    # The schedule is the layout's: the model code passes none (nor an axis).
    trainer = _trainer(name, nd_model.scheduled_loss(), schedule)
    state = trainer.init(params, jax.random.key(1), specs=specs)
    for batch in data():
        state, metrics = trainer.step(state, batch)
    got = trainer.host_params(state)
    for k in TWIN:
        if isinstance(schedule, parallel.Interleaved):
            got[k]["blocks"] = nd_model.interleave(got[k]["blocks"], -1)
        assert _max_rel(got[k], reference[k]) <= TOL, (name, schedule, k)


def _is_spec(x):
    return isinstance(x, P)


def test_a_tensor_split_leaf_keeps_its_split_and_fsdp_adds_the_data_split():
    trainer = _trainer("fsdp4xtp2")
    state = trainer.init(params0(), jax.random.key(1), specs=SPECS)
    blocks = state.params["adam"]["blocks"]
    assert blocks["w1"].sharding.spec == P(None, "shard", "tensor")
    assert blocks["w2"].sharding.spec == P(None, "tensor", "shard")
    assert blocks["b1"].sharding.spec == P("shard", "tensor")  # (L, F): only the layer axis left
    # Adam's moments mirror the params' placement.
    mu = state.opt_state.inner_states["adam"].inner_state[0].mu["adam"]["blocks"]["w1"]
    assert mu.sharding.spec == P(None, "shard", "tensor")
    # Under ZeRO-1 the params stay whole over the data axis, the moments and an EMA of the
    # params split there too, and all keep the tensor split.
    trainer = _trainer("fsdp4xtp2", sync=dp.sync.ZeRO1())
    state = trainer.init(params0(), jax.random.key(1), specs=SPECS)
    assert state.params["sgd"]["blocks"]["w1"].sharding.spec == P(None, None, "tensor")
    mu = state.opt_state.inner_states["adam"].inner_state[0].mu["adam"]["blocks"]["w1"]
    assert mu.sharding.spec == P("shard", None, "tensor")  # ZeRO-1: the first dim 4 divides
    assert state.extra["sgd"]["blocks"]["w1"].sharding.spec == P(None, None, "tensor")


def test_specs_from_flax_boxes_equal_explicit_specs():
    import flax.linen as nn

    boxed = jax.tree_util.tree_map(
        lambda x, s: nn.Partitioned(x, tuple(s) + (None,) * (x.ndim - len(s))) if s else x,
        params0(),
        SPECS,
        is_leaf=lambda s: isinstance(s, P),
    )
    trainer = _trainer("fsdp4xtp2")
    a = trainer.init(boxed, jax.random.key(1))
    b = _trainer("fsdp4xtp2").init(params0(), jax.random.key(1), specs=SPECS)
    specs = lambda s: jax.tree_util.tree_map(lambda x: x.sharding.spec, s.params)  # noqa: E731
    assert specs(a) == specs(b)


def test_a_loss_that_varies_over_the_tensor_axis_is_refused():
    def partial_loss(params, batch, rng):
        # A model running its tensor parallel by hand (it asks for the axis), its row-parallel
        # product without the all-reduce: each tensor rank holds a partial sum. (A model that
        # never asks leaves the axis to XLA, which inserts the reduction: tests/dp/
        # test_honoured.py.)
        assert parallel.is_bound("tensor")
        h = batch["x"] @ params["w1"]
        return jnp.mean((h @ params["w2"]) ** 2), {}

    mesh = _mesh((4, 2), ("data", "tensor"))
    trainer = dp.Trainer(partial_loss, optax.sgd(0.1), mesh=mesh, layout=dp.Layout(tensor="tensor"))
    params = {"w1": np.ones((D, F), np.float32), "w2": np.ones((F, 2), np.float32)}
    state = trainer.init(
        params, jax.random.key(0), specs={"w1": P(None, "tensor"), "w2": P("tensor")}
    )
    with pytest.raises(
        ValueError, match=r"Trainer.step: the loss varies over the model axis 'tensor'"
    ):
        trainer.step(state, data()[0])


def test_a_state_placed_against_the_init_specs_is_refused_not_remade():
    trainer = _trainer("fsdp4xtp2")
    state = trainer.init(params0(), jax.random.key(1), specs=SPECS)  # "inp" whole
    mesh = trainer.mesh
    w = state.params["adam"]["inp"]
    split = jax.device_put(w, NamedSharding(mesh, P(None, "tensor")))
    bad = state.replace(params={**state.params, "adam": {**state.params["adam"], "inp": split}})
    with pytest.raises(ValueError, match=r"Trainer.step: params\['adam'\]\['inp'\] is placed "):
        trainer.step(bad, data()[0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(layout=dp.Layout(tensor="model")),
            r"layout tensor='model' is not an axis of the mesh",
        ),
        (dict(layout=dp.Layout(tensor="data")), r"layout tensor='data' is also a data axis"),
        (dict(layout="tensor"), r"layout must be a dp.Layout"),
    ],
)
def test_bad_layouts_are_named(kwargs, match):
    mesh = _mesh((4, 2), ("data", "tensor"))
    with pytest.raises((TypeError, ValueError), match=match):
        dp.Trainer(loss_fn, optimizer(), mesh=mesh, **kwargs)


def test_layout_value_checks():
    with pytest.raises(TypeError, match=r"dp.Layout: tensor must be a degree \(an int"):
        dp.Layout(tensor=2.0)
    with pytest.raises(ValueError, match=r"names one mesh axis for two roles"):
        dp.Layout(tensor="x", pipeline="x")
    with pytest.raises(ValueError, match=r"mixes degrees \(ints\) and mesh axis names"):
        dp.Layout(shard=4, tensor="model")
    with pytest.raises(ValueError, match=r"gives -1 \(the devices left\) to more than one"):
        dp.Layout(shard=-1, replicate=-1)
    with pytest.raises(ValueError, match=r"tensor=0 must be a positive degree"):
        dp.Layout(tensor=0)
    with pytest.raises(TypeError, match=r"schedule must be a pipeline schedule value"):
        dp.Layout(pipeline=2, schedule="1f1b")
    with pytest.raises(ValueError, match=r"and Layout\(shard=8\) has none; give it pipeline="):
        dp.Layout(shard=8, schedule=parallel.OneFOneB(4))
    with pytest.raises(ValueError, match=r"rules\['heads'\] = 'model'"):
        dp.Layout(tensor=2, rules={"heads": "model"})
    assert dp.Layout(tensor="t", pipeline="p").axes == ("t", "p")
    # Degrees build the mesh: tensor innermost, pipeline outermost, the rest to -1 / replicate.
    mesh = dp.Layout(replicate=2, tensor=2, pipeline=2).make_mesh()
    assert dict(mesh.shape) == {"pipeline": 2, "replicate": 2, "tensor": 2}
    assert mesh.axis_names == ("pipeline", "replicate", "tensor")
    assert [d.id for d in mesh.devices[0, 0]] == [0, 1]  # a tensor pair: neighbours
    assert dict(dp.Layout(tensor=2).make_mesh().shape) == {"replicate": 4, "tensor": 2}
    assert dict(dp.Layout(shard=-1, pipeline=2).make_mesh().shape) == {"pipeline": 2, "shard": 4}
    with pytest.raises(ValueError, match=r"uses 4 devices, and there are 8"):
        dp.Layout(shard=2, tensor=2).make_mesh()
    with pytest.raises(ValueError, match=r"needs a multiple of 3 devices"):
        dp.Layout(tensor=3).make_mesh()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(layout=dp.Layout(shard=8), mesh=_mesh((8,), ("data",))),
            r"Layout\(shard=8\) gives degrees, so it builds the mesh itself",
        ),
        (
            dict(layout=dp.Layout(shard=8), sync=dp.sync.DDP()),
            r"sync=DDP\(\) keeps whole params .* Layout\(shard=8\) shards them over 'shard'",
        ),
        (
            dict(layout=dp.Layout(replicate=8), sync=dp.sync.FSDP()),
            r"sync=FSDP\(\) splits the state over the data shards, and Layout\(replicate=8\)",
        ),
    ],
)
def test_each_role_is_said_once(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        dp.Trainer(loss_fn, optimizer(), **kwargs)


def test_a_layout_names_the_roles_of_a_users_mesh(reference):
    # The same model code (roles "tensor"/"pipeline", logical "mlp"/"layers") on a mesh whose
    # axes are named otherwise: the layout maps each role to its axis.
    mesh = _mesh((2, 2, 2), ("p", "d", "m"))
    layout = dp.Layout(shard="d", tensor="m", pipeline="p", schedule=parallel.OneFOneB(MICRO))
    trainer = dp.Trainer(nd_model.scheduled_loss(), optimizer(), mesh=mesh, layout=layout)
    assert isinstance(trainer.sync, dp.sync.FSDP) and trainer.layout.axis_name == "d"
    state = trainer.init(params0(), jax.random.key(1), specs=SPECS)
    assert state.params["sgd"]["blocks"]["w1"].sharding.spec == P("p", "d", "m")
    for batch in data():
        state, _ = trainer.step(state, batch)
    got = trainer.host_params(state)
    for k in TWIN:
        assert _max_rel(got[k], reference[k]) <= TOL, k
    # A rule keeps a logical axis whole: the layers stay on every stage.
    whole = dp.Trainer(
        loss_fn, optimizer(), layout=dp.Layout(shard=4, pipeline=2, rules={"layers": None})
    )
    state = whole.init(params0(), jax.random.key(1), specs=SPECS)
    assert state.params["sgd"]["blocks"]["b2"].sharding.spec == P(None, "shard")


def test_a_split_the_axis_does_not_divide_is_named():
    mesh = _mesh((4, 2), ("data", "tensor"))
    trainer = dp.Trainer(loss_fn, optimizer(), mesh=mesh, layout=dp.Layout(tensor="tensor"))
    params = {"w": np.ones((3, 5), np.float32)}
    with pytest.raises(ValueError, match=r"params\['w'\] \(shape \(3, 5\)\) is split over"):
        trainer.init(params, jax.random.key(0), specs={"w": P(None, "tensor")})


def test_the_types_inside_the_step_stay_checked():
    # A tensor-replicated param is typed invariant over the tensor axis inside the step (so
    # jax sums its gradient over the axis); the tensor-split one varies.
    seen = {}

    def probe(params, batch, rng):
        seen["inp"] = varying_axes(params["adam"]["inp"])
        seen["w1"] = varying_axes(params["adam"]["blocks"]["w1"])
        return loss_fn(params, batch, rng)

    trainer = dp.Trainer(
        probe,
        optimizer(),
        mesh=_mesh((4, 2), ("data", "tensor")),
        layout=dp.Layout(tensor="tensor"),
    )
    state = trainer.init(params0(), jax.random.key(1), specs=SPECS)
    trainer.step(state, data()[0])
    assert "tensor" not in seen["inp"] and "data" in seen["inp"]
    assert {"tensor", "data"} <= set(seen["w1"])


def test_a_checkpoint_moves_between_model_layouts(tmp_path):
    # Saved under FSDP 4 x tensor 2 after 10 steps; restored into tensor 2 x pipeline 2 (and
    # into plain DDP over 8, the model whole): the restored params are bit-identical, placed
    # as the destination's template, and 10 more steps reach the single-device params.
    batches = data()
    src = _trainer("fsdp4xtp2")
    state = src.init(params0(), jax.random.key(1), specs=SPECS)
    for batch in batches[:10]:
        state, _ = src.step(state, batch)
    ckpt = dp.Checkpointer(tmp_path)
    ckpt.save(state)
    ckpt.close()
    saved = src.host_params(state)
    want = nd_model.reference()
    for name in ("dp2xtp2xpp2", "dp8"):
        dst = _trainer(name)
        template = dst.init(params0(), jax.random.key(0), specs=SPECS)
        restored = dp.Checkpointer(tmp_path).restore_latest(template)
        for a, b in zip(
            jax.tree_util.tree_leaves(dst.host_params(restored)),
            jax.tree_util.tree_leaves(saved),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(
            jax.tree_util.tree_leaves(restored.params),
            jax.tree_util.tree_leaves(template.params),
            strict=True,
        ):
            assert a.sharding == b.sharding
        for batch in batches[10:]:
            restored, _ = dst.step(restored, batch)
        got = dst.host_params(restored)
        for k in TWIN:
            assert _max_rel(got[k], want[k]) <= TOL, (name, k)


def test_the_3d_step_exports_for_gpus_and_the_export_runs_here():
    # What a GPU would get: the FSDP x tensor x pipeline step exported for cuda and cpu at
    # once; its cuda module holds the layout's collectives, and the export, called on these
    # CPU devices, takes the same step as the Trainer. The schedule is ZB-H1, whose slot runs
    # its sendrecv in a switch on the slot's pattern (the same branch on every device); the
    # other schedules' steps train in the matrix above.
    schedule = parallel.ZeroBubble(nd_model.MICRO)
    trainer = _trainer("fsdp2xtp2xpp2", schedule=schedule)
    state = trainer.init(params0(), jax.random.key(1), specs=SPECS)
    batch = data()[0]
    step, args = trainer.step_program(state, batch)
    exported = jax.export.export(step, platforms=("cuda", "cpu"))(*args)
    text = exported.mlir_module()
    for op in ("all_gather", "reduce_scatter", "all_reduce", "collective_permute"):
        assert f"stablehlo.{op}" in text, op
    placed = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), (state, batch), args)
    got, _ = exported.call(*placed)
    fresh = trainer.init(params0(), jax.random.key(1), specs=SPECS)  # the export consumed it
    want, _ = trainer.step(fresh, batch)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_spec_written_as_a_bare_string_is_named_not_read_letter_by_letter():
    # Before: "tensor" was read as P('t', 'e', 'n', 's', 'o', 'r'), one dimension per letter.
    import flax.linen as nn

    mesh = _mesh((4, 2), ("data", "tensor"))
    trainer = dp.Trainer(loss_fn, optimizer(), mesh=mesh, layout=dp.Layout(tensor="tensor"))
    params = {"w": np.ones((4, 6), np.float32), "b": np.zeros(6, np.float32)}
    with pytest.raises(
        TypeError,
        match=r"Trainer.init: specs\['w'\] is the string 'tensor', where a PartitionSpec is "
        r"expected .*write P\('tensor'\) to split dimension 0 over it, or P\(None, 'tensor'\)",
    ):
        trainer.init(params, jax.random.key(0), specs={"w": "tensor", "b": P()})
    with pytest.raises(TypeError, match=r"specs\['b'\] is 3 \(a int\), where a PartitionSpec"):
        trainer.init(params, jax.random.key(0), specs={"w": P(), "b": 3})
    boxed = {"w": nn.Partitioned(params["w"], "tensor"), "b": params["b"]}
    with pytest.raises(
        TypeError,
        match=r"Trainer.init: params\['w'\] is boxed with the names 'tensor', a string where "
        r"a tuple of axis names .*nn.with_partitioning\(init, \('tensor',\)\)",
    ):
        trainer.init(boxed, jax.random.key(0))


def test_a_context_role_splits_the_sequence_and_averages_over_it():
    # The mesh puts context between the data shards and tensor; the gradients are averaged
    # over it as over a data axis, the batch's examples are not split over it, and a
    # sequence that does not split into 2 chunks per device is refused by name.
    layout = dp.Layout(shard=2, context=2, tensor=2)
    assert layout.make_mesh().axis_names == ("shard", "context", "tensor")
    assert layout.data_axes == ("shard", "context") and layout.batch_axes == ("shard",)
    assert layout.bind().binding.axes["context"] == "context"
    assert dp.Layout(shard=8).bind().binding.axes["context"] is None

    def loss(w, batch, rng):
        return jnp.mean((batch["x"] @ w) ** 2), {}

    trainer = dp.Trainer(loss, optax.sgd(0.1), layout=dp.Layout(replicate=2, context=4))
    assert trainer.layout.n == 2 and trainer.batch_sharding.spec == P("replicate")
    state = trainer.init(jnp.ones((3, 2)), jax.random.key(0))
    with pytest.raises(ValueError, match=r"batch\['x'\] has a sequence of 6 .* 8 equal chunks"):
        trainer.step(state, {"x": np.ones((4, 6, 3), np.float32)})
    # a (batch, features) array beside the sequences would be cut along its features
    with pytest.raises(ValueError, match=r"these differ in length: batch\['f'\]: 3, batch\['x'\]"):
        trainer.step(state, {"x": np.ones((4, 8, 3), np.float32), "f": np.ones((4, 3))})


# ------------------------------------------------------------------------------ the grammar
#: Layouts by degree, each with its short name: Layout.parse(name) is the layout, and
#: str(layout) is the name.
NAMED = [
    (dp.Layout(replicate=1), "single"),
    (dp.Layout(replicate=8), "dp8"),
    (dp.Layout(shard=8), "fsdp8"),
    (dp.Layout(replicate=2, shard=4, tensor=2), "dp2xfsdp4xtp2"),
    (dp.Layout(shard=2, context=2, tensor=2), "fsdp2xcp2xtp2"),
    (dp.Layout(replicate=1, context=8), "dp1xcp8"),
    (dp.Layout(tensor=2), "tp2"),
    (dp.Layout(shard=-1, pipeline=2), "fsdp-1xpp2"),
    (dp.Layout(shard=8, expert=8), "fsdp8xep8"),
    (dp.Layout(replicate=2, shard=4, expert=4), "dp2xfsdp4xep4"),
    (dp.Layout(expert=8), "ep8"),
    (
        dp.Layout(shard=2, tensor=2, pipeline=2, schedule=parallel.OneFOneB(8)),
        "fsdp2xtp2xpp2:1f1b8",
    ),
    (dp.Layout(pipeline=4, schedule=parallel.Interleaved(8, virtual=2)), "pp4:interleaved8v2"),
    (dp.Layout(pipeline=4, schedule=parallel.Interleaved(8, virtual=3)), "pp4:interleaved8v3"),
    (dp.Layout(pipeline=4, schedule=parallel.ZeroBubble(8)), "pp4:zb8"),
    (dp.Layout(pipeline=2, schedule=parallel.GPipe(4)), "pp2:gpipe4"),
    (
        dp.Layout(replicate=2, tensor=2, pipeline=2, schedule=parallel.GPipe(16)),
        "dp2xtp2xpp2:gpipe16",
    ),
]


@pytest.mark.parametrize("layout, name", NAMED, ids=[n for _, n in NAMED])
def test_a_layout_prints_and_parses_its_short_name(layout, name):
    assert str(layout) == layout.name == name
    assert dp.Layout.parse(name) == layout
    assert dp.Layout.parse(str(layout)) == layout


def test_the_short_name_round_trips_over_every_combination_of_roles():
    import itertools

    schedules = [None, parallel.GPipe(2), parallel.OneFOneB(4), parallel.ZeroBubble(3)]
    schedules += [parallel.Interleaved(4, virtual=2)]
    seen = set()
    for degrees in itertools.product([None, 1, 2, 4], repeat=5):
        kwargs = dict(zip(("replicate", "shard", "context", "tensor", "pipeline"), degrees))
        for schedule in schedules if kwargs["pipeline"] else [None]:
            try:
                layout = dp.Layout(**kwargs, schedule=schedule)
            except ValueError:
                continue
            if not layout.by_degree:
                continue
            name = str(layout)
            assert dp.Layout.parse(name) == layout, (name, layout)
            seen.add(name)
    assert len(seen) > 500  # every combination has its own name


@pytest.mark.parametrize(
    "name, match",
    [
        ("tp2x3", r"'3' is not a role and its degree; a layout's name is its roles "),
        ("zero1x4xtp2", r"'zero1' is not a role and its degree"),
        ("dp2xdp4", r"'dp4' repeats a role"),
        ("tp0", r"'tp0' is not a role and its degree"),
        ("dp8:", r"'' is no schedule; the schedule is one of \['1f1b', 'gpipe', 'interleaved', "),
        ("pp2:2f2b", r"'2f2b' is no schedule"),
        ("pp2:1f1b", r"'1f1b' is no schedule; .*followed by its micro-batches"),
        ("pp2:1f1b8v2", r"the schedule '1f1b' has no model chunks per stage \('v2'\)"),
        ("fsdp4xep2", r"is no layout: dp.Layout: .*the expert role borrows"),
        ("dp2:1f1b4", r"is no layout: .*the pipeline role.s, and Layout\(replicate=2\) has none"),
        ("", r"'' is not a role and its degree"),
    ],
)
def test_a_bad_name_is_named_with_the_grammar(name, match):
    with pytest.raises(
        ValueError, match=r"dp\.Layout\.parse: " + re.escape(repr(name)) + ".*" + match
    ):
        dp.Layout.parse(name)


def test_a_layout_without_a_short_name_says_why():
    with pytest.raises(
        ValueError,
        match=r"dp\.Layout\.name: Layout\(shard='d', tensor='m'\) "
        r"has no short name: it names mesh axes",
    ):
        _ = dp.Layout(shard="d", tensor="m").name
    with pytest.raises(ValueError, match=r"has no short name: it has rules=\{'vocab': None\}"):
        _ = dp.Layout(shard=8, rules={"vocab": None}).name
    # str() never raises: a layout without a short name prints its repr
    assert str(dp.Layout(shard="d")) == repr(dp.Layout(shard="d")) == "Layout(shard='d')"
    with pytest.raises(TypeError, match=r"dp\.Layout\.parse: name must be a layout's short"):
        dp.Layout.parse(8)


def test_single_is_one_device():
    mesh = dp.Layout.parse("single").make_mesh()
    assert dict(mesh.shape) == {"replicate": 1} and mesh.devices.flat[0] == jax.devices()[0]


# ------------------------------------------------------------------------- old spellings
def test_the_old_spellings_raise_naming_their_replacement():
    with pytest.raises(
        TypeError,
        match=r"Trainer: axis_name= is gone; name the data axes in the layout: "
        r"layout=dp\.Layout\(replicate='data'\)",
    ):
        dp.Trainer(loss_fn, optimizer(), mesh=_mesh((8,), ("data",)), axis_name="data")
    for cls in (dp.sync.FSDP, dp.sync.ZeRO1):
        with pytest.raises(
            TypeError,
            match=rf"dp\.sync\.{cls.__name__}: shard_axis= is gone; the layout names the "
            r"shard axis: layout=dp\.Layout\(shard=\.\.\.\).*"
            r"layout=dp\.Layout\(replicate=\.\.\., shard=\.\.\.\)",
        ):
            cls(shard_axis="shard")
        with pytest.raises(TypeError, match=r"shard_axis= is gone"):
            cls().replace(shard_axis="shard")
    # the signatures shown stay the classes' own
    import inspect

    assert "axis_name" not in inspect.signature(dp.Trainer).parameters
    assert "layout" in inspect.signature(dp.Trainer).parameters
    assert "shard_axis" not in inspect.signature(dp.sync.FSDP).parameters
    assert "reshard_after_forward" in inspect.signature(dp.sync.FSDP).parameters


# ------------------------------------------------------------------- one bound layout
def test_the_trainer_keeps_its_bound_layout_as_one_attribute():
    trainer = _trainer("dp2xfsdp4")
    bound = trainer.layout
    assert isinstance(bound, dp.BoundLayout) and bound.layout == dp.Layout(replicate=2, shard=4)
    assert str(bound) == "dp2xfsdp4"
    assert trainer.mesh is bound.mesh and trainer.sync.layout is bound
    assert bound.data_axes == ("replicate", "shard") and bound.axis_name == bound.data_axes
    assert bound.n == 8 and bound.split.spec == P(("replicate", "shard"))
    assert trainer.batch_sharding == bound.batch_sharding
    # No other copy of what the bound layout answers: no mesh, data axes, split, device count
    # or binding of its own.
    held = vars(trainer)
    for gone in ("axis_name", "n", "_split", "mesh", "_model_specs", "_specs_known"):
        assert gone not in held, gone
    for key, value in held.items():
        if key != "layout":
            assert not isinstance(value, (dp.BoundLayout, dp.Layout, Mesh)), key
    # A layout binds on its own too: the same value the Trainer keeps.
    again = dp.Layout(replicate=2, shard=4).bind()
    assert again.mesh.shape == bound.mesh.shape and again.data_axes == bound.data_axes
    users = dp.Layout(shard="d", tensor="m").bind(jax.make_mesh((4, 2), ("d", "m")))
    assert users.mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
    assert users.axis_name == "d" and users.axes == ("m",) and users.binding.axes["mlp"] == "m"
    with pytest.raises(
        ValueError,
        match=r"dp\.Layout\.bind: the data axis 'data' \(Layout\(\) "
        r"names none: the default\) is not an axis of the mesh",
    ):
        dp.Layout().bind(_mesh((8,), ("x",)))


def test_the_model_specs_are_found_once_and_travel_with_the_state(monkeypatch, tmp_path):
    # init finds them; a step on the state it returned, on a copy of that state and on one
    # restored into its template reads no specs again (each is placed as the Trainer places
    # it), nor does evaluate.
    from jaxcoll.dp import trainer as trainer_module
    from jaxcoll.dp.trainer import _placement

    calls = []
    found = trainer_module.model_specs

    def counted(*args, **kwargs):
        calls.append(args[0])
        return found(*args, **kwargs)

    # init reads them in the Trainer's module; a state's placement check in _placement's.
    monkeypatch.setattr(trainer_module, "model_specs", counted)
    monkeypatch.setattr(_placement, "model_specs", counted)
    trainer = _trainer("fsdp4xtp2")
    batches = data()
    state = trainer.init(params0(), jax.random.key(1), specs=SPECS)
    state, _ = trainer.step(state, batches[0])
    state, _ = trainer.step(state, batches[1])
    state, _ = trainer.step(jax.tree.map(lambda x: x, state), batches[2])  # not just returned
    ckpt = dp.Checkpointer(tmp_path)
    ckpt.save(state)
    ckpt.close()
    restored = dp.Checkpointer(tmp_path).restore_latest(state)
    state, _ = trainer.step(restored, batches[3])
    state, _ = trainer.step(state, batches[4])
    trainer.evaluate(state, batches[:1])
    assert calls == ["Trainer.init"]
    # A state placed otherwise is read (once) and refused, as before.
    w = state.params["adam"]["inp"]
    moved = jax.device_put(w, NamedSharding(trainer.mesh, P(None, "tensor")))
    bad = state.replace(params={**state.params, "adam": {**state.params["adam"], "inp": moved}})
    with pytest.raises(ValueError, match=r"Trainer.step: params\['adam'\]\['inp'\] is placed "):
        trainer.step(bad, batches[5])
    assert calls == ["Trainer.init", "Trainer.step"]
