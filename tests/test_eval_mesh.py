"""Models larger than one device. A model from scratch is drawn straight onto the mesh (`drawn_on_mesh`). For
evaluation, `load_model(..., mesh=)` and the command lines' `--mesh` restore a run whose checkpoints hold every
parameter (a run from scratch, a retrofit of one) straight onto the mesh, or build the model in host memory
(`trainer.host_device()`) and place its parameters on the mesh as the trainer does (`sharding.place_model`; a Hugging
Face directory is read straight onto the mesh), and each batch's rows are split over the data and fsdp axes;
perplexity, diagnostics, decoding (recall) and a Hugging Face directory (harness `--hf`) then give what they give on
one device. 8 fake CPU devices (conftest)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from focal_jax.convert import hf
from focal_jax.convert.safetensors_io import StoredTensors
from focal_jax.eval import decode, diagnostics, harness, perplexity, recall
from focal_jax.train import train, trainer
from focal_jax.train.sharding import make_mesh, tree_shardings
from helpers import hf_focus_retrofit_config, stored_run_config
from test_eval_perplexity import tiny_focus_run

MESH = {"fsdp": 2, "tensor": 4}


@pytest.fixture(scope="module")
def focus_run(tmp_path_factory):
    return tiny_focus_run(tmp_path_factory.mktemp("focus"))


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    return tiny_focus_run(tmp_path_factory.mktemp("dense"), attn={"kind": "dense"})


def on(tree) -> set:
    """The devices that hold the arrays of `tree` (its abstract leaves hold none)."""
    return {device for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for device in x.devices()}


def check_placed(model, mesh):
    """Every array of `model` is on `mesh` with the trainer's sharding (`tree_shardings`); the q projection
    `[d_model, heads * head_dim]` is split over fsdp x tensor, so that each device holds an eighth of it."""
    state = nnx.to_pure_dict(nnx.state(model))
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, x), want in zip(leaves, jax.tree.leaves(tree_shardings(state, mesh)), strict=True):
        assert isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh, path
        assert x.sharding.spec == want.spec, path
    q = state["layers"][0]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P("fsdp", "tensor")
    assert q.addressable_shards[0].data.shape == (q.shape[0] // 2, q.shape[1] // 4)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_model_from_scratch_is_drawn_straight_onto_the_mesh_as_on_one_device(dense_run, family):
    """`build_model(run, mesh=)` for a run from scratch draws each parameter into its sharding on the mesh
    (`drawn_on_mesh`), bit for bit the draws of `build_model` without a mesh, and the seed's draws of the model's
    own constructor outside jit to float32 rounding."""
    config = stored_run_config(dense_run)
    if family == "gpt2":
        config.model = {"family": "gpt2", "vocab_size": 64, "n_positions": 32, "d_model": 32, "n_layers": 2,
                        "n_heads": 4}
    run = trainer.check_config(config)
    mesh = make_mesh(MESH)
    drawn = nnx.to_pure_dict(nnx.state(trainer.build_model(run, seed=3, mesh=mesh)))
    for x, want in zip(jax.tree.leaves(drawn), jax.tree.leaves(tree_shardings(drawn, mesh)), strict=True):
        assert x.sharding == want
    assert any(x.sharding.spec != P() for x in jax.tree.leaves(drawn))
    jax.tree.map(np.testing.assert_array_equal, drawn, nnx.to_pure_dict(nnx.state(trainer.build_model(run, seed=3))))
    cls = trainer.GPT2 if family == "gpt2" else trainer.Llama
    eager = nnx.to_pure_dict(nnx.state(cls(run.model, rngs=nnx.Rngs(3))))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), drawn, eager)
    other_seed = jax.tree.leaves(nnx.to_pure_dict(nnx.state(trainer.build_model(run, seed=4))))
    random = [(x, y) for x, y in zip(jax.tree.leaves(drawn), other_seed) if np.std(x) > 0]  # not ones or zeros
    assert random and not any(np.array_equal(x, y) for x, y in random)


@pytest.fixture(scope="module")
def retrofit_run(dense_run, tmp_path_factory):
    """A Focus retrofit of `dense_run` (its centroids trained for one step)."""
    config = stored_run_config(dense_run)
    config.update(init_from=dense_run, total_steps=1)
    config.retrofit.focus = {"groups": 2, "dim": 8, "window": 8}
    config.optim.trainable = "centroids"
    workdir = str(tmp_path_factory.mktemp("retrofit") / "run")
    train(config, workdir)
    return workdir


def spy_load_pretrained(monkeypatch) -> list:
    """`(the model trainer.load_pretrained is given, the devices of the model it returns)` of every call."""
    calls, load_pretrained = [], trainer.load_pretrained

    def spied(model, workdir, **kwargs):
        given = nnx.to_pure_dict(nnx.state(model))
        model = load_pretrained(model, workdir, **kwargs)
        calls.append((given, on(nnx.state(model))))
        return model

    monkeypatch.setattr(trainer, "load_pretrained", spied)
    return calls


def test_load_model_on_a_mesh_restores_a_run_from_scratch_straight_onto_it(focus_run, monkeypatch):
    """A run from scratch (its checkpoints hold every parameter): `load_model(..., mesh=)` draws no parameter and
    builds nothing in host memory; the checkpoint is restored into abstract arrays that carry the trainer's
    shardings, so each process reads only its own shards. The values are those of the model loaded on one
    device."""
    calls = spy_load_pretrained(monkeypatch)
    monkeypatch.setattr(trainer, "host_device", lambda: pytest.fail("built in host memory"))
    mesh = make_mesh(MESH)
    placed = trainer.load_model(focus_run, mesh=mesh)
    [(given, devices)] = calls
    state = nnx.to_pure_dict(nnx.state(placed))
    for x, want in zip(jax.tree.leaves(given), jax.tree.leaves(tree_shardings(state, mesh)), strict=True):
        assert isinstance(x, jax.ShapeDtypeStruct) and x.sharding == want
    assert devices == set(jax.devices())
    check_placed(placed, mesh)
    jax.tree.map(np.testing.assert_array_equal, state, nnx.to_pure_dict(nnx.state(trainer.load_model(focus_run))))


def test_load_model_on_a_mesh_restores_a_retrofit_of_a_run_straight_onto_it(retrofit_run, monkeypatch):
    """A Focus retrofit of a focal_jax run from scratch: its checkpoint (the centroids) and its base's (the rest)
    hold every parameter, so nothing is drawn or built in host memory. The base run's checkpoint is restored into
    the abstract model first (the centroids stay abstract), then the retrofit's; the values are those of the model
    loaded on one device."""
    calls = spy_load_pretrained(monkeypatch)
    monkeypatch.setattr(trainer, "host_device", lambda: pytest.fail("built in host memory"))
    mesh = make_mesh(MESH)
    placed = trainer.load_model(retrofit_run, mesh=mesh)
    state = nnx.to_pure_dict(nnx.state(placed))
    [(_, base_filled), (given, _)] = calls  # the base run's load returns within the retrofit's
    for x, want in zip(jax.tree.leaves(given), jax.tree.leaves(tree_shardings(state, mesh)), strict=True):
        assert isinstance(x, jax.ShapeDtypeStruct) and x.sharding == want
    assert base_filled == set(jax.devices())
    check_placed(placed, mesh)
    jax.tree.map(np.testing.assert_array_equal, state, nnx.to_pure_dict(nnx.state(trainer.load_model(retrofit_run))))


@pytest.mark.parametrize("kind", ["dense", "focus"])
def test_init_model_on_a_mesh_restores_a_base_run_that_holds_every_parameter_straight_onto_it(retrofit_run, kind,
                                                                                               monkeypatch):
    """The trainer's start from a focal_jax run (`init_model(..., mesh=)`): a Focus retrofit of `dense_run`, whose
    checkpoint holds every parameter of the dense architecture, restores it into the abstract model on the mesh
    (nothing drawn) and draws only the retrofit's routing parameters. A model of attention kind 'focus' has routing
    parameters the dense run lacks: it is drawn whole, straight onto the mesh (`drawn_on_mesh`), then loaded.
    Either way the values equal those of the model built without a mesh."""
    config = stored_run_config(retrofit_run)
    if kind == "focus":
        config.retrofit.focus = None
        config.model.attn.update(kind="focus", focus_groups=2, focus_window=8)
    run = trainer.check_config(config)
    calls = spy_load_pretrained(monkeypatch)
    mesh = make_mesh(MESH)
    model = trainer.init_model(run, mesh=mesh)
    [(given, devices)] = calls
    leaves = jax.tree.leaves(given)
    if kind == "dense":
        assert all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding.mesh == mesh for x in leaves)
        assert devices == set(jax.devices())
        routing = nnx.to_pure_dict(nnx.state(model))["layers"][0]["self_attn"]
        assert on([routing["centroids"], routing["w_g"]]) == {jax.devices()[0]}
    else:
        assert all(isinstance(x, jax.Array) and x.sharding.mesh == mesh for x in leaves)
        assert devices == set(jax.devices())
    monkeypatch.undo()
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model)),
                 nnx.to_pure_dict(nnx.state(trainer.init_model(run))))


@pytest.fixture(scope="module")
def hf_retrofit_runs(dense_run, tmp_path_factory):
    """`(directory, phase1, phase2)`: `dense_run` written as a Hugging Face directory, a Focus retrofit of it
    (model family 'hf', the centroids trained for one step), and a second phase that starts from that run
    (family 'hf', `init_from` the first phase's workdir) and trains the centroids one step more."""
    root = tmp_path_factory.mktemp("hf_runs")
    directory = str(root / "hf")
    hf.to_hf(trainer.load_model(dense_run), directory)
    config = hf_focus_retrofit_config(dense_run, directory, window=8)
    phase1 = str(root / "phase1")
    train(config, phase1)
    config.init_from = phase1
    config.retrofit.focus = None
    phase2 = str(root / "phase2")
    train(config, phase2)
    return directory, phase1, phase2


def spy_reads(monkeypatch) -> list:
    """The names of the tensors `StoredTensors.read` reads, one entry per read (a whole tensor or one slice)."""
    reads, read = [], StoredTensors.read

    def spied(self, name, index=()):
        reads.append(name)
        return read(self, name, index)

    monkeypatch.setattr(StoredTensors, "read", spied)
    return reads


@pytest.mark.parametrize("phase", [1, 2])
def test_load_model_on_a_mesh_reads_the_hugging_face_base_of_a_retrofit_straight_onto_it(hf_retrofit_runs, phase,
                                                                                        monkeypatch):
    """A retrofit of a Hugging Face directory (phase 1), and a run that starts from that retrofit (phase 2, whose
    base is the whole model of phase 1): the directory's tensors are read slice by slice into their shards on the
    mesh (the q projection as its 8 shards), and only phase 1's centroids are built in host memory (CPU device 5
    of 8 here), then placed. The values are those of the model loaded on one device."""
    directory, *phases = hf_retrofit_runs
    workdir = phases[phase - 1]
    reads = spy_reads(monkeypatch)
    calls = spy_load_pretrained(monkeypatch)
    monkeypatch.setattr(trainer, "host_device", lambda: jax.devices()[5])
    mesh = make_mesh(MESH)
    placed = trainer.load_model(workdir, mesh=mesh)
    assert reads.count("model.layers.0.self_attn.q_proj.weight") == 8
    assert len(calls) == phase  # each phase's own checkpoint (the centroids)
    assert all(devices == set(jax.devices()) for _, devices in calls)
    given = dict(jax.tree_util.tree_flatten_with_path(calls[0][0])[0])  # phase 1's model, as its checkpoint loads
    centroids = [x for path, x in given.items() if "centroids" in jax.tree_util.keystr(path)]
    q = [x for path, x in given.items() if "q_proj" in jax.tree_util.keystr(path)]
    assert centroids and all(x.devices() == {jax.devices()[5]} for x in centroids)
    assert q and all(x.sharding.mesh == mesh for x in q)
    if phase == 2:  # phase 2 starts from phase 1's model placed on the mesh
        assert on(calls[1][0]) == set(jax.devices())
    check_placed(placed, mesh)
    reads.clear()
    alone = trainer.load_model(workdir)
    assert reads.count("model.layers.0.self_attn.q_proj.weight") == 1
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(placed)), nnx.to_pure_dict(nnx.state(alone)))


def test_perplexity_and_diagnostics_on_a_mesh_equal_one_device(focus_run, monkeypatch, tmp_path):
    """`--mesh fsdp=2,tensor=4`: the soft and hard top-1 rows and the group diagnostics equal those on one
    device; the evaluation runs under the mesh (the Pallas kernels' per-shard context) with the placed model and
    each batch's rows split over fsdp. A batch size that the data x fsdp axes do not divide is refused before the
    model loads."""
    seen = []
    topk_table = perplexity.topk_table

    def spied(model, batches, **kwargs):
        seen.append((model, batches, dict(jax.sharding.get_abstract_mesh().shape)))
        return topk_table(model, batches, **kwargs)

    monkeypatch.setattr(perplexity, "topk_table", spied)
    args = ["--workdir", focus_run, "--batches", "1", "--topk", "1"]
    want = perplexity.main(args)
    got = perplexity.main([*args, "--mesh", "fsdp=2,tensor=4", "--out", str(tmp_path / "ppl.json")])
    assert [r["form"] for r in got] == ["soft", "hard"]
    for row, row_want in zip(got, want):
        assert row.keys() == row_want.keys()
        for key in row:
            if isinstance(row[key], (float, list)):
                np.testing.assert_allclose(row[key], row_want[key], rtol=1e-5, err_msg=key)
            else:
                assert row[key] == row_want[key], key
    (_, _, outside), (model, batches, inside) = seen
    assert outside == {} and inside == {"data": 1, **MESH}
    check_placed(model, make_mesh(MESH))
    inputs = batches[0]["inputs"]  # 8 rows, 4 on each device of the fsdp axis
    assert inputs.sharding.spec == P(("data", "fsdp")) and inputs.addressable_shards[0].data.shape == (4, 32)
    assert json.loads((tmp_path / "ppl.json").read_text())["settings"]["mesh"] == MESH

    args = ["--workdir", focus_run, "--batches", "1", "--no-entropy"]
    want, got = diagnostics.main(args), diagnostics.main([*args, "--mesh", "fsdp=2,tensor=-1"])
    routing, routing_want = got["layers"][0]["routing"], want["layers"][0]["routing"]
    assert routing["tokens"] == routing_want["tokens"] > 0
    assert routing["sizes"] == routing_want["sizes"] and routing["top_tokens"] == routing_want["top_tokens"]
    np.testing.assert_allclose(routing["confidence"], routing_want["confidence"], rtol=1e-5)


def test_recall_decodes_on_a_mesh_as_on_one_device(dense_run, monkeypatch, tmp_path):
    """The recall command line decodes (KV cache) the same tokens as on one device with `--mesh tensor=8` (the
    heads split over 8 devices) and with `--mesh data=2,fsdp=2,tensor=2`, where the batch's rows are split over
    data x fsdp: each device of a cache step holds 2 of its 8 rows."""
    decoded, steps = [], []
    greedy_decode, cached_steps = recall.greedy_decode, decode._cached_steps

    def spied(model, prompts, **kwargs):
        decoded.append((model, greedy_decode(model, prompts, **kwargs)))
        return decoded[-1][1]

    def spied_steps(*args, **kwargs):
        out = cached_steps(*args, **kwargs)
        steps.append(out[0].addressable_shards[0].data.shape)  # the token buffer [rows, slots] on one device
        return out

    monkeypatch.setattr(recall, "greedy_decode", spied)
    monkeypatch.setattr(decode, "_cached_steps", spied_steps)
    args = ["--workdir", dense_run, "--tasks", "needle", "--lengths", "160", "--n", "8"]
    recall.main([*args, "--out", str(tmp_path / "one")])
    rows_alone = {shape[0] for shape in steps}
    steps.clear()
    recall.main([*args, "--mesh", "tensor=8", "--out", str(tmp_path / "tensor")])
    rows_tensor = {shape[0] for shape in steps}
    steps.clear()
    recall.main([*args, "--mesh", "data=2,fsdp=2,tensor=2", "--out", str(tmp_path / "data")])
    assert rows_alone == rows_tensor == {8} and {shape[0] for shape in steps} == {2}
    (_, want), (model, got), (_, got_data) = decoded
    assert got == want == got_data and len(got) == 8 and all(len(tokens) > 1 for tokens in got)
    q = nnx.to_pure_dict(nnx.state(model))["layers"][0]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P(None, "tensor") and len(q.sharding.device_set) == 8
    assert json.loads((tmp_path / "data" / "recall.json").read_text())["mesh"] == {"data": 2, "fsdp": 2,
                                                                                   "tensor": 2}


def test_a_hugging_face_directory_on_a_mesh(dense_run, tmp_path, monkeypatch):
    """harness `--hf DIR --mesh ...` (`harness.hf_model`): the directory's tensors are read straight onto the mesh
    (`from_hf(..., sharding=)`), never whole onto one device; the logits equal those of `from_hf` on one device."""
    directory = str(tmp_path / "hf")
    hf.to_hf(trainer.load_model(dense_run), directory)
    reads = spy_reads(monkeypatch)
    mesh = make_mesh(MESH)
    model = harness.hf_model(directory, mesh=mesh)
    check_placed(model, mesh)
    assert reads.count("model.layers.0.self_attn.q_proj.weight") == 8  # its 8 shards, one by one
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda m, x: m(x))(model, tokens)
    np.testing.assert_allclose(got, hf.from_hf(directory)(tokens), atol=1e-5)


def test_a_batch_the_mesh_cannot_split_is_refused_before_the_model_loads(focus_run, monkeypatch, capsys):
    monkeypatch.setattr(diagnostics, "load_model", lambda *args, **kwargs: pytest.fail("loaded the model"))
    for main in perplexity.main, diagnostics.main:
        with pytest.raises(SystemExit) as info:
            main(["--workdir", focus_run, "--mesh", "data=4,fsdp=2", "--batch-size", "6"])
        assert info.value.code == 2
        assert ("batch_size=6 must be a multiple of the data-parallel size 8 (mesh {'data': 4, 'fsdp': 2, "
                "'tensor': 1})") in capsys.readouterr().err
