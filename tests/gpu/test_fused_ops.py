"""The fused RMSNorm (+ residual add), SiLU-and-mul and rotary kernels (`ops.fused_ops`) against
their torch twins: bf16 and fp16, hidden sizes 96 and 4096, 1 and 37 rows, with and without the
residual, strided 3-D rows (per-head q/k of a fused projection), other launch shapes (the module
constants patched); the routing
(which calls take the kernels, that torch.compile traces the torch ops), the option through
`Model.set_fused_ops` and the runner, a whole model with and without the kernels, and on CUDA a
replayed CUDA graph. Runs on CUDA, or on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from dyngen_core.config import ModelConfig  # noqa: E402
from dyngen_core.engine.plan import SequenceSlice, StepPlan  # noqa: E402
from dyngen_core.kv.attention import SdpaBackend  # noqa: E402
from dyngen_core.kv.attention.base import build_forward_batch  # noqa: E402
from dyngen_core.kv.cache import Cache  # noqa: E402
from dyngen_core.model import Model  # noqa: E402
from dyngen_core.model.layers import Attention, GatedMLP, RMSNorm  # noqa: E402
from dyngen_core.model.rope import RotaryEmbedding  # noqa: E402
from dyngen_core.ops import fused_ops as fo  # noqa: E402
from dyngen_core.runtime.runner import ModelRunner  # noqa: E402
from tests.gpu.conftest import interpreter_mode  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-5
QWEN3 = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=96, hidden_size=64,
                    intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    qk_norm=True)


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int,
           scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale + shift).to(dtype).to(device)


def _assert_rounds_like(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Same rounding steps, another summation order: a few last-bit differences at most.

    Triton 3.6's interpreter truncates float32 to bf16 (it ignores the rounding mode), so there
    each of up to three bf16 roundings may land a unit of the last place (2^-8 to 2^-7 of the
    value) off torch's: bf16 is checked element-wise to 2^-5 there; fp16 converts exactly, so
    the fp16 cases check the rounding steps on the CPU."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    assert torch.isfinite(ours).all()
    if interpreter_mode() and ours.dtype == torch.bfloat16:
        diff = (ours.double() - ref.double()).abs()
        assert (diff <= ref.double().abs() * 2.0**-5 + 1e-6).all(), f"max diff {diff.max()}"
        return
    error = ((ours.double() - ref.double()).norm() / ref.double().norm()).item()
    differing = (ours != ref).double().mean().item()
    assert error < 1e-3, f"relative error {error}"
    assert differing < 0.05, f"{differing:.1%} of the elements differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [96, 4096])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_torch(device: torch.device, dtype: torch.dtype, n: int, rows: int,
                                residual: bool) -> None:
    x = _randn(rows, n, dtype=dtype, device=device, seed=n + rows, scale=3.0)
    out = _randn(rows, n, dtype=dtype, device=device, seed=1, scale=2.0) if residual else None
    weight = _randn(n, dtype=dtype, device=device, seed=2, scale=0.2, shift=1.0)
    y, h = fo.launch_rms_norm(x, weight, EPS, residual=out)
    if out is None:
        assert h is None
        _assert_rounds_like(y, fo.rms_norm_torch(x, weight, EPS))
        return
    assert h is not None
    if not (interpreter_mode() and dtype == torch.bfloat16):
        assert torch.equal(h, x + out), "h must round exactly like x + out"
    _assert_rounds_like(h, x + out)
    _assert_rounds_like(y, fo.rms_norm_torch(x + out, weight, EPS))


# (NORM_PROGRAM_ELEMENTS, NORM_WARP_ELEMENTS) giving 96-wide rows (128 padded) block_m rows
# and warps of 1 and 1, 4 and 2, 16 and 4, 64 and 8.
@pytest.mark.parametrize(("program_elements", "warp_elements"),
                         [(128, 128), (512, 256), (2048, 512), (8192, 1024)])
def test_rms_norm_launch_shapes(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                program_elements: int, warp_elements: int) -> None:
    """Several rows per program, rows not a multiple of it (the last program's row mask)."""
    monkeypatch.setattr(fo, "NORM_PROGRAM_ELEMENTS", program_elements)
    monkeypatch.setattr(fo, "NORM_WARP_ELEMENTS", warp_elements)
    x = _randn(37, 96, dtype=torch.bfloat16, device=device, seed=3)
    out = _randn(37, 96, dtype=torch.bfloat16, device=device, seed=4)
    weight = _randn(96, dtype=torch.bfloat16, device=device, seed=5, scale=0.2, shift=1.0)
    y, h = fo.launch_rms_norm(x, weight, EPS, residual=out)
    assert h is not None
    _assert_rounds_like(h, x + out)
    _assert_rounds_like(y, fo.rms_norm_torch(x + out, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_head_views(device: torch.device, dtype: torch.dtype) -> None:
    """q [T, H, D] and k [T, Hkv, D] as views of the fused q/k/v rows (Qwen3's per-head norms),
    and rows of a 2-D view with a row stride past N."""
    tokens, heads, kv_heads, dim = 37, 4, 2, 16
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, device=device, seed=6)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    for view in (q, k, qkv[:, 8:8 + 48]):
        weight = _randn(view.shape[-1], dtype=dtype, device=device, seed=7, scale=0.2,
                        shift=1.0)
        y = fo.rms_norm(view, weight, EPS, fused=True)
        assert y.is_contiguous()
        _assert_rounds_like(y, fo.rms_norm_torch(view, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 14336])
@pytest.mark.parametrize("rows", [1, 37])
def test_silu_mul_matches_torch(device: torch.device, dtype: torch.dtype, inter: int,
                                rows: int) -> None:
    gate_up = _randn(rows, 2 * inter, dtype=dtype, device=device, seed=inter + rows, scale=3.0)
    _assert_rounds_like(fo.launch_silu_mul(gate_up), fo.silu_mul_torch(gate_up))


@pytest.mark.parametrize(("block", "num_warps"), [(64, 1), (128, 4), (1024, 8)])
def test_silu_mul_launch_shapes_and_strided_rows(device: torch.device,
                                                 monkeypatch: pytest.MonkeyPatch, block: int,
                                                 num_warps: int) -> None:
    """Column tails (96 is no multiple of 64 or 128) and rows strided past 2 * I."""
    monkeypatch.setattr(fo, "SILU_BLOCK", block)
    monkeypatch.setattr(fo, "SILU_WARPS", num_warps)
    wide = _randn(5, 2 * 96 + 10, dtype=torch.float16, device=device, seed=8, scale=3.0)
    gate_up = wide[:, 3:3 + 2 * 96]
    y = fo.launch_silu_mul(gate_up)
    _assert_rounds_like(y, fo.silu_mul_torch(gate_up))


def _cos_sin(tokens: int, dim: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, ...]:
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=4 * dim,
                         intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=dim)
    positions = torch.randint(0, 40_000, (tokens,), generator=torch.Generator().manual_seed(dim))
    return RotaryEmbedding(config, device).cos_sin(positions.to(device), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [16, 128])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_equals_the_torch_ops(device: torch.device, dtype: torch.dtype, dim: int,
                                     tokens: int) -> None:
    """q and k heads as one strided view of the fused q/k/v rows (what `Attention` passes),
    and a contiguous head set: against float64, at least as close as the torch ops (the kernel
    rounds each product like them, unless the compiler keeps a product in float32)."""
    heads, kv_heads = 32, 8
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, device=device, seed=dim,
                 scale=4.0)
    cos, sin = _cos_sin(tokens, dim, dtype, device)
    q_k = qkv[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    for x in (q_k, q_k[:, heads:].contiguous()):
        _assert_rotary_close(fo.rotary(x, cos, sin, fused=True), x, cos, sin)


def _assert_rotary_close(y: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> None:
    assert y.is_contiguous() and y.shape == x.shape and y.dtype == x.dtype
    exact = fo.rotary_torch(x.double(), cos.double(), sin.double())
    ours, torch_ops = (((out.double() - exact).norm() / exact.norm()).item()
                       for out in (y, fo.rotary_torch(x, cos, sin)))
    # The interpreter truncates to bf16 (`_assert_rounds_like`).
    bound = 1e-2 if interpreter_mode() and x.dtype == torch.bfloat16 else 1.25 * torch_ops
    assert ours <= bound + 1e-7, f"relative error {ours} (torch ops {torch_ops})"


def test_rotary_launch_shapes(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads per program that do not divide the head count (the last program's head mask)."""
    x = _randn(5, 11, 32, dtype=torch.float16, device=device, seed=18)
    cos, sin = _cos_sin(5, 32, torch.float16, device)
    for elements in (32, 128, 4096):
        monkeypatch.setattr(fo, "ROTARY_PROGRAM_ELEMENTS", elements)
        _assert_rotary_close(fo.launch_rotary(x, cos, sin), x, cos, sin)


def _recorder(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[int, ...]]:
    """Wrap ``fused_ops.<name>`` to record the shapes of its first argument."""
    calls: list[tuple[int, ...]] = []
    original: Callable[..., Any] = getattr(fo, name)

    def record(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(x.shape))
        return original(x, *args, **kwargs)

    monkeypatch.setattr(fo, name, record)
    return calls


def test_routing_takes_the_kernels_only_for_half_precision(
        device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    norms, silus = _recorder(monkeypatch, "launch_rms_norm"), _recorder(monkeypatch,
                                                                         "launch_silu_mul")
    x = _randn(3, 32, dtype=torch.bfloat16, device=device, seed=9)
    weight = _randn(32, dtype=torch.bfloat16, device=device, seed=10)
    fo.rms_norm(x, weight, EPS, fused=True)
    fo.add_rms_norm(x, x, weight, EPS, fused=True)
    fo.silu_mul(x, fused=True)
    assert norms == [(3, 32), (3, 32)] and silus == [(3, 32)]
    x32, w32 = x.float(), weight.float()
    assert torch.equal(fo.rms_norm(x32, w32, EPS, fused=True), F.rms_norm(x32, (32,), w32, EPS))
    fo.add_rms_norm(x32, x32, w32, EPS, fused=True)
    fo.silu_mul(x32, fused=True)
    fo.rms_norm(x, weight, EPS, fused=False)
    fo.add_rms_norm(x, x.float(), weight, EPS, fused=True)  # mixed dtypes
    fo.rms_norm(x.t(), weight[:3], EPS, fused=True)  # not contiguous along N
    fo.silu_mul(x[0], fused=True)  # not 2-D
    assert len(norms) == 2 and len(silus) == 1
    rotations = _recorder(monkeypatch, "launch_rotary")
    heads = _randn(3, 4, 16, dtype=torch.bfloat16, device=device, seed=19)
    cos, sin = _cos_sin(3, 16, torch.bfloat16, device)
    fo.rotary(heads, cos, sin, fused=True)
    fo.rotary(heads, cos, sin, fused=False)
    fo.rotary(heads.float(), cos.float(), sin.float(), fused=True)
    fo.rotary(heads, cos.float(), sin.float(), fused=True)  # mixed dtypes
    odd = _randn(3, 4, 24, dtype=torch.bfloat16, device=device, seed=20)  # D / 2 = 12
    fo.rotary(odd, *_cos_sin(3, 24, torch.bfloat16, device), fused=True)
    assert rotations == [(3, 4, 16)]


def test_torch_compile_traces_the_torch_ops(device: torch.device,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("launched a kernel while compiling")

    monkeypatch.setattr(fo, "launch_rms_norm", no_launch)
    monkeypatch.setattr(fo, "launch_silu_mul", no_launch)
    monkeypatch.setattr(fo, "launch_rotary", no_launch)
    x = _randn(5, 32, dtype=torch.bfloat16, device=device, seed=11)
    weight = _randn(32, dtype=torch.bfloat16, device=device, seed=12)

    cos, sin = _cos_sin(5, 16, torch.bfloat16, device)

    def step(x: torch.Tensor) -> torch.Tensor:
        normed, h = fo.add_rms_norm(x, x, weight, EPS, fused=True)
        mixed = fo.silu_mul(fo.rms_norm(normed + h, weight, EPS, fused=True), fused=True)
        return fo.rotary(mixed.view(5, 1, 16), cos, sin, fused=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    reference = fo.silu_mul_torch(fo.rms_norm_torch(
        fo.rms_norm_torch(x + x, weight, EPS) + (x + x), weight, EPS))
    assert torch.equal(compiled(x), fo.rotary_torch(reference.view(5, 1, 16), cos, sin))


def _fused_flags(model: Model) -> list[bool]:
    return [module.fused for module in model.modules()
            if isinstance(module, (RMSNorm, GatedMLP, Attention))]


def test_option_reaches_every_norm_and_mlp(device: torch.device,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    model = Model(QWEN3, device=device, dtype=torch.bfloat16)
    assert set(_fused_flags(model)) == {device.type == "cuda"}  # the default: CUDA only
    cache = Cache(model, max_tokens=512)
    ModelRunner(model, cache, SdpaBackend(), cuda_graphs=False, fused_ops=True)
    assert set(_fused_flags(model)) == {True} and len(_fused_flags(model)) == 1 + 2 * 6
    ModelRunner(model, cache, SdpaBackend(), cuda_graphs=False)  # None: left as it is
    assert set(_fused_flags(model)) == {True}
    ModelRunner(model, cache, SdpaBackend(), cuda_graphs=False, fused_ops=False)
    assert set(_fused_flags(model)) == {False}
    cpu_model = Model(QWEN3, device=torch.device("cpu"), dtype=torch.bfloat16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert set(_fused_flags(cpu_model)) == {False}
    with pytest.raises(ValueError, match="fused_ops=True needs a CUDA device"):
        cpu_model.set_fused_ops(True)


def _random_model(device: torch.device, dtype: torch.dtype) -> Model:
    model = Model(QWEN3, device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for param in model.parameters():
            shape = param.shape
            values = (1.0 + 0.2 * torch.randn(shape, generator=gen) if param.dim() == 1
                      else 0.1 * torch.randn(shape, generator=gen))
            param.copy_(values.to(param.dtype))
    return model.eval()


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_with_kernels_matches_the_torch_ops(device: torch.device, dtype: torch.dtype,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-layer Qwen3 (per-head q/k norms) over a 37-token prompt: every norm, residual add,
    SiLU-and-mul and rotation through the kernels, hidden states as with the torch ops (in bf16
    under the interpreter, which truncates to bf16, a few units of the last place apart)."""
    model = _random_model(device, dtype)
    cache = Cache(model, max_tokens=512)
    plan = StepPlan([SequenceSlice(0, list(range(1, 38)), 0, [1], sample=True)])
    batch = build_forward_batch(plan, cache.page_size, device)
    model.set_fused_ops(False)
    reference = model.forward_hidden(batch, cache.storage, SdpaBackend())
    norms, silus = _recorder(monkeypatch, "launch_rms_norm"), _recorder(monkeypatch,
                                                                         "launch_silu_mul")
    rotations = _recorder(monkeypatch, "launch_rotary")
    model.set_fused_ops(True)
    hidden = model.forward_hidden(batch, cache.storage, SdpaBackend())
    # Per layer: input norm, q norm, k norm, post-attention norm; SiLU-and-mul; q and k rotated.
    assert len(norms) == 2 * 4 and len(silus) == 2 and len(rotations) == 2 * 2
    error = ((hidden.double() - reference.double()).norm() / reference.double().norm()).item()
    tolerance = 5e-2 if interpreter_mode() and dtype == torch.bfloat16 else 1e-2
    assert error < tolerance, f"relative error {error}"


def test_fused_ops_replay_in_a_cuda_graph(cuda_device: torch.device) -> None:
    x = _randn(7, 4096, dtype=torch.bfloat16, device=cuda_device, seed=14)
    out = _randn(7, 4096, dtype=torch.bfloat16, device=cuda_device, seed=15)
    weight = _randn(4096, dtype=torch.bfloat16, device=cuda_device, seed=16, shift=1.0)

    def step() -> torch.Tensor:
        normed, h = fo.add_rms_norm(x, out, weight, EPS, fused=True)
        return fo.silu_mul(torch.cat([normed, h], dim=1), fused=True)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    x.copy_(_randn(7, 4096, dtype=torch.bfloat16, device=cuda_device, seed=17))
    graph.replay()
    torch.cuda.synchronize()
    h = x + out
    reference = fo.silu_mul_torch(torch.cat([fo.rms_norm_torch(h, weight, EPS), h], dim=1))
    _assert_rounds_like(result, reference)
