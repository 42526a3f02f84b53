"""Bit packing: pagoda's unpackers read what the formats' packers write, and the runtime layout round-trips."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.plugins.quant.packing import (
    AWQ_REVERSE_ORDER, pack_awq, pack_int32, pack_uint8, unpack_awq, unpack_int32, unpack_uint8)
from quant_helpers import pack_along_cols, pack_along_rows
from quant_helpers import pack_awq as reference_pack_awq


def random_values(bits, rows, cols, seed=0):
    return torch.randint(0, 1 << bits, (rows, cols), generator=torch.Generator().manual_seed(seed))


def test_awq_columns_sit_in_interleaved_nibbles():
    values = torch.arange(8).view(1, 8)  # column j holds value j
    word = int(reference_pack_awq(values)[0, 0]) & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0, 2, 4, 6, 1, 3, 5, 7]
    assert [nibbles[AWQ_REVERSE_ORDER[j]] for j in range(8)] == list(range(8))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), groups=st.integers(1, 4), seed=st.integers(0, 1000))
def test_awq_unpacking_reads_the_format_packer_and_inverts_pagodas_packer(rows, groups, seed):
    values = random_values(4, rows, 8 * groups, seed)
    assert torch.equal(unpack_awq(reference_pack_awq(values)), values.int())
    assert torch.equal(pack_awq(values), reference_pack_awq(values))


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([4, 8]), words=st.integers(1, 4), cols=st.integers(1, 7), seed=st.integers(0, 1000))
def test_sequential_int32_unpacking_reads_gptq_and_compressed_tensors_packing(bits, words, cols, seed):
    values = random_values(bits, words * 32 // bits, cols, seed)
    assert torch.equal(unpack_int32(pack_along_rows(values, bits), bits, dim=0), values.int())  # GPTQ qweight
    assert torch.equal(unpack_int32(pack_along_cols(values.t(), bits), bits, dim=1), values.t().int())
    assert torch.equal(pack_int32(values, bits, dim=0), pack_along_rows(values, bits))


def test_top_bit_values_survive_the_signed_int32_words():
    values = torch.full((8, 1), 15)
    packed = pack_along_rows(values, 4)
    assert packed.dtype == torch.int32 and int(packed) == -1
    assert torch.equal(unpack_int32(packed, 4, dim=0), values.int())


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 5), cols=st.integers(1, 12), seed=st.integers(0, 1000))
def test_runtime_uint8_layout_round_trips(bits, rows, cols, seed):
    values = random_values(bits, rows, cols, seed)
    packed = pack_uint8(values, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, (cols + 1) // 2 if bits == 4 else cols)
    assert torch.equal(unpack_uint8(packed, bits)[:, :cols], values.to(torch.uint8))
