"""The HLO collective reader, on the line forms the CPU and GPU backends print."""

from zero1_jax.inspect import hlo_collectives

G8 = "replica_groups={{0,1,2,3,4,5,6,7}}"


def test_cpu_forms():
  text = "\n".join([
      f"  %rs = f32[128]{{0}} reduce-scatter(f32[1024]{{0}} %p), {G8}, dimensions={{0}}",
      f"  %ag = f32[1024]{{0}} all-gather(f32[128]{{0}} %rs), {G8}, dimensions={{0}}",
      f"  %ar = (f32[4,19]{{1,0}}, /*index=1*/f32[1]{{0}}) all-reduce(%a, %b), {G8}",
  ])
  c = hlo_collectives(text)
  assert c["reduce-scatter"] == (1, 4096, 4096)   # the full buffer reduced
  assert c["all-gather"] == (1, 4096, 4096)
  assert c["all-reduce"] == (1, 4 * 19 * 4 + 4, 2 * (4 * 19 * 4 + 4))


def test_gpu_async_forms_count_results_only():
  text = "\n".join([
      f"  %s = ((f32[1024]{{0}}), f32[128]{{0}}) reduce-scatter-start(%p), {G8}",
      "  %d = f32[128]{0} reduce-scatter-done(%s)",
      f"  %g = (f32[128]{{0}}, f32[1024]{{0}}) all-gather-start(%x), {G8}",
      "  %h = f32[1024]{0} all-gather-done(%g)",
      f"  %a = f32[256]{{0}} all-reduce-start(%y), {G8}",
      "  %b = f32[256]{0} all-reduce-done(%a)",
  ])
  c = hlo_collectives(text)
  assert c["reduce-scatter"] == (1, 4096, 4096)
  assert c["all-gather"] == (1, 4096, 4096)
  assert c["all-reduce"] == (1, 1024, 2048)


def test_mesh_and_iota_replica_groups():
  mesh = "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}"
  iota = "replica_groups=[2,4]<=[8]"
  for groups in (mesh, iota):
    c = hlo_collectives(f"  %r = f32[2,5]{{1,0}} reduce-scatter(%p), {groups}")
    assert c["reduce-scatter"].bytes == 4 * 2 * 5 * 4
