"""The sparse codec (zeroband/comm/codecs/sparse.py): its bytes, its top-k, its 2-bit values, its residual."""

import math

import pytest
import torch

from zeroband.comm import codecs
from zeroband.comm.codecs.sparse import CHUNK, SparseCodec, chunk_bytes, keep


def test_bytes_per_param_at_density_002_count_every_byte():
    # k = ceil(0.02 x 4096) = 82 values: 4 bytes of levels + 82 x 2 bits + 82 x 12 bits
    assert keep(CHUNK, 0.02) == 82 and chunk_bytes(CHUNK, 0.02) == 4 + 21 + 123
    spec = codecs.spec("sparse")
    assert spec.bytes_per_param() == 148 / 4096 <= 0.06
    assert spec.feedback == "always" and spec.exchange == "gather" and spec.wire_factor(3) == 2
    codec = SparseCodec(0.02)
    for n in (1, 5, 4096, 4097, 3 * 4096 + 100):
        assert codec.encode(torch.randn(n)).numel() == codec.nbytes(n)
    assert codec.nbytes(4096 + 100) == 148 + 4 + 1 + 3  # the short chunk keeps ceil(0.02 x 100) = 2


def test_sends_each_chunks_top_k_at_two_magnitudes_and_their_signs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * CHUNK + 999, generator=g)
    codec = SparseCodec(0.05)
    y = codec.decode(codec.encode(x), x.numel())
    for start in range(0, x.numel(), CHUNK):
        xs, ys = x[start : start + CHUNK], y[start : start + CHUNK]
        k = keep(xs.numel(), 0.05)
        top = xs.abs().topk(k).indices.sort().values
        assert torch.equal(ys.nonzero().view(-1), top)
        assert torch.equal(ys[top].sign(), xs[top].sign())
        assert len(ys[top].abs().unique()) <= 2  # lo and hi
        # the levels are the mean magnitudes of the two halves, rounded to bf16
        mags = xs.abs().topk(k).values
        hi = mags[: k // 2].mean().to(torch.bfloat16).float()
        assert float(ys.abs().max()) == pytest.approx(float(hi))


def test_zeros_decode_to_zeros_and_a_forged_chunk_to_nan():
    codec = SparseCodec(0.02)
    assert codec.decode(codec.encode(torch.zeros(5000)), 5000).abs().sum() == 0
    buf = codec.encode(torch.randn(CHUNK))
    buf[4 + 21 + 3 : 4 + 21 + 6] = 0  # two indices of 0 after others: not strictly increasing
    assert codec.decode(buf, CHUNK).isnan().all()
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(torch.tensor([1.0, math.inf]))


def test_error_feedback_delivers_the_input_over_steps():
    """What the gather exchange keeps (input - decoded) fed into the next step: after T steps the
    decoded values plus the last residual are the sum of the inputs, up to fp32 rounding."""
    g = torch.Generator().manual_seed(1)
    codec, residual = SparseCodec(0.02), torch.zeros(3 * CHUNK)
    inputs, delivered = torch.zeros(3 * CHUNK, dtype=torch.float64), torch.zeros(3 * CHUNK, dtype=torch.float64)
    for _ in range(30):
        x = torch.randn(3 * CHUNK, generator=g)
        inputs += x.double()
        folded = x + residual
        decoded = codec.decode(codec.encode(folded), folded.numel())
        residual = folded - decoded
        delivered += decoded.double()
    assert torch.allclose(delivered + residual.double(), inputs, atol=1e-4)
    assert residual.norm() < inputs.norm()  # the residual does not grow without bound


def test_decode_is_the_same_bits_every_time():
    codec, x = SparseCodec(0.1), torch.randn(10 * CHUNK + 7)
    buf = codec.encode(x)
    a, b = codec.decode(buf, x.numel()), torch.full((x.numel(),), 7.0)
    codec.decode(buf, x.numel(), out=b)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
