"""The fused CPU kernels (gpu_workers/kernels) against the torch path they replace."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from plurai.gpu_workers import kernels
from plurai.gpu_workers.layers.attention import AttnContext, PagedAttention
from plurai.gpu_workers.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None, reason="no C++ compiler: the engine runs the torch path"
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    return kernels.build()  # a failed build fails here, with the compiler's message


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(
        got.float(), want.float(), rtol=2e-5 if got.dtype == torch.float32 else 1.6e-2, atol=1e-5
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(ops, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    res = torch.randn(7, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)

    def ref(v):
        return w * F.rms_norm(v.float(), (96,), eps=1e-6).to(dtype)

    close(ops.rms_norm(x, None, w, 1e-6), ref(x))
    total = x + res
    got = ops.rms_norm(x, res, w, 1e-6)
    assert torch.equal(res, total)  # the residual is updated in place, rounded as torch rounds
    close(got, ref(total))
    # per-head norms (Qwen3's q/k norm): [T, H, D] rows, non-contiguous input
    heads = torch.randn(5, 3, 128, generator=gen).to(dtype)[:, :, :96]
    close(ops.rms_norm(heads, None, w, 1e-6), ref(heads))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(ops, dtype):
    x = torch.randn(9, 2 * 200, generator=torch.Generator().manual_seed(1)).to(dtype) * 6
    gate, up = x.split(200, dim=-1)
    close(ops.silu_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_cache_rotates_in_place_and_writes_the_cache(ops, dtype):
    gen = torch.Generator().manual_seed(2)
    t, hq, hk, d, bs, nb = 6, 4, 2, 32, 4, 5
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q, k, v = (
        a.view(t, -1, d) for a in qkv.split([hq * d, hk * d, hk * d], dim=-1)
    )  # strided views, as the model passes them
    cos = torch.randn(t, 1, d, generator=gen).to(dtype)
    sin = torch.randn(t, 1, d, generator=gen).to(dtype)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    want_v = v.clone()
    k_cache = torch.zeros(hk, nb, bs, d, dtype=dtype)
    v_cache = torch.zeros(hk, nb, bs, d, dtype=dtype)
    slots = torch.tensor([3, 17, 0, 9, 10, 19])
    ops.rotary_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
    close(q, want_q)
    close(k, want_k)
    flat_k, flat_v = k_cache.view(hk, -1, d), v_cache.view(hk, -1, d)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(flat_k[:, s], k[i]) and torch.equal(flat_v[:, s], want_v[i])
    untouched = [s for s in range(nb * bs) if s not in slots.tolist()]
    assert not flat_k[:, untouched].any() and not flat_v[:, untouched].any()


def attention_pair(hq: int, hk: int, d: int, bs: int, nb: int, dtype, ops) -> tuple:
    torch_attn = PagedAttention(hq, hk, d, d**-0.5)
    native = PagedAttention(hq, hk, d, d**-0.5, ops)
    cache = torch.randn(2, hk, nb, bs, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    for a in (torch_attn, native):
        a.k_cache, a.v_cache = cache[0], cache[1]
    return torch_attn, native


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("hq", "hk", "bs", "d"),
    # head dims 64 and 128 have their own unrolled code; 36 is no multiple of the vector
    # width, so its last lanes take the scalar remainder
    [(8, 4, 16, 64), (4, 4, 2, 64), (6, 1, 1, 64), (8, 2, 8, 64), (8, 4, 16, 128), (4, 2, 4, 36)],
)
def test_paged_decode_matches_the_gathering_path(ops, dtype, hq, hk, bs, d):
    lens = [1, bs, 3 * bs + 1, 37, 5 * bs]  # one token, exact blocks, partial last blocks
    width = -(-max(lens) // bs)
    nb = len(lens) * width + 3
    torch_attn, native = attention_pair(hq, hk, d, bs, nb, dtype, ops)
    gen = torch.Generator().manual_seed(4)
    perm = torch.randperm(nb, generator=gen)  # scattered blocks, as a running cache has them
    tables = [perm[i * width : (i + 1) * width].tolist() for i in range(len(lens))]
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    blocks = torch.tensor(tables)
    pad = torch.arange(width * bs)[None, :] >= torch.tensor(lens)[:, None]
    bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[None, :, None]
    empty = torch.empty(0, dtype=dtype)
    want = torch_attn(
        q,
        empty,
        empty,
        AttnContext(
            slot_mapping=torch.empty(0, dtype=torch.long),
            num_decode=len(lens),
            decode_blocks=blocks,
            decode_bias=bias,
        ),
        cached=True,
    )
    ctx = AttnContext(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decode=len(lens),
        decode_blocks=blocks,
        decode_lens=torch.tensor(lens),
    )
    got = native(q, empty, empty, ctx, cached=True)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_bad_indices_are_refused_not_read(ops):
    """A slot or block id outside the cache is an error, never a stray memory access."""
    hk, nb, bs, d = 2, 4, 4, 16
    cache = torch.zeros(hk, nb, bs, d)
    q, k, v = torch.zeros(1, 2, d), torch.zeros(1, hk, d), torch.zeros(1, hk, d)
    cs = torch.zeros(1, d)
    with pytest.raises(RuntimeError, match="slot 16 out of range"):
        ops.rotary_cache(q, k, v, cs, cs, cache, cache.clone(), torch.tensor([nb * bs]))
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_decode(q, cache, cache, torch.tensor([[nb]]), torch.tensor([2]), 1.0)
    with pytest.raises(RuntimeError, match="does not fit the block table"):
        ops.paged_decode(q, cache, cache, torch.tensor([[0]]), torch.tensor([bs + 1]), 1.0)
    with pytest.raises(RuntimeError, match="only float32 and bfloat16"):
        ops.silu_mul(torch.zeros(2, 8, dtype=torch.float16))


def test_modes(monkeypatch):
    assert kernels.load("torch") is None
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.load("fast")
    monkeypatch.setenv("PLURAI_KERNELS", "torch")
    assert kernels.load() is None
    monkeypatch.setenv("PLURAI_KERNEL_ISA", "sse9")
    with pytest.raises(ValueError, match="PLURAI_KERNEL_ISA"):
        kernels.build_isa()
    # a build wider than the CPU would die on its first instruction: refused up front
    monkeypatch.setattr(kernels, "cpu_isa", lambda: "avx2")
    monkeypatch.setenv("PLURAI_KERNEL_ISA", "avx512_bf16")
    with pytest.raises(ValueError, match="this CPU offers only 'avx2'"):
        kernels.build_isa()
    monkeypatch.setenv("PLURAI_KERNEL_ISA", "baseline")
    assert kernels.build_isa() == "baseline"


@pytest.mark.parametrize(
    "flags, isa, build",
    [
        ("fma avx2", "avx2", "avx2"),
        ("avx2 avx512f avx512bw", "avx512", "avx512"),
        ("avx2 avx512f avx512_bf16", "avx512_bf16", "avx512_bf16"),
        # AMX tiles are oneDNN's (torch's bf16 matmuls); the kernels take AVX-512 there
        ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", "amx", "avx512_bf16"),
        ("fpu sse sse2", "baseline", "baseline"),
    ],
)
def test_the_build_each_cpu_gets(monkeypatch, flags: str, isa: str, build: str):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags.split())
    monkeypatch.delenv("PLURAI_KERNEL_ISA", raising=False)
    assert kernels.cpu_isa() == isa
    assert kernels.build_isa() == build


def test_without_a_compiler_auto_falls_back_and_native_says_why(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert kernels.load("auto") is None
    assert "no C++ compiler" in caplog.text and "pure-torch path" in caplog.text
    with pytest.raises(RuntimeError, match="native kernels unavailable: no C\\+\\+ compiler"):
        kernels.load("native")


def test_avx2_build_agrees(monkeypatch):
    """The AVX2 build (what an AVX2-only machine compiles) runs here too, and agrees."""
    if kernels.cpu_isa() not in ("avx2", "avx512", "avx512_bf16", "amx"):
        pytest.skip("not an x86 CPU with AVX2")
    monkeypatch.setenv("PLURAI_KERNEL_ISA", "avx2")
    avx2 = kernels.build()
    assert avx2.__name__ == "plurai_cpu_avx2"
    x = torch.randn(4, 2 * 64) * 4
    gate, up = x.split(64, dim=-1)
    close(avx2.silu_mul(x), F.silu(gate) * up)
    torch_attn, native = attention_pair(8, 4, 64, 16, 12, torch.float32, avx2)
    q = torch.randn(2, 8, 64)
    blocks = torch.tensor([[3, 7, 1], [0, 11, 5]])
    pad = torch.arange(48)[None, :] >= torch.tensor([40, 33])[:, None]
    bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[None, :, None]
    e = torch.empty(0)
    no_slots = torch.empty(0, dtype=torch.long)
    want = torch_attn(
        q,
        e,
        e,
        AttnContext(slot_mapping=no_slots, num_decode=2, decode_blocks=blocks, decode_bias=bias),
        cached=True,
    )
    got = native(
        q,
        e,
        e,
        AttnContext(
            slot_mapping=no_slots,
            num_decode=2,
            decode_blocks=blocks,
            decode_lens=torch.tensor([40, 33]),
        ),
        cached=True,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_engine_takes_the_torch_path_where_the_kernels_do_not_apply(model_factory, engine_factory):
    path = model_factory("llama")
    assert engine_factory(path, dtype="fp16", kernels="auto").runner.ops is None
    with pytest.raises(ValueError, match="CPU kernels for fp32 and bf16"):
        engine_factory(path, dtype="fp16", kernels="native")
    assert engine_factory(path, kernels="native").runner.ops is not None
    with pytest.raises(ValueError, match="kernels must be auto, native or torch"):
        engine_factory(path, kernels="fast")


def test_top_p_keeps_what_the_numpy_path_keeps(ops):
    """The kernel's cutoff is the sampler's numpy path's, to the bit: random rows of
    vocabularies up to 40k, flat to peaked, exact ties, top_p of 0 and near 1."""
    from plurai.gpu_workers.engine.sampler import _nucleus
    from tests.unit.test_sampling import top_p_cases

    for trial, probs, top_p in top_p_cases(seed=2, n=150, top_max=0.9999):
        want = _nucleus(probs.clone(), top_p)
        got = _nucleus(probs.clone(), top_p, ops)
        assert torch.equal(got, want), trial


def test_top_p_refuses_bad_shapes_and_survives_nan(ops):
    probs = torch.rand(3, 50)
    with pytest.raises(RuntimeError, match="float32"):
        ops.top_p_(probs.double(), torch.full((3,), 0.9, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="float32"):
        ops.top_p_(probs.t(), torch.full((50,), 0.9, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="want"):
        ops.top_p_(probs, torch.full((2,), 0.9, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="want"):
        ops.top_p_(probs, torch.full((3,), 0.9))
    nan = torch.full((2, 50), float("nan"))
    nan[1, :10] = 1.0e30  # out of a probability's range: still no read or write outside
    ops.top_p_(nan, torch.full((2,), 0.9, dtype=torch.float64))


def test_seeded_sampling_draws_the_same_tokens_with_the_kernel(ops):
    from plurai.gpu_workers.engine.sampler import Sampler
    from plurai.gpu_workers.engine.sampling_params import SamplingParams
    from plurai.gpu_workers.engine.sequence import Sequence

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=gen) * 4

    def draw(with_ops):
        seqs = []
        for i in range(6):
            sp = SamplingParams(temperature=0.7, top_p=0.8 if i % 3 else 1.0, seed=i, max_tokens=4)
            seqs.append(Sequence(f"s{i}", [1, 2, 3], sp))
        sampler = Sampler(0, ops=ops if with_ops else None)
        drawn = []
        for _ in range(5):  # a seeded draw depends on the position: one more token each time
            drawn.append(sampler(logits.clone(), seqs)[0])
            for s, t in zip(seqs, drawn[-1], strict=True):
                s.append(t)
        return drawn

    assert draw(True) == draw(False)
