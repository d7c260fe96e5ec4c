"""The roofline of a compiled TPU program (jax_bridge/roofline.py), and the private XLA bindings it
stands on: if jax changes them, the first test here says which one broke.

One small program (a scanned stack of matmuls and its gradient) is compiled for a deviceless v6e;
the whole train step's roofline is tested with the step compile in tests/test_tpu_compile.py.
"""
import jax
import jax.numpy as jnp
import pytest

from jax_bridge import hlo_text, roofline, tpu_compile

LAYERS, M, K = 3, 512, 256


def stacked(w, x):
    def body(c, wi):
        return jnp.tanh(c @ wi), None
    y, _ = jax.lax.scan(body, x, w)
    return (y.astype(jnp.float32) ** 2).sum()


@pytest.fixture(scope="module")
def compiled():
    specs = (jax.ShapeDtypeStruct((LAYERS, K, K), jnp.bfloat16), jax.ShapeDtypeStruct((M, K), jnp.bfloat16))
    program, _ = tpu_compile.compile_for(jax.value_and_grad(stacked), specs, tpu_compile.device_of("v6e:2x2"))
    return program


def test_private_xla_apis_the_roofline_uses(compiled):
    """Pins what roofline.py reads through private bindings (jax 0.10.2 / jaxlib): the compiled
    program's HloModule, its printing with operand shapes and backend configs, re-parsing text into
    a module and the generic cost analysis with per-operand byte counts, and libtpu's totals."""
    from jaxlib import _hlo, _jax

    modules = compiled.runtime_executable().hlo_modules()
    assert len(modules) == 1 and isinstance(modules[0], _hlo.HloModule)
    options = _hlo.HloPrintOptions()
    for field in ("print_operand_shape", "print_metadata", "print_backend_config"):
        assert hasattr(options, field), f"HloPrintOptions lost {field}"
    text = roofline.module_text(compiled)
    assert "while(" in text and "ENTRY" in text
    assert "bf16[512,256]{" in text.split("ENTRY", 1)[1]            # operand shapes printed
    module = _hlo.hlo_module_from_text("HloModule m\n\nENTRY %e {\n  %a = f32[8,128]{1,0} parameter(0)\n"
                                       "  ROOT %b = f32[8,128]{1,0} exponential(%a)\n}")
    cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    assert cost["transcendentals"] == 8 * 128 and cost["bytes accessed"] == 2 * 8 * 128 * 4
    assert cost["bytes accessed0{}"] == cost["bytes accessedout{}"] == 8 * 128 * 4
    tpu = compiled.cost_analysis()
    tpu = tpu[0] if isinstance(tpu, (list, tuple)) else tpu
    assert {"flops", "transcendentals", "bytes accessed", "optimal_seconds"} <= set(tpu)


def test_roofline_counts_every_trip_of_a_loop_and_sums_to_the_program(compiled):
    """The compilers count a loop body once; the roofline multiplies by the trip count it reads
    from the loop's condition. Forward and backward make 3 matmuls of 2 M K K FLOPs per layer."""
    r = roofline.roofline(compiled, "v6e")
    assert r.unknown_trip_counts == r.unpriced_ops == r.totals_mismatch() == []
    rows = {row.category: row for row in r.rows}
    matmuls = 3 * LAYERS * 2 * M * K * K
    fused = 20 * LAYERS * M * K            # tanh and its derivative, fused into the matmuls' fusions
    assert matmuls <= rows["matmul (XLA)"].flops <= matmuls + fused
    assert r.once_flops < 0.5 * r.flops                         # the loop bodies, once
    peak, bandwidth = roofline.device_peaks("v6e")
    assert (peak, bandwidth) == (918e12, 1638e9)
    assert rows["matmul (XLA)"].seconds >= rows["matmul (XLA)"].flops / peak
    assert r.seconds == pytest.approx(sum(row.seconds for row in r.rows))
    assert "matmul (XLA)" in roofline.format_roofline(r)


def test_each_op_pays_the_fixed_cost_measured_on_its_generation(compiled):
    """v5e's measured fixed cost per op (OP_COST_S) is added to every run of every op, loop trips
    included; a generation without a measurement (v6e) prices bytes and FLOPs alone, and says so."""
    text = roofline.module_text(compiled)
    ops, _, _ = roofline.collect_ops(text, roofline.xla_cost_fn())
    runs = sum(op.trips for op in ops if op.category != "collectives")
    bare, costed = roofline.roofline(compiled, "v6e"), roofline.roofline(compiled, "v5e")
    assert bare.op_cost == 0.0 and costed.op_cost == roofline.OP_COST_S["v5e"] > 0
    peak, bandwidth = roofline.device_peaks("v5e")
    unfixed = sum(roofline.op_seconds(op, peak, bandwidth, 0.0)[0] * op.trips for op in ops
                  if op.category != "collectives")
    assert costed.seconds == pytest.approx(unfixed + runs * costed.op_cost)
    assert "0.28 us (one op's fixed cost, measured on a v5e)" in roofline.format_roofline(costed)
    assert "no fixed cost per op measured" in roofline.format_roofline(bare)


def test_hbm_bytes_skip_vmem_and_count_tile_padding():
    """Operands the compiler placed in VMEM (S(1)) move no HBM bytes; arrays in HBM move their
    padded tiles (a 64-wide minor dimension in 128-lane tiles moves twice its logical bytes)."""
    line = ("  %f = bf16[64,64]{1,0:T(8,128)(2,1)} fusion(bf16[64,64]{1,0:T(8,128)(2,1)S(1)} %a, "
            "f32[8,256]{1,0:T(8,128)} %b), kind=kLoop, calls=%c")
    ins = hlo_text.parse_instruction(line)
    assert (ins.name, ins.opcode, ins.operand_names) == ("f", "fusion", ["a", "b"])
    assert ins.operands == ["bf16[64,64]{1,0:T(8,128)(2,1)S(1)}", "f32[8,256]{1,0:T(8,128)}"]
    assert hlo_text.padding_factor("bf16[64,64]{1,0:T(8,128)(2,1)}") == 2.0
    assert hlo_text.padding_factor("f32[3]{0:T(128)}") == pytest.approx(128 / 3)
    cost = {"bytes accessed0{}": 8192.0, "bytes accessed1{}": 8192.0, "bytes accessedout{}": 8192.0}
    assert roofline.hbm_bytes(ins, cost) == 8192.0 + 2 * 8192.0
    with pytest.raises(ValueError, match="no published peaks for TPU generation 'v9'"):
        roofline.device_peaks("v9")


def test_float32_matmuls_at_highest_precision_cost_six_passes():
    """libtpu prices a float32 "highest" matmul like a bf16 one; the roofline charges 6 passes."""
    def piece(precision):
        return (f"  ROOT %d = f32[8,8]{{1,0}} dot(f32[8,8]{{1,0}} %a, f32[8,8]{{1,0}} %b), lhs_contracting_dims={{1}}, "
                f"rhs_contracting_dims={{0}}, operand_precision={{{precision},{precision}}}")
    assert [roofline.mxu_passes(piece(p)) for p in ("highest", "high", "default")] == [6, 3, 1]
    assert roofline.mxu_passes(piece("highest").replace("f32[8,8]{1,0} %", "bf16[8,8]{1,0} %")) == 1


def test_chip_peaks_agree_with_the_mfu_table():
    """One bf16 peak per chip: the roofline's table and train/run/flops.py's say the same."""
    from train.run.flops import published_peak

    kinds = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5p", "v6e": "TPU v6 lite"}
    for generation, (flops, _, _) in roofline.CHIPS.items():
        assert published_peak(kinds[generation], "bfloat16")[0] == flops


def test_in_place_outputs_move_their_update_only():
    """A scan writing one step into a stacked buffer (dynamic-update-slice into a parameter, in
    place) moves the slice, not the buffer; a parameter returned unchanged moves nothing."""
    text = """HloModule m

%fused (p0: f32[8,128,128], p1: f32[1,128,128], p2: s32[], p3: f32[4,128]) -> (f32[8,128,128], f32[4,128]) {
  %p0 = f32[8,128,128]{2,1,0:T(8,128)} parameter(0)
  %p1 = f32[1,128,128]{2,1,0:T(8,128)} parameter(1)
  %p2 = s32[]{:T(128)} parameter(2)
  %p3 = f32[4,128]{1,0:T(8,128)} parameter(3)
  %c = s32[]{:T(128)} constant(0)
  %dus = f32[8,128,128]{2,1,0:T(8,128)} dynamic-update-slice(f32[8,128,128]{2,1,0:T(8,128)} %p0, f32[1,128,128]{2,1,0:T(8,128)} %p1, s32[]{:T(128)} %p2, s32[]{:T(128)} %c, s32[]{:T(128)} %c)
  ROOT %t = (f32[8,128,128]{2,1,0:T(8,128)}, f32[4,128]{1,0:T(8,128)}) tuple(f32[8,128,128]{2,1,0:T(8,128)} %dus, f32[4,128]{1,0:T(8,128)} %p3)
}

ENTRY %e (a: f32[8,128,128], b: f32[1,128,128], i: s32[], d: f32[4,128]) -> (f32[8,128,128], f32[4,128]) {
  %a = f32[8,128,128]{2,1,0:T(8,128)} parameter(0)
  %b = f32[1,128,128]{2,1,0:T(8,128)} parameter(1)
  %i = s32[]{:T(128)} parameter(2)
  %d = f32[4,128]{1,0:T(8,128)} parameter(3)
  ROOT %f = (f32[8,128,128]{2,1,0:T(8,128)}, f32[4,128]{1,0:T(8,128)}) fusion(f32[8,128,128]{2,1,0:T(8,128)} %a, f32[1,128,128]{2,1,0:T(8,128)} %b, s32[]{:T(128)} %i, f32[4,128]{1,0:T(8,128)} %d), kind=kLoop, calls=%fused
}
"""
    comps, entry = hlo_text.parse_module(text)
    fusion = hlo_text.parse_instruction(comps[entry][1][-1])
    skip, added = roofline.in_place(fusion, comps)
    assert skip == {"bytes accessedout{0}", "bytes accessed0{}", "bytes accessedout{1}", "bytes accessed3{}"}
    update = 128 * 128 * 4
    assert added == update                    # written into the buffer
    ops, unknown, unpriced = roofline.collect_ops(text, roofline.xla_cost_fn())
    assert unpriced == [] and len(ops) == 1
    # the update read and written, and the index (scalars: padded to a 128-lane tile)
    assert ops[0].hbm_bytes == pytest.approx(2 * update, abs=1024)


def test_an_asynchronous_slice_into_vmem_moves_its_slice_once():
    """The TPU compiler prefetches a weight's rows into VMEM with slice-start: its output tuple
    repeats the whole HBM source, but only the slice is read (a decode step's weights were
    priced 1.8x before: 1.67 GB per token for the 1.15 GB Llama)."""
    line = ("  %s = ((bf16[2048,5632]{1,0:T(8,128)(2,1)}), bf16[512,5632]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) "
            "slice-start(bf16[2048,5632]{1,0:T(8,128)(2,1)} %w), slice={[0:512], [0:5632]}")
    ins = hlo_text.parse_instruction(line)
    generic = {"bytes accessed": 2.0 * 512 * 5632 * 2, "bytes accessed0{}": 512 * 5632 * 2.0,
               "bytes accessedout{}": 512 * 5632 * 2.0}        # what the generic analysis reports
    assert roofline.hbm_bytes(ins, generic) == 512 * 5632 * 2          # read from HBM; written to VMEM
    to_hbm = hlo_text.parse_instruction(line.replace("(2,1)S(1)}", "(2,1)}"))
    assert roofline.hbm_bytes(to_hbm, generic) == 2 * 512 * 5632 * 2


def test_a_collective_inside_a_fusion_takes_no_more_bytes_than_the_fusion():
    """An all-reduce-scatter fusion reads the whole input and writes a quarter: priced alone, its
    all-reduce would count a whole output too. The collective and the fusion's rest still sum to
    what the whole module counts (gpt-oss-20b's v6e-32 tables were 3.15 GB over before)."""
    text = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%ars (p: f32[1024,128]) -> f32[256,128] {
  %p = f32[1024,128]{1,0} parameter(0)
  %ar = f32[1024,128]{1,0} all-reduce(f32[1024,128]{1,0} %p), replica_groups={{0,1,2,3}}, to_apply=%add
  %c = s32[] constant(0)
  ROOT %ds = f32[256,128]{1,0} dynamic-slice(f32[1024,128]{1,0} %ar, s32[] %c, s32[] %c), dynamic_slice_sizes={256,128}
}

ENTRY %e (a: f32[1024,128]) -> f32[256,128] {
  %a = f32[1024,128]{1,0} parameter(0)
  ROOT %f = f32[256,128]{1,0} fusion(f32[1024,128]{1,0} %a), kind=kCustom, calls=%ars
}
"""
    cost_fn = roofline.xla_cost_fn()
    ops, unknown, unpriced = roofline.collect_ops(text, cost_fn)
    assert unknown == unpriced == [] and [op.category for op in ops] == ["collectives", "elementwise / fusions"]
    whole = cost_fn(text)["bytes accessed"]
    assert whole == (1024 + 256) * 128 * 4
    assert sum(op.bytes for op in ops) == pytest.approx(whole)
    assert ops[0].bytes == pytest.approx(whole) and ops[1].bytes == 0
