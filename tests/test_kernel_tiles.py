"""The committed tables of tuned kernel tiles (jax_bridge/tiles/GENERATION.json): a program compiled
for a TPU generation takes that generation's table by default, never another generation's or
platform's; explicit options override it; a call shape the table lacks runs the kernel's default
tiles and says so; `tiles=off` turns the table off. A fixture table stands in for the committed
one (its tiles are a choice to check, not measurements); the committed ones are checked as they are.
"""
import json

import jax
import jax.numpy as jnp
import pytest

from jax_bridge import kernel_tiles, registry

CE_KEY = "hidden=256x256 vocab=4096 dtype=bfloat16"                       # tiny, 2 rows of 128
SLIDING_KEY = "q=2x4x128x64 kv_heads=2 window=64 dtype=bfloat16"           # its sliding layers' attention
FULL_KEY = "q=2x4x128x64 kv_heads=2 window=0 dtype=bfloat16"               # its full layers': not in the table


def fixture_table(device_kind="TPU v5 lite"):
    table = kernel_tiles.new_table("tpu", device_kind)
    kernel_tiles.add_entry(table, "cross_entropy", "pallas", CE_KEY, {"block_n": 128, "block_v": 1024}, 1e-3)
    kernel_tiles.add_entry(table, "attention", "pallas", SLIDING_KEY, {"block_q": 64, "block_kv": 64}, 1e-3)
    return table


@pytest.fixture
def tables_dir(tmp_path, monkeypatch):
    """A tables directory holding the fixture's v5e.json, in place of the committed one."""
    (tmp_path / "v5e.json").write_text(json.dumps(fixture_table()))
    monkeypatch.setattr(kernel_tiles, "TABLES_DIR", str(tmp_path))
    return tmp_path


def tuned(options, op="cross_entropy", impl="pallas"):
    return options.get(op, {}).get(impl, {}).get(kernel_tiles.TUNED)


def test_the_v5e_table_is_taken_for_a_v5e_target_only(tables_dir):
    from jax_bridge.step import StepConfig

    v5e = StepConfig(platform="tpu", tpu_generation="v5e").kernel_options
    assert tuned(v5e)["path"] == str(tables_dir / "v5e.json")
    assert tuned(v5e)["entries"][CE_KEY]["options"] == {"block_n": 128, "block_v": 1024}
    assert kernel_tiles.tables_in(v5e) == [str(tables_dir / "v5e.json")]
    for other in (dict(platform="tpu", tpu_generation="v6e"), dict(platform="tpu"),   # no v6e table; generation unknown
                  dict(platform="cpu"), dict(platform="gpu"), dict(platform="tpu", tpu_generation="v5e",
                                                                    kernel_options="tiles=off")):
        assert kernel_tiles.tables_in(StepConfig(**other).kernel_options) == [], other
    # Explicit options override the table's option by option; a table given replaces it.
    explicit = StepConfig(platform="tpu", tpu_generation="v5e", kernel_options="cross_entropy.pallas.block_v=512")
    assert explicit.kernel_options["cross_entropy"]["pallas"]["block_v"] == 512 and tuned(explicit.kernel_options)
    mine = tables_dir / "mine.json"
    mine.write_text(json.dumps(fixture_table()))
    assert kernel_tiles.tables_in(StepConfig(platform="tpu", tpu_generation="v5e",
                                             kernel_options=str(mine)).kernel_options) == [str(mine)]
    # Tuned on another generation's chips: refused by name, committed or given.
    (tables_dir / "v6e.json").write_text(json.dumps(fixture_table()))
    with pytest.raises(kernel_tiles.TileTableError,
                       match="v6e.json: the table of v6e holds tiles tuned on TPU v5 lite"):
        StepConfig(platform="tpu", tpu_generation="v6e")
    with pytest.raises(kernel_tiles.TileTableError, match=r"mine.json were tuned on TPU v5 lite \(v5e\); this program "
                                                          r"compiles for a TPU v6e"):
        StepConfig(platform="tpu", tpu_generation="v6e", kernel_options=f"tiles=off,{mine}")


def test_a_step_for_v5e_runs_the_tables_tiles_and_says_which_shapes_it_lacks(tables_dir, capsys):
    """The train step's forward traced for a v5e (the registry binding its kernels as for a run)
    gives the cross-entropy and sliding-window attention kernels the table's tiles, and the
    full-attention layers, whose shape the table lacks, their default tiles, said once on stderr
    and listed for the run's summary; the deviceless TPU compiler takes the tuned kernel for v5e."""
    import torch

    from helpers import pallas_calls
    from jax_bridge import tpu_compile
    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM

    with torch.device("meta"):
        model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=2, max_seq_len=128))
    step = TrainStep(model, step_cfg=StepConfig(platform="tpu", tpu_generation="v5e", kernels="pallas"))
    params = {**step.abstract_state().params, **step.abstract_frozen()}
    tokens = jax.ShapeDtypeStruct((2, 129), jnp.int32)
    with kernel_tiles.recording() as lookups:
        calls = pallas_calls(lambda p, t: step.loss_and_metrics(p, t[:, :-1], t[:, 1:])[0], params, tokens)
    table = str(tables_dir / "v5e.json")
    found = {(u.op, u.key): u.options for u in lookups}
    assert found[("cross_entropy", CE_KEY)] == {"block_n": 128, "block_v": 1024}
    assert found[("attention", SLIDING_KEY)] == {"block_q": 64, "block_kv": 64}
    assert found[("attention", FULL_KEY)] is None
    grids = sorted(c["grid_mapping"].grid for c in calls if c["name"].startswith("attention"))
    # grids (rows, KV heads, q tiles, kv tiles): the default 128 x 128 tiles, the tuned 64 x 64
    assert grids == [(2, 2, 1, 1), (2, 2, 128 // 64, 128 // 64)]
    [ce] = [c["grid_mapping"].grid for c in calls if c["name"].startswith("cross_entropy")]
    assert ce == (256 // 128, 4096 // 1024)
    err = capsys.readouterr().err
    assert f"kernel tiles: {table} has no entry for attention=pallas at {FULL_KEY}; its default tiles run" in err
    assert {"op": "attention", "implementation": "pallas", "key": FULL_KEY, "table": table} in \
        kernel_tiles.untuned([table])

    # The kernel as the step binds it, compiled for a v5e chip by the deviceless TPU compiler.
    fn = registry.implementations("cross_entropy")["pallas"].bind("tpu", step.cfg.kernel_options["cross_entropy"]
                                                                  ["pallas"], "v5e")
    specs = (jax.ShapeDtypeStruct((256, 256), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 256), jnp.bfloat16),
             jax.ShapeDtypeStruct((256,), jnp.int32))
    program = lambda h, w, y: fn(h, w, y, ignore_index=-100)[0]    # noqa: E731
    assert [c["grid_mapping"].grid for c in pallas_calls(program, *specs)] == [(2, 4)]
    _, stats = tpu_compile.compile_for(program, specs, tpu_compile.device_of("v5e:2x2"))
    assert len(stats.kernels) == 1


def test_an_attention_shape_tuned_at_another_batch_takes_those_tiles_and_says_so(capsys):
    """The Llama ran at batch 2 with tiles tuned at batch 8 in the table: the batch only lengthens
    the grid, so the nearest batch's entry serves (said once); other fields must match, and the
    row-tiled ops (cross-entropy, MoE) stay exact."""
    table = kernel_tiles.new_table("tpu", "TPU v5 lite")
    for batch, tiles in ((8, {"block_q": 1024, "block_kv": 1024}), (16, {"block_q": 512, "block_kv": 512})):
        kernel_tiles.add_entry(table, "attention", "pallas", f"q={batch}x16x2048x128 kv_heads=8 window=0 dtype=bfloat16",
                               tiles, 1e-3)
    kernel_tiles.add_entry(table, "cross_entropy", "pallas", "hidden=16384x2048 vocab=4096 dtype=bfloat16",
                           {"block_n": 512}, 1e-3)
    tuned = {"path": "T.json", "entries": {}}
    pick = lambda op, key: kernel_tiles.options_for(op, "pallas", {**tuned, "entries": table["entries"][op]["pallas"]},  # noqa: E731
                                                    key)
    key = "q=2x16x2048x128 kv_heads=8 window=0 dtype=bfloat16"
    assert pick("attention", key) == {"block_q": 1024, "block_kv": 1024}
    assert pick("attention", key) == {"block_q": 1024, "block_kv": 1024}
    assert pick("attention", "q=12x16x2048x128 kv_heads=8 window=0 dtype=bfloat16") == {"block_q": 512, "block_kv": 512}
    for other in ("q=2x16x2048x128 kv_heads=8 window=128 dtype=bfloat16", "q=2x16x1024x128 kv_heads=8 window=0 "
                  "dtype=bfloat16", "q=2x16x2048x128 kv_heads=4 window=0 dtype=bfloat16"):
        assert pick("attention", other) == {}
    assert pick("cross_entropy", "hidden=4096x2048 vocab=4096 dtype=bfloat16") == {}
    err = capsys.readouterr().err
    assert err.count(f"at {key}; the tiles tuned at q=8x16x2048x128 kv_heads=8 window=0 dtype=bfloat16 run") == 1
    assert "at q=2x16x1024x128 kv_heads=8 window=0 dtype=bfloat16; its default tiles run" in err


def test_the_decoder_and_the_plan_report_take_the_table(tables_dir):
    import torch

    from jax_bridge import decoding
    from jax_bridge.plan import kernel_tiles as plan_tiles
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM

    cfg = get_preset("tiny").replace(n_layers=2)
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    params = decoding.decoder_params(model, "bfloat16")
    decoder = decoding.Decoder(model, kernels="xla", platform="tpu", tpu_generation="v5e", params=params)
    assert kernel_tiles.tables_in(decoder.kernel_options) == [str(tables_dir / "v5e.json")]
    off = decoding.Decoder(model, kernels="xla", platform="tpu", tpu_generation="v5e", params=params,
                           kernel_options="tiles=off")
    assert kernel_tiles.tables_in(off.kernel_options) == []
    # `plan --roofline` reports per call key the tiles the trace took.
    lookups = [kernel_tiles.Lookup("attention", "pallas", SLIDING_KEY, "v5e.json", {"block_q": 64, "block_kv": 64}),
               kernel_tiles.Lookup("attention", "pallas", FULL_KEY, "v5e.json", None)]
    tiles = plan_tiles({"attention": "pallas"}, decoder.kernel_options, cfg, 128, 256, generation="v5e",
                       lookups=lookups)
    assert tiles["attention.pallas"] == {"table": str(tables_dir / "v5e.json"),
                                         "calls": {SLIDING_KEY: {"block_q": 64, "block_kv": 64}, FULL_KEY: "default"}}


def test_the_committed_tables_are_their_generations_and_their_options_are_accepted():
    """Each committed table (jax_bridge/tiles/GENERATION.json, tuned on the chip by `torchlyra
    bench kernels --tune`) was tuned on its generation's chips and names only options its
    implementations take."""
    for generation in kernel_tiles.committed_generations():
        table = kernel_tiles.read_committed(generation)
        assert table["platform"] == "tpu" and kernel_tiles.generation_of(table["device_kind"]) == generation
        registry.check_options(kernel_tiles.committed_path(generation))
        for per_impl in table["entries"].values():
            for per_key in per_impl.values():
                assert all(entry["seconds"] > 0 for entry in per_key.values())
