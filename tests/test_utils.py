from tessera.utils import cdiv


def test_cdiv_counts_partial_blocks():
    # reference computed independently: the smallest q with q * b >= a
    for b in (1, 3, 16):
        for a in range(0, 50):
            q = cdiv(a, b)
            assert q * b >= a and (q - 1) * b < a if a else q == 0


def test_cdiv_exact_beyond_float_precision():
    a = 2**60 + 1
    assert cdiv(a, 2) == 2**59 + 1  # math.ceil(a / 2) rounds through a float and returns 2**59
