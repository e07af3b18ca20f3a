"""Where host code mirrors device code, held together without a GPU: every launcher's config
dataclass against the template parameters of the kernel it instantiates (names and order), and
the Hopper forward's register arithmetic against Sm90Config's, per shipped variant."""

import dataclasses
import re

import pytest

from ptxattn import runtime
from ptxattn.launchers import (backward_prepost, blockscaled, hopper_backward, hopper_forward,
                               portable_backward, portable_decode, portable_forward,
                               portable_mla, split_kv)

# config dataclass -> (the device source declaring its template, the struct or kernel name)
MIRRORS = [
    (hopper_forward.Sm90Config, "mainloops/fwd_sm90.cuh", "struct Sm90Config"),
    (hopper_backward.BwdSm90Config, "mainloops/bwd_sm90.cuh", "struct BwdSm90Config"),
    (portable_forward.MmaSyncConfig, "mainloops/fwd_mma_sync.cuh", "struct MmaSyncConfig"),
    (portable_backward.BwdMmaSyncConfig, "mainloops/bwd_mma_sync.cuh",
     "struct BwdMmaSyncConfig"),
    (portable_decode.DecodeConfig, "mainloops/decode_mma_sync.cuh", "struct DecodeConfig"),
    (portable_mla.MlaConfig, "mainloops/mla_mma_sync.cuh", "struct MlaConfig"),
    (backward_prepost.RowKernelConfig, "kernels/bwd_prepost.cu", "bwd_preprocess("),
    (backward_prepost.RowKernelConfig, "kernels/bwd_prepost.cu", "bwd_postprocess("),
    (split_kv.CombineConfig, "kernels/combine.cu", "combine_states("),
    (blockscaled.BlockScaledConfig, "kernels/fwd_blockscaled.cu", "attn_fwd_blockscaled("),
]


def template_parameters(source: str, declaration: str) -> list[str]:
    """The parameter names of the last `template <...>` before ``declaration`` in ``source``,
    as Python field names: kHeadDim and HeadDim -> head_dim."""
    text = (runtime.SOURCE_DIR / source).read_text()
    end = text.index(declaration)
    start = text.rindex("template <", 0, end)
    parameters = text[start + len("template <"):text.index(">", start)]
    names = [p.split()[-1] for p in parameters.replace("\n", " ").split(",")]
    return [re.sub(r"(?<!^)(?=[A-Z])", "_", name.removeprefix("k")).lower()
            .replace("bf_16", "bf16").replace("fp_8", "fp8").replace("nvfp_4", "nvfp4")
            .replace("q_in_registers", "q_in_registers")
            for name in names]


@pytest.mark.parametrize("config, source, declaration", MIRRORS,
                         ids=[f"{m[0].__name__}-{m[2].split()[-1].rstrip('(')}" for m in MIRRORS])
def test_config_fields_are_the_template_parameters_in_order(config, source, declaration):
    assert [field.name for field in dataclasses.fields(config)] == (
        template_parameters(source, declaration))


def test_template_arguments_follow_the_declared_order():
    config = portable_decode.DecodeConfig(128, 1, 64, 4, 3, True, False, 2)
    assert runtime.template_arguments(config) == "128, 1, 64, 4, 3, true, false, 2"
    with pytest.raises(TypeError, match="must be an int or a bool"):
        runtime.template_arguments(split_kv.CombineConfig(0, "1"))


def test_every_shipped_hopper_forward_counts_its_registers_as_the_kernel_does():
    """A static_assert per shipped Sm90Config: kFragmentRegs, kProducerRegs and kConsumerRegs
    equal hopper_forward.registers(), which the tuner prunes candidates by."""
    configs = [config for config, _ in hopper_forward.shipped_configs()]
    assert any(not config.intra_overlap for config in configs)  # blocks in turn are covered
    runtime.check_source(hopper_forward.register_check_source(configs),
                         "sm90_register_check.cu", "sm_90a")


def test_the_register_check_fails_on_a_wrong_count(monkeypatch):
    configs = [config for config, _ in hopper_forward.shipped_configs()][:1]
    monkeypatch.setattr(hopper_forward, "registers", lambda *args: (1, 2, 3))
    with pytest.raises(runtime.CompileError, match="kFragmentRegs is not 1"):
        runtime.check_source(hopper_forward.register_check_source(configs),
                             "sm90_register_check.cu", "sm_90a")


def _serving_configs():
    """(spec, the header declaring its config, an arch it is built for) of every decode and MLA
    variant."""
    for spec in portable_decode.variants():
        yield spec, "mainloops/decode_mma_sync.cuh", spec.archs[0]
    for spec in portable_mla.variants():
        yield spec, "mainloops/mla_mma_sync.cuh", spec.archs[0]


def test_serving_launchers_request_the_shared_memory_their_kernels_lay_out():
    """The decode and MLA launchers compute their variants' shared memory in Python
    (DecodeTile.smem_bytes, MlaTile.smem_bytes); each must equal the config's kSmemBytes, or
    a kernel would address past its allocation."""
    by_arch = {}
    for spec, header, arch in _serving_configs():
        config = spec.entry[spec.entry.index("<") + 1:spec.entry.rindex(">")]
        by_arch.setdefault(arch, {}).setdefault(header, []).append(
            f"static_assert({config}::kSmemBytes == {spec.smem_bytes}, "
            f"\"{spec.name}: the launcher requests {spec.smem_bytes} bytes\");")
    for arch, headers in by_arch.items():
        source = "".join(f'#include "{header}"\n' + "\n".join(lines) + "\n"
                         for header, lines in headers.items())
        runtime.check_source(source, "serving_smem_check.cu", arch)
