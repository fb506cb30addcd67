"""ggml tensor types: ids as llama.cpp numbers them, and their block geometry."""
from enum import IntEnum


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    BF16 = 30


# (elements per block, bytes per block), as in ggml's type traits.
BLOCK_GEOMETRY = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
}


def row_nbytes(qtype: GGMLType, n: int) -> int:
    """Bytes of one row of n elements; n must be a whole number of blocks."""
    elems, nbytes = BLOCK_GEOMETRY[qtype]
    if n % elems:
        raise ValueError(f"{qtype.name} rows need a multiple of {elems} elements, got {n}")
    return n // elems * nbytes


def tensor_nbytes(qtype: GGMLType, shape) -> int:
    """Bytes of a tensor of numpy-order shape (innermost dimension last)."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * row_nbytes(qtype, shape[-1])
