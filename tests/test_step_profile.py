"""scripts/step_profile.py: a profiled step's GPU time by kind of work, from kernel names."""
import torch

from scripts.step_profile import device_kernels, kind_of, kind_table, time_by_kind


def test_kernel_names_map_to_kinds():
    assert kind_of("_attn_bwd_dkdv_kernel") == "attention"
    # cuDNN's attention kernels carry sm90_ too: attention, not matrix products.
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x128x128_4x1x1") == \
        "attention"
    assert kind_of("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)") == "attention"
    assert kind_of("_row_norm_backward_kernel") == "norms"
    assert kind_of("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNN") == "matrix products (cuBLAS)"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matrix products (cuBLAS)"
    assert kind_of("Memcpy DtoH (Device -> Pinned)") == "copies (offload, side stream)"
    assert kind_of("Memcpy DtoD (Device -> Device)") == "casts and copies"      # on the compute stream
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>") == \
        "activation (SiLU)"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<float>>").startswith(
        "elementwise")
    assert kind_of("_adamw_update_kernel") == "optimizer"
    assert kind_of("something_new") == "other"


def test_totals_are_summed_per_kind_largest_first():
    totals = time_by_kind([("_attn_fwd", 3000.0), ("nvjet_a", 1000.0), ("_attn_bwd_dq", 2500.0),
                           ("Memcpy HtoD (Pinned -> Device)", 4000.0), ("nvjet_b", 500.0)])
    assert totals == {"attention": 5.5, "copies (offload, side stream)": 4.0, "matrix products (cuBLAS)": 1.5}
    table = kind_table(totals, step_ms=10.0)
    # Idle is the step less the compute-stream kernels: the side-stream copies overlap and do not count.
    assert table.splitlines()[-1].split()[-2:] == ["3.0", "30.0%"]


def test_a_cpu_profile_has_no_device_kernels():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        torch.ones(4) @ torch.ones(4)
    assert device_kernels(profiler) == []
