"""The fast outer step's parts, each against the slow reference it replaced (issue 15)."""

from __future__ import annotations

import math

import pytest
import torch

from zeroband.comm.dense import DenseCodec
from zeroband.comm.direct import Arena, flat_base, flatten
from zeroband.comm.kernels import kernels, value_stats
from zeroband.outer.placement import _views, outer_thread_count, pick_outer_device
from zeroband.outer.stats import tensor_stats
from zeroband.trust.mac import TAG_BYTES, WireAuth


def test_fused_sgd_is_bitwise_the_per_tensor_loop():
    """The outer optimizer's fused kernel gives today's (per-tensor) result bit for bit and leaves
    the gradients alone, through momentum warm-up and lr changes, Nesterov or not."""
    gen = torch.Generator().manual_seed(0)
    for nesterov in (True, False):
        ref = [torch.randn(1000, 37, generator=gen) for _ in range(3)]
        new = [p.clone() for p in ref]
        slow = torch.optim.SGD(ref, lr=0.7, momentum=0.5, nesterov=nesterov, foreach=False)
        fast = torch.optim.SGD(new, lr=0.7, momentum=0.5, nesterov=nesterov, fused=True)
        for step in range(5):
            grads = [torch.randn(p.shape, generator=gen) * 10.0 ** -step for p in ref]
            for opt in (slow, fast):
                opt.param_groups[0].update(momentum=0.1 * (step + 1), lr=0.7 / (step + 1))
            for p, q, g in zip(ref, new, grads):
                p.grad, q.grad = g.clone(), g.clone()
            slow.step()
            fast.step()
            assert all(torch.equal(q.grad, g) for q, g in zip(new, grads))
        assert all(torch.equal(p, q) for p, q in zip(ref, new))
        assert all(torch.equal(slow.state[p]["momentum_buffer"], fast.state[q]["momentum_buffer"])
                   for p, q in zip(ref, new))


def test_tensor_stats_match_float64_reference():
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(3 << 20, generator=gen), torch.randn(17, 5, generator=gen) * 100]
    sumsq, nonfinite = tensor_stats(tensors)
    ref = sum(float(t.double().square().sum()) for t in tensors)
    # fp32 accumulation inside each 1M chunk (~1e-5 measured); the sums feed 4x and 10x thresholds
    assert sumsq == pytest.approx(ref, rel=1e-4)
    assert nonfinite == 0
    tensors[0][5], tensors[1][0, 0], tensors[1][1, 1] = float("nan"), float("inf"), -float("inf")
    assert tensor_stats(tensors)[1] == 3
    assert tensor_stats([]) == (0.0, 0.0)
    assert value_stats(torch.tensor([3.0, float("nan")]))[1] == 1


def test_views_of_one_vector_are_reduced_in_place():
    flat = torch.arange(30, dtype=torch.float32)
    views = _views(flat, [torch.empty(2, 5), torch.empty(20)])
    base = flat_base(views)
    assert base is not None and base.data_ptr() == flat.data_ptr() and base.numel() == 30
    assert flatten(views).data_ptr() == flat.data_ptr()
    separate = [torch.zeros(3), torch.zeros(4)]
    assert flat_base(separate) is None and flatten(separate).data_ptr() != separate[0].data_ptr()
    assert flat_base([views[1], views[0]]) is None  # out of order: a copy


def test_arena_reuses_its_memory_and_grows_to_what_an_exchange_took():
    arena = Arena()
    arena.start()
    first = [arena.take(100), arena.take(40, torch.float32)]  # nothing reserved yet: fresh memory
    arena.start()
    again = [arena.take(100), arena.take(40, torch.float32)]
    assert again[1].dtype == torch.float32 and again[1].numel() == 10
    assert again[0].data_ptr() == arena.buf.data_ptr() and first[0].data_ptr() != arena.buf.data_ptr()
    assert again[1].data_ptr() % 64 == 0  # aligned: views as fp16/fp32 are valid


def test_fp16_encode_into_place_equals_the_reference(kernel_impl: str):
    codec = DenseCodec("fp16")
    x = torch.randn(1001) * 1e-3
    out = codec.encode(x, tail=TAG_BYTES)
    assert out.numel() == codec.nbytes(x.numel()) + TAG_BYTES
    scale = 2.0 ** 25  # the largest power of two with scale x max|x| <= 2**15 for these values
    assert torch.equal(out[4 : out.numel() - TAG_BYTES].view(torch.float16), (x * float(out[:4].view(torch.float32))).half())
    assert float(out[:4].view(torch.float32)) <= scale * 4
    dest = torch.empty(1001)
    assert torch.equal(codec.decode(out, 1001, out=dest), codec.decode(out[: out.numel() - TAG_BYTES], 1001))


def _fp16_definition(x: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The fp16 wire by its definition, in float64 where every step is exact: the scale (the largest
    power of two <= 2**127 keeping max|x| x scale <= 2**15), the values (x x scale rounded once to
    fp32, then once to fp16) and what a receiver decodes (fp16 value / scale, rounded once to fp32)."""
    peak = float(x.double().abs().max())
    exp = min(127, math.floor(math.log2(2.0**15 / peak))) if peak > 0 else 0
    body = (x.double() * 2.0**exp).float().half()
    return 2.0**exp, body, (body.double() / 2.0**exp).float()


@pytest.mark.parametrize("peak", [3e4, 1.0, 1e-3, 1e-30, 1e-36, 1e-42])  # the last two: below the old scale's range
def test_fp16_codec_bits_match_their_definition(peak: float, kernel_impl: str):
    """Encoding through a scratch buffer, decoding by the scale's inverse, and the scale's cap at
    2**127 give exactly the definition's bits: signed zeros, fp32 subnormals and all."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3001, generator=gen).mul_(peak / 4)
    x[:5] = torch.tensor([-0.0, 0.0, peak, -peak / 3, 1e-45])
    scale, body, decoded = _fp16_definition(x)
    codec, before = DenseCodec("fp16"), x.clone()
    scratch = torch.full((4000,), float("nan"))
    for buf in (codec.encode(x), codec.encode(x, TAG_BYTES, torch.empty(codec.nbytes(3001) + TAG_BYTES,
                                                                        dtype=torch.uint8), scratch)):
        assert float(buf[:4].view(torch.float32)) == scale
        assert torch.equal(buf[4 : 4 + 2 * 3001].view(torch.int16), body.view(torch.int16))
        got = codec.decode(buf, 3001, out=torch.empty(3001))
        assert torch.equal(got.view(torch.int32), decoded.view(torch.int32))
        assert torch.isfinite(got).all()
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))  # the input is read, not written


@pytest.mark.parametrize("wire", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("peak", [3e38, 1.0, 1e-30, 1e-38])  # huge, plain, a scale past 2**100, subnormals
def test_weighted_encode_is_the_encoding_of_the_product(wire: str, peak: float, kernel_impl: str):
    """A sender encodes weight x slice in one product with the scale: the bytes must be those of
    multiplying first (fp32) and encoding the result, for every weight, scale and value."""
    from zeroband.comm.reduce import wire_codec

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4096, generator=gen).mul_(peak / 4)
    x[:6] = torch.tensor([-0.0, 0.0, peak, -peak, 1e-45, -1e-42])
    codec, scratch = wire_codec(wire), torch.empty(4096)
    for weight in (1 / 3, 0.5, 0.7, 1e-3, 1 / 7000):
        product = x * weight
        assert torch.equal(codec.encode(x, 0, None, scratch, weight), codec.encode(product))
        assert torch.equal(codec.encode(x, 0, None, None, weight), codec.encode(product))


def test_sealed_in_place_equals_sealed_by_copy():
    # two senders of one session (each seals a message identity once: its guard refuses a second seal)
    auth, other = (WireAuth(b"k" * 32).for_session(b"ctx", {0: b"a" * 32, 1: b"b" * 32}) for _ in range(2))
    body = torch.randint(0, 255, (1000,), dtype=torch.uint8)
    spare = torch.cat([body, torch.zeros(TAG_BYTES, dtype=torch.uint8)])
    fields = (1, 7, 0, 1)
    assert torch.equal(auth.seal_tail(spare, b"ctx", fields), other.seal(body, b"ctx", fields))
    assert torch.equal(auth.open(spare, b"ctx", fields), body)


def test_outer_device_and_threads_are_pure_decisions():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert pick_outer_device("auto", cpu, True, 10, None) == cpu
    assert pick_outer_device("cuda", cpu, True, 10, None) == cpu  # a CPU model has no GPU to use
    assert pick_outer_device("auto", gpu, True, 10, 100) == gpu
    assert pick_outer_device("auto", gpu, True, 60, 100) == cpu  # more than half the free memory
    assert pick_outer_device("auto", gpu, False, 10, 100) == cpu  # overlapped / elastic: host
    assert pick_outer_device("cpu", gpu, True, 10, 100) == cpu
    assert outer_thread_count(0, 16, 8) == 2 and outer_thread_count(0, 2, 4) == 1 and outer_thread_count(3, 16, 8) == 3


@pytest.mark.parametrize("peak", [3.0, 1e-3, 2.0**-110])  # the last: a factor too small to defer
def test_owner_sum_is_bitwise_zero_decode_add(peak: float, kernel_impl: str):
    """An owner's sum in one pass per source (its own slice x its weight, a peer's wire values x a
    power of two, each added to +0 or the total) has the bits of zeroing, weighting, decoding and
    adding one by one: signed zeros, tiny values and all; and the statistics of what it decoded."""
    gen = torch.Generator().manual_seed(4)
    codec, n, scratch = DenseCodec("fp16"), 4099, torch.empty(4099)
    own = torch.randn(n, generator=gen) * peak
    own[:4] = torch.tensor([-0.0, 0.0, -0.0, 1e-30])
    peer = torch.randn(n, generator=gen) * peak
    peer[:4] = torch.tensor([-0.0, -0.0, 0.0, -1e-30])
    buf = codec.encode(peer)
    for weight in (1.0, 0.5, 1 / 3):
        for order in ((own, buf), (buf, own)):  # the owner's own slice first (site 0) or second
            ref, total = torch.zeros(n), torch.empty(n)
            for first, src in zip((True, False), order):
                if src is own:
                    ref += own * weight
                    kernels().add_f32(total, own, weight, first, scratch)
                else:
                    ref += _fp16_definition(peer)[2]
                    codec.add_decoded(total, src, n, first, scratch)
            assert torch.equal(total.view(torch.int32), ref.view(torch.int32))
    stats, ref_stats = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    codec.add_decoded(torch.empty(n), buf, n, True, scratch, stats)
    codec.decode(buf, n, stats=ref_stats)
    assert torch.equal(stats, ref_stats)
    want = float(_fp16_definition(peer)[2].double().square().sum())
    assert stats[0] == pytest.approx(want, rel=1e-5) and stats[1] == 0  # fp32 squares summed per block


@pytest.mark.parametrize("momentum, nesterov, with_buf", [(0.0, True, True), (0.9, True, True), (0.9, False, True),
                                                         (0.5, True, False), (0.5, False, False)])
def test_outer_preview_in_reused_memory_is_the_formula(momentum: float, nesterov: bool, with_buf: bool):
    """The eager rules' preview written into reused memory gives the formula's bits (one temporary
    per operation), whatever the state of the momentum buffer."""
    from zeroband.outer.optimizer import sgd_preview as outer_preview

    gen = torch.Generator().manual_seed(7)
    theta, d, buf = (torch.randn(999, generator=gen) * c for c in (1.0, 1e-3, 1e-3))
    lr = 0.7
    buf = buf if with_buf else None
    if momentum == 0:
        want = theta - lr * d
    else:
        new_buf = d if buf is None else buf * momentum + d
        want = theta - lr * (d + momentum * new_buf if nesterov else new_buf)
    out, scratch = torch.full((999,), float("nan")), torch.full((999,), float("nan"))
    got = outer_preview(theta, buf, d, lr, momentum, nesterov, out, scratch)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(outer_preview(theta, buf, d, lr, momentum, nesterov).view(torch.int32), want.view(torch.int32))


def test_overlapped_pseudo_gradients_take_turns_in_two_vectors():
    """A blocking step reuses one vector; overlapped steps alternate between two, never writing the
    one returned last (it may still be in flight)."""
    from zeroband.comm.timing import Parts
    from zeroband.config import DilocoConfig
    from zeroband.outer.placement import OuterCopy

    local = [torch.randn(30, 4), torch.randn(7)]
    copy = OuterCopy(local, DilocoConfig(inner_steps=1, overlap=True))
    ptrs = []
    for _ in range(4):
        grads = copy.pseudo_gradient(Parts(), fresh=True)
        assert torch.equal(grads[0], copy.tensors[0] - local[0])
        ptrs.append(grads[0].data_ptr())
    assert ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3] and ptrs[0] != ptrs[1]
    blocking = OuterCopy(local, DilocoConfig(inner_steps=1))
    assert len({blocking.pseudo_gradient(Parts(), fresh=False)[0].data_ptr() for _ in range(3)}) == 1
